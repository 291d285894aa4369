"""qbruntime 1.5.0's buffer, NPU-data, pinned-memory, scale and async names, with the real
signatures, not simulated yet (``Scale``, a plain value, is).

vllm-mblt's text path never calls them; transformers-mblt's MoE and advanced paths do
(``get_input_scale``/``Scale``, ``acquire_*_npu_data``, ``infer_npu_data``, ``Buffer``,
``Future``, ``NPUData``, ``PinnedMemory``, ``infer_buffer``). Each raises
:class:`NotImplementedError` naming the issue that will build it, so a caller finds out at the
first call, with the name, rather than through a missing attribute. Signatures are those of the
real module's Python layer (read from the ``mobilint-qb-runtime`` 1.5.0 wheel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PENDING", "AdvancedModelApi", "Buffer", "Future", "NPUData", "PinnedMemory", "Scale"]

#: Why these are not built, and where they will be.
PENDING = ("is not simulated by npusim.mxq yet: the buffer, NPU-data, pinned-memory, scale and "
           "async APIs come with the Mobilint MoE work (issue 13)")


def _pending(name: str) -> NotImplementedError:
    return NotImplementedError(f"qbruntime {name} {PENDING}")


@dataclass(eq=False)
class Scale:
    """Quantisation scale of an MXQ input or output: ``Scale(scale, is_uniform, scale_list,
    zero_point=0, is_asymmetric=False, zero_points=None)``. A plain value (every field
    settable, as in qbruntime); ``scale[i]`` is ``scale_list[i]``. The simulator's MXQs have no
    quantised inputs, so no Model returns one yet (``Model.get_input_scale`` is issue 13)."""

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
        NotImplementedError: always (issue 13).
    """

    def __init__(self, _buffer: Any = None) -> None:
        raise _pending("Buffer")


class NPUData:
    """Device-resident tensor from ``Model.acquire_input_npu_data``: ``launch(acc)``, ``cpu()``,
    ``copy_from(src)``, ``data[key]`` (read and write, host side), ``len``, ``shape``, ``dtype``,
    ``dev_no``, ``hardware_name``, as in qbruntime.

    Raises:
        NotImplementedError: on construction and every member (issue 13).
    """

    def __init__(self, _npu_data: Any = None) -> None:
        raise _pending("NPUData")

    def launch(self, acc: Any) -> None:
        raise _pending("NPUData.launch")

    def cpu(self) -> None:
        raise _pending("NPUData.cpu")

    def copy_from(self, src: NPUData) -> None:
        raise _pending("NPUData.copy_from")

    def __getitem__(self, key: Any) -> Any:
        raise _pending("NPUData.__getitem__")

    def __setitem__(self, key: Any, value: Any) -> None:
        raise _pending("NPUData.__setitem__")

    def __len__(self) -> int:
        raise _pending("NPUData.__len__")

    @property
    def shape(self) -> tuple[int, ...]:
        raise _pending("NPUData.shape")

    @property
    def dtype(self) -> Any:
        raise _pending("NPUData.dtype")

    @property
    def dev_no(self) -> int:
        raise _pending("NPUData.dev_no")

    @property
    def hardware_name(self) -> str:
        raise _pending("NPUData.hardware_name")


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
