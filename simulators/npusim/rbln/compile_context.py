"""``rebel.compile_context.CompileContext``: what the programs of one model share.

optimum-rbln makes one context per model and passes it to every phase's
``compile_from_torch``; it marks the KV caches (``past_key_values_*``) as static-address
buffers with :meth:`CompileContext.mark_static_address`. Every program compiled in a context
records the context's id, and every :class:`~npusim.rbln.runtime.Runtime` of those programs
shares one set of those buffers (see :mod:`npusim.rbln.runtime`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

__all__ = ["CompileContext", "StaticBuffer"]


@dataclass(frozen=True)
class StaticBuffer:
    """A static-address buffer: its name, compile-time shape and dtype name (``float32``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(eq=False)
class CompileContext:
    """One model's compile context.

    Args:
        use_weight_sharing: the programs of the context share one copy of the weights on the
            device (the weights are counted once, in the first program compiled).
        use_global_ctx: accepted for vllm-rbln; no effect in the simulator.
    """

    use_weight_sharing: bool = False
    use_global_ctx: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    static: dict[str, StaticBuffer] = field(default_factory=dict)
    programs: int = 0

    def mark_static_address(self, tensor, name: str) -> None:
        """Mark ``tensor`` (a real or meta tensor) as the static buffer ``name``.

        Raises:
            ValueError: ``name`` is empty or already marked with another shape/dtype.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"mark_static_address: name must be a non-empty string, got {name!r}")
        buf = StaticBuffer(name, tuple(int(d) for d in tensor.shape), str(tensor.dtype).removeprefix("torch."))
        old = self.static.get(name)
        if old is not None and old != buf:
            raise ValueError(f"mark_static_address: {name!r} is already marked as {old}, not {buf}")
        self.static[name] = buf
