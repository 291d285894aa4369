"""Exceptions raised by the golden numpy decoder (:mod:`npusim.llm`)."""

from __future__ import annotations

__all__ = ["CheckpointError", "KVCacheOverflowError", "UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """A model config asks for something the golden decoder does not implement.

    Raised for an unknown ``model_type``, a RoPE type other than ``default``, ``linear``,
    ``dynamic`` or ``llama3``, sliding-window attention outside EXAONE 4's ``layer_types``
    (e.g. Qwen2's ``use_sliding_window``), an unknown layer type, an activation other than SiLU,
    or a partial rotary factor other than 1. The message names the offending value and what is
    supported.
    """


class CheckpointError(ValueError):
    """A checkpoint file or directory is malformed or does not match the model config.

    The message names the file (or tensor) and what is wrong: a truncated or corrupt
    safetensors header, an unknown dtype, overlapping or out-of-range data offsets, a missing
    tensor, or a tensor whose shape differs from the one the config implies.
    """


class KVCacheOverflowError(ValueError):
    """Appending tokens would exceed a :class:`~npusim.llm.KVCache`'s capacity.

    Raised before anything is written, so the cache is unchanged.

    Attributes:
        capacity: the cache's capacity in tokens.
        length: the number of tokens the cache held when the append was attempted.
        requested: the number of tokens the append asked for.
    """

    def __init__(self, capacity: int, length: int, requested: int) -> None:
        self.capacity = int(capacity)
        self.length = int(length)
        self.requested = int(requested)
        super().__init__(
            f"KV cache holds {self.length} of {self.capacity} tokens; appending {self.requested} "
            f"would need {self.length + self.requested} > capacity {self.capacity}"
        )

    def __reduce__(self):  # keep the exception picklable (e.g. across worker processes)
        return (type(self), (self.capacity, self.length, self.requested))
