"""NEFF bucket ladders of the Neuron plugin: defaults, validation, selection and the compile set.

Neuron compiles static-shape programs (NEFFs), one per bucket; an input is padded to the
smallest compiled bucket that holds it (reference neuron.md §2). Three dimensions:

* prefill token buckets (``num_batched_tokens_buckets``), paired with a KV segment size when
  segmented prefill is on (``kv_segment_size_buckets``; 0 = not segmented);
* decode batch buckets (``num_seqs_buckets``);
* decode context-length buckets (``decode_context_length_buckets``, opt-in), with
  ``max_model_len`` always the implicit fallback.

:func:`resolve_buckets` turns vLLM's scheduler values plus the parsed ``neuron_config`` into a
frozen :class:`BucketPlan`; :meth:`BucketPlan.compile_targets` is the warmup set, in warmup
order. The vendor's error and log texts are reproduced; where the vendor's text is not
published, the docstring says the text is ours.

This module imports only the standard library (no vLLM, torch or npusim).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only; keeps this module free of siblings
    from vllm_npu.neuron.neuron_config import NeuronConfig

__all__ = [
    "SUPPORTED_KV_SEGMENT_SIZES", "MAX_MODEL_LEN_SINGLE_SHOT", "ATTENTION_TILE",
    "DEFAULT_MIN_PREFILL_BUCKET", "BucketConfigError", "BucketPlan",
    "get_default_num_batched_tokens_buckets", "get_default_num_seqs_buckets",
    "get_max_num_batched_tokens", "validate_num_batched_tokens_buckets",
    "validate_num_seqs_buckets", "validate_decode_context_length_buckets",
    "validate_kv_segment_size_buckets", "resolve_segmented_prefill_config",
    "check_prefix_caching", "check_bucket_list", "APC_REQUIRES_SEGMENTED",
    "get_bucket_for_count", "decode_context_bucket",
    "resolve_buckets", "target_name",
]

logger = logging.getLogger("vllm.vllm_npu.neuron")

#: KV segment sizes (tokens) the segmented-prefill attention kernel supports.
SUPPORTED_KV_SEGMENT_SIZES: frozenset[int] = frozenset({512, 1024, 2048, 4096, 8192})
#: Largest ``max_model_len`` (tokens) that may be prefilled in one shot (no segmentation).
MAX_MODEL_LEN_SINGLE_SHOT: int = 16 * 1024
#: Attention-kernel tile (P_MAX, tokens): decode context buckets must be multiples of it.
ATTENTION_TILE: int = 128
#: First rung (tokens) of the default prefill ladder.
DEFAULT_MIN_PREFILL_BUCKET: int = 128

_SUPPORTED_SIZES_TEXT = str(sorted(SUPPORTED_KV_SEGMENT_SIZES))  # "[512, 1024, 2048, 4096, 8192]"

APC_REQUIRES_SEGMENTED = (
    "Automatic Prefix Caching (APC) requires segmented prefill to be enabled. Either disable "
    "APC with '--no-enable-prefix-caching' or set 'max_num_batched_tokens' to a supported "
    f"segmented prefill size {_SUPPORTED_SIZES_TEXT} to auto-enable segmented prefill.")


class BucketConfigError(ValueError):
    """A bucket list, or a bucket-shaping scheduler value, the Neuron plugin refuses.

    A ValueError, as the vendor raises; the message names the list (and index) at fault.
    """


# --------------------------------------------------------------------------------------------
# Default ladders


def _doubling_ladder(start: int, limit: int, what: str) -> list[int]:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise BucketConfigError(f"{what} must be a positive integer, got {limit}")
    ladder = []
    value = start
    while value < limit:
        ladder.append(value)
        value *= 2
    ladder.append(limit)
    return ladder


def get_default_num_batched_tokens_buckets(max_num_batched_tokens: int) -> list[int]:
    """The default prefill ladder: 128, doubling while below M, then M itself.

    ``M=2048 -> [128, 256, 512, 1024, 2048]``; ``M=3000 -> [128, ..., 2048, 3000]``;
    ``M <= 128 -> [M]``.

    Args:
        max_num_batched_tokens: M, tokens (see :func:`get_max_num_batched_tokens`); >= 1.

    Raises:
        BucketConfigError: M is not a positive integer (our own check).
    """
    return _doubling_ladder(DEFAULT_MIN_PREFILL_BUCKET, max_num_batched_tokens,
                            "max_num_batched_tokens")


def get_default_num_seqs_buckets(max_num_seqs: int) -> list[int]:
    """The default decode-batch ladder: 1, doubling while below N, then N itself.

    ``N=8 -> [1, 2, 4, 8]``; ``N=6 -> [1, 2, 4, 6]``.

    Args:
        max_num_seqs: N, sequences; >= 1.

    Raises:
        BucketConfigError: N is not a positive integer (our own check).
    """
    return _doubling_ladder(1, max_num_seqs, "max_num_seqs")


def get_max_num_batched_tokens(max_num_batched_tokens: int | None, max_model_len: int) -> int:
    """M, the largest prefill bucket: ``min(scheduler max_num_batched_tokens, max_model_len)``.

    Args:
        max_num_batched_tokens: vLLM's scheduler value, tokens; None (unset) means
            ``max_model_len`` (our reading: vLLM always fills it in before the platform runs).
        max_model_len: tokens.
    """
    if max_num_batched_tokens is None:
        return int(max_model_len)
    return min(int(max_num_batched_tokens), int(max_model_len))


# --------------------------------------------------------------------------------------------
# Validation of user lists


def check_bucket_list(name: str, buckets: Any) -> list[int]:
    """The checks every bucket list gets; returns a copy.

    Args:
        name: the list's ``neuron_config`` key, quoted in the messages.
        buckets: the value.

    Raises:
        BucketConfigError: not a list ("<name> must be a list, got <type name>"); empty
            ("<name> cannot be empty"); an item not an int, a bool counting as not an int (our
            rule) ("<name>[i] must be an integer, got v"); an item <= 0 ("<name>[i] must be
            positive, got v"); not strictly ascending ("<name> must be in strictly ascending
            order, got [...]").
    """
    if not isinstance(buckets, list):
        raise BucketConfigError(f"{name} must be a list, got {type(buckets).__name__}")
    if not buckets:
        raise BucketConfigError(f"{name} cannot be empty")
    for i, value in enumerate(buckets):
        if isinstance(value, bool) or not isinstance(value, int):
            raise BucketConfigError(f"{name}[{i}] must be an integer, got {value!r}")
        if value <= 0:
            raise BucketConfigError(f"{name}[{i}] must be positive, got {value}")
    if any(b >= a for a, b in zip(buckets[1:], buckets)):
        raise BucketConfigError(f"{name} must be in strictly ascending order, got {buckets}")
    return list(buckets)


def validate_num_batched_tokens_buckets(buckets: Any, max_num_batched_tokens: int) -> list[int]:
    """Check a user ``num_batched_tokens_buckets`` list; returns a copy.

    Args:
        buckets: the list from ``neuron_config`` (tokens).
        max_num_batched_tokens: M (see :func:`get_max_num_batched_tokens`), tokens.

    Raises:
        BucketConfigError: not a list ("num_batched_tokens_buckets must be a list, got
            <type>"); empty ("num_batched_tokens_buckets cannot be empty"); an item that is not
            an int (a bool counts as not an int: our rule) or not positive ("...[i] must be an
            integer, got v" / "...[i] must be positive, got v"); not strictly ascending; last
            bucket != M ("Last bucket in num_batched_tokens_buckets must equal
            max_num_batched_tokens (M), got x").
    """
    out = check_bucket_list("num_batched_tokens_buckets", buckets)
    if out[-1] != max_num_batched_tokens:
        raise BucketConfigError(
            "Last bucket in num_batched_tokens_buckets must equal max_num_batched_tokens "
            f"({max_num_batched_tokens}), got {out[-1]}")
    return out


def validate_num_seqs_buckets(buckets: Any, max_num_seqs: int) -> list[int]:
    """Check a user ``num_seqs_buckets`` list; returns a copy.

    Args:
        buckets: the list from ``neuron_config`` (sequences).
        max_num_seqs: N, sequences.

    Raises:
        BucketConfigError: as :func:`validate_num_batched_tokens_buckets`, naming
            ``num_seqs_buckets``; the last bucket must equal N ("Last bucket in
            num_seqs_buckets must equal max_num_seqs (N), got x").
    """
    out = check_bucket_list("num_seqs_buckets", buckets)
    if out[-1] != max_num_seqs:
        raise BucketConfigError(
            f"Last bucket in num_seqs_buckets must equal max_num_seqs ({max_num_seqs}), "
            f"got {out[-1]}")
    return out


def validate_decode_context_length_buckets(buckets: Any, max_model_len: int) -> list[int] | None:
    """Check the opt-in ``decode_context_length_buckets``; None (unset) passes as None.

    Each bucket must be ``< max_model_len`` (which is the implicit fallback bucket) and a
    multiple of 128 (:data:`ATTENTION_TILE`).

    Args:
        buckets: the list from ``neuron_config`` (tokens of context), or None.
        max_model_len: tokens.

    Raises:
        BucketConfigError: the common list checks (as
            :func:`validate_num_batched_tokens_buckets`, naming
            ``decode_context_length_buckets``); "decode_context_length_buckets[i]=v must be
            strictly less than max_model_len=L; max_model_len is the implicit fallback
            bucket."; "decode_context_length_buckets[i]=v must be divisible by 128 to satisfy
            the attention kernel tile constraint." (the ``name[i]=v`` prefix is ours; the
            vendor's sentence follows it).
    """
    if buckets is None:
        return None
    name = "decode_context_length_buckets"
    out = check_bucket_list(name, buckets)
    for i, value in enumerate(out):
        if value >= max_model_len:
            raise BucketConfigError(
                f"{name}[{i}]={value} must be strictly less than max_model_len={max_model_len}; "
                "max_model_len is the implicit fallback bucket.")
        if value % ATTENTION_TILE:
            raise BucketConfigError(
                f"{name}[{i}]={value} must be divisible by {ATTENTION_TILE} to satisfy the "
                "attention kernel tile constraint.")
    return out


def validate_kv_segment_size_buckets(buckets: Any, num_batched_tokens_buckets: Sequence[int] | None,
                                     block_size: int) -> list[int]:
    """Check an explicit ``kv_segment_size_buckets`` list (official rule: exactly one size).

    Args:
        buckets: the list from ``neuron_config`` (tokens per KV segment).
        num_batched_tokens_buckets: the user's prefill list if also set, else None; when set it
            must equal ``buckets`` (kernel constraint).
        block_size: KV block, tokens; every segment must be a multiple of it (docs).

    Raises:
        BucketConfigError: the common list checks (naming ``kv_segment_size_buckets``); a size
            outside :data:`SUPPORTED_KV_SEGMENT_SIZES`; more than one size ("Only one segment
            size is currently supported"); a size not divisible by ``block_size``; a
            ``num_batched_tokens_buckets`` that differs. Texts other than the vendor's
            "Only one segment size is currently supported" are ours.
    """
    name = "kv_segment_size_buckets"
    out = check_bucket_list(name, buckets)
    for i, value in enumerate(out):
        if value not in SUPPORTED_KV_SEGMENT_SIZES:
            raise BucketConfigError(
                f"{name}[{i}]={value} is not a supported KV segment size on Neuron. "
                f"Supported values: {_SUPPORTED_SIZES_TEXT}.")
    if len(out) != 1:
        raise BucketConfigError("Only one segment size is currently supported")
    for i, value in enumerate(out):
        if block_size and value % block_size:
            raise BucketConfigError(
                f"{name}[{i}]={value} must be divisible by block_size={block_size}.")
    if num_batched_tokens_buckets is not None and list(num_batched_tokens_buckets) != out:
        raise BucketConfigError(
            f"num_batched_tokens_buckets ({list(num_batched_tokens_buckets)}) must equal "
            f"{name} ({out}) when both are set (segmented-prefill kernel constraint).")
    return out


# --------------------------------------------------------------------------------------------
# Segmented prefill


def resolve_segmented_prefill_config(max_num_batched_tokens: int, max_model_len: int
                                     ) -> tuple[list[int] | None, list[int] | None]:
    """Decide segmented prefill when the user did not set ``kv_segment_size_buckets``.

    * ``M >= max_model_len``: single-shot prefill (allowed up to
      :data:`MAX_MODEL_LEN_SINGLE_SHOT`); returns ``(None, None)`` (power-of-2 defaults) and
      logs "Segmented prefill disabled (single-shot prefill; max_num_batched_tokens ==
      max_model_len)".
    * otherwise M is the chunk size and must be a supported segment size; returns
      ``([M], [M])`` (``kv_segment_size_buckets``, ``num_batched_tokens_buckets``) and logs
      "Segmented prefill auto-enabled with kv_segment_size_buckets=%s,
      num_batched_tokens_buckets=%s".

    Args:
        max_num_batched_tokens: M (see :func:`get_max_num_batched_tokens`), tokens.
        max_model_len: tokens.

    Raises:
        BucketConfigError: single-shot with ``max_model_len > 16384`` (vendor text); M not a
            supported chunk size (vendor text, plus our hint to use single-shot prefill when
            ``max_model_len <= 16384``).
    """
    m, length = int(max_num_batched_tokens), int(max_model_len)
    if m >= length:
        if length > MAX_MODEL_LEN_SINGLE_SHOT:
            raise BucketConfigError(
                f"Single-shot prefill (max_num_batched_tokens={m} >= max_model_len={length}) is "
                f"only supported when max_model_len <= {MAX_MODEL_LEN_SINGLE_SHOT}. Set "
                f"max_num_batched_tokens to one of {_SUPPORTED_SIZES_TEXT} to enable chunked "
                "prefill.")
        logger.info("Segmented prefill disabled (single-shot prefill; "
                    "max_num_batched_tokens == max_model_len)")
        return None, None
    if m not in SUPPORTED_KV_SEGMENT_SIZES:
        msg = (f"max_num_batched_tokens={m} is not a supported chunked prefill size on Neuron. "
               f"Supported values: {_SUPPORTED_SIZES_TEXT}.")
        if length <= MAX_MODEL_LEN_SINGLE_SHOT:
            msg += (f" Alternatively, set max_num_batched_tokens to max_model_len ({length}) "
                    "for single-shot prefill.")
        raise BucketConfigError(msg)
    kv, nbt = [m], [m]
    logger.info("Segmented prefill auto-enabled with kv_segment_size_buckets=%s, "
                "num_batched_tokens_buckets=%s", kv, nbt)
    return kv, nbt


def check_prefix_caching(enable_prefix_caching: bool, segmented: bool) -> None:
    """Automatic prefix caching needs segmented prefill (the vendor checks it in the runner).

    Raises:
        BucketConfigError: APC on without segmented prefill (vendor text
            :data:`APC_REQUIRES_SEGMENTED`).
    """
    if enable_prefix_caching and not segmented:
        raise BucketConfigError(APC_REQUIRES_SEGMENTED)


# --------------------------------------------------------------------------------------------
# Selection


def get_bucket_for_count(count: int, buckets: Sequence[int]) -> int:
    """The first bucket ``>= count`` (linear scan of an ascending list).

    ``count <= 0`` returns the smallest bucket with warning "Count is %d, returning smallest
    bucket"; a count above every bucket returns the **largest** bucket with warning "Count %d
    exceeds all buckets %s, returning largest bucket %d" (the caller then fails on the shape,
    as the vendor does). On ``[128, 256, 512, 1024]``: 100 -> 128, 128 -> 128, 129 -> 256,
    2000 -> 1024.

    Args:
        count: tokens or sequences to fit.
        buckets: ascending, non-empty.

    Raises:
        BucketConfigError: ``buckets`` is empty (our own check).
    """
    if not buckets:
        raise BucketConfigError("get_bucket_for_count needs at least one bucket, got none")
    if count <= 0:
        logger.warning("Count is %d, returning smallest bucket", count)
        return buckets[0]
    for bucket in buckets:
        if bucket >= count:
            return bucket
    logger.warning("Count %d exceeds all buckets %s, returning largest bucket %d",
                   count, buckets, buckets[-1])
    return buckets[-1]


def decode_context_bucket(max_ctx_plus_one: int, ctx_buckets: Sequence[int] | None,
                          max_model_len: int) -> int:
    """The decode context bucket for a step: the smallest of ``ctx_buckets + [max_model_len]``
    that holds the step's largest context plus its new token.

    Args:
        max_ctx_plus_one: the step's max context length + 1 (the token being decoded), tokens.
            Under DP the caller MAX-all-reduces it first so every rank picks the same NEFF.
        ctx_buckets: validated ``decode_context_length_buckets`` or None (then always
            ``max_model_len``).
        max_model_len: tokens; the implicit fallback, also returned for a value above it
            (vLLM never schedules one).
    """
    for bucket in ctx_buckets or ():
        if bucket >= max_ctx_plus_one:
            return bucket
    return int(max_model_len)


# --------------------------------------------------------------------------------------------
# The resolved plan


def target_name(target: Mapping[str, Any], max_model_len: int | None = None) -> str:
    """A compile target's bucket name (the ``bucket_name`` label format).

    ``{"kind": "prefill", "tokens": 1024, "kv_segment": 0}`` -> ``prefill_s1024``;
    ``kv_segment=1024`` with ``tokens=512`` -> ``prefill_s512_kv1024``;
    ``{"kind": "decode", "batch": 8, "context": 2048}`` -> ``decode_b8`` when 2048 is
    ``max_model_len`` (the fallback bucket), else ``decode_b8_s2048``.

    Args:
        target: one item of :meth:`BucketPlan.compile_targets`.
        max_model_len: tokens; needed for decode targets (:meth:`BucketPlan.target_name`
            passes it).

    Raises:
        ValueError: an unknown ``kind``, or a decode target without ``max_model_len``.
    """
    kind = target.get("kind")
    if kind == "prefill":
        name = f"prefill_s{target['tokens']}"
        if target.get("kv_segment"):
            name += f"_kv{target['kv_segment']}"
        return name
    if kind == "decode":
        if max_model_len is None:
            raise ValueError("target_name of a decode target needs max_model_len")
        name = f"decode_b{target['batch']}"
        if target["context"] != max_model_len:
            name += f"_s{target['context']}"
        return name
    raise ValueError(f"unknown compile target kind {kind!r}")


@dataclass(frozen=True)
class BucketPlan:
    """Every bucket the Neuron plugin compiles, resolved from vLLM's and the user's settings.

    Attributes:
        num_batched_tokens_buckets: prefill token buckets, ascending (tokens).
        kv_segment_size_buckets: KV segment sizes (tokens) when segmented prefill is on, else
            None.
        num_seqs_buckets: decode batch buckets, ascending (sequences).
        decode_context_length_buckets: opt-in decode context buckets (tokens, each below
            ``max_model_len``), else None.
        segmented: segmented prefill is on.
        max_model_len: tokens; the implicit decode-context fallback bucket.
        max_num_batched_tokens: M, the largest prefill bucket (tokens).
        max_num_seqs: sequences.
        block_size: KV block, tokens.
    """

    num_batched_tokens_buckets: tuple[int, ...]
    kv_segment_size_buckets: tuple[int, ...] | None
    num_seqs_buckets: tuple[int, ...]
    decode_context_length_buckets: tuple[int, ...] | None
    segmented: bool
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int

    @property
    def decode_context_targets(self) -> tuple[int, ...]:
        """The decode context sizes compiled: the opt-in buckets, then ``max_model_len``."""
        return (*(self.decode_context_length_buckets or ()), self.max_model_len)

    def compile_targets(self) -> list[dict[str, Any]]:
        """The warmup set in warmup order: prefill pairs, then decode.

        Prefill: ``{"kind": "prefill", "tokens": b, "kv_segment": k}`` for each bucket ``b``
        and each KV segment ``k`` (0 when not segmented), skipping ``b > k``. Decode:
        ``{"kind": "decode", "batch": b, "context": s}``, the Cartesian product of the batch
        buckets and :attr:`decode_context_targets` (batch-major).
        """
        out: list[dict[str, Any]] = []
        segments = self.kv_segment_size_buckets or (0,)
        for tokens in self.num_batched_tokens_buckets:
            for seg in segments:
                if seg and tokens > seg:
                    continue
                out.append({"kind": "prefill", "tokens": tokens, "kv_segment": seg})
        for batch in self.num_seqs_buckets:
            for ctx in self.decode_context_targets:
                out.append({"kind": "decode", "batch": batch, "context": ctx})
        return out

    def target_name(self, target: Mapping[str, Any]) -> str:
        """:func:`target_name` with this plan's ``max_model_len``."""
        return target_name(target, self.max_model_len)

    def prefill_bucket(self, num_tokens: int) -> int:
        """The prefill bucket for ``num_tokens`` (:func:`get_bucket_for_count`)."""
        return get_bucket_for_count(num_tokens, self.num_batched_tokens_buckets)

    def decode_batch_bucket(self, num_reqs: int) -> int:
        """The decode batch bucket for ``num_reqs`` (:func:`get_bucket_for_count`)."""
        return get_bucket_for_count(num_reqs, self.num_seqs_buckets)

    def decode_ctx_bucket(self, max_ctx_plus_one: int) -> int:
        """The decode context bucket (:func:`decode_context_bucket`)."""
        return decode_context_bucket(max_ctx_plus_one, self.decode_context_length_buckets,
                                     self.max_model_len)


def resolve_buckets(*, max_num_batched_tokens: int | None, max_model_len: int, max_num_seqs: int,
                    block_size: int, neuron_config: NeuronConfig,
                    enable_prefix_caching: bool = False) -> BucketPlan:
    """Resolve every bucket list.

    Prefill precedence: explicit ``num_batched_tokens_buckets`` ("Using
    num_batched_tokens_buckets from config: %s") -> the segmented-prefill list -> the
    power-of-2 default ("Using default num_batched_tokens_buckets: %s"). Segmented prefill:
    an explicit ``kv_segment_size_buckets`` (validated; without an explicit prefill list the
    prefill list is the segment list, our reading of the kernel constraint, logged as
    "Segmented prefill auto-enabled; num_batched_tokens_buckets=%s"), else
    :func:`resolve_segmented_prefill_config`. Decode batch: explicit list or the default
    ("Using default num_seqs_buckets: %s"; "Using num_seqs_buckets from config: %s" is ours).

    Args:
        max_num_batched_tokens: vLLM's scheduler value (tokens).
        max_model_len: tokens.
        max_num_seqs: sequences.
        block_size: KV block, tokens.
        neuron_config: the parsed ``neuron_config`` (any object with the four ``*_buckets``
            attributes, None for unset).
        enable_prefix_caching: vLLM's APC switch; APC needs segmented prefill.

    Raises:
        BucketConfigError: any rule of the validators above, or
            :data:`APC_REQUIRES_SEGMENTED`.
    """
    m = get_max_num_batched_tokens(max_num_batched_tokens, max_model_len)
    user_nbt = getattr(neuron_config, "num_batched_tokens_buckets", None)
    user_kv = getattr(neuron_config, "kv_segment_size_buckets", None)
    user_seqs = getattr(neuron_config, "num_seqs_buckets", None)
    user_ctx = getattr(neuron_config, "decode_context_length_buckets", None)
    user_nbt = None if user_nbt is None else list(user_nbt)

    if user_kv is not None:
        kv: list[int] | None = validate_kv_segment_size_buckets(
            list(user_kv) if isinstance(user_kv, tuple) else user_kv, user_nbt, block_size)
        auto_nbt: list[int] | None = None
        if user_nbt is None:
            auto_nbt = validate_num_batched_tokens_buckets(list(kv), m)
            logger.info("Segmented prefill auto-enabled; num_batched_tokens_buckets=%s", auto_nbt)
    else:
        kv, auto_nbt = resolve_segmented_prefill_config(m, max_model_len)

    if user_nbt is not None:
        nbt = validate_num_batched_tokens_buckets(user_nbt, m)
        logger.info("Using num_batched_tokens_buckets from config: %s", nbt)
    elif auto_nbt is not None:
        nbt = auto_nbt
    else:
        nbt = get_default_num_batched_tokens_buckets(m)
        logger.info("Using default num_batched_tokens_buckets: %s", nbt)

    if user_seqs is not None:
        seqs = validate_num_seqs_buckets(list(user_seqs) if isinstance(user_seqs, tuple)
                                         else user_seqs, max_num_seqs)
        logger.info("Using num_seqs_buckets from config: %s", seqs)
    else:
        seqs = get_default_num_seqs_buckets(max_num_seqs)
        logger.info("Using default num_seqs_buckets: %s", seqs)

    ctx = validate_decode_context_length_buckets(
        list(user_ctx) if isinstance(user_ctx, tuple) else user_ctx, max_model_len)
    segmented = kv is not None
    check_prefix_caching(enable_prefix_caching, segmented)
    return BucketPlan(
        num_batched_tokens_buckets=tuple(nbt),
        kv_segment_size_buckets=None if kv is None else tuple(kv),
        num_seqs_buckets=tuple(seqs),
        decode_context_length_buckets=None if ctx is None else tuple(ctx),
        segmented=segmented, max_model_len=int(max_model_len), max_num_batched_tokens=m,
        max_num_seqs=int(max_num_seqs), block_size=int(block_size))
