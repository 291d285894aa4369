"""vllm_npu.mblt.prefix_cache: knobs, snapshot cap, the load-vs-recompute cost model and the
LRU snapshot index (rules from the vllm-mblt README "Cache Behavior" and mobilint.md §5)."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_npu.mblt.prefix_cache import (
    CALIBRATION_BLOCKS,
    DEFAULT_EWMA_ALPHA,
    DEFAULT_MARGIN,
    DEFAULT_MAX_HOST_MIB,
    MAX_FINISHED_SNAPSHOTS,
    PrefixCacheCostModel,
    PrefixCacheSettings,
    SnapshotIndex,
    finished_snapshot_cap,
    prefix_cache_settings,
    snapshot_cap_log_line,
)
from vllm_npu.mblt.settings import MbltConfigError, parse_loader_extra_config

MIB = 2**20


def test_constants():
    assert (MAX_FINISHED_SNAPSHOTS, DEFAULT_MAX_HOST_MIB) == (16, 4096)
    assert (DEFAULT_MARGIN, DEFAULT_EWMA_ALPHA, CALIBRATION_BLOCKS) == (0.9, 0.3, (1, 2, 4, 8))
    assert PrefixCacheSettings() == PrefixCacheSettings(
        auto_threshold=True, min_hit_tokens=0, margin=0.9, calibrate=True, max_host_mib=4096)


# --- settings ---------------------------------------------------------------------------------


def test_defaults_with_nothing_set():
    assert prefix_cache_settings({}, {}) == PrefixCacheSettings()


def test_every_env_var_is_read():
    env = {"VLLM_MBLT_PREFIX_CACHE_AUTO_THRESHOLD": "0", "VLLM_MBLT_PREFIX_CACHE_MIN_HIT_TOKENS": "64",
           "VLLM_MBLT_PREFIX_CACHE_LOAD_MARGIN": "0.5", "VLLM_MBLT_PREFIX_CACHE_CALIBRATE": "off",
           "VLLM_MBLT_PREFIX_CACHE_MAX_HOST_MIB": "1024"}
    assert prefix_cache_settings(env, {}) == PrefixCacheSettings(
        auto_threshold=False, min_hit_tokens=64, margin=0.5, calibrate=False, max_host_mib=1024)


def test_every_override_key_is_read():
    keys = {"prefix_cache_auto_threshold": False, "prefix_cache_min_hit_tokens": 32,
            "prefix_cache_load_margin": 2, "prefix_cache_calibrate": "no",
            "prefix_cache_max_host_mib": 0}
    assert prefix_cache_settings({}, keys) == PrefixCacheSettings(
        auto_threshold=False, min_hit_tokens=32, margin=2.0, calibrate=False, max_host_mib=0)


def test_loader_key_wins_over_env_per_knob():
    env = {"VLLM_MBLT_PREFIX_CACHE_MIN_HIT_TOKENS": "64", "VLLM_MBLT_PREFIX_CACHE_LOAD_MARGIN": "0.5"}
    s = prefix_cache_settings(env, {"prefix_cache_min_hit_tokens": 8})
    assert (s.min_hit_tokens, s.margin) == (8, 0.5)


def test_blank_env_is_unset_and_overrides_come_from_the_parser():
    assert prefix_cache_settings({"VLLM_MBLT_PREFIX_CACHE_MAX_HOST_MIB": " "}, {}).max_host_mib == 4096
    o = parse_loader_extra_config({"prefix_cache_auto_threshold": "FALSE", "dev_no": 0})
    assert prefix_cache_settings({}, o.prefix_cache).auto_threshold is False


@pytest.mark.parametrize("word, expected", [
    ("1", True), ("true", True), ("YES", True), (" On ", True),
    ("0", False), ("False", False), ("no", False), ("OFF", False),
])
def test_boolish_words(word, expected):
    assert prefix_cache_settings({"VLLM_MBLT_PREFIX_CACHE_CALIBRATE": word}, {}).calibrate is expected


@pytest.mark.parametrize("env_var, value, words", [
    ("VLLM_MBLT_PREFIX_CACHE_AUTO_THRESHOLD", "enabled", ["switch", "1, true, yes, on"]),
    ("VLLM_MBLT_PREFIX_CACHE_CALIBRATE", "2", ["switch", "0, false, no, off"]),
    ("VLLM_MBLT_PREFIX_CACHE_MIN_HIT_TOKENS", "-4", ["integer"]),
    ("VLLM_MBLT_PREFIX_CACHE_MIN_HIT_TOKENS", "1.5", ["integer"]),
    ("VLLM_MBLT_PREFIX_CACHE_LOAD_MARGIN", "0", ["> 0"]),
    ("VLLM_MBLT_PREFIX_CACHE_LOAD_MARGIN", "-0.1", ["> 0"]),
    ("VLLM_MBLT_PREFIX_CACHE_LOAD_MARGIN", "inf", ["finite"]),
    ("VLLM_MBLT_PREFIX_CACHE_LOAD_MARGIN", "lots", ["finite"]),
    ("VLLM_MBLT_PREFIX_CACHE_MAX_HOST_MIB", "4G", ["integer"]),
    ("VLLM_MBLT_PREFIX_CACHE_MAX_HOST_MIB", "-1", ["integer"]),
])
def test_bad_env_values_name_variable_and_value(env_var, value, words):
    with pytest.raises(MbltConfigError) as info:
        prefix_cache_settings({env_var: value}, {})
    assert f"{env_var}={value!r}" in str(info.value)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("key, value", [
    ("prefix_cache_auto_threshold", 3), ("prefix_cache_calibrate", None),
    ("prefix_cache_min_hit_tokens", True), ("prefix_cache_load_margin", float("nan")),
    ("prefix_cache_max_host_mib", -2),
])
def test_bad_override_values_name_key_and_value(key, value):
    with pytest.raises(MbltConfigError, match=f"^{key}="):
        prefix_cache_settings({}, {key: value})


def test_bad_override_wins_even_over_a_good_env():
    with pytest.raises(MbltConfigError, match="prefix_cache_load_margin"):
        prefix_cache_settings({"VLLM_MBLT_PREFIX_CACHE_LOAD_MARGIN": "0.5"},
                              {"prefix_cache_load_margin": 0})


def test_unknown_override_key():
    with pytest.raises(MbltConfigError, match="unknown prefix cache key 'prefix_cache_margin'"):
        prefix_cache_settings({}, {"prefix_cache_margin": 0.5})


# --- cap --------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget_mib, slot_bytes, cap", [
    (4096, 256 * MIB, 16),   # README default, 4K-token Llama-3 slot
    (1024, 256 * MIB, 4),
    (0, 256 * MIB, 0),
    (255, 256 * MIB, 0),
    (4096, 192 * MIB, 16),   # capped by the count, budget allows 21
    (2000, 192 * MIB, 10),
    (4096, 1, 16),
])
def test_finished_snapshot_cap(budget_mib, slot_bytes, cap):
    assert finished_snapshot_cap(budget_mib, slot_bytes) == cap


@given(budget=st.integers(0, 10**6), nbytes=st.integers(1, 2**40))
def test_cap_never_overspends(budget, nbytes):
    cap = finished_snapshot_cap(budget, nbytes)
    assert 0 <= cap <= 16
    assert cap * nbytes <= budget * MIB
    assert cap == 16 or (cap + 1) * nbytes > budget * MIB


@pytest.mark.parametrize("budget, nbytes", [(4096, 0), (4096, -1), (-1, MIB)])
def test_cap_rejects_bad_inputs(budget, nbytes):
    with pytest.raises(ValueError):
        finished_snapshot_cap(budget, nbytes)


def test_cap_log_line():
    assert snapshot_cap_log_line(16, 256 * MIB, 4096) == (
        "MBLT keeps up to 16 finished prefix snapshots (256 MiB each, budget 4096 MiB).")
    assert snapshot_cap_log_line(3, 3 * MIB // 2, 5) == (
        "MBLT keeps up to 3 finished prefix snapshots (1.50 MiB each, budget 5 MiB).")


# --- cost model -------------------------------------------------------------------------------


def test_ewma_arithmetic_per_cache_id():
    m = PrefixCacheCostModel(PrefixCacheSettings())
    m.observe_load(0, 10.0)
    assert m.load_ms(0) == 10.0
    m.observe_load(0, 20.0)
    assert m.load_ms(0) == pytest.approx(10.0 * 0.7 + 20.0 * 0.3)  # 13.0
    m.observe_load(0, 0.0)
    assert m.load_ms(0) == pytest.approx(13.0 * 0.7)
    m.observe_dump(0, 4.0)
    m.observe_dump(0, 8.0)
    assert m.dump_ms(0) == pytest.approx(5.2)
    assert m.load_ms(0) == pytest.approx(9.1)  # dumps do not touch loads


def test_ewma_custom_alpha():
    m = PrefixCacheCostModel(PrefixCacheSettings(), alpha=0.5)
    m.observe_prefill(128, 10.0)
    m.observe_prefill(128, 30.0)
    assert m.prefill_ms(128) == pytest.approx(20.0)


@given(samples=st.lists(st.floats(0, 1e6), min_size=1, max_size=20), alpha=st.floats(0.01, 1.0))
def test_ewma_matches_the_recurrence(samples, alpha):
    m = PrefixCacheCostModel(PrefixCacheSettings(), alpha=alpha)
    expected = samples[0]
    for s in samples[1:]:
        expected = expected * (1 - alpha) + s * alpha
    for s in samples:
        m.observe_load(3, s)
    assert m.load_ms(3) == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_load_ms_fallbacks():
    m = PrefixCacheCostModel(PrefixCacheSettings())
    assert m.load_ms(0) is None
    m.observe_load(1, 10.0)
    m.observe_load(2, 30.0)
    m.observe_load(3, 14.0)
    assert m.load_ms(2) == 30.0
    assert m.load_ms(7) == 14.0          # median of 10, 30, 14
    m.observe_load(None, 50.0)
    assert m.load_ms(7) == 50.0          # key None before the median
    assert m.load_ms(1) == 10.0


def test_prefill_interpolation_and_extrapolation():
    m = PrefixCacheCostModel(PrefixCacheSettings())
    assert m.prefill_ms(100) is None
    m.observe_prefill(128, 8.0)
    m.observe_prefill(512, 20.0)
    assert m.prefill_ms(64) == pytest.approx(4.0)       # 8 * 64/128
    assert m.prefill_ms(128) == pytest.approx(8.0)
    assert m.prefill_ms(256) == pytest.approx(10.0)     # first bucket >= 256 is 512: 20 * 256/512
    assert m.prefill_ms(1024) == pytest.approx(40.0)    # extrapolated from 512
    assert m.prefill_ms(0) == 0.0
    with pytest.raises(ValueError):
        m.prefill_ms(-1)


@pytest.mark.parametrize("call", [
    lambda m: m.observe_prefill(0, 1.0), lambda m: m.observe_prefill(True, 1.0),
    lambda m: m.observe_prefill(8, -1.0), lambda m: m.observe_load(0, math.nan),
    lambda m: m.observe_dump(0, math.inf), lambda m: m.observe_load(0, "3"),
])
def test_bad_observations(call):
    with pytest.raises(ValueError):
        call(PrefixCacheCostModel(PrefixCacheSettings()))


@pytest.mark.parametrize("alpha", [0, -0.1, 1.5, True])
def test_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        PrefixCacheCostModel(PrefixCacheSettings(), alpha=alpha)


def _measured(settings=PrefixCacheSettings(), load=5.0):
    m = PrefixCacheCostModel(settings)
    m.observe_prefill(256, 20.0)
    m.observe_load(0, load)
    return m


def test_should_load_cheap_load():
    ok, why = _measured(load=5.0).should_load(256, 0)
    assert ok is True
    assert why == "load_ms 5.000 < prefill_ms(256) 20.000 * margin 0.9 = 18.000"


def test_should_not_load_expensive_load():
    ok, why = _measured(load=18.0).should_load(256, 0)  # 18 is not < 18
    assert ok is False
    assert "load_ms 18.000 >= prefill_ms(256) 20.000" in why
    # A shorter match is cheaper to recompute: 128 tokens -> 10 ms * 0.9 = 9 ms < 18 ms load.
    assert _measured(load=8.0).should_load(128, 0)[0] is True
    assert _measured(load=9.5).should_load(128, 0)[0] is False


def test_should_load_uses_margin():
    assert _measured(PrefixCacheSettings(margin=0.2), load=5.0).should_load(256, 0)[0] is False
    assert _measured(PrefixCacheSettings(margin=2.0), load=30.0).should_load(256, 0)[0] is True


def test_no_match_never_loads():
    for matched in (0, -3):
        ok, why = PrefixCacheCostModel(PrefixCacheSettings(auto_threshold=False)).should_load(matched, 0)
        assert ok is False and "no matched tokens" in why


def test_min_hit_tokens_gates_even_cheap_loads():
    m = _measured(PrefixCacheSettings(min_hit_tokens=200), load=0.1)
    ok, why = m.should_load(199, 0)
    assert ok is False and why == "matched 199 tokens < min_hit_tokens 200"
    assert m.should_load(200, 0)[0] is True


def test_auto_threshold_off_loads_expensive_snapshots():
    ok, why = _measured(PrefixCacheSettings(auto_threshold=False), load=1000.0).should_load(16, 0)
    assert ok is True and "auto threshold off" in why


def test_missing_measurements_load():
    m = PrefixCacheCostModel(PrefixCacheSettings())
    ok, why = m.should_load(64, 0)
    assert ok is True and "missing measurements" in why
    m.observe_prefill(64, 1.0)
    ok, why = m.should_load(64, 0)
    assert ok is True and "load_ms=None" in why
    m.observe_load(5, 100.0)              # another cache id's timing is used for id 0
    assert m.should_load(64, 0)[0] is False


# --- snapshot index ---------------------------------------------------------------------------


def test_lru_eviction_order_and_touch():
    idx: SnapshotIndex[str] = SnapshotIndex(3)
    assert idx.add("a", [1], "A") == []
    assert idx.add("b", [2], "B") == []
    assert idx.add("c", [3], "C") == []
    idx.touch("a")
    assert idx.keys() == ["b", "c", "a"]
    assert idx.add("d", [4], "D") == [("b", "B")]
    assert idx.keys() == ["c", "a", "d"]
    assert idx.set_cap(1) == [("c", "C"), ("a", "A")]
    assert idx.keys() == ["d"] and len(idx) == 1 and idx.cap == 1


def test_re_add_replaces_and_touches():
    idx: SnapshotIndex[str] = SnapshotIndex(2)
    idx.add("a", [1, 2], "A1")
    idx.add("b", [1], "B")
    assert idx.add("a", [1, 2, 3], "A2") == []
    assert idx.keys() == ["b", "a"] and len(idx) == 2
    assert idx.best_match([1, 2, 3], 10) == ("a", "A2", 3)
    assert idx.add("c", [9], "C") == [("b", "B")]


def test_cap_zero_evicts_the_new_entry():
    idx: SnapshotIndex[int] = SnapshotIndex(0)
    assert idx.add("a", [1], 1) == [("a", 1)]
    assert len(idx) == 0


def test_pop_touch_and_contains():
    idx: SnapshotIndex[str] = SnapshotIndex(4)
    idx.add("a", [1], "A")
    assert "a" in idx and "z" not in idx
    assert idx.pop("a") == "A"
    assert idx.pop("a") is None
    with pytest.raises(KeyError):
        idx.touch("a")


@pytest.mark.parametrize("cap", [-1, 1.5, True])
def test_bad_cap(cap):
    with pytest.raises(ValueError, match="cap"):
        SnapshotIndex(cap)
    with pytest.raises(ValueError, match="cap"):
        SnapshotIndex(2).set_cap(cap)


def test_best_match_longest_with_limit_and_ties():
    idx: SnapshotIndex[str] = SnapshotIndex(8)
    idx.add("short", [1, 2, 9], "S")
    idx.add("long", [1, 2, 3, 4, 5], "L")
    idx.add("other", [7, 7], "O")
    assert idx.best_match([1, 2, 3, 4, 5, 6], 100) == ("long", "L", 5)
    assert idx.best_match([1, 2, 3, 4, 5, 6], 4) == ("long", "L", 4)
    # Limited to 2 tokens, "short" and "long" tie; "long" was used more recently.
    assert idx.best_match([1, 2, 3], 2) == ("long", "L", 2)
    idx.touch("short")
    assert idx.best_match([1, 2, 3], 2) == ("short", "S", 2)
    assert idx.best_match([1, 2, 3], 3) == ("long", "L", 3)
    assert idx.keys() == ["long", "other", "short"]    # matching does not touch
    assert idx.best_match([8, 1], 100) is None
    assert idx.best_match([1, 2], 0) is None
    assert idx.best_match([], 10) is None
    with pytest.raises(ValueError, match="limit"):
        idx.best_match([1], -1)


_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.sampled_from("abcdef"), st.lists(st.integers(0, 2), max_size=5)),
    st.tuples(st.just("touch"), st.sampled_from("abcdef")),
    st.tuples(st.just("pop"), st.sampled_from("abcdef")),
    st.tuples(st.just("cap"), st.integers(0, 5)),
    st.tuples(st.just("match"), st.lists(st.integers(0, 2), max_size=5), st.integers(0, 6)),
), max_size=40)


@given(cap=st.integers(0, 5), ops=_ops)
def test_index_matches_a_reference_model(cap, ops):
    idx: SnapshotIndex[str] = SnapshotIndex(cap)
    model: OrderedDict[str, list[int]] = OrderedDict()

    def evict():
        out = []
        while len(model) > cap:
            k, _ = model.popitem(last=False)
            out.append((k, k.upper()))
        return out

    for op in ops:
        if op[0] == "add":
            _, key, tokens = op
            model.pop(key, None)
            model[key] = tokens
            assert idx.add(key, tokens, key.upper()) == evict()
        elif op[0] == "touch":
            if op[1] in model:
                model.move_to_end(op[1])
                idx.touch(op[1])
        elif op[0] == "pop":
            expected = op[1].upper() if model.pop(op[1], None) is not None else None
            assert idx.pop(op[1]) == expected
        elif op[0] == "cap":
            cap = op[1]
            assert idx.set_cap(cap) == evict()
        else:
            _, query, limit = op
            best = None
            for k in reversed(model):  # newest first, strict improvement keeps the newest tie
                n = 0
                while n < min(len(model[k]), len(query), limit) and model[k][n] == query[n]:
                    n += 1
                if n > 0 and (best is None or n > best[2]):
                    best = (k, k.upper(), n)
            assert idx.best_match(query, limit) == best
        assert idx.keys() == list(model)


def test_displaced_snapshots_one_per_request_outside_the_lru():
    idx: SnapshotIndex[str] = SnapshotIndex(1)
    idx.add("f", [1, 2], "F")
    for n in range(3, 20):  # a request displaced again and again
        assert idx.add_displaced("x", list(range(1, n)), f"X{n}") == (None if n == 3 else f"X{n - 1}")
    assert idx.keys() == ["f"] and len(idx) == 1, "displaced snapshots neither count nor evict"
    assert idx.displaced_keys() == ["x"]
    assert idx.best_match([1, 2, 3, 4], 10) == ("x@displaced", "X19", 4)
    idx.touch("x@displaced")  # not in the LRU: nothing to do
    assert idx.best_match([1, 2], 10) == ("f", "F", 2), "ties go to the finished snapshot"
    assert idx.pop_displaced("x") == "X19" and idx.pop_displaced("x") is None
    assert idx.best_match([1, 2, 3, 4], 10) == ("f", "F", 2)
