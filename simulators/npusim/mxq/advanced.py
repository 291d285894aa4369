"""qbruntime 1.5.0's buffer, NPU-data, pinned-memory, scale and async names, with the real
signatures, not simulated yet.

vllm-mblt's text path never calls them; transformers-mblt's MoE and advanced paths do
(``get_input_scale``/``Scale``, ``acquire_*_npu_data``, ``infer_npu_data``, ``Buffer``,
``Future``, ``NPUData``, ``PinnedMemory``, ``infer_buffer``). Each raises
:class:`NotImplementedError` naming the issue that will build it, so a caller finds out at the
first call, with the name, rather than through a missing attribute. Signatures are those of the
real module's Python layer (read from the ``mobilint-qb-runtime`` 1.5.0 wheel).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PENDING", "AdvancedModelApi", "Buffer", "Future", "NPUData", "PinnedMemory", "Scale"]

#: Why these are not built, and where they will be.
PENDING = ("is not simulated by npusim.mxq yet: the buffer, NPU-data, pinned-memory, scale and "
           "async APIs come with the Mobilint MoE work (issue 13)")


def _pending(name: str) -> NotImplementedError:
    return NotImplementedError(f"qbruntime {name} {PENDING}")


class Scale:
    """``Scale(scale, is_uniform, scale_list, zero_point=0, is_asymmetric=False, zero_points=None)``.

    Raises:
        NotImplementedError: always (issue 13).
    """

    def __init__(self, scale: float, is_uniform: bool, scale_list: list[float], zero_point: int = 0,
                 is_asymmetric: bool = False, zero_points: list[int] | None = None) -> None:
        raise _pending("Scale")


class Buffer:
    """``Buffer()``: a device buffer from ``Model.acquire_input_buffer``.

    Raises:
        NotImplementedError: always (issue 13).
    """

    def __init__(self, _buffer: Any = None) -> None:
        raise _pending("Buffer")


class NPUData:
    """Device-resident tensor from ``Model.acquire_input_npu_data``.

    Raises:
        NotImplementedError: always (issue 13).
    """

    def __init__(self, _npu_data: Any = None) -> None:
        raise _pending("NPUData")


class PinnedMemory:
    """Host pinned memory from ``Accelerator.allocate_pinned_memory`` (Regulus only).

    Raises:
        NotImplementedError: always (issue 13).
    """

    def __init__(self, _pinned_memory: Any = None) -> None:
        raise _pending("PinnedMemory")


class Future:
    """The result of ``Model.infer_async_to_float``.

    Raises:
        NotImplementedError: always (issue 13).
    """

    def __init__(self, _future: Any = None, _inputs: Any = None) -> None:
        raise _pending("Future")


class AdvancedModelApi:
    """``Model`` methods of the real module that the simulator does not run yet; each raises
    :class:`NotImplementedError` naming issue 13."""

    def get_input_scale(self) -> list[Scale]:
        raise _pending("Model.get_input_scale")

    def get_output_scale(self) -> list[Scale]:
        raise _pending("Model.get_output_scale")

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

    def acquire_input_npu_data(self, shape: list[int], idx: int = 0, upload: bool = False,
                               dtype: Any = None) -> NPUData:
        raise _pending("Model.acquire_input_npu_data")

    def acquire_output_npu_data(self, shape: list[int], idx: int = 0, upload: bool = False,
                                dtype: Any = None) -> NPUData:
        raise _pending("Model.acquire_output_npu_data")

    def infer_npu_data(self, inputs: list[NPUData], outputs: list[NPUData] | None = None,
                       cache_size: int = 0) -> list[NPUData] | None:
        raise _pending("Model.infer_npu_data")

    def infer_npu_data_chw(self, inputs: list[NPUData], outputs: list[NPUData] | None = None,
                           cache_size: int = 0) -> list[NPUData] | None:
        raise _pending("Model.infer_npu_data_chw")

    def infer_async_to_float(self, inputs: Any) -> Future:
        raise _pending("Model.infer_async_to_float")
