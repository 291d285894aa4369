"""The Neuron KV-cache budget: how many bytes (then blocks) of HBM the KV cache gets.

On Neuron the KV-cache shape is baked into every NEFF, and an oversized KV cache fails the
compile (``NCC_EVRF009``), so the budget is capped (seed: features guide "Memory management";
reference neuron.md §3). Two policies per logical core:

* **default (fractional cap)**::

      total_budget = int(logical_core_hbm * gpu_memory_utilization)
      available = max(min(max(total_budget - model_weight_bytes, 0),
                          int(total_budget * cap_fraction)), 0)

* **headroom** (``VLLM_NEURON_RESERVED_HEADROOM_GIB`` set, ``0`` included): GMU becomes 1.0
  and the cap is bypassed::

      available = max(logical_core_hbm - model_weight_bytes - headroom_bytes, 0)

Then a minimum (``VLLM_NEURON_MIN_KV_BUDGET_GIB``, 0 disables) stops the server on a budget
too small. CPU mode (:func:`compute_cpu_kv_budget`) sizes from the host's fair share per
worker, with no weight subtraction and no minimum check.

This module imports only the standard library (no vLLM, torch or npusim).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["GIB", "DEFAULT_CAP_FRACTION", "DEFAULT_MIN_KV_BUDGET_GIB", "KvBudgetError",
           "KvBudget", "kv_cap_fraction", "min_kv_budget_gib", "reserved_headroom_gib",
           "compute_kv_budget", "compute_cpu_kv_budget", "page_bytes", "num_blocks",
           "max_kv_concurrency"]

logger = logging.getLogger("vllm.vllm_npu.neuron")

GIB = 2 ** 30
#: Default ``VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION`` (from worst-case GPT-OSS compiles).
DEFAULT_CAP_FRACTION = 0.30
#: Default ``VLLM_NEURON_MIN_KV_BUDGET_GIB``.
DEFAULT_MIN_KV_BUDGET_GIB = 1.0

CAP_ENV = "VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION"
MIN_ENV = "VLLM_NEURON_MIN_KV_BUDGET_GIB"
HEADROOM_ENV = "VLLM_NEURON_RESERVED_HEADROOM_GIB"

#: Appended to the minimum-budget error in headroom mode (the seed: decrease the headroom).
HEADROOM_HINT = (f" In headroom mode, decrease {HEADROOM_ENV} instead; do not increase it for "
                 "this error.")


class KvBudgetError(RuntimeError):
    """A KV-budget setting or result the Neuron worker refuses (a RuntimeError, as the vendor
    raises)."""


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def kv_cap_fraction(env: Mapping[str, str] | None = None) -> float:
    """``VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION``: the default policy's cap (fraction of the
    GMU budget), default 0.30. Unset or empty -> the default.

    Args:
        env: the environment (None = ``os.environ``).

    Raises:
        KvBudgetError: not a number in (0, 1] ("VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION must be
            in (0, 1]. Got X.").
    """
    raw = _env(env).get(CAP_ENV, "")
    if not raw.strip():
        return DEFAULT_CAP_FRACTION
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0:
        raise KvBudgetError(f"{CAP_ENV} must be in (0, 1]. Got {raw}.")
    return value


def min_kv_budget_gib(env: Mapping[str, str] | None = None) -> float:
    """``VLLM_NEURON_MIN_KV_BUDGET_GIB``: the smallest KV budget (GiB) the server starts with,
    default 1.0; 0 disables the check. Unset or empty -> the default.

    Raises:
        KvBudgetError: not a number >= 0 ("VLLM_NEURON_MIN_KV_BUDGET_GIB must be >= 0. Got X.",
            our text).
    """
    raw = _env(env).get(MIN_ENV, "")
    if not raw.strip():
        return DEFAULT_MIN_KV_BUDGET_GIB
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= 0.0:
        raise KvBudgetError(f"{MIN_ENV} must be >= 0. Got {raw}.")
    return value


def reserved_headroom_gib(env: Mapping[str, str] | None = None) -> float | None:
    """``VLLM_NEURON_RESERVED_HEADROOM_GIB``: the explicit reserve per worker (GiB) that
    selects headroom mode; unset (or empty: our reading) -> None, the default policy. ``"0"``
    is an explicit value and enables headroom mode.

    Raises:
        KvBudgetError: not a number >= 0 ("VLLM_NEURON_RESERVED_HEADROOM_GIB must be >= 0.
            Got X.", our text).
    """
    raw = _env(env).get(HEADROOM_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= 0.0:
        raise KvBudgetError(f"{HEADROOM_ENV} must be >= 0. Got {raw}.")
    return value


@dataclass(frozen=True)
class KvBudget:
    """One KV-budget computation: every input and the result.

    Attributes:
        mode: ``"fractional_cap"`` (default), ``"headroom"``, ``"cpu"`` or ``"cpu_headroom"``.
        logical_core_hbm_bytes: HBM of one logical core (CPU modes: the worker's fair share of
            host available memory), bytes.
        model_weight_bytes: model-resident bytes (params + buffers, drafter included); 0 in CPU
            modes (host available memory already accounts for them).
        gpu_memory_utilization: the GMU the user asked for.
        effective_gpu_memory_utilization: the GMU applied (1.0 in headroom modes).
        cap_fraction: ``VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION`` (not applied in headroom modes).
        headroom_bytes: the explicit reserve, bytes; None outside headroom modes.
        min_kv_budget_gib: ``VLLM_NEURON_MIN_KV_BUDGET_GIB`` (0 = check disabled).
        total_budget: ``int(hbm * effective GMU)``, bytes.
        user_budget: ``max(total_budget - weights, 0)``, bytes.
        heuristic_cap: ``int(total_budget * cap_fraction)``, bytes; None when bypassed.
        available_bytes: the KV budget, bytes.
    """

    mode: str
    logical_core_hbm_bytes: int
    model_weight_bytes: int
    gpu_memory_utilization: float
    effective_gpu_memory_utilization: float
    cap_fraction: float
    headroom_bytes: int | None
    min_kv_budget_gib: float
    total_budget: int
    user_budget: int
    heuristic_cap: int | None
    available_bytes: int

    @property
    def available_gib(self) -> float:
        """:attr:`available_bytes` in GiB."""
        return self.available_bytes / GIB

    @property
    def headroom_mode(self) -> bool:
        """The explicit-headroom policy was used."""
        return self.headroom_bytes is not None


def _check_minimum(budget: KvBudget) -> None:
    minimum = budget.min_kv_budget_gib
    if minimum > 0 and budget.available_bytes < minimum * GIB:
        msg = ("Computed KV cache budget is below minimum threshold. "
               f"effective={budget.available_bytes / GIB:.2f} GiB, minimum={minimum:.2f} GiB. "
               "Increase gpu_memory_utilization or lower VLLM_NEURON_MIN_KV_BUDGET_GIB.")
        if budget.headroom_mode:
            msg += HEADROOM_HINT
        raise KvBudgetError(msg)


def compute_kv_budget(*, logical_core_hbm_bytes: int, model_weight_bytes: int,
                      gpu_memory_utilization: float,
                      env: Mapping[str, str] | None = None) -> KvBudget:
    """The KV budget of one Neuron worker (one logical core).

    Default policy logs (debug) "KV cache heuristic: user_budget=%d cap=%d (total_budget=%d,
    total_hbm=%d, bytes_used=%d, cap_fraction=%.2f), effective=%d" (bytes; the vendor's field
    order, our number formats); headroom mode logs "KV cache headroom: ..." (ours).

    Args:
        logical_core_hbm_bytes: HBM of one logical core (HBM stack / logical cores per stack;
            e.g. 24 GiB on Trn2 at LNC=2), bytes.
        model_weight_bytes: model-resident bytes (params + buffers, drafter included).
        gpu_memory_utilization: vLLM's GMU, in (0, 1].
        env: the environment (None = ``os.environ``).

    Raises:
        KvBudgetError: a bad environment value (see the readers above), or a budget below the
            minimum: "Computed KV cache budget is below minimum threshold. effective=%.2f GiB,
            minimum=%.2f GiB. Increase gpu_memory_utilization or lower
            VLLM_NEURON_MIN_KV_BUDGET_GIB." (headroom mode appends :data:`HEADROOM_HINT`).
    """
    cap = kv_cap_fraction(env)
    minimum = min_kv_budget_gib(env)
    headroom = reserved_headroom_gib(env)
    hbm, weights = int(logical_core_hbm_bytes), int(model_weight_bytes)
    if headroom is None:
        total_budget = int(hbm * gpu_memory_utilization)
        user_budget = max(total_budget - weights, 0)
        heuristic_cap = int(total_budget * cap)
        available = max(min(user_budget, heuristic_cap), 0)
        logger.debug("KV cache heuristic: user_budget=%d cap=%d (total_budget=%d, total_hbm=%d, "
                     "bytes_used=%d, cap_fraction=%.2f), effective=%d", user_budget,
                     heuristic_cap, total_budget, hbm, weights, cap, available)
        budget = KvBudget("fractional_cap", hbm, weights, float(gpu_memory_utilization),
                          float(gpu_memory_utilization), cap, None, minimum, total_budget,
                          user_budget, heuristic_cap, available)
    else:
        headroom_bytes = int(headroom * GIB)
        total_budget = hbm
        user_budget = max(total_budget - weights, 0)
        available = max(hbm - weights - headroom_bytes, 0)
        logger.debug("KV cache headroom: total_hbm=%d, bytes_used=%d, headroom=%d, effective=%d "
                     "(gpu_memory_utilization=1.0, cap bypassed)", hbm, weights, headroom_bytes,
                     available)
        budget = KvBudget("headroom", hbm, weights, float(gpu_memory_utilization), 1.0, cap,
                          headroom_bytes, minimum, total_budget, user_budget, None, available)
    _check_minimum(budget)
    return budget


def compute_cpu_kv_budget(*, host_available_bytes: int, local_world_size: int,
                          gpu_memory_utilization: float,
                          env: Mapping[str, str] | None = None) -> KvBudget:
    """The KV budget of one worker in CPU mode (``VLLM_NEURON_CPU_MODE=1``).

    Default: ``free_share = host_available // local_world_size``; ``total_budget =
    int(free_share * gmu)``; ``available = int(total_budget * cap)``. Headroom:
    ``available = max(host_available / local_world_size - headroom_bytes, 0)``. No weight
    subtraction, no minimum check. Logs "Host memory: %.2f GiB available, %d local worker(s),
    %.2f GiB fair-share per worker".

    Raises:
        KvBudgetError: a bad environment value.
        ValueError: ``local_world_size < 1``.
    """
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be a positive integer, got {local_world_size}")
    cap = kv_cap_fraction(env)
    minimum = min_kv_budget_gib(env)
    headroom = reserved_headroom_gib(env)
    host = int(host_available_bytes)
    share = host // local_world_size
    logger.info("Host memory: %.2f GiB available, %d local worker(s), %.2f GiB fair-share per "
                "worker", host / GIB, local_world_size, share / GIB)
    if headroom is None:
        total_budget = int(share * gpu_memory_utilization)
        available = int(total_budget * cap)
        return KvBudget("cpu", share, 0, float(gpu_memory_utilization),
                        float(gpu_memory_utilization), cap, None, minimum, total_budget,
                        total_budget, available, available)
    headroom_bytes = int(headroom * GIB)
    available = max(int(host / local_world_size - headroom_bytes), 0)
    return KvBudget("cpu_headroom", share, 0, float(gpu_memory_utilization), 1.0, cap,
                    headroom_bytes, minimum, share, share, None, available)


def page_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
               dtype_bytes: int) -> int:
    """Bytes of one KV block across all layers, K and V:
    ``2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes``.

    Args:
        num_layers: attention layers holding KV.
        block_size: tokens per block.
        num_kv_heads: KV heads per worker (after TP sharding).
        head_dim: elements per head.
        dtype_bytes: bytes per element (2 for bf16, 1 for fp8).
    """
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def num_blocks(available_bytes: int, page_bytes: int, override: int | None = None) -> int:
    """KV blocks: ``available_bytes // page_bytes``, or ``--num-gpu-blocks-override``.

    An override logs vLLM's "Overriding num_gpu_blocks=%d with num_gpu_blocks_override=%d".
    Block 0 is vLLM's null block (so ``n`` blocks hold ``n - 1`` usable ones).

    Raises:
        ValueError: ``page_bytes < 1`` or an override below 1 (our checks).
    """
    if page_bytes < 1:
        raise ValueError(f"page_bytes must be a positive integer, got {page_bytes}")
    computed = max(int(available_bytes), 0) // page_bytes
    if override is None:
        return computed
    if override < 1:
        raise ValueError(f"num_gpu_blocks_override must be a positive integer, got {override}")
    logger.info("Overriding num_gpu_blocks=%d with num_gpu_blocks_override=%d", computed, override)
    return int(override)


def max_kv_concurrency(num_blocks: int, max_model_len: int, block_size: int,
                       max_num_seqs: int | None = None) -> int:
    """Worst-case concurrent requests the KV cache holds: ``num_blocks //
    ceil(max_model_len / block_size)`` (every request at ``max_model_len``).

    With ``max_num_seqs`` it returns the effective cap ``min(max_num_seqs, capacity)`` and, when
    ``max_num_seqs`` exceeds the capacity, logs the scheduler's init warning "max_num_seqs (%d)
    exceeds worst-case KV cache capacity (%d concurrent requests at max_model_len=%d, %d blocks
    of %d tokens). Effective concurrency will be capped at %d." (the parts the reference elides
    are ours).

    Raises:
        ValueError: ``block_size < 1`` or ``max_model_len < 1``.
    """
    if block_size < 1 or max_model_len < 1:
        raise ValueError(f"block_size and max_model_len must be positive, got {block_size} "
                         f"and {max_model_len}")
    capacity = int(num_blocks) // -(-int(max_model_len) // int(block_size))
    if max_num_seqs is None:
        return capacity
    if max_num_seqs > capacity:
        logger.warning("max_num_seqs (%d) exceeds worst-case KV cache capacity (%d concurrent "
                       "requests at max_model_len=%d, %d blocks of %d tokens). Effective "
                       "concurrency will be capped at %d.", max_num_seqs, capacity, max_model_len,
                       num_blocks, block_size, capacity)
        return capacity
    return int(max_num_seqs)
