"""Cases of the MBLT worker, run by ``test_mblt_worker.py`` in a fresh interpreter (vLLM resolves
its platform once per process).

No fake runtime: the worker is built from a real ``VllmConfig`` (``EngineArgs(...)
.create_engine_config()`` with ``NPU_HARNESS_TARGET=mblt-sim``, so the MBLT platform's
``check_and_update_config`` sizes it), loads an artifact compiled by
``npusim.mxq.compile.compile_artifact`` from a ``npusim.tinymodel`` checkpoint, and every
output is compared with the golden ``npusim.llm.Decoder.generate_greedy``.

:class:`step_driver.Driver` (shared by every device's worker cases) plays vLLM 0.32's
scheduler; the MBLT worker keeps its KV by slot, so the driver hands out no block ids.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time

import numpy as np
import pytest

pytest.importorskip("vllm")

from npusim import tinymodel  # noqa: E402
from npusim.llm import Decoder  # noqa: E402
from npusim.mxq import machine  # noqa: E402
from npusim.mxq.compile import compile_artifact  # noqa: E402
from step_driver import Driver, greedy  # noqa: E402,F401

BLOCK = 16
MAX_LEN = 128
CHUNK = 16  # the artifacts' npu_prefill_chunk_size / max_width
WORKER_CLS = "vllm_npu.mblt.worker.MbltWorker"


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tinymodel.build("llama", tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def golden(hf_dir):
    dec = Decoder.from_pretrained(hf_dir)
    memo: dict = {}

    def run(prompt, n):
        key = (tuple(prompt), n)
        if key not in memo:
            memo[key] = [int(t) for t in dec.generate_greedy(list(prompt), n)]
        return memo[key]

    return run


@pytest.fixture(scope="module")
def artifact(hf_dir, tmp_path_factory):
    """``artifact(name, k, cache=256, drop_batch_key=False, logits="last")`` -> compiled artifact
    dir (memoized)."""
    made: dict = {}

    def make(name, k, cache=256, drop_batch_key=False, logits="last"):
        if name not in made:
            out = compile_artifact(hf_dir, tmp_path_factory.mktemp(name), max_batch_size=k,
                                   max_cache_size=cache, prefill_chunk_size=CHUNK, max_width=CHUNK,
                                   output_logits=logits)
            if drop_batch_key:
                cfg_path = out / "config.json"
                cfg = json.loads(cfg_path.read_text())
                del cfg["max_batch_size"]
                cfg_path.write_text(json.dumps(cfg))
            made[name] = out
        return made[name]

    return make


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("NPU_HARNESS_TARGET", "mblt-sim")
    monkeypatch.setenv("VLLM_MBLT_PREFIX_CACHE_CALIBRATE", "0")
    for var in ("VLLM_MBLT_PREFIX_CACHE_AUTO_THRESHOLD", "VLLM_MBLT_PREFIX_CACHE_MIN_HIT_TOKENS",
                "VLLM_MBLT_PREFIX_CACHE_MAX_HOST_MIB", "VLLM_MBLT_ENABLE_SAMPLING_PENALTIES",
                "VLLM_MBLT_PREFIX_CACHE_LOAD_MARGIN", "NPUSIM_MXQ"):
        monkeypatch.delenv(var, raising=False)
    machine.reset()
    yield
    machine.reset()


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


_handlers: list[_ListHandler] = []


def _attach_handlers():
    """(Re)attach the capture handlers: vLLM's ``dictConfig`` (run by the first
    ``create_engine_config``) clears handlers of existing child loggers, and its ``vllm``
    logger does not propagate to caplog's root handler."""
    log = logging.getLogger("vllm.vllm_npu.mblt")
    for h in _handlers:
        if h not in log.handlers:
            log.addHandler(h)


@pytest.fixture
def mblt_log():
    """Messages the plugin logs (``vllm.vllm_npu.mblt``, INFO and up) during the test."""
    h = _ListHandler()
    _handlers.append(h)
    _attach_handlers()
    yield h.lines
    _handlers.remove(h)
    logging.getLogger("vllm.vllm_npu.mblt").removeHandler(h)


def vllm_config(model_dir, *, max_model_len=MAX_LEN, extra=None):
    """A real VllmConfig; the MBLT platform's check_and_update_config runs inside."""
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=str(model_dir), max_model_len=max_model_len, block_size=BLOCK,
                     model_loader_extra_config=extra or {}).create_engine_config()
    assert cfg.parallel_config.worker_cls == WORKER_CLS, "the MBLT platform did not configure vLLM"
    _attach_handlers()
    return cfg


@pytest.fixture
def make_worker():
    from vllm_npu.mblt.worker import MbltWorker

    made = []

    def make(model_dir, *, load=True, edit=None, **kw):
        cfg = vllm_config(model_dir, **kw)
        if edit is not None:  # what the platform could not see (a capacity it could not read)
            edit(cfg)
        w = MbltWorker(cfg, 0, 0, "tcp://127.0.0.1:0")
        made.append(w)
        w.init_device()
        if load:
            w.load_model()
        return w

    yield make
    for w in made:
        w.shutdown()


def prompts(seed, *lengths):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(5, 1000, n)] for n in lengths]


# ---------------------------------------------------------------------- greedy equivalence
def test_platform_sizes_the_scheduler_from_the_artifact(artifact):
    cfg = vllm_config(artifact("k4", 4))
    assert cfg.scheduler_config.max_num_seqs == 4
    assert cfg.cache_config.block_size == BLOCK
    assert cfg.scheduler_config.enable_chunked_prefill


def test_chunked_batched_greedy_equals_golden(artifact, make_worker, golden):
    w = make_worker(artifact("k4", 4))
    d = Driver(w, chunk=7)  # chunks smaller than every prompt, not a divisor of any
    ps = prompts(1, 37, 23, 50, 9)
    for i, p in enumerate(ps):
        d.add(f"r{i}", p, greedy(6))
    # r0 and r1 start together; r2 and r3 join one step later (new + running in one step)
    d.step(["r0", "r1"])
    outs = d.run(["r0", "r1", "r2", "r3"])
    for i, p in enumerate(ps):
        assert outs[f"r{i}"] == golden(p, 6), f"r{i}"
    d.flush()
    assert sorted(w.free_vslots) == [0, 1, 2, 3]
    assert w.backend.k_per_model == 4 and len(w.backend.models) == 1


def test_requests_share_one_dispatch_on_a_batch_artifact(artifact, make_worker, golden):
    """Several requests in one step go to the K=4 MXQ as one batched infer."""
    w = make_worker(artifact("k4", 4))
    calls = []
    model = w.backend.models[0]
    real = model.infer

    def spy(*a, **kw):
        calls.append(len(a[3]) if len(a) > 3 and a[3] is not None else 1)
        return real(*a, **kw)

    model.infer = spy
    d = Driver(w)
    ps = prompts(2, 12, 14, 10)
    for i, p in enumerate(ps):
        d.add(f"b{i}", p, greedy(4))
    outs = d.run()
    assert max(calls) == 3
    assert len(calls) == 4  # one prefill step + three decode steps, each one dispatch
    for i, p in enumerate(ps):
        assert outs[f"b{i}"] == golden(p, 4)


# ---------------------------------------------------------------------- non-batch slot thrash
def test_non_batch_slot_thrash_restores_each_requests_own_kv(artifact, make_worker, golden):
    w = make_worker(artifact("nobatch", 1, drop_batch_key=True))
    assert w.max_batch_size == 1
    d = Driver(w, chunk=11)
    ps = prompts(3, 30, 19, 41, 26)
    for i, p in enumerate(ps):
        d.add(f"t{i}", p, greedy(5))
    outs = d.run()  # every step schedules all four, all on slot (0, 0)
    for i, p in enumerate(ps):
        assert outs[f"t{i}"] == golden(p, 5), f"t{i}"
    assert all(st.kv.slot == (0, 0) for st in w.reqs.values())
    assert w.table.saves > 0 and w.table.restores > 0


# ---------------------------------------------------------------------- multi-card
def test_multi_card_two_instances_run_concurrently(artifact, make_worker, golden):
    machine.configure(devices=2, pace=True, infer_fixed_us=30000, infer_us_per_token=0, io_fixed_us=0)
    w = make_worker(artifact("k1", 1), extra={"dev_no": [0, 1], "max_batch_size": 2})
    assert len(w.backend.models) == 2 and w.backend.model_dev_no == [0, 1]
    assert w.backend.k_per_model == 1
    spans: list[tuple[int, float, float]] = []
    lock = threading.Lock()
    for idx, model in enumerate(w.backend.models):
        def spy(*a, _real=model.infer, _idx=idx, **kw):
            t0 = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                with lock:
                    spans.append((_idx, t0, time.perf_counter()))
        model.infer = spy
    d = Driver(w)
    ps = prompts(4, 14, 9)
    d.add("m0", ps[0], greedy(3))
    d.add("m1", ps[1], greedy(3))
    outs = d.run()
    assert outs["m0"] == golden(ps[0], 3) and outs["m1"] == golden(ps[1], 3)
    assert {st.kv.slot for st in w.reqs.values()} == {(0, 0), (1, 0)}
    by_model = {0: [s for s in spans if s[0] == 0], 1: [s for s in spans if s[0] == 1]}
    assert len(by_model[0]) == len(by_model[1]) == 3
    # each step's two infers overlap in time (the 30 ms simulated runs are not serialized)
    for (_, a0, a1), (_, b0, b1) in zip(by_model[0], by_model[1]):
        assert max(a0, b0) < min(a1, b1)
    assert machine.device(0).clock_us > 0 and machine.device(1).clock_us > 0


# ---------------------------------------------------------------------- prefix snapshots
def _prefix_pair(seed=5):
    a, tail = prompts(seed, 40, 13)
    return a, a[:32] + tail  # B shares A's first two blocks


def _finish_a(d, a_prompt, n=4):
    d.add("A", a_prompt, greedy(n))
    d.run(["A"])
    d.flush()


def test_prefix_snapshot_is_loaded_when_threshold_off(artifact, make_worker, golden, monkeypatch, mblt_log):
    monkeypatch.setenv("VLLM_MBLT_PREFIX_CACHE_AUTO_THRESHOLD", "0")
    w = make_worker(artifact("k4", 4))
    a, b = _prefix_pair()
    d = Driver(w)
    d.add("A", a, greedy(4))
    d.run(["A"])
    saves = w.table.saves
    d.flush()
    assert w.snapshots.keys() == ["A"]
    assert w.table.saves == saves  # finishing does not dump: A's KV stays on its slot
    d.add("B", b, greedy(5), num_computed=32)
    assert d.run(["B"])["B"] == golden(b, 5)
    assert w.stats["prefix_loads"] == 1 and w.stats["prefix_recomputes"] == 0
    assert any("load 32 tokens for req_id=B" in m for m in mblt_log)


def test_prefix_snapshot_below_min_hit_tokens_is_recomputed(artifact, make_worker, golden, monkeypatch):
    monkeypatch.setenv("VLLM_MBLT_PREFIX_CACHE_AUTO_THRESHOLD", "0")
    monkeypatch.setenv("VLLM_MBLT_PREFIX_CACHE_MIN_HIT_TOKENS", "33")
    w = make_worker(artifact("k4", 4))
    a, b = _prefix_pair()
    d = Driver(w)
    _finish_a(d, a)
    d.add("B", b, greedy(5), num_computed=32)
    assert d.run(["B"])["B"] == golden(b, 5)
    assert w.stats["prefix_loads"] == 0 and w.stats["prefix_recomputes"] == 1


@pytest.mark.parametrize("expensive_load", [True, False], ids=["load-expensive", "load-cheap"])
def test_measured_threshold_follows_the_simulated_costs(artifact, make_worker, golden, monkeypatch, mblt_log,
                                                        expensive_load):
    """pace=True makes loads/infers take their simulated cost; the worker's calibration and
    real snapshot loads measure them, and the second B's decision follows."""
    # Simulated costs dwarf the host's own (noisy) compute time: a 256 KiB load costs ~0.8 s
    # against an unpaced prefill, or nothing against 20 ms per infer call (32 tokens = 2 calls).
    if expensive_load:
        machine.configure(pace=True, load_us_per_kib=3000, dump_us_per_kib=0, io_fixed_us=0,
                          infer_fixed_us=0, infer_us_per_token=0)
    else:
        machine.configure(pace=True, load_us_per_kib=0, dump_us_per_kib=0, io_fixed_us=0,
                          infer_fixed_us=20000, infer_us_per_token=0)
    monkeypatch.setenv("VLLM_MBLT_PREFIX_CACHE_CALIBRATE", "1")
    w = make_worker(artifact("k4", 4), max_model_len=64)  # calibrates 16, 32 and 64 tokens
    assert w.cost_model.prefill_ms(32) is not None  # calibrated at load_model
    a, b = _prefix_pair()
    d = Driver(w)
    _finish_a(d, a)
    # B1 takes slot 1 (a filler request holds slot 0), so its snapshot load is a real restore
    d.add("F", prompts(6, 5)[0], greedy(1))
    d.add("B1", b, greedy(2), num_computed=32)
    d.run(["F", "B1"])
    d.flush()
    assert w.stats["prefix_loads"] == 1  # no load timing yet: the first match loads
    assert w.cost_model.load_ms(1) is not None
    b2 = b[:40] + [7, 8, 9]
    d.add("B2", b2, greedy(4), num_computed=32)
    assert d.run(["B2"])["B2"] == golden(b2, 4)
    decision = [m for m in mblt_log if "req_id=B2" in m]
    assert len(decision) == 1, (w.stats, list(mblt_log))
    if expensive_load:
        assert w.stats["prefix_loads"] == 1 and w.stats["prefix_recomputes"] == 1
        assert "recompute 32 tokens" in decision[0] and "load_ms" in decision[0] and ">=" in decision[0]
    else:
        assert w.stats["prefix_loads"] == 2 and w.stats["prefix_recomputes"] == 0
        assert "load 32 tokens" in decision[0] and "load_ms" in decision[0] and " < " in decision[0]


def test_snapshot_lru_cap_keeps_only_the_newest(artifact, make_worker, golden, monkeypatch, mblt_log):
    monkeypatch.setenv("VLLM_MBLT_PREFIX_CACHE_AUTO_THRESHOLD", "0")
    monkeypatch.setenv("VLLM_MBLT_PREFIX_CACHE_MAX_HOST_MIB", "1")
    w = make_worker(artifact("k4c1024", 4, cache=1024))  # 1 MiB of KV per cache id
    assert w.backend.kv_nbytes_per_cache == 2**20
    assert w.snapshots.cap == 1
    assert any("MBLT keeps up to 1 finished prefix snapshots (1 MiB each, budget 1 MiB)." in m for m in mblt_log)
    a, b = _prefix_pair()
    c = prompts(7, 20)[0]
    d = Driver(w)
    _finish_a(d, a)
    d.add("C", c, greedy(2))
    d.run(["C"])
    d.flush()
    assert w.snapshots.keys() == ["C"]
    assert all(kv.token_ids[:1] != a[:1] for kv in w.table.owner.values())  # A's cache was let go
    d.add("B", b, greedy(3), num_computed=32)  # A's prefix is gone: recomputed
    assert d.run(["B"])["B"] == golden(b, 3)
    assert w.stats["prefix_loads"] == 0 and w.stats["prefix_recomputes"] == 1


def test_non_batch_displaced_request_is_a_prefix_snapshot(artifact, make_worker, golden, monkeypatch):
    monkeypatch.setenv("VLLM_MBLT_PREFIX_CACHE_AUTO_THRESHOLD", "0")
    w = make_worker(artifact("nobatch", 1, drop_batch_key=True))
    a, b = _prefix_pair()
    z = prompts(14, 10)[0]
    d = Driver(w)
    d.add("X", a, greedy(6))
    d.add("Z", z, greedy(6))
    for _ in range(4):  # X and Z take turns on slot (0, 0): X loses it to Z every step
        d.step(["X", "Z"])
    d.add("Y", b, greedy(3), num_computed=32)  # vLLM's prefix cache shares X's first two blocks
    outs = d.run(["X", "Z", "Y"])
    assert outs["Y"] == golden(b, 3)
    assert w.stats["prefix_loads"] == 1



def test_displaced_snapshots_are_one_per_request_and_never_evict_finished_ones(artifact, make_worker, golden,
                                                                               monkeypatch):
    """Issue 20 §2.2: two requests taking turns on a non-batch model's one slot once added a
    ``req@len`` snapshot per slot loss to the finished LRU (16 copies; a finished snapshot
    pushed out within 9 steps). Now: one displaced snapshot per running request, outside the
    LRU; the finished snapshot survives and is loaded; finishing drops the displaced copy."""
    monkeypatch.setenv("VLLM_MBLT_PREFIX_CACHE_AUTO_THRESHOLD", "0")
    monkeypatch.setenv("VLLM_MBLT_PREFIX_CACHE_MAX_HOST_MIB", "1")  # a small finished cap
    w = make_worker(artifact("nobatch", 1, drop_batch_key=True))
    cap = w.snapshots.cap
    a, b = _prefix_pair()
    d = Driver(w)
    _finish_a(d, a)
    assert w.snapshots.keys() == ["A"]
    x, z = prompts(15, 40, 40)
    d.add("X", x, greedy(14))
    d.add("Z", z, greedy(14))
    for _ in range(12):  # X and Z take turns on slot (0, 0): each loses it every step
        d.step(["X", "Z"])
    assert w.snapshots.keys() == ["A"], w.snapshots.keys()
    assert sorted(w.snapshots.displaced_keys()) == ["X", "Z"]
    d.add("B", b, greedy(3), num_computed=32)
    assert d.run(["B"])["B"] == golden(b, 3)
    assert w.stats["prefix_loads"] == 1
    outs = d.run(["X", "Z"])
    assert outs["X"] == golden(x, 14) and outs["Z"] == golden(z, 14)
    d.flush()
    assert w.snapshots.displaced_keys() == []
    assert len(w.snapshots) <= max(cap, 1)


# ---------------------------------------------------------------------- preemption
@pytest.mark.parametrize("resume_at", [0, 16])
def test_preempted_request_resumes_to_golden(artifact, make_worker, golden, resume_at):
    w = make_worker(artifact("k4", 4))
    p0, p1, p2 = prompts(8, 30, 21, 18)
    d = Driver(w)
    d.add("P", p0, greedy(6))
    d.add("Q", p1, greedy(6))
    for _ in range(4):  # P: 2 prefill chunks (the second samples) + 2 decodes
        d.step(["P", "Q"])
    assert len(d.reqs["P"].out) == 3
    d.preempt("P")
    d.add("R", p2, greedy(3))  # takes P's slot while P waits
    d.step(["Q", "R"])
    assert w.reqs["P"].vslot is None
    restores = w.table.restores
    d.resume("P", num_computed=resume_at)
    outs = d.run(["P", "Q", "R"])
    assert outs["P"] == golden(p0, 6)
    assert outs["Q"] == golden(p1, 6) and outs["R"] == golden(p2, 3)
    if resume_at:
        assert w.table.restores > restores  # P's own saved KV was restored


def test_short_cache_warning_when_scheduler_claims_more(artifact, make_worker, golden, mblt_log):
    w = make_worker(artifact("k4", 4))
    p = prompts(9, 45)[0]
    d = Driver(w)
    d.add("S", p, greedy(3))
    d.step(["S"])  # 16 tokens computed
    d.preempt("S")
    d.flush()
    d.resume("S", num_computed=32)  # as if vLLM's prefix cache had two blocks
    assert d.run(["S"])["S"] == golden(p, 3)
    warn = [m for m in mblt_log if m.startswith("MBLT request cache holds fewer tokens than the scheduler expects")]
    assert len(warn) == 1
    assert "req_id=S" in warn[0] and "cache_id=0" in warn[0]
    assert "live_tokens=16" in warn[0] and "expected=32" in warn[0]
    assert w.short_cache_warnings == 1


def _common(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("kind,seed", [("k4", 0), ("k4", 2), ("nobatch", 1)])
def test_random_schedules_match_golden(artifact, make_worker, golden, monkeypatch, kind, seed):
    """Random arrivals sharing prefixes, random chunk budgets, partial scheduling, preemption
    and resumption, with vLLM-style block-aligned prefix hits (from any tokens computed so
    far): every request's output equals its golden continuation."""
    import random

    monkeypatch.setenv("VLLM_MBLT_PREFIX_CACHE_AUTO_THRESHOLD", "0")
    w = make_worker(artifact("k4", 4) if kind == "k4" else artifact("nobatch", 1, drop_batch_key=True))
    rng = random.Random(seed)
    base = prompts(seed, 70)[0]
    d = Driver(w)
    computed: list[list[int]] = []  # sequences whose blocks vLLM's prefix cache would hold

    def hit(ids):
        best = min(max([_common(c, ids) for c in computed] + [0]), len(ids) - 1)
        return best // BLOCK * BLOCK if rng.random() < 0.8 else 0

    n_req, waiting = 0, []
    for _ in range(60):
        d.chunk = rng.choice([5, 8, 11, 16, 16])
        running = d.active()
        if n_req < 8 and len(running) < 4 and rng.random() < 0.5:
            length, cut = rng.randint(20, 60), rng.randint(0, 40)
            p = (base[:cut] + prompts(seed * 100 + n_req, length)[0])[:length]
            d.add(f"q{n_req}", p, greedy(rng.randint(1, 6)), num_computed=hit(p))
            running.append(f"q{n_req}")
            n_req += 1
        started = [r for r in running if d.reqs[r].sent]
        if len(started) > 1 and rng.random() < 0.1:
            v = rng.choice(started)
            computed.append(d.reqs[v].all_ids[:d.reqs[v].computed])
            d.preempt(v)
            waiting.append(v)
            running.remove(v)
        elif waiting and len(running) < 4 and rng.random() < 0.5:
            v = waiting.pop(0)
            d.resume(v, hit(d.reqs[v].all_ids))
            running.append(v)
        sched = [r for r in running if rng.random() < 0.85] or running
        d.step(sched)
        for rid in sched:
            computed.append(d.reqs[rid].all_ids[:d.reqs[rid].computed])
    for v in waiting:
        d.resume(v, 0)
    d.run([rid for rid, r in d.reqs.items() if not r.done])
    assert n_req >= 4
    for rid, r in d.reqs.items():
        assert r.out == golden(r.prompt, r.params.max_tokens), rid


# ---------------------------------------------------------------------- configuration errors
def test_no_free_slot_message(artifact, make_worker):
    from vllm_npu.mblt.worker import NoFreeSlotError

    w = make_worker(artifact("k4", 4))
    d = Driver(w)
    for i, p in enumerate(prompts(10, 5, 5, 5, 5, 5)):
        d.add(f"x{i}", p, greedy(2))
    with pytest.raises(NoFreeSlotError, match=r"No free accelerator cache slots remain for batch execution\. "
                                              r"req_id=x4, max_batch_size=4"):
        d.step()


def test_max_model_len_above_kv_capacity_is_refused_before_an_engine(artifact):
    # the platform reads the MXQ's capacity while vLLM builds its config (the API server's part)
    with pytest.raises(Exception, match=r"max_model_len=512 exceeds the KV capacity of the MXQ .*model\.mxq "
                                        r"\(256 tokens per cache id\)\. Pass --max-model-len 256 or lower"):
        vllm_config(artifact("k4", 4), max_model_len=512)


def test_max_model_len_above_kv_capacity_is_refused_by_the_worker_too(artifact, make_worker):
    # a value the platform let through (it could not read the capacity) meets the worker's check
    from vllm_npu.mblt.settings import MbltConfigError

    def over(cfg):
        cfg.model_config.max_model_len = 512

    w = make_worker(artifact("k4", 4), max_model_len=256, load=False, edit=over)
    with pytest.raises(MbltConfigError, match=r"max_model_len=512 exceeds the KV capacity .* \(256 tokens per cache id\)"):
        w.load_model()
    assert w.backend is None


# ---------------------------------------------------------------------- sampling
def _sampled(w, params_list, ps):
    d = Driver(w)
    for i, (p, params) in enumerate(zip(ps, params_list)):
        d.add(f"s{i}", p, params)
    outs = d.run()
    d.flush()
    return [outs[f"s{i}"] for i in range(len(ps))]


def test_seeded_random_sampling_is_reproducible_across_workers(artifact, make_worker, golden):
    from vllm import SamplingParams

    ps = prompts(11, 12, 17)
    params = [SamplingParams(temperature=1.5, seed=1234, max_tokens=10),
              SamplingParams(temperature=1.5, seed=99, max_tokens=10)]
    w1 = make_worker(artifact("k4", 4))
    first = _sampled(w1, params, ps)
    w1.shutdown()  # the second worker needs the cores back
    second = _sampled(make_worker(artifact("k4", 4)), params, ps)
    assert first == second
    assert first[0] != golden(ps[0], 10) or first[1] != golden(ps[1], 10)  # really sampled


def test_penalties_off_warns_once_and_changes_nothing_else(artifact, make_worker, golden, monkeypatch, mblt_log):
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_MBLT_ENABLE_SAMPLING_PENALTIES", "0")
    w = make_worker(artifact("k4", 4))
    ps = prompts(12, 15, 22)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=1.0, max_tokens=8),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=8)]
    outs = _sampled(w, params, ps)
    assert outs == [golden(ps[0], 8), golden(ps[1], 8)]
    warns = [m for m in mblt_log if m.startswith("Sampling penalties are disabled by VLLM_MBLT_ENABLE_SAMPLING_PENALTIES")]
    assert len(warns) == 1  # once, though two requests carried penalties over 16 sampling steps
    assert "Ignoring frequency_penalty, repetition_penalty:" in warns[0]
    assert "presence_penalty" not in warns[0]


def test_repetition_penalty_changes_the_greedy_continuation(artifact, make_worker, golden):
    """Greedy decoding of this prompt repeats token 226 (outputs 2 and 5); a 1.3 repetition
    penalty applied on the host sampler steers the continuation away from the repeat."""
    from vllm import SamplingParams

    w = make_worker(artifact("k4", 4))
    p = prompts(18, 20)[0]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=8), greedy(8)]
    with_pen, without = _sampled(w, params, [p, p])
    assert without == golden(p, 8)
    assert without[2] == without[5]  # the repeat the penalty should remove
    assert with_pen[:5] == without[:5] and with_pen[5] != without[5]


# ---------------------------------------------------------------------- prompt logprobs
def _golden_prompt_logprobs(hf_dir, prompt):
    """The golden decoder's log-softmax after each prompt position ``[P, vocab]`` (float64)."""
    dec = Decoder.from_pretrained(hf_dir)
    logits = dec.prefill(prompt, dec.new_cache(len(prompt))).astype(np.float64)
    m = logits.max(axis=1, keepdims=True)
    return logits - (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))


def _run_collecting_prompt_logprobs(d, rids):
    got = {}
    while any(not d.reqs[r].done for r in rids):
        out = d.step([r for r in rids if not d.reqs[r].done])
        for rid, t in out.prompt_logprobs_dict.items():
            assert rid not in got, f"{rid}: prompt logprobs returned twice"
            got[rid] = t
    return got


#: |served - golden| bound on a prompt logprob (nats): both are float32 forward passes of the
#: same weights; chunked vs one-token feeding changes only the summation order.
PROMPT_LOGPROB_ATOL = 2e-4


@pytest.mark.parametrize(("name", "k", "logits"), [("k4", 4, "last"), ("k1", 1, "last"), ("k4all", 4, "all")],
                         ids=["batch-last-microsteps", "nonbatch-last-microsteps", "batch-all-one-infer"])
def test_prompt_logprobs_equal_golden_log_softmax(artifact, make_worker, golden, hf_dir, mblt_log, name, k, logits):
    """prompt_logprobs=3 beside an ordinary request, prefilled in chunks of 7: every prompt
    position's logprob of the next prompt token and its top 3 equal the golden decoder's
    log-softmax; last-logit MXQs take one microstep per scored position, full-sequence ones
    none; the ordinary request's tokens stay golden."""
    from vllm import SamplingParams

    w = make_worker(artifact(name, k, logits=logits))
    d = Driver(w, chunk=7)
    pa, pb = prompts(11, 29, 23)
    d.add("plp", pa, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3))
    d.add("plain", pb, greedy(5))
    got = _run_collecting_prompt_logprobs(d, ["plp", "plain"])
    assert d.reqs["plp"].out == golden(pa, 3) and d.reqs["plain"].out == golden(pb, 5)
    assert set(got) == {"plp"}
    t = got["plp"]
    gold = _golden_prompt_logprobs(hf_dir, pa)
    ids, vals, ranks = t.logprob_token_ids.numpy(), t.logprobs.numpy(), t.selected_token_ranks.numpy()
    assert ids.shape == (len(pa) - 1, 4) and vals.shape == ids.shape
    for p in range(len(pa) - 1):
        tok = pa[p + 1]
        assert ids[p, 0] == tok
        assert abs(vals[p, 0] - gold[p, tok]) <= PROMPT_LOGPROB_ATOL, (p, vals[p, 0], gold[p, tok])
        top = np.argsort(-gold[p], kind="stable")[:3]
        assert list(ids[p, 1:]) == list(top), (p, ids[p, 1:], top)
        assert np.abs(vals[p, 1:] - gold[p, top]).max() <= PROMPT_LOGPROB_ATOL
        assert ranks[p] == int((gold[p] > gold[p, tok]).sum()) + 1
    micro = w.stats["prompt_logprob_microsteps"]
    assert micro == (len(pa) - 1 if logits == "last" else 0), micro
    text = "\n".join(mblt_log)
    path = "1-token microsteps" if logits == "last" else "one infer per chunk"
    assert f"MBLT prompt logprobs for req_id=plp ({len(pa) - 1} positions, top 3): {path}" in text, text[-2000:]


def test_prompt_logprobs_survive_preemption_mid_prompt(artifact, make_worker, hf_dir):
    """Preempted halfway through its prompt and recomputed from 0 (vLLM never gives a
    prompt-logprobs request a prefix hit), the request still returns every position once."""
    from vllm import SamplingParams

    w = make_worker(artifact("k4", 4))
    d = Driver(w, chunk=7)
    (pa,) = prompts(12, 30)
    d.add("plp", pa, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))
    d.step(["plp"])
    d.step(["plp"])
    d.preempt("plp")
    d.flush()
    d.resume("plp", 0)
    got = _run_collecting_prompt_logprobs(d, ["plp"])
    gold = _golden_prompt_logprobs(hf_dir, pa)
    vals = got["plp"].logprobs.numpy()[:, 0]
    want = np.array([gold[p, pa[p + 1]] for p in range(len(pa) - 1)])
    assert np.abs(vals - want).max() <= PROMPT_LOGPROB_ATOL


# ---------------------------------------------------------------------- errors that name the value
def test_missing_embedding_names_both_files_searched(tmp_path):
    from vllm_npu.mblt.worker import MbltWorkerError, _load_embeddings

    with pytest.raises(MbltWorkerError) as info:
        _load_embeddings(str(tmp_path))
    text = str(info.value)
    assert f"{tmp_path}/model.safetensors" in text and f"{tmp_path}/embedding.safetensors" in text
    assert "neither file exists" in text


def test_worker_without_a_target_refuses_instead_of_picking_the_simulator(artifact, make_worker, monkeypatch):
    from vllm_npu.mblt.worker import MbltWorkerError

    w = make_worker(artifact("k4", 4), load=False)
    monkeypatch.delenv("NPU_HARNESS_TARGET")
    with pytest.raises(MbltWorkerError, match=r"NPU_HARNESS_TARGET='': the MBLT worker runs on mblt-sim"):
        w.load_model()


def test_config_dev_no_true_is_refused_naming_the_file(artifact, make_worker, tmp_path):
    from vllm_npu.mblt.settings import MbltConfigError

    src = artifact("k4", 4)
    dst = tmp_path / "devtrue"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["dev_no"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    w = make_worker(dst, load=False)
    with pytest.raises(MbltConfigError, match=r"config\.json: dev_no=True must be an int >= 0"):
        w.load_model()


def test_auto_core_mode_on_a_several_mode_artifact_is_refused_naming_the_modes(hf_dir, make_worker, tmp_path):
    """A K=1 artifact compiled for every core mode, served without ``core_mode``: the worker's
    Auto config is refused by the runtime, and the start-up error names the compiled modes."""
    out = compile_artifact(hf_dir, tmp_path / "auto4", max_batch_size=1, max_cache_size=256,
                           prefill_chunk_size=CHUNK, max_width=CHUNK, core_mode="auto")
    from vllm_npu.mblt.settings import MbltConfigError

    w = make_worker(out, load=False)
    with pytest.raises(MbltConfigError) as info:
        w.load_model()
    text = str(info.value)
    assert "does not run in core_mode=auto" in text, text
    assert "Its compiled core modes: single, multi, global4, global8." in text, text


def test_batch_mxq_width_is_128_and_a_lone_long_step_is_split(hf_dir, make_worker, golden, tmp_path):
    """Issue 20 §2.1: vLLM 0.32 may give a lone request ``chunk x K`` tokens in one step, and
    batch MXQs were compiled ``max(128, chunk)`` wide, so the seed's 128-token batch limit was
    never exercised. A K=4 MXQ advertising chunk 256 is 128 wide; a 300-token step of one
    request runs as pieces of at most 128 (the simulator refuses wider items) and is golden."""
    out = compile_artifact(hf_dir, tmp_path / "k4c256", max_batch_size=4, max_cache_size=512,
                           prefill_chunk_size={"single": 256})
    w = make_worker(out, max_model_len=512)
    assert w.backend.max_width == 128
    (p,) = prompts(21, 300)
    d = Driver(w, chunk=300)
    d.add("lone", p, greedy(4))
    assert d.run(["lone"])["lone"] == golden(p, 4)


# ---------------------------------------------------------------------- user values vs vLLM defaults
def test_vllm_defaults_are_not_taken_for_user_values(artifact, mblt_log):
    """Issue 20 §2.3: with no ``--max-num-seqs``, vLLM's filled-in default (128 here, 256 for
    ``vllm serve``) once counted as the user's: a K=4 artifact logged a spurious clamp, and one
    without ``max_batch_size`` was scheduled at that many sequences on its one slot."""
    cfg = vllm_config(artifact("k4", 4))
    assert cfg.scheduler_config.max_num_seqs == 4
    assert not any("Clamping scheduler max_num_seqs" in m for m in mblt_log), mblt_log
    assert any("Setting scheduler max_num_seqs to model-configured max batch size 4." in m for m in mblt_log)
    cfg = vllm_config(artifact("nobatch", 1, drop_batch_key=True))
    assert cfg.scheduler_config.max_num_seqs == 1, "the vendor defaults max_batch_size to 1"


def test_user_values_are_still_the_users(artifact, mblt_log):
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=str(artifact("k4", 4)), max_model_len=MAX_LEN, block_size=BLOCK,
                     max_num_seqs=64).create_engine_config()
    assert cfg.scheduler_config.max_num_seqs == 4
    _attach_handlers()
    cfg = EngineArgs(model=str(artifact("nobatch", 1, drop_batch_key=True)), max_model_len=MAX_LEN,
                     block_size=BLOCK, max_num_seqs=3).create_engine_config()
    assert cfg.scheduler_config.max_num_seqs == 3, "an artifact without max_batch_size keeps the user's value"


def test_engine_level_logits_processors_are_refused_at_start_up(artifact):
    """Issue 20 §2.7: ``--logits-processors`` were silently ignored by the host sampler."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class Boost(LogitsProcessor):  # never instantiated: refused before
        pass

    # the platform's MbltConfigError (a ValueError) reaches the caller inside pydantic's
    # ValidationError for VllmConfig, as every config error of a platform does
    with pytest.raises(ValueError, match=r"--logits-processors .*Boost: the MBLT worker .* no engine-level"):
        EngineArgs(model=str(artifact("k4", 4)), max_model_len=MAX_LEN, block_size=BLOCK,
                   logits_processors=[Boost]).create_engine_config()


def test_bad_words_steer_greedy_away_from_the_banned_token(artifact, make_worker, golden, hf_dir):
    """Issue 20 §2.7: ``bad_words`` (as token ids, what vLLM's processor hands the worker):
    banning the golden first token makes greedy pick the golden runner-up, and the banned
    token never appears."""
    from vllm import SamplingParams

    w = make_worker(artifact("k4", 4))
    (p,) = prompts(31, 20)
    first = golden(p, 1)[0]
    dec = Decoder.from_pretrained(hf_dir)
    logits = dec.prefill(p, dec.new_cache(len(p)))[-1].astype(np.float64)
    logits[first] = -np.inf
    runner_up = int(np.argmax(logits))
    params = SamplingParams(temperature=0.0, max_tokens=4, bad_words=["x"])
    params._bad_words_token_ids = [[first]]
    d = Driver(w)
    d.add("bw", p, params)
    out = d.run(["bw"])["bw"]
    assert out[0] == runner_up and first not in out, (out, first, runner_up)
