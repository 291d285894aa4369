"""A fixed-capacity key/value cache for one sequence."""

from __future__ import annotations

import numpy as np

from .errors import KVCacheOverflowError

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of one sequence, for every layer, in preallocated arrays.

    Token ``j`` of the sequence (absolute position ``j``) lives at index ``j`` of the token
    axis. Keys are stored after RoPE, as transformers caches them.

    Attributes:
        capacity: maximum number of tokens (fixed at creation).
        length: tokens currently held (``0 <= length <= capacity``); also the position the
            next appended token gets.
        num_layers, num_kv_heads, head_dim: the geometry.
        dtype: element dtype of the arrays.
        keys, values: per-layer arrays of shape ``[num_kv_heads, capacity, head_dim]``; only
            ``[:, :length]`` is meaningful (the rest is zero).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: np.dtype | type = np.float32) -> None:
        """Allocate ``2 * num_layers * num_kv_heads * capacity * head_dim`` zeros.

        Raises:
            ValueError: a size is negative (or zero, except ``capacity``), or not an integer.
        """
        for name, v, minimum in (("num_layers", num_layers, 1), ("num_kv_heads", num_kv_heads, 1), ("head_dim", head_dim, 1), ("capacity", capacity, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
                raise ValueError(f"KVCache {name} must be an integer >= {minimum}, got {v!r}")
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.capacity = int(capacity)
        self.dtype = np.dtype(dtype)
        self.length = 0
        shape = (self.num_kv_heads, self.capacity, self.head_dim)
        self.keys: list[np.ndarray] = [np.zeros(shape, self.dtype) for _ in range(self.num_layers)]
        self.values: list[np.ndarray] = [np.zeros(shape, self.dtype) for _ in range(self.num_layers)]

    def __repr__(self) -> str:
        return (
            f"KVCache(length={self.length}, capacity={self.capacity}, num_layers={self.num_layers}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype})"
        )

    @property
    def free(self) -> int:
        """Tokens that can still be appended."""
        return self.capacity - self.length

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value arrays."""
        return 2 * sum(k.nbytes for k in self.keys)

    def check_append(self, n: int) -> None:
        """Raise if ``n`` more tokens do not fit; change nothing.

        Raises:
            KVCacheOverflowError: ``length + n > capacity`` (message names all three sizes).
        """
        if self.length + n > self.capacity:
            raise KVCacheOverflowError(self.capacity, self.length, n)

    def write(self, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Store ``[num_kv_heads, n, head_dim]`` keys/values of ``layer`` at positions ``length .. length+n-1``.

        Does not advance :attr:`length` (call :meth:`advance` once all layers are written).

        Raises:
            KVCacheOverflowError: the tokens do not fit.
            ValueError: wrong shapes.
        """
        n = keys.shape[1] if keys.ndim == 3 else -1
        expected = (self.num_kv_heads, n, self.head_dim)
        if keys.shape != expected or values.shape != expected:
            raise ValueError(
                f"KV write expects keys and values of shape [num_kv_heads={self.num_kv_heads}, n, "
                f"head_dim={self.head_dim}], got {keys.shape} and {values.shape}"
            )
        self.check_append(n)
        self.keys[layer][:, self.length : self.length + n] = keys
        self.values[layer][:, self.length : self.length + n] = values

    def advance(self, n: int) -> None:
        """Mark ``n`` more tokens (already written for every layer) as held.

        Raises:
            KVCacheOverflowError: ``length + n > capacity``.
            ValueError: ``n < 0``.
        """
        if n < 0:
            raise ValueError(f"cannot advance a KV cache by {n} tokens")
        self.check_append(n)
        self.length += int(n)

    def truncate(self, length: int) -> None:
        """Drop every token at position ``>= length`` (their slots are zeroed).

        Raises:
            ValueError: ``length`` is negative or greater than the current :attr:`length`.
        """
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a KV cache holding {self.length} tokens to {length!r} (need 0 <= length <= {self.length})")
        for k, v in zip(self.keys, self.values):
            k[:, length : self.length] = 0
            v[:, length : self.length] = 0
        self.length = int(length)

    def copy(self) -> KVCache:
        """An independent deep copy (same capacity, length and contents)."""
        new = KVCache.__new__(KVCache)
        new.num_layers, new.num_kv_heads, new.head_dim = self.num_layers, self.num_kv_heads, self.head_dim
        new.capacity, new.dtype, new.length = self.capacity, self.dtype, self.length
        new.keys = [k.copy() for k in self.keys]
        new.values = [v.copy() for v in self.values]
        return new
