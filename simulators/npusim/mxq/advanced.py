"""qbruntime 1.5.0's buffer, pinned-memory and async names, with the real signatures, not
simulated; and ``Scale``, a plain value.

Neither vllm-mblt nor transformers-mblt's text and Mixture-of-Experts paths call them (the MoE
path's NPU-data and scale API is simulated: :mod:`npusim.mxq.npu_data`, ``Model.infer_npu_data``,
``Model.get_input_scale``). Each raises :class:`NotImplementedError` with its name, so a caller
finds out at the first call rather than through a missing attribute. Signatures are those of the
real module's Python layer (read from the ``mobilint-qb-runtime`` 1.5.0 wheel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .npu_data import NPUData

__all__ = ["PENDING", "AdvancedModelApi", "Buffer", "Future", "PinnedMemory", "Scale"]

#: Why these are not built.
PENDING = ("is not simulated by npusim.mxq: neither vllm-mblt nor transformers-mblt's text and "
           "Mixture-of-Experts paths call it, and no open issue asks for it (docs/mblt.md)")


def _pending(name: str) -> NotImplementedError:
    return NotImplementedError(f"qbruntime {name} {PENDING}")


@dataclass(eq=False)
class Scale:
    """Quantisation scale of an MXQ input or output: ``Scale(scale, is_uniform, scale_list,
    zero_point=0, is_asymmetric=False, zero_points=None)``. A plain value (every field
    settable, as in qbruntime); ``scale[i]`` is ``scale_list[i]``. ``Model.get_input_scale`` and
    ``get_output_scale`` return uniform ones (``npu_data`` module docstring: what they mean)."""

    scale: float
    is_uniform: bool
    scale_list: list[float]
    zero_point: int = 0
    is_asymmetric: bool = False
    zero_points: list[int] | None = None

    def __post_init__(self) -> None:
        self.scale_list = list(self.scale_list)
        self.zero_points = [] if self.zero_points is None else list(self.zero_points)

    def __getitem__(self, i: int) -> float:
        """Raises: IndexError: ``i`` outside ``scale_list``."""
        return self.scale_list[i]


class Buffer:
    """``Buffer()``: a device buffer from ``Model.acquire_input_buffer``.

    Raises:
        NotImplementedError: always (not simulated).
    """

    def __init__(self, _buffer: Any = None) -> None:
        raise _pending("Buffer")


class PinnedMemory:
    """Host pinned memory from ``Accelerator.allocate_pinned_memory`` (Regulus only).

    Raises:
        NotImplementedError: always (not simulated).
    """

    def __init__(self, _pinned_memory: Any = None) -> None:
        raise _pending("PinnedMemory")


class Future:
    """The result of ``Model.infer_async_to_float``.

    Raises:
        NotImplementedError: always (not simulated).
    """

    def __init__(self, _future: Any = None, _inputs: Any = None) -> None:
        raise _pending("Future")


class AdvancedModelApi:
    """``Model`` methods of the real module that the simulator does not run; each raises
    :class:`NotImplementedError` with its name."""

    def acquire_input_buffer(self, seqlens: list[list[int]] | None = None) -> list[Buffer]:
        raise _pending("Model.acquire_input_buffer")

    def acquire_output_buffer(self, seqlens: list[list[int]] | None = None) -> list[Buffer]:
        raise _pending("Model.acquire_output_buffer")

    def release_buffer(self, buffer: list[Buffer]) -> None:
        raise _pending("Model.release_buffer")

    def reposition_inputs(self, inputs: list[Any], input_bufs: list[Buffer],
                          seqlens: list[list[int]] | None = None) -> None:
        raise _pending("Model.reposition_inputs")

    def reposition_outputs(self, output_bufs: list[Buffer], outputs: list[Any],
                           seqlens: list[list[int]] | None = None) -> None:
        raise _pending("Model.reposition_outputs")

    def infer_buffer(self, inputs: list[Buffer], outputs: list[Buffer], shape: list[list[int]] | None = None,
                     cache_size: int = 0) -> None:
        raise _pending("Model.infer_buffer")

    def infer_speedrun(self) -> None:
        raise _pending("Model.infer_speedrun")

    def infer_pinned_memory(self, inputs: list[PinnedMemory], outputs: list[PinnedMemory] | None = None,
                            cache_size: int = 0) -> list[PinnedMemory] | None:
        raise _pending("Model.infer_pinned_memory")

    def infer_npu_data_chw(self, inputs: list[NPUData], outputs: list[NPUData] | None = None,
                           cache_size: int = 0) -> list[NPUData] | None:
        raise _pending("Model.infer_npu_data_chw")

    def infer_async_to_float(self, inputs: Any) -> Future:
        raise _pending("Model.infer_async_to_float")
