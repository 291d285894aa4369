"""Linear layers on the IME2 kernel: a weight Q4_0-quantized and packed ONCE, then applied (issue 5).

:class:`PackedQ4Weight` holds one ``nn.Linear``-style weight ``W [N, K]`` as the kernel's packed
B tiles (``kernels/ime2``: Q4_0 weight quantization in C, packing to 576-byte tiles). Each
:meth:`PackedQ4Weight.apply` quantizes the activations (the kernel's HP int8 rows) and runs the
GEMM with the N tiles split over threads (one slice per pinned GEMM worker once the core fence
configured the kernel's worker pool, else one per core the calling thread may use), on the path
``auto`` resolves to where the slices run. Results are those of
``npusim.q4x32.ime2_hp_gemm(A, *quantize_q4_0(W), level="hardware")`` bit for bit, whatever the
thread count. This module talks to the kernel's C ABI only (never to the simulator).

Environment: ``NPU_HARNESS_IME2_THREADS`` overrides the thread count (an integer 1..256; a
configured pool uses at most its workers).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_npu.settings import env_int

from . import kernel

__all__ = ["THREADS_ENV", "PackedQ4Weight", "default_threads", "pack_count"]

#: Environment variable overriding the number of GEMM threads.
THREADS_ENV = "NPU_HARNESS_IME2_THREADS"
_MAX_THREADS = 256

_PACKS = 0
_PACKS_LOCK = threading.Lock()


def pack_count() -> int:
    """How many weights this process has packed into tiles (it must not grow with ``apply`` calls)."""
    return _PACKS


def _configured_workers(pool_state: Callable[[], Any] | None) -> int:
    """The pinned GEMM workers of the kernel's pool (``PoolState.configured``; 0: unconfigured).

    ``pool_state``: returns the pool's counters (default :func:`fence.pool_state`); a library
    that is not built or has no pool API counts as unconfigured here (the GEMM reports it).
    """
    if pool_state is None:
        from . import fence

        pool_state = fence.pool_state
    try:
        return int(pool_state().configured)
    except kernel.KernelUnavailableError:
        return 0


def default_threads(*, pool_state: Callable[[], Any] | None = None) -> int:
    """Threads (N slices) per GEMM, 1..256: ``$NPU_HARNESS_IME2_THREADS`` if set; else, once the
    core fence configured the kernel's worker pool, its pinned workers (eight, one per A100 core
    8..15 on a K3: every GEMM runs on them, whatever cores the calling thread may use); else the
    cores the calling thread may run on (``os.sched_getaffinity(0)``).

    Args:
        pool_state: returns the pool's counters, a :class:`fence.PoolState` or any object with
            ``configured`` (default :func:`fence.pool_state`; tests inject a fake pool's).

    Raises:
        ValueError: the variable is not an integer in 1..256 (the message names the value).
    """
    threads = env_int(THREADS_ENV, default=None, minimum=1, maximum=_MAX_THREADS)
    if threads is not None:
        return threads
    workers = _configured_workers(pool_state)
    if workers > 0:
        return min(workers, _MAX_THREADS)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, _MAX_THREADS))


def _float32_matrix(w: Any, what: str) -> np.ndarray:
    """A float32 C-contiguous numpy copy/view of a torch tensor or array (bf16 tensors included)."""
    if kernel._is_tensor(w):
        import torch

        w = w.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    w = np.asarray(w)
    if w.dtype.kind != "f":
        raise kernel.DTypeError(f"{what} must be a floating-point array, got {w.dtype}")
    return np.ascontiguousarray(w, dtype=np.float32)


@dataclass(frozen=True, eq=False)
class PackedQ4Weight:
    """One weight ``W [N, K]`` quantized to Q4_0 and packed into IME2 tiles, ready to apply.

    Attributes:
        name: the layer's name, used in error messages.
        n, k: output and input features (K a multiple of 32).
        qweight: uint8 ``[N, K/32, 16]``, the Q4_0 codes (byte b: K element 2b low nibble, 2b+1 high).
        scales: float32 ``[N, K/32]``, the Q4_0 block scales (fp16-rounded when packed).
        packed: uint8, the packed B tiles (``ceil(N/32) * ceil(K/256) * 4608`` bytes).
    """

    name: str
    n: int
    k: int
    qweight: np.ndarray = field(repr=False)
    scales: np.ndarray = field(repr=False)
    packed: np.ndarray = field(repr=False)

    @classmethod
    def from_float(cls, w: Any, *, name: str = "weight") -> PackedQ4Weight:
        """Quantize (Q4_0, in C) and pack a float weight ``[N, K]`` (torch tensor or array, any float dtype).

        Raises:
            kernel.KDimensionError: K is not a positive multiple of 32 (names the layer and K).
            kernel.ShapeMismatchError: ``w`` is not 2-D or has no rows.
            kernel.DTypeError: ``w`` is not floating point.
            kernel.NonFiniteError: ``w`` holds NaN or Inf.
        """
        w = _float32_matrix(w, f"{name}: the weight")
        if w.ndim != 2 or w.shape[0] < 1:
            raise kernel.ShapeMismatchError(f"{name}: the weight must be 2-D [N, K] with N >= 1, got shape {w.shape}")
        n, k = w.shape
        if k <= 0 or k % kernel.QK:
            raise kernel.KDimensionError(
                f"{name}: input size K={k} is not a multiple of {kernel.QK} (the Q4_0 block length), so "
                f"this layer cannot use the ime2_q4 kernel (weight shape [N, K] = [{n}, {k}])")
        try:
            qweight, scales = kernel.quantize_q4_0(w)
        except kernel.Ime2Error as exc:
            raise type(exc)(f"{name}: {exc}") from exc
        return cls.from_q4(qweight, scales, name=name)

    @classmethod
    def from_q4(cls, qweight: Any, scales: Any, *, name: str = "weight") -> PackedQ4Weight:
        """Pack already quantized operands (``qweight [N, K/32, 16]`` uint8, ``scales [N, K/32]`` float32).

        Raises:
            kernel.Ime2Error subclasses: bad shapes, dtypes or non-finite scales (message names ``name``).
        """
        global _PACKS
        qweight = np.ascontiguousarray(qweight)
        scales = np.ascontiguousarray(scales)
        try:
            packed = np.frombuffer(kernel.pack_b(qweight, scales), dtype=np.uint8)
        except kernel.Ime2Error as exc:
            raise type(exc)(f"{name}: {exc}") from exc
        with _PACKS_LOCK:
            _PACKS += 1
        qweight.setflags(write=False)
        scales.setflags(write=False)
        n, kb, _ = qweight.shape
        return cls(name=name, n=int(n), k=int(kb) * kernel.QK, qweight=qweight, scales=scales, packed=packed)

    def matmul(self, a: np.ndarray, *, threads: int | None = None, path: str = "auto") -> np.ndarray:
        """``A [M, K]`` float32 -> ``C [M, N]`` float32 through the kernel (A quantized per call).

        Raises:
            kernel.ShapeMismatchError: A is not ``[M, K]`` with this weight's K.
            kernel.NonFiniteError: A holds NaN or Inf.
            kernel.PathError: ``path`` is unknown or cannot run on this CPU.
        """
        a = np.ascontiguousarray(a, dtype=np.float32)
        if a.ndim != 2 or a.shape[1] != self.k:
            raise kernel.ShapeMismatchError(
                f"{self.name}: activations of shape {a.shape} do not match the weight's K={self.k} ([M, K] expected)")
        try:
            a_packed = kernel.quantize_a_array(a)
            return kernel.gemm_packed(a_packed, self.packed, a.shape[0], self.k, self.n, path=path,
                                      threads=threads or default_threads())
        except kernel.Ime2Error as exc:
            raise type(exc)(f"{self.name}: {exc}") from exc

    def apply(self, x: Any, bias: Any = None, *, threads: int | None = None) -> Any:
        """``x [..., K] -> x @ W.T (+ bias) [..., N]``: a torch tensor comes back in ``x``'s dtype,
        a numpy array as float32. The GEMM runs in float32 (activations cast exactly from bf16/fp16).

        Raises:
            kernel.ShapeMismatchError: the last dimension of ``x`` is not K.
            kernel.NonFiniteError: ``x`` holds NaN or Inf.
        """
        if kernel._is_tensor(x):
            import torch

            lead = tuple(x.shape[:-1])
            a = x.detach().reshape(-1, x.shape[-1]).to(device="cpu", dtype=torch.float32).contiguous().numpy()
            y = torch.from_numpy(self.matmul(a, threads=threads)).reshape(*lead, self.n)
            if bias is not None:
                y = y + bias.to(torch.float32)
            return y.to(dtype=x.dtype, device=x.device)
        x = np.asarray(x)
        lead = x.shape[:-1]
        y = self.matmul(x.reshape(-1, x.shape[-1]), threads=threads).reshape(*lead, self.n)
        if bias is not None:
            y = y + np.asarray(bias, dtype=np.float32)
        return y
