"""Switchable defaults of npusim.q4x32's open options (issue 15, section 2) and the ``m4`` option.

Once a K3 board has answered the open questions (``npu-harness conformance --target ime2-hw``
writes ``ime2-board-answers.json``), the simulator's defaults must follow it: through
``set_defaults``, the ``NPUSIM_Q4X32`` JSON environment variable, or the answers file
(``set_defaults_from_answers``, ``NPUSIM_Q4X32_ANSWERS``). Each path is checked to change what
the functions compute when their options are left unset, and to reject bad keys and values with
a message naming them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import npusim.q4x32 as q
from npusim.q4x32 import AnswersError, OptionError
from npusim.q4x32.options import ENV_ANSWERS, ENV_DEFAULTS


@pytest.fixture(autouse=True)
def clean_defaults(monkeypatch):
    monkeypatch.delenv(ENV_DEFAULTS, raising=False)
    monkeypatch.delenv(ENV_ANSWERS, raising=False)
    q.reset_defaults()
    yield
    q.reset_defaults()


def fused_case() -> tuple[np.ndarray, bytes, bytes, np.ndarray]:
    """One .hp whose unfused and fused results differ: vd = 2048, tmp = 3, scale = 0x3556
    (3 * scale = 1 + 2**-11: fp16 rounds it to 1, then 2048 + 1 ties down to 2048; fused, the
    exact 2049.00049 rounds up to 2050)."""
    vd = np.full(64, 2048, dtype=np.float16)
    a = np.zeros((8, 32), dtype=np.int64)
    b = np.zeros((8, 32), dtype=np.int64)
    a[:, 0], b[:, 0] = 1, 3
    scale = np.full(64, np.uint16(0x3556)).view(np.float16)
    return vd, q.pack_tile(a), q.pack_tile(b), scale


def answers_file(tmp_path, answers: dict, schema: int = 1):
    path = tmp_path / "ime2-board-answers.json"
    path.write_text(json.dumps({"schema": schema, "target": "ime2-hw", "answers": answers}))
    return path


# ---------------------------------------------------------------------------------------------
# set_defaults


def test_builtin_defaults_are_the_reference_model():
    assert q.get_defaults() == {"rounding": "unfused", "dot": "fp16", "overflow": "inf", "order": "hi_lo",
                                "m4": "grouped"} == q.BUILTIN_DEFAULTS


def test_set_defaults_changes_what_unset_options_compute():
    vd, a, b, s = fused_case()
    assert np.all(q.vmadot_hp(vd, a, b, s) == 2048)
    before = q.set_defaults(rounding="fused")
    assert before["rounding"] == "unfused" and q.get_defaults()["rounding"] == "fused"
    assert np.all(q.vmadot_hp(vd, a, b, s) == 2050)
    assert np.all(q.vmadot_hp(vd, a, b, s, rounding="unfused") == 2048)  # explicit still wins
    regs = np.zeros((32, 128), dtype=np.uint8)
    regs[16], regs[3], regs[4], regs[0] = vd.view(np.uint8), np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8), \
        s.view(np.uint8)
    out = q.execute_hp(q.encode_hp(16, 3, 4), regs)
    assert np.all(out[16].view("<f2") == 2050)
    q.set_defaults(**before)
    assert np.all(q.vmadot_hp(vd, a, b, s) == 2048)


def test_set_defaults_reaches_the_gemm_levels():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4, 512)).astype(np.float32)
    qw, sc = q.quantize_q4_0(rng.standard_normal((64, 512)).astype(np.float32))
    unfused = q.ime2_hp_gemm(a, qw, sc, level="hardware")
    fused = q.ime2_hp_gemm(a, qw, sc, level="hardware", rounding="fused")
    assert not np.array_equal(unfused, fused)
    with q.option_defaults(rounding="fused") as now:
        assert now["rounding"] == "fused"
        np.testing.assert_array_equal(q.ime2_hp_gemm(a, qw, sc, level="hardware"), fused)
        rp = q.replay_gemm(q.pack_a(q.quantize_a(a)), q.pack_b(qw, sc), 4, 512, 64)
        np.testing.assert_array_equal(rp, fused)
    np.testing.assert_array_equal(q.ime2_hp_gemm(a, qw, sc, level="hardware"), unfused)


def test_set_defaults_rejects_unknown_keys_and_values_and_changes_nothing():
    with pytest.raises(OptionError, match=r"set_defaults\(\): unknown keys \['roundng'\]; known: dot, m4, order, overflow, rounding"):
        q.set_defaults(roundng="fused")
    with pytest.raises(OptionError, match=r"set_defaults\(\): overflow='clip' is not one of 'inf', 'saturate'"):
        q.set_defaults(rounding="fused", overflow="clip")
    assert q.get_defaults() == q.BUILTIN_DEFAULTS


def test_reset_defaults_forgets_set_defaults():
    q.set_defaults(dot="exact", m4="rowwise")
    assert q.reset_defaults()["dot"] == "exact"
    assert q.get_defaults() == q.BUILTIN_DEFAULTS


# ---------------------------------------------------------------------------------------------
# the environment


def test_env_json_sets_the_defaults(monkeypatch):
    monkeypatch.setenv(ENV_DEFAULTS, '{"rounding": "fused", "overflow": "saturate"}')
    q.reset_defaults()
    assert q.get_defaults() == {**q.BUILTIN_DEFAULTS, "rounding": "fused", "overflow": "saturate"}
    vd, a, b, s = fused_case()
    assert np.all(q.vmadot_hp(vd, a, b, s) == 2050)
    q.set_defaults(rounding="unfused")  # set_defaults wins over the environment
    assert np.all(q.vmadot_hp(vd, a, b, s) == 2048)


@pytest.mark.parametrize("text,message", [
    ("{rounding: fused}", r"NPUSIM_Q4X32='\{rounding: fused\}' is not valid JSON"),
    ('["fused"]', r"NPUSIM_Q4X32='\[\"fused\"\]' must be a JSON object, got list"),
    ('{"rounding": "fma"}', r"NPUSIM_Q4X32: rounding='fma' is not one of 'unfused', 'fused'"),
    ('{"m5": "grouped"}', r"NPUSIM_Q4X32: unknown keys \['m5'\]; known: dot, m4, order, overflow, rounding"),
])
def test_bad_env_is_an_error_at_every_use(monkeypatch, text, message):
    monkeypatch.setenv(ENV_DEFAULTS, text)
    q.reset_defaults()
    vd, a, b, s = fused_case()
    for _ in range(2):
        with pytest.raises(OptionError, match=message):
            q.vmadot_hp(vd, a, b, s)
    q.vmadot_hp(vd, a, b, s, rounding="unfused", dot="fp16", overflow="inf")  # explicit needs no default


# ---------------------------------------------------------------------------------------------
# board answers


def test_answers_file_sets_the_options_it_settles(tmp_path):
    path = answers_file(tmp_path, {
        "rounding": {"value": "fused", "scenario": "ime2_board.hp_rounding"},
        "order": {"value": "lo_hi"},
        "layout": {"value": "spec"},  # a fact, not an option: ignored
        "qweight_nibbles": {"value": None},  # the fork op was not installed: ignored
    })
    assert q.load_answers(path) == {"rounding": "fused", "order": "lo_hi"}
    before = q.set_defaults_from_answers(path)
    assert before == q.BUILTIN_DEFAULTS
    assert q.get_defaults() == {**q.BUILTIN_DEFAULTS, "rounding": "fused", "order": "lo_hi"}


def test_answers_env_then_json_env(tmp_path, monkeypatch):
    path = answers_file(tmp_path, {"rounding": {"value": "fused"}, "dot": {"value": "exact"}})
    monkeypatch.setenv(ENV_ANSWERS, str(path))
    monkeypatch.setenv(ENV_DEFAULTS, '{"dot": "fp16"}')  # the JSON variable wins over the file
    q.reset_defaults()
    assert q.get_defaults() == {**q.BUILTIN_DEFAULTS, "rounding": "fused"}


@pytest.mark.parametrize("content,error,message", [
    (None, AnswersError, "cannot read the answers file"),
    ("not json", AnswersError, "the answers file is not JSON"),
    ({"schema": 2, "answers": {}}, AnswersError, "answers schema 2 is not 1"),
    ({"schema": 1}, AnswersError, "has no 'answers' object"),
    ({"schema": 1, "answers": {"rounding": "fused"}}, AnswersError,
     "answer 'rounding' must be an object with a 'value'"),
    ({"schema": 1, "answers": {"overflow": {"value": None, "detail": "vd=65504 + 32 gave 0x7e00"}}}, AnswersError,
     r"the board showed none of inf, saturate for 'overflow' \(vd=65504 \+ 32 gave 0x7e00\)"),
    ({"schema": 1, "answers": {"dot": {"value": "fp32"}}}, OptionError, r"dot='fp32' is not one of 'fp16', 'exact'"),
])
def test_bad_answers_files_are_errors_naming_the_file(tmp_path, content, error, message):
    path = tmp_path / "answers.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(error, match=message) as info:
        q.set_defaults_from_answers(path)
    assert str(path) in str(info.value)
    assert q.get_defaults() == q.BUILTIN_DEFAULTS


def test_bad_answers_env_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_ANSWERS, str(tmp_path / "missing.json"))
    q.reset_defaults()
    with pytest.raises(AnswersError, match=r"NPUSIM_Q4X32_ANSWERS=.*missing.json: cannot read"):
        q.get_defaults()


# ---------------------------------------------------------------------------------------------
# the m4 option


def _operands(m: int, k: int = 288, n: int = 70, seed: int = 2):
    rng = np.random.default_rng([seed, m, k, n])
    a = rng.standard_normal((m, k)).astype(np.float32)
    a[1, 5] = 40.0  # an outlier in the first 4-row group: grouping changes rows 0, 2 and 3
    return (a, *q.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32)))


def test_rowwise_quantizes_every_row_alone():
    a, _, _ = _operands(6)
    grouped, rowwise = q.quantize_a(a), q.quantize_a(a, m4="rowwise")
    assert grouped.n_grouped == 4 and rowwise.n_grouped == 0
    for r in range(6):
        alone = q.quantize_a(a[r:r + 1])
        np.testing.assert_array_equal(rowwise.q[r], alone.q[0])
        np.testing.assert_array_equal(rowwise.rel[r], alone.rel[0])
    assert not np.array_equal(grouped.q[0], rowwise.q[0])
    np.testing.assert_array_equal(grouped.q[4:], rowwise.q[4:])  # the remainder rows were alone anyway
    back = q.unpack_a(q.pack_a(rowwise), 6, 288, m4="rowwise")
    np.testing.assert_array_equal(back.q, rowwise.q)


def test_rowwise_gemm_equals_one_row_at_a_time_and_the_replay():
    a, qw, sc = _operands(5)
    rowwise = q.ime2_hp_gemm(a, qw, sc, level="hardware", m4="rowwise")
    per_row = np.concatenate([q.ime2_hp_gemm(a[r:r + 1], qw, sc, level="hardware") for r in range(5)])
    np.testing.assert_array_equal(rowwise.view(np.uint32), per_row.view(np.uint32))
    grouped = q.ime2_hp_gemm(a, qw, sc, level="hardware")
    assert not np.array_equal(grouped[:4], rowwise[:4]) and np.array_equal(grouped[4], rowwise[4])
    rp = q.replay_gemm(q.pack_a(q.quantize_a(a, m4="rowwise")), q.pack_b(qw, sc), 5, 288, 70, m4="rowwise")
    np.testing.assert_array_equal(rp.view(np.uint32), rowwise.view(np.uint32))
    with q.option_defaults(m4="rowwise"):
        np.testing.assert_array_equal(q.ime2_hp_gemm(a, qw, sc, level="hardware"), rowwise)
        np.testing.assert_array_equal(q.scalar_tail_gemm(a, qw, sc), q.scalar_tail_gemm(a, qw, sc, m4="rowwise"))


def test_unknown_m4_is_an_option_error():
    a, qw, sc = _operands(4)
    with pytest.raises(OptionError, match=r"m4='pairs' is not one of 'grouped', 'rowwise'"):
        q.ime2_hp_gemm(a, qw, sc, m4="pairs")
    with pytest.raises(OptionError, match="m4="):
        q.quantize_a(a, m4="pairs")
