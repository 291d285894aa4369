"""The IME2 GEMM's persistent worker pool (kernels/ime2/src/threads.c, issue 15) and its N split.

* The split: :func:`fence.plan_slices` (pure; the split ``npu_ime2_gemm_mt`` makes) gives eight
  slices over cores 8..15 on the K3, one per core; bad CPU lists and counts raise naming the
  value and the rule.
* The pool, each scenario in a fresh child process (its counters count from process start):
  threads are created once across many calls; workers pin to the CPUs asked for (read back from
  the kernel by thread id); a configured pool runs every call on its workers, never in the
  caller; results stay bit-identical to ``npu_ime2_gemm``; bad CPU lists fail with EINVAL and the
  offending index; a forked child gets its own pool; exit and ``dlclose`` with live workers are
  clean.
* The riscv64 cross build: the pool under QEMU at VLEN 1024 with the IME2 path (its ``.hp``
  instructions emulated on SIGILL in the worker threads) equals ``npu_ime2_gemm``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_npu.ime2 import fence

K3_CORES = tuple(range(8, 16))
#: The seed's feed-forward N (intermediate sizes of the ten models).
SEED_N = (1536, 2560, 4864, 5632, 8960, 8192, 10240, 11008)


# ---- the split (pure) ---------------------------------------------------------------------------


def covers(plan: tuple[fence.Slice, ...], n: int) -> bool:
    """The slices are contiguous, in order, and cover [0, n) exactly."""
    edges = [(s.col_start, s.col_stop) for s in plan]
    return edges[0][0] == 0 and edges[-1][1] == n and all(a[1] == b[0] for a, b in zip(edges, edges[1:]))


@pytest.mark.parametrize("n", SEED_N)
def test_k3_split_is_eight_slices_one_per_a100_core(n):
    plan = fence.plan_slices(n, fence.ai_worker_cpus(fence.K3_LAYOUT))
    assert [s.cpu for s in plan] == list(K3_CORES) and [s.index for s in plan] == list(range(8))
    assert covers(plan, n)
    tiles = [s.tiles for s in plan]
    assert sum(tiles) == -(-n // 32) and max(tiles) - min(tiles) <= 1  # balanced to one tile


def test_split_formula_matches_threads_c():
    # tiles * i / T, integer division, as in threads.c; 70 columns = 2 full tiles + a 6-column tail
    assert [(s.cpu, s.tile_start, s.tile_stop, s.col_start, s.col_stop) for s in fence.plan_slices(70, K3_CORES)] == [
        (8, 0, 1, 0, 32), (9, 1, 2, 32, 64), (10, 2, 3, 64, 70)]
    assert [s.tiles for s in fence.plan_slices(32 * 10, K3_CORES)] == [1, 1, 1, 2, 1, 1, 1, 2]
    assert [s.cpu for s in fence.plan_slices(5632, K3_CORES, threads=3)] == [8, 9, 10]
    assert [s.cpu for s in fence.plan_slices(5632, [15, 8])] == [15, 8]  # worker i on cpus[i]


def test_ai_worker_cpus_is_one_worker_per_a100_core():
    assert fence.ai_worker_cpus() == K3_CORES
    assert fence.ai_worker_cpus(fence.CoreLayout(x100_cores={0}, a100_cores={9, 3})) == (3, 9)


@pytest.mark.parametrize("cpus, message", [
    ([], "cpus is empty: the pool needs at least one CPU"),
    ([8, -1], "cpus[1]=-1 is outside 0..1023"),
    ([1024], "cpus[0]=1024 is outside 0..1023, the CPU numbers a Linux cpu_set_t holds"),
    ([8, 9, 8], "cpus[2]=8 repeats cpus[0]: one worker per CPU"),
    ([True], "cpus[0]=True is not a CPU number (an integer 0..1023, not a bool)"),
    (["8"], "cpus[0]='8' is not a CPU number"),
    ([8.0], "cpus[0]=8.0 is not a CPU number"),
    ("8,9", "cpus='8,9' must be a sequence of CPU numbers, not a string"),
    (None, "cpus=None must be a sequence of CPU numbers"),
    (list(range(257)), "cpus names 257 CPUs; a pool has at most 256 workers"),
])
def test_bad_cpu_lists_name_the_value_and_the_rule(cpus, message):
    with pytest.raises(fence.CpuListError) as info:
        fence.plan_slices(100, cpus)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("n, threads, message", [
    (0, None, "n=0 breaks the rule: N, the GEMM's output columns, must be >= 1"),
    (100, 0, "threads=0 breaks the rule: 1 <= threads <= 256"),
    (100, 257, "threads=257 breaks the rule"),
    ("100", None, "n='100' must be an integer"),
])
def test_bad_split_arguments(n, threads, message):
    with pytest.raises(fence.SplitError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fence.plan_slices(n, K3_CORES, threads)


# ---- the C pool, each scenario in its own process ----------------------------------------------

PRELUDE = r"""
import ctypes, json, os, sys, threading
import numpy as np
from vllm_npu.ime2 import fence, kernel

lib = kernel.load_library()
rng = np.random.default_rng(7)

def operands(m, k, n):
    qw, sc = kernel.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))
    a = kernel.quantize_a_array(rng.standard_normal((m, k)).astype(np.float32))
    return a, np.frombuffer(kernel.pack_b(qw, sc), np.uint8)

def single(a, b, m, k, n, path=1):
    c = np.empty((m, n), np.float32)
    st = lib.npu_ime2_gemm(a.ctypes.data, a.nbytes, b.ctypes.data, b.nbytes, m, k, n, c.ctypes.data, c.nbytes, path)
    assert st == 0, st
    return c

def mt(a, b, m, k, n, threads, path=1):
    c = np.empty((max(m, 1), max(n, 1)), np.float32)
    st = lib.npu_ime2_gemm_mt(a.ctypes.data if a.size else ctypes.addressof(ctypes.c_uint8()), a.nbytes,
                              b.ctypes.data, b.nbytes, m, k, n, c.ctypes.data, m * n * 4, path, threads)
    return st, c[:m, :n]

def same(x, y):
    return bool(x.shape == y.shape and (x.view(np.uint32) == y.view(np.uint32)).all())

def state():
    s = fence.pool_state()
    return [s.size, s.configured, s.created]

def slices():
    return [w.slices for w in fence.pool_workers()]

def task_count():
    return len(os.listdir("/proc/self/task"))

out = {}
"""


def run_child(body: str, timeout: float = 120) -> dict:
    """Run PRELUDE + body in a fresh interpreter; the ``out`` dict it fills, as JSON."""
    from vllm_npu.ime2 import kernel

    if not kernel.LIBRARY_PATH.is_file():
        pytest.skip(f"the kernel library is not built: {kernel.BUILD_COMMAND}")
    code = PRELUDE + textwrap.dedent(body) + "\nprint('RESULT ' + json.dumps(out))\n"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


needs_two_cpus = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs Linux and at least two CPUs")


def test_threads_are_created_once_across_many_calls():
    got = run_child("""
        m, k, n = 5, 320, 200                      # 7 tiles
        a, b = operands(m, k, n)
        ref = single(a, b, m, k, n)
        tasks0 = task_count()
        out["fresh"] = state()
        ok = []
        for _ in range(200):
            st, c = mt(a, b, m, k, n, 2)
            ok.append(st == 0 and same(c, ref))
        out["after_200"] = state()
        out["tasks_added"] = task_count() - tasks0
        st, c = mt(a, b, m, k, n, 1)               # one slice, unconfigured: inline, no worker
        ok.append(st == 0 and same(c, ref))
        out["after_inline"] = state()
        for _ in range(50):
            st, c = mt(a, b, m, k, n, 4)           # grows by two, once
            ok.append(st == 0 and same(c, ref))
        st, c = mt(a, b, m, k, n, 256)             # 7 tiles: 7 slices at most
        ok.append(st == 0 and same(c, ref))
        out["after_grow"] = state()
        out["ok"] = all(ok)
        out["slices"] = slices()
    """)
    assert got["ok"]
    assert got["fresh"] == [0, 0, 0]
    assert got["after_200"] == [2, 0, 2] and got["tasks_added"] == 2  # two threads for 200 calls
    assert got["after_inline"] == [2, 0, 2]
    assert got["after_grow"] == [7, 0, 7]
    assert got["slices"] == [251, 251, 51, 51, 1, 1, 1]


@needs_two_cpus
def test_workers_pin_to_the_configured_cpus_and_read_back():
    got = run_child("""
        cpus = sorted(os.sched_getaffinity(0))[:2][::-1]   # e.g. [1, 0]: worker 0 on the higher CPU
        caller_before = sorted(os.sched_getaffinity(0))
        m, k, n = 5, 320, 200
        a, b = operands(m, k, n)
        ref = single(a, b, m, k, n)
        pinned = fence.configure_pool(cpus)
        out["cpus"] = cpus
        out["pinned"] = [[w.cpu, sorted(w.affinity)] for w in pinned]
        out["kernel_view"] = [sorted(os.sched_getaffinity(w.tid)) for w in fence.pool_workers()]
        ok = []
        for threads in (1, 2, 3, 8, 256):
            st, c = mt(a, b, m, k, n, threads)
            ok.append(st == 0 and same(c, ref))
        out["ok"] = all(ok)
        out["workers"] = [[w.cpu, w.last_cpu, w.slices] for w in fence.pool_workers()]
        out["state"] = state()
        out["caller_same"] = sorted(os.sched_getaffinity(0)) == caller_before
        out["caller_not_a_worker"] = threading.get_native_id() not in [w.tid for w in fence.pool_workers()]
        out["pid_not_a_worker"] = os.getpid() not in [w.tid for w in fence.pool_workers()]
    """)
    cpus = got["cpus"]
    assert got["pinned"] == [[c, [c]] for c in cpus] and got["kernel_view"] == [[c] for c in cpus]
    assert got["ok"] and got["caller_same"] and got["caller_not_a_worker"] and got["pid_not_a_worker"]
    # threads=1 ran on worker 0 too (a configured pool never computes in the caller); 2, 3, 8, 256: both
    assert got["workers"] == [[cpus[0], cpus[0], 5], [cpus[1], cpus[1], 4]]
    assert got["state"] == [2, 2, 2]


@needs_two_cpus
def test_a_configured_pool_runs_every_call_on_its_workers():
    got = run_child("""
        cpus = sorted(os.sched_getaffinity(0))[:2]
        fence.configure_pool(cpus)
        ok = {}
        for m, k, n in [(1, 32, 5), (4, 256, 32), (5, 320, 33), (9, 544, 300), (3, 64, 64)]:
            a, b = operands(m, k, n)
            ref = single(a, b, m, k, n)
            for threads in (1, 2):
                before = slices()
                st, c = mt(a, b, m, k, n, threads)
                ran = [x - y for x, y in zip(slices(), before)]
                ok[f"{m},{k},{n},{threads}"] = [st == 0 and same(c, ref), ran]
        a, b = operands(4, 64, 64)
        before = slices()
        st, _ = mt(np.zeros(0, np.uint8), b, 0, 64, 64, 2)       # empty C: worker 0 checks the path
        out["empty"] = [st, [x - y for x, y in zip(slices(), before)]]
        st, _ = mt(a, b, 4, 64, 64, 2, path=2)                    # RVV: not built here -> BAD_PATH, C untouched
        out["bad_path"] = st
        ok_status, w0 = fence.worker_path_status(kernel.PATHS["portable"])
        out["worker_path_status"] = [ok_status, fence.worker_path_status(kernel.PATHS["rvv"])[0], w0.index,
                                     w0.cpu == cpus[0], w0.last_cpu == cpus[0]]
        out["ok"] = ok
    """)
    for key, (same, ran) in got["ok"].items():
        m, k, n, threads = map(int, key.split(","))
        tiles = -(-n // 32)
        assert same, key
        assert ran == ([1, 1] if min(threads, tiles) == 2 else [1, 0]), key
    assert got["empty"] == [0, [1, 0]]
    assert got["bad_path"] == 7  # NPU_IME2_ERR_BAD_PATH, from the workers
    assert got["worker_path_status"] == [0, 7, 0, True, True]  # checked by worker 0, on its core


def test_bad_cpu_lists_are_refused_by_c_and_python():
    got = run_child("""
        def configure(cpus, n=None):
            arr = (ctypes.c_int * max(len(cpus), 1))(*cpus)
            bad = ctypes.c_int(-7)
            err = lib.npu_ime2_pool_configure(ctypes.addressof(arr) if cpus else None,
                                              len(cpus) if n is None else n, ctypes.byref(bad))
            return [err, bad.value]
        out["negative"] = configure([0, -1])
        out["too_big"] = configure([1024])
        out["repeat"] = configure([0, 1, 0])
        out["too_many"] = configure([0], n=257)
        out["null"] = configure([], n=1)
        out["state_after_refusals"] = state()      # refused before any thread started
        try:
            fence.configure_pool([0, 1000])          # in range, but not a CPU of this host
        except fence.AffinityError as exc:
            out["offline"] = str(exc)
        out["state_after_offline"] = state()
        out["python"] = []
        for cpus in ([], [-1], [0, 0], [1024]):
            try:
                fence.configure_pool(cpus)
            except fence.CpuListError as exc:
                out["python"].append(str(exc))
    """)
    einval = 22
    assert got["negative"] == [einval, 1] and got["too_big"] == [einval, 0] and got["repeat"] == [einval, 2]
    assert got["too_many"] == [einval, -1] and got["null"] == [einval, -1]
    assert got["state_after_refusals"] == [0, 0, 0]
    assert "cannot pin GEMM worker 1 (thread" in got["offline"] and "to CPU 1000" in got["offline"]
    assert "EINVAL" in got["offline"] and "online" in got["offline"]
    assert got["state_after_offline"][1] == 0  # left unconfigured
    assert ["empty" in got["python"][0], "cpus[0]=-1 is outside" in got["python"][1],
            "cpus[1]=0 repeats cpus[0]" in got["python"][2], "cpus[0]=1024" in got["python"][3]] == [True] * 4


@needs_two_cpus
def test_unconfigure_stops_the_workers_and_later_calls_start_unpinned_ones():
    got = run_child("""
        m, k, n = 5, 320, 200
        a, b = operands(m, k, n)
        ref = single(a, b, m, k, n)
        fence.configure_pool(sorted(os.sched_getaffinity(0))[:2])
        tasks = task_count()
        fence.unconfigure_pool()
        out["stopped"] = [state(), tasks - task_count()]
        st, c = mt(a, b, m, k, n, 2)
        out["again"] = [st == 0 and same(c, ref), state(), [w.cpu for w in fence.pool_workers()]]
    """)
    assert got["stopped"] == [[0, 0, 2], 2]  # joined: two fewer tasks
    assert got["again"] == [True, [2, 0, 4], [None, None]]


@needs_two_cpus
def test_a_forked_child_gets_its_own_pool():
    got = run_child("""
        m, k, n = 5, 320, 200
        a, b = operands(m, k, n)
        ref = single(a, b, m, k, n)
        cpus = sorted(os.sched_getaffinity(0))[:1]
        fence.configure_pool(cpus)
        parent_tids = [w.tid for w in fence.pool_workers()]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            res = {"inherited": state(), "workers": len(fence.pool_workers())}
            st, c = mt(a, b, m, k, n, 2)
            res["gemm"] = st == 0 and same(c, ref)
            res["after"] = state()
            res["pinned"] = [x.cpu for x in fence.pool_workers()]
            os.write(w, json.dumps(res).encode())
            os._exit(0)
        os.close(w)
        child = json.loads(os.read(r, 65536).decode())
        _, status = os.waitpid(pid, 0)
        out["child"] = child
        out["child_status"] = status
        st, c = mt(a, b, m, k, n, 2)
        out["parent"] = [st == 0 and same(c, ref), state(), [x.tid for x in fence.pool_workers()] == parent_tids]
    """)
    assert got["child_status"] == 0
    child = got["child"]
    assert child["inherited"] == [0, 0, 0] and child["workers"] == 0  # no workers, unconfigured, fresh counter
    assert child["gemm"] and child["after"] == [2, 0, 2] and child["pinned"] == [None, None]
    assert got["parent"] == [True, [1, 1, 1], True]  # the parent's configured pool is untouched


@needs_two_cpus
def test_exit_with_live_pinned_workers_is_clean():
    got = run_child("""
        m, k, n = 5, 320, 200
        a, b = operands(m, k, n)
        fence.configure_pool(sorted(os.sched_getaffinity(0))[:2])
        mt(a, b, m, k, n, 2)
        out["state"] = state()
        # and a second process that exits from a non-main thread while the pool is idle
        import subprocess
        code = ("import threading, numpy as np; from vllm_npu.ime2 import fence, kernel; "
                "fence.configure_pool([0]); kernel.load_library().npu_ime2_pool_start(3); "
                "t = threading.Thread(target=lambda: None); t.start(); t.join()")
        p = subprocess.run([sys.executable, "-c", code], timeout=60, env=dict(os.environ))
        out["inner_rc"] = p.returncode
    """, timeout=120)
    assert got["state"] == [2, 2, 2] and got["inner_rc"] == 0  # both processes exited (no hang)


def test_dlclose_joins_the_workers():
    got = run_child("""
        import _ctypes
        own = ctypes.CDLL(str(kernel.LIBRARY_PATH), mode=os.RTLD_LOCAL)
        # kernel.load_library() holds a handle too: take that one off as well, so the library unloads
        handles = [own._handle, lib._handle]
        tasks0 = task_count()
        own.npu_ime2_pool_start.argtypes = [ctypes.c_int]
        out["start"] = own.npu_ime2_pool_start(3)
        out["added"] = task_count() - tasks0
        for h in handles:
            _ctypes.dlclose(h)
        maps = open("/proc/self/maps").read()
        out["unloaded"] = str(kernel.LIBRARY_PATH) not in maps
        import time; time.sleep(0.2)
        out["left"] = task_count() - tasks0
    """)
    assert got["start"] == 0 and got["added"] == 3
    assert got["unloaded"] and got["left"] == 0  # the destructor joined them before the code went away


def test_concurrent_callers_share_the_pool_one_gemm_at_a_time():
    got = run_child("""
        m, k, n = 5, 320, 200
        a, b = operands(m, k, n)
        ref = single(a, b, m, k, n)
        results = []
        def worker():
            for _ in range(40):
                c = kernel.gemm_packed(a, b, m, k, n, threads=2, path="portable")
                results.append(same(c, ref))
        ts = [threading.Thread(target=worker) for _ in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
        out["ok"] = [len(results), all(results)]
        out["state"] = state()
    """)
    assert got["ok"] == [160, True] and got["state"] == [2, 0, 2]


@needs_two_cpus
def test_the_whole_op_runs_its_gemm_on_a_configured_pool():
    """``ime2_hp_gemm_cpu`` (``npu_ime2_hp_gemm_on``) with the pool pinned to two CPUs: worker 0
    checks the path, then the GEMM runs on the two workers (their slice counters advance, one
    slice each where there are two tiles or more), and every result equals the unpooled one (the
    calling thread, before any worker existed) bit for bit; so does the C function called
    directly, on AUTO and PORTABLE."""
    got = run_child("""
        shapes = [(5, 288, 70), (1, 128, 256), (4, 256, 512), (9, 544, 300), (3, 64, 32)]
        cases = []
        for m, k, n in shapes:
            qw, sc = kernel.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))
            cases.append((rng.standard_normal((m, k)).astype(np.float32), qw, sc))
        unpooled = [kernel.ime2_hp_gemm_cpu(*case) for case in cases]
        out["unpooled_state"] = state()          # the unpooled whole op created no worker
        cpus = sorted(os.sched_getaffinity(0))[:2]
        caller = sorted(os.sched_getaffinity(0))
        fence.configure_pool(cpus)
        out["configured"] = kernel.pool_configured()
        res = []
        for case, ref in zip(cases, unpooled):
            before = slices()
            c = kernel.ime2_hp_gemm_cpu(*case)
            res.append([same(c, ref), [x - y for x, y in zip(slices(), before)]])
        out["res"] = res
        a, qw, sc = cases[0]
        m, k, n = a.shape[0], a.shape[1], qw.shape[0]
        direct = []
        for path in (kernel.PATHS["auto"], kernel.PATHS["portable"]):
            c = np.empty((m, n), np.float32)
            before = slices()
            st = lib.npu_ime2_hp_gemm_on(a.ctypes.data, qw.ctypes.data, sc.ctypes.data, m, k, n, c.ctypes.data,
                                         c.nbytes, path)
            direct.append([st, same(c, unpooled[0]), [x - y for x, y in zip(slices(), before)]])
        out["direct"] = direct
        before = slices()
        empty = kernel.ime2_hp_gemm_cpu(np.zeros((0, k), np.float32), qw, sc)
        out["empty"] = [list(empty.shape), [x - y for x, y in zip(slices(), before)]]
        out["last_cpus"] = [w.last_cpu for w in fence.pool_workers()] == cpus
        out["caller_same"] = sorted(os.sched_getaffinity(0)) == caller
        fence.unconfigure_pool()
        c = kernel.ime2_hp_gemm_cpu(*cases[0])
        out["after_unconfigure"] = [same(c, unpooled[0]), state()]
    """)
    assert got["unpooled_state"] == [0, 0, 0] and got["configured"] == 2
    # worker 0 makes the path check, then the GEMM's slices: two for (5, 288, 70), (1, 128, 256),
    # (4, 256, 512), (9, 544, 300), one for (3, 64, 32) (a single tile)
    assert got["res"] == [[True, [2, 1]]] * 4 + [[True, [2, 0]]]
    assert got["direct"] == [[0, True, [2, 1]], [0, True, [2, 1]]]
    assert got["empty"] == [[0, 70], [1, 0]]  # an empty C: worker 0 checks the path, nothing else
    assert got["last_cpus"] and got["caller_same"]
    assert got["after_unconfigure"] == [True, [0, 0, 2]]  # back in the calling thread, no new worker


# ---- the riscv64 cross build under QEMU ---------------------------------------------------------

KERNEL = Path(__file__).resolve().parents[2] / "kernels" / "ime2"
RV_TOOLS = ("make", "clang-19", "ld.lld-19", "qemu-riscv64-static")
_rv_missing = [t for t in RV_TOOLS if shutil.which(t) is None]

RV_PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "npu_ime2.h"
#include "ime2_emu.h"

static unsigned long long lcg = 12345;
static float rnd(void)
{
    lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((lcg >> 40) & 0xffff) / 32768.0f - 1.0f;
}

/* pool_test PATH: PATH (2 rvv, 3 ime2) split over 1, 2, 4, 7 threads against npu_ime2_gemm on IME2;
 * then the whole op (npu_ime2_hp_gemm) on an unconfigured pool and on a pool pinned to CPU 0 */
int main(int argc, char **argv)
{
    if (argc != 2 || npu_ime2_emu_install() != 0) return 2;
    const int path = atoi(argv[1]);
    enum { M = 5, K = 288, N = 200 };  /* one 4-row group + a row; K % 256 != 0; 7 tiles, a tail */
    static float a[M * K], w[N * K], ref[M * N], c[M * N];
    static uint8_t qw[N * K / 2];
    static float sc[N * K / 32];
    for (int i = 0; i < M * K; i++) a[i] = rnd();
    for (int i = 0; i < N * K; i++) w[i] = rnd();
    size_t ab, bb;
    if (npu_ime2_quantize_q4_0(w, N, K, qw, sizeof qw, sc, sizeof sc) || npu_ime2_a_packed_size(M, K, &ab) ||
        npu_ime2_b_packed_size(N, K, &bb)) return 3;
    uint8_t *ap = malloc(ab), *bp = malloc(bb);
    if (npu_ime2_quantize_a(a, M, K, ap, ab) || npu_ime2_pack_b(qw, sc, N, K, bp, bb)) return 4;
    int st = npu_ime2_gemm(ap, ab, bp, bb, M, K, N, ref, sizeof ref, NPU_IME2_PATH_IME2);
    printf("single %d\n", st);
    static float hp[M * N];
    st = npu_ime2_hp_gemm(a, qw, sc, M, K, N, hp, sizeof hp); /* unconfigured pool: in this thread */
    printf("hp_unpooled %d %d\n", st, memcmp(hp, ref, sizeof hp) == 0);
    const int threads[] = {1, 2, 4, 7};
    for (int t = 0; t < 4; t++) {
        memset(c, 0, sizeof c);
        st = npu_ime2_gemm_mt(ap, ab, bp, bb, M, K, N, c, sizeof c, path, threads[t]);
        printf("mt %d %d %d\n", threads[t], st, memcmp(c, ref, sizeof c) == 0);
    }
    const int cpus[] = {0};
    int bad = -1;
    printf("configure %d %d\n", npu_ime2_pool_configure(cpus, 1, &bad), bad);
    memset(c, 0, sizeof c);
    st = npu_ime2_gemm_mt(ap, ab, bp, bb, M, K, N, c, sizeof c, NPU_IME2_PATH_AUTO, 4);
    printf("pinned %d %d\n", st, memcmp(c, ref, sizeof c) == 0);
    npu_ime2_pool_info info;
    npu_ime2_pool_get_info(&info);
    npu_ime2_pool_worker_info w0;
    npu_ime2_pool_get_worker(0, &w0);
    printf("pool %d %d %lld worker0 %d %d %lld\n", info.size, info.configured, (long long)info.created, w0.cpu,
           w0.last_vlenb, (long long)w0.slices);
    const long long slices_before = (long long)w0.slices;
    memset(hp, 0, sizeof hp);
    st = npu_ime2_hp_gemm(a, qw, sc, M, K, N, hp, sizeof hp); /* configured: the GEMM on worker 0 */
    npu_ime2_pool_get_worker(0, &w0);
    printf("hp_pooled %d %d %lld %d\n", st, memcmp(hp, ref, sizeof hp) == 0, (long long)w0.slices - slices_before,
           w0.last_vlenb);
    printf("emulated %lu\n", npu_ime2_emu_count());
    return 0;
}
"""


@pytest.fixture(scope="module")
def rv_pool_program(tmp_path_factory) -> Path:
    """The static riscv64 test program, linked with every object of ``make riscv64`` but the
    driver's own main (threads.c compiled as the board driver gets it)."""
    if _rv_missing:
        pytest.skip(f"missing {', '.join(_rv_missing)} (bash ci/setup.sh installs them)")
    tmp = tmp_path_factory.mktemp("rvpool")
    env = {k: v for k, v in os.environ.items() if k not in ("CFLAGS", "MAKEFLAGS", "MFLAGS")}
    subprocess.run(["make", "-s", "-C", str(KERNEL), "riscv64", f"OUT={tmp / 'out'}"], env=env, check=True,
                   capture_output=True, timeout=600)
    objs = sorted(p for p in (tmp / "out" / "obj-riscv64").glob("*.o") if p.name not in ("driver.o", "ime2_probe.o"))
    src = tmp / "pool_test.c"
    src.write_text(RV_PROGRAM)
    prog = tmp / "pool_test"
    subprocess.run(["clang-19", "--target=riscv64-linux-gnu", "-march=rv64gcv_zvfh", "-O1", "-fno-vectorize",
                    "-fno-slp-vectorize", "-Wall", "-Werror", f"-I{KERNEL / 'include'}", f"-I{KERNEL / 'driver'}",
                    str(src), *map(str, objs), "-fuse-ld=lld", "-static", "-pthread", "-lm", "-o", str(prog)],
                   check=True, capture_output=True, timeout=300)
    return prog


def run_rv(prog: Path, path: int, vlen: int = 1024) -> tuple[dict[str, str], list[list[str]], str]:
    run = subprocess.run(["qemu-riscv64-static", "-cpu", f"rv64,v=true,Zfh=true,vlen={vlen},vext_spec=v1.0",
                          str(prog), str(path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if " " in line)
    mts = [ln.split()[1:] for ln in run.stdout.splitlines() if ln.startswith("mt ")]
    return lines, mts, run.stdout


ALL_EQUAL = [["1", "0", "1"], ["2", "0", "1"], ["4", "0", "1"], ["7", "0", "1"]]


def test_riscv64_pool_under_qemu(rv_pool_program):
    """Under QEMU at VLEN 1024: the RVV path split over 1..7 pool workers equals npu_ime2_gemm on
    the IME2 path bit for bit; the pool grows to 7 threads once; pinned to CPU 0, AUTO (IME2 on
    the K3 build) runs on worker 0, whose .hp instructions the SIGILL handler emulates on that
    thread (synchronous signals stay unblocked in workers), and worker 0 read vlenb 128."""
    lines, mts, text = run_rv(rv_pool_program, 2)
    assert lines["single"] == "0" and mts == ALL_EQUAL, text
    assert lines["configure"] == "0 -1" and lines["pinned"] == "0 1", text
    pool = lines["pool"].split()
    assert pool[:3] == ["7", "1", "7"]  # 7 workers (grown to 7, never per call), the first one configured
    assert pool[4:6] == ["0", "128"]  # worker 0 on CPU 0, read vlenb 128 after its slice
    assert int(lines["emulated"]) > 0


def test_riscv64_whole_op_runs_its_gemm_on_the_pinned_worker_under_qemu(rv_pool_program):
    """The whole op on the K3 build at VLEN 1024: in the calling thread while the pool is
    unconfigured; once it is pinned (to CPU 0 here), its path check and its GEMM run on worker 0
    (two more slices on that worker), and both results equal npu_ime2_gemm on IME2 bit for bit."""
    lines, _, text = run_rv(rv_pool_program, 2)
    assert lines["hp_unpooled"] == "0 1", text
    assert lines["hp_pooled"] == "0 1 2 128", text  # status, same, worker 0's slices +2, its vlenb


def custom1_words(obj: Path) -> int:
    """The 32-bit custom-1 words (opcode 0x2B: the IME2 ``.hp`` encodings) in ``obj``'s .text,
    walking the instruction stream (low bits 11: 32-bit, else a 16-bit compressed instruction)."""
    text = obj.with_suffix(".text.bin")
    subprocess.run(["riscv64-linux-gnu-objcopy", "-O", "binary", "--only-section=.text", str(obj), str(text)],
                   check=True, capture_output=True, timeout=60)
    code, i, words = text.read_bytes(), 0, 0
    while i + 2 <= len(code):
        if code[i] & 3 != 3:
            i += 2
            continue
        words += (int.from_bytes(code[i:i + 4], "little") & 0x7F) == 0x2B
        i += 4
    return words


@pytest.mark.skipif(shutil.which("riscv64-linux-gnu-objcopy") is None, reason="missing riscv64-linux-gnu-objcopy")
def test_the_whole_ops_caller_side_has_no_ime2_instruction(rv_pool_program):
    """What the whole op runs in the calling thread, which stays on an X100 core after the core
    fence (quantizing A and packing B: pack.c; the checks and dispatch: dispatch.c; handing out
    the slices: threads.c), holds no IME2 instruction; the IME2 path's object does."""
    objs = rv_pool_program.parent / "out" / "obj-riscv64"
    assert {name: custom1_words(objs / name) for name in ("pack.o", "dispatch.o", "threads.o", "quant_w.o")} == {
        "pack.o": 0, "dispatch.o": 0, "threads.o": 0, "quant_w.o": 0}
    assert custom1_words(objs / "gemm_ime2.o") > 0


def test_riscv64_whole_op_checks_vlenb_on_the_pinned_worker_under_qemu(rv_pool_program):
    """At VLEN 256 the K3 build's whole op returns WRONG_VLEN (6) by default, unpooled from the
    calling thread's check and pooled from worker 0's (one slice: the check, nothing computed)."""
    lines, _, text = run_rv(rv_pool_program, 2, vlen=256)
    unpooled, pooled = lines["hp_unpooled"].split(), lines["hp_pooled"].split()
    assert lines["single"] == "6" and unpooled[0] == "6", text  # (C stays untouched: "same" is moot here)
    assert [pooled[0]] + pooled[2:] == ["6", "1", "32"], text  # status, worker 0's slices +1, its vlenb


def test_riscv64_pool_runs_ime2_on_several_workers_under_qemu(rv_pool_program):
    """The IME2 path itself split over 1..7 workers under QEMU: several threads trap on .hp at
    once, and each emulates its own register file (ime2_emu.c's per-trap state is _Thread_local),
    so every split equals npu_ime2_gemm on IME2 bit for bit."""
    lines, mts, text = run_rv(rv_pool_program, 3)
    assert lines["single"] == "0" and mts == ALL_EQUAL, text
    assert int(lines["emulated"]) > 0
