"""Child process that runs an IME2 op on saved GEMM cases (used by :mod:`npu_conformance.ime2_board`).

Usage::

    python -m npu_conformance.ime2_op_child --op fork|ours IN.npz OUT.npz [--ai-cores]
    python -m npu_conformance.ime2_op_child --op fork --check

``IN.npz`` holds ``count`` and ``a<i>``, ``qweight<i>``, ``scales<i>``; ``OUT.npz`` receives
``c<i>`` (float32 [M, N]).

``--op fork`` is ``torch.ops._C.ime2_hp_gemm_cpu`` of the opensolvers/vllm k3-a100-ime2 fork;
``--op ours`` this project's ``vllm_npu.ime2.kernel.ime2_hp_gemm_cpu``. A child process, because
the fork's op is fenced the way the seed does it, which the test process must not be:

1. ``_C`` is loaded while the process runs on the X100 cores 0-7 (loading it on cores 8-15
   aborts: its other objects were built for VLEN 256); with ``--ai-cores`` the affinity is set to
   cores 0-7 first if it included any of 8-15;
2. with ``--ai-cores``: the process id is written to ``/proc/set_ai_thread`` and the affinity set
   to cores 8-15 (the A100 cores, VLEN 1024; the op errors unless vlenb is 128);
3. the op runs on each case, on this thread only (``torch.set_num_threads(1)``: threads torch
   made before the move stay on the X100 cores, where the op refuses to run).

Exit status: 0 done (or ``--check``: the op exists); 2 bad arguments or an op error (message on
stderr); 3 the fork's op does not exist; 4 the fence failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

X100_CORES = set(range(0, 8))
A100_CORES = set(range(8, 16))
SET_AI_THREAD = "/proc/set_ai_thread"


class FenceError(OSError):
    """The move to the A100 cores failed (set_ai_thread or the affinity refused)."""


def _before_load(ai_cores: bool) -> None:
    """Step 1: run on the X100 cores while the op's library loads (with ``--ai-cores``, or on any
    machine with ``/proc/set_ai_thread``, i.e. a K3)."""
    if (ai_cores or os.path.exists(SET_AI_THREAD)) and os.sched_getaffinity(0) & A100_CORES:
        os.sched_setaffinity(0, X100_CORES)


def _enter_ai_cores(set_ai_thread: str = SET_AI_THREAD) -> None:
    """Step 2, as the seed writes it.

    Raises:
        FenceError: naming the file or the cores that were refused.
    """
    try:
        fd = os.open(set_ai_thread, os.O_WRONLY)  # no O_CREAT: the kernel's file must exist
        try:
            os.write(fd, str(os.getpid()).encode("ascii"))
        finally:
            os.close(fd)
    except OSError as exc:
        raise FenceError(f"cannot write the process id to {set_ai_thread}: {exc}") from exc
    try:
        os.sched_setaffinity(0, A100_CORES)
    except OSError as exc:
        raise FenceError(f"sched_setaffinity(cores 8-15) failed: {exc}") from exc


def _fork_op() -> Callable | None:
    """``torch.ops._C.ime2_hp_gemm_cpu`` after loading the vLLM kernel build this CPU can run
    (:func:`vllm_npu.cpu_kernels.load_vllm_cpu_kernels`: ``vllm._C`` on the K3, never blindly
    on an x86-64 CPU without AVX-512, where it dies with SIGILL), or None."""
    import torch

    from vllm_npu.cpu_kernels import load_vllm_cpu_kernels

    if load_vllm_cpu_kernels() is None:  # registers torch.ops._C.*; logs why when it cannot
        print("no vLLM CPU kernel build fits this CPU", file=sys.stderr)
        return None
    try:
        return torch.ops._C.ime2_hp_gemm_cpu
    except (AttributeError, RuntimeError):
        return None


def _load_op(name: str) -> Callable | None:
    if name == "fork":
        op = _fork_op()
        if op is None:
            return None
        import torch

        torch.set_num_threads(1)  # only this thread is fenced: keep the op's work on it

        def run(a, qweight, scales):
            return op(torch.from_numpy(a), torch.from_numpy(qweight), torch.from_numpy(scales)).numpy()

        return run
    from vllm_npu.ime2 import kernel

    return kernel.ime2_hp_gemm_cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="npu_conformance.ime2_op_child")
    parser.add_argument("--op", choices=("fork", "ours"), required=True)
    parser.add_argument("--check", action="store_true", help="exit 0 if the op exists, 3 if not")
    parser.add_argument("--ai-cores", action="store_true", help="fence onto the A100 cores as the seed does")
    parser.add_argument("paths", nargs="*", metavar="IN.npz OUT.npz")
    args = parser.parse_args(argv)
    if not args.check and len(args.paths) != 2:
        print("expected IN.npz OUT.npz (or --check)", file=sys.stderr)
        return 2
    import numpy as np

    _before_load(args.ai_cores)
    op = _load_op(args.op)
    if op is None:
        print("torch.ops._C.ime2_hp_gemm_cpu does not exist (the opensolvers/vllm k3-a100-ime2 fork is not "
              "installed)", file=sys.stderr)
        return 3
    if args.check:
        return 0
    if args.ai_cores:
        try:
            _enter_ai_cores()
        except FenceError as exc:
            print(f"--ai-cores: {exc}", file=sys.stderr)
            return 4
    src, dst = Path(args.paths[0]), Path(args.paths[1])
    out = {}
    with np.load(src) as data:
        for i in range(int(data["count"])):
            a = np.ascontiguousarray(data[f"a{i}"], dtype=np.float32)
            qweight = np.ascontiguousarray(data[f"qweight{i}"], dtype=np.uint8)
            scales = np.ascontiguousarray(data[f"scales{i}"], dtype=np.float32)
            try:
                out[f"c{i}"] = np.asarray(op(a, qweight, scales), dtype=np.float32)
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                print(f"case {i}: {type(exc).__name__}: {exc}", file=sys.stderr)
                return 2
    np.savez(dst, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
