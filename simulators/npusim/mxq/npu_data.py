"""``NPUData``: a model input or output tensor on the host or on a simulated card, as qbruntime 1.5.0's.

An NPUData is acquired from a :class:`~npusim.mxq.model.Model` (``acquire_input_npu_data`` /
``acquire_output_npu_data``) for one of its inputs or outputs, with a shape, and either on the
host (``upload=False``) or on the model's card (``upload=True``). It remembers the quantisation
scale of the tensor it was acquired for: its *scale* ``s``, the dequantisation multiplier
(``real = raw * s``):

* for output ``i`` of a model, ``s = model.get_output_scale()[i].scale``;
* for input ``i``, ``s = 1 / model.get_input_scale()[i].scale`` (an input scale is the
  quantisation multiplier, ``raw = real * scale``).

What each side holds:

* on the host: real values, float32, readable and writable with ``data[key]``;
* on a card: raw values, ``real / s``. Indexing raises ``ValueError("NPUData is not on the CPU;
  call cpu() first.")`` as qbruntime's does.

Moves quantise or dequantise with the NPU-side buffer's own scale: ``launch(acc)`` and a
host-to-card ``copy_from`` store ``real / s``; ``cpu()`` and a card-to-host ``copy_from`` give
``raw * s``. A card-to-card ``copy_from`` copies raw values. ``Model.infer_npu_data`` reads a
card-resident input with *the model's* input scale and writes raw outputs with *the model's*
output scale, whatever buffer they came from: a card does not know which model acquired a
buffer. So a buffer handed between models of different scales reads back with the acquiring
model's scale, and the caller must correct it, as on the board (transformers-mblt's expert
output pool does: ``expert_out_scale / pool_scale``).

The simulator keeps raw values in float32 (not int8): the scale bookkeeping is simulated, the
rounding of quantisation is not. Scales of ``npu-harness mxq compile`` artifacts are powers of
two, so a correct caller gets exactly the golden decoder's values.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .accelerator import Accelerator

__all__ = ["NPUData", "NOT_ON_CPU"]

NOT_ON_CPU = "NPUData is not on the CPU; call cpu() first."


class NPUData:
    """A tensor acquired from a Model, on the host or on a card (module docstring).

    Attributes (read-only properties): ``shape`` (tuple), ``dtype`` (``numpy.float32``),
    ``dev_no`` (the card, -1 on the host), ``hardware_name`` (the card's device name,
    ``"aries-rb"``; ``""`` on the host). ``len(data)`` is ``shape[0]``.
    """

    def __init__(self, _npu_data: Any = None) -> None:
        """Raises: TypeError: always; NPUData comes from ``Model.acquire_input_npu_data`` /
        ``acquire_output_npu_data``, as in qbruntime."""
        raise TypeError("NPUData is not constructed directly: use Model.acquire_input_npu_data or "
                        "Model.acquire_output_npu_data")

    @classmethod
    def _acquire(cls, shape: tuple[int, ...], scale: float, acc: Accelerator | None) -> NPUData:
        """A zero tensor of ``shape`` with dequantisation ``scale``, on ``acc`` (None: the host)."""
        self = object.__new__(cls)
        self._values = np.zeros(shape, dtype=np.float32)
        self._scale = float(scale)
        self._acc = acc
        self._lock = threading.Lock()
        return self

    def __repr__(self) -> str:
        where = "host" if self._acc is None else f"dev {self.dev_no}"
        return f"<npusim.mxq.NPUData shape={self.shape} on {where} scale={self._scale!r}>"

    # ------------------------------------------------------------------ residency
    @property
    def on_npu(self) -> bool:
        """True while the data is on a card (simulator addition)."""
        return self._acc is not None

    def launch(self, acc: Accelerator) -> None:
        """Move the data to ``acc``'s card, quantised with this buffer's scale.

        Raises:
            TypeError: ``acc`` is not an Accelerator.
        """
        if not isinstance(acc, Accelerator):
            raise TypeError(f"NPUData.launch needs an Accelerator, got {type(acc).__name__}")
        with self._lock:
            if self._acc is None:
                self._values = self._values / np.float32(self._scale)
            self._acc = acc

    def cpu(self) -> None:
        """Bring the data back to the host, dequantised with this buffer's scale."""
        with self._lock:
            if self._acc is not None:
                self._values = self._values * np.float32(self._scale)
            self._acc = None

    def copy_from(self, src: NPUData) -> None:
        """Copy ``src`` (same shape; either side) into this buffer, converting as the module docstring says.

        Raises:
            TypeError: ``src`` is not an NPUData.
            ValueError: the shapes differ (both named).
        """
        if not isinstance(src, NPUData):
            raise TypeError(f"NPUData.copy_from needs an NPUData, got {type(src).__name__}")
        if src.shape != self.shape:
            raise ValueError(f"NPUData.copy_from: shape mismatch (destination {self.shape}, source {src.shape})")
        self._put(src._real() if self._acc is None else src._raw_for(self._scale))

    def _put(self, values: np.ndarray) -> None:
        """Store ``values`` as they are (raw on a card, real on the host): what a model's infer writes."""
        with self._lock:
            self._values[...] = values

    def _real(self) -> np.ndarray:
        """Real values (dequantised with this buffer's scale when on a card)."""
        return self._values * np.float32(self._scale) if self._acc is not None else self._values.copy()

    def _raw_for(self, scale: float) -> np.ndarray:
        """What a card-side buffer of dequantisation ``scale`` holds after receiving this data."""
        return self._values.copy() if self._acc is not None else self._values / np.float32(scale)

    # ------------------------------------------------------------------ host access
    def __getitem__(self, key: Any) -> Any:
        """Raises: ValueError: the data is on a card (qbruntime's message)."""
        if self._acc is not None:
            raise ValueError(NOT_ON_CPU)
        return self._values[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        """Raises: ValueError: the data is on a card (qbruntime's message), or numpy's for a bad value."""
        if self._acc is not None:
            raise ValueError(NOT_ON_CPU)
        self._values[key] = value

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._values.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    @property
    def dev_no(self) -> int:
        return -1 if self._acc is None else int(self._acc.get_dev_no())

    @property
    def hardware_name(self) -> str:
        return "" if self._acc is None else self._acc.get_device_name()
