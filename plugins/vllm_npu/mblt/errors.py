"""Exceptions of the mblt device adapter (re-exported by :mod:`vllm_npu.mblt.backend`).

Errors raised by the runtime itself (``QbRuntimeError``) are not wrapped, except BadAlloc
during backend creation (:class:`MobilintBackendAllocError`, chained to the original).
"""

from __future__ import annotations

__all__ = ["BackendCapacityError", "MbltBackendError", "MobilintBackendAllocError"]


class MbltBackendError(RuntimeError):
    """A backend misuse or an output the adapter cannot interpret."""


class BackendCapacityError(MbltBackendError):
    """The loaded slots (models x K) hold fewer rows than the scheduler's max_batch_size."""

    def __init__(self, backend_capacity: int, max_batch_size: int) -> None:
        self.backend_capacity = backend_capacity
        self.max_batch_size = max_batch_size
        super().__init__(
            "Mobilint backend capacity is smaller than the vLLM scheduler capacity: "
            f"backend_capacity={backend_capacity}, max_batch_size={max_batch_size}"
        )


class MobilintBackendAllocError(MbltBackendError):
    """qbruntime reported BadAlloc while the backend created, launched or probed a slot.

    Attributes:
        phase: ``"create"`` (``Model(...)``), ``"launch"`` or ``"probe_k_per_model"``.
        slot: index of the failing model instance.
        dev: its device number.
        succeeded_so_far: instances launched before the failure.
        n_total: instances the backend wanted (None when K was not yet known).
        max_batch_size: the requested aggregate capacity.
        k_per_model: KV slots per instance (None when not yet probed).
        original: the ``QbRuntimeError`` (also ``__cause__``).
    """

    def __init__(self, *, phase: str, slot: int, dev: int, succeeded_so_far: int,
                 n_total: int | None, max_batch_size: int, k_per_model: int | None,
                 original: BaseException) -> None:
        self.phase = phase
        self.slot = slot
        self.dev = dev
        self.succeeded_so_far = succeeded_so_far
        self.n_total = n_total
        self.max_batch_size = max_batch_size
        self.k_per_model = k_per_model
        self.original = original
        first_line = str(original).splitlines()[0] if str(original) else repr(original)
        super().__init__(
            f"Mobilint NPU memory ran out (BadAlloc) during {phase} of slot {slot} on device "
            f"{dev}: succeeded_so_far={succeeded_so_far}, n_total={n_total}, "
            f"max_batch_size={max_batch_size}, k_per_model={k_per_model}. All slots created so "
            "far were disposed. Lower max_batch_size, or spread the slots over more cards with "
            f"dev_no. qbruntime said: {first_line}"
        )
