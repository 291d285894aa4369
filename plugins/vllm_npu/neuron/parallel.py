"""Parallelism rules of the Neuron plugin: EP degree, component DP, the vision encoder's TP/DP,
device visibility, executor backend and scheduling policy.

Seed (features guide, "Tensor, data, and expert parallelism") and reference neuron.md §5. Where
they disagree the seed wins:

* ``--enable-expert-parallel`` without an explicit ``ep_degree`` (i.e. ``ep_degree == 1``)
  defaults to full EP: ``--tensor-parallel-size`` when DP is 1. With DP > 1 the seed accepts
  only ``ep_degree = TP x DP``, so that is the default there (the reference's code default,
  ``world_size_across_dp``, agrees);
* with DP > 1 an explicit ``ep_degree`` other than ``TP x DP`` is rejected (the reference's
  code only requires it to divide ``TP x DP``; that rule is kept for DP == 1).

This module imports only the standard library (no vLLM, torch or npusim).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["ParallelConfigError", "KV_CONSUMER_ROLES", "COMPONENT_DP_DENSE_LOG",
           "VISIBLE_CORES_WITH_MP", "resolve_ep_degree", "validate_component_dp",
           "resolve_encoder_tp_dp", "resolve_executor_backend", "validate_multinode",
           "validate_scheduler_policy", "validate_parallelism"]

logger = logging.getLogger("vllm.vllm_npu.neuron")

#: ``kv_role`` values of a decode server, the only place component DP runs.
KV_CONSUMER_ROLES: frozenset[str] = frozenset({"kv_consumer", "kv_both"})
#: Logged when component DP runs a dense model with DP > 1 (the platform sets num_experts=1).
COMPONENT_DP_DENSE_LOG = ("Component DP enabled — setting num_experts=1 to preserve "
                          "data_parallel_size for cross-DP process groups")
VISIBLE_CORES_WITH_MP = (
    "NEURON_RT_VISIBLE_CORES cannot be used with multi-processing execution on vLLM. Set "
    "NEURON_VISIBLE_DEVICES to control device visibility.")

_COMPONENT_DP_FIELDS = ("attention_dp_size", "embedding_dp_size", "mlp_dp_size",
                        "lm_head_dp_size")


class ParallelConfigError(ValueError):
    """A parallelism setting the Neuron plugin refuses (a ValueError, as the vendor raises)."""


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParallelConfigError(f"{name} must be a positive integer, got {value}")
    return value


def resolve_ep_degree(*, tp: int, dp: int, enable_expert_parallel: bool, ep_degree: int,
                      world_size: int | None = None) -> int:
    """The expert-parallel degree the worker uses.

    Args:
        tp, dp: ``--tensor-parallel-size``, ``--data-parallel-size``.
        enable_expert_parallel: ``--enable-expert-parallel``.
        ep_degree: ``neuron_config.ep_degree`` (1 = not set).
        world_size: TP x DP across DP ranks (None = ``tp * dp``).

    Returns:
        1 without EP; with EP, full EP (``tp`` at DP 1, ``tp * dp`` otherwise) for
        ``ep_degree == 1``, else ``ep_degree``.

    Raises:
        ParallelConfigError: "ep_degree must be a positive integer, got X"; "ep_degree={e}
            requires --enable-expert-parallel to be set."; with DP > 1 an ``ep_degree`` other
            than TP x DP ("Combining DP with EP requires ep_degree = TP × DP ..." naming the
            values, our wording around the seed's sentence); at DP 1 an ``ep_degree`` that does
            not divide the world size ("world_size (TP*DP={n}) must be divisible by ep_degree
            ({e}).").
    """
    e = _positive("ep_degree", ep_degree)
    tp, dp = _positive("tensor_parallel_size", tp), _positive("data_parallel_size", dp)
    n = tp * dp if world_size is None else world_size
    if not enable_expert_parallel:
        if e > 1:
            raise ParallelConfigError(f"ep_degree={e} requires --enable-expert-parallel to be set.")
        return 1
    if e == 1:
        return n
    if dp > 1:
        if e != n:
            raise ParallelConfigError(
                f"Combining DP with EP requires ep_degree = TP × DP ({tp} × {dp} = {n}), got "
                f"ep_degree={e}. Other combinations are rejected.")
        return e
    if n % e:
        raise ParallelConfigError(f"world_size (TP*DP={n}) must be divisible by ep_degree ({e}).")
    return e


def validate_component_dp(component_dp: Mapping[str, int], *, dp: int,
                          kv_transfer_config: Mapping[str, Any] | None) -> None:
    """Component DP (attention/embedding/MLP/LM-head sharded across DP replicas) runs only on
    the decode server of disaggregated inference, with DP >= 2.

    Args:
        component_dp: the active degrees (``{"attention_dp_size": 2}``; sizes <= 1 ignored).
        dp: ``--data-parallel-size``.
        kv_transfer_config: ``--kv-transfer-config`` as a dict, or None.

    Raises:
        ParallelConfigError: (``{active}`` is ``"attention_dp_size=2, mlp_dp_size=2"``)
            "Component DP ({active}) requires disaggregated inference (--kv-transfer-config).
            Single-node serving without DI is not supported with component DP."; a ``kv_role``
            not in :data:`KV_CONSUMER_ROLES` ("Component DP ({active}) is only supported on the
            decode server (kv_role='kv_consumer' or 'kv_both'), got kv_role='...'. The prefill
            server should not set component DP sizes > 1."); "Component DP ({active}) requires
            --data-parallel-size >= 2. Component DP shards modules across DP replicas and needs
            multiple DP ranks to function."
    """
    active_map = {k: v for k, v in component_dp.items() if v > 1}
    if not active_map:
        return
    active = ", ".join(f"{k}={v}" for k, v in active_map.items())
    if kv_transfer_config is None:
        raise ParallelConfigError(
            f"Component DP ({active}) requires disaggregated inference (--kv-transfer-config). "
            "Single-node serving without DI is not supported with component DP.")
    role = kv_transfer_config.get("kv_role")
    if role not in KV_CONSUMER_ROLES:
        raise ParallelConfigError(
            f"Component DP ({active}) is only supported on the decode server "
            f"(kv_role='kv_consumer' or 'kv_both'), got kv_role='{role}'. The prefill server "
            "should not set component DP sizes > 1.")
    if dp < 2:
        raise ParallelConfigError(
            f"Component DP ({active}) requires --data-parallel-size >= 2. Component DP shards "
            "modules across DP replicas and needs multiple DP ranks to function.")


def resolve_encoder_tp_dp(world_size: int, tp: int | None, dp: int | None) -> tuple[int, int]:
    """The vision encoder's (tp_size, dp_size); their product is the world size.

    Neither set: ``(1, world_size)`` (full DP); one set: the other is ``world_size // it``.

    Raises:
        ParallelConfigError: "vision tp_size must be a positive integer, got X" (and
            ``dp_size``); "world_size (W) must be divisible by vision tp_size (tp)" (resp.
            ``dp_size (dp)``); both set: "vision tp_size ({tp}) * dp_size ({dp}) = {tp*dp}
            must equal world_size ({W})".
    """
    for name, value in (("tp_size", tp), ("dp_size", dp)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ParallelConfigError(f"vision {name} must be a positive integer, got {value}")
    if tp is None and dp is None:
        return 1, world_size
    if dp is None:
        if world_size % tp:
            raise ParallelConfigError(
                f"world_size ({world_size}) must be divisible by vision tp_size ({tp})")
        return tp, world_size // tp
    if tp is None:
        if world_size % dp:
            raise ParallelConfigError(
                f"world_size ({world_size}) must be divisible by vision dp_size ({dp})")
        return world_size // dp, dp
    if tp * dp != world_size:
        raise ParallelConfigError(
            f"vision tp_size ({tp}) * dp_size ({dp}) = {tp * dp} must equal world_size "
            f"({world_size})")
    return tp, dp


def resolve_executor_backend(backend: str | None, *, world_size: int,
                             env: Mapping[str, str] | None = None) -> str:
    """The distributed executor backend: ``mp`` unless ``uni`` (None: ``uni`` for one worker,
    else ``mp``, as vLLM picks). Another backend is forced to ``mp`` with a warning (our text:
    "Neuron supports the 'mp' and 'uni' distributed executor backends; got %r, using 'mp'.").

    Raises:
        RuntimeError: ``NEURON_RT_VISIBLE_CORES`` is set and the backend is ``mp``
            (:data:`VISIBLE_CORES_WITH_MP`).
    """
    env = os.environ if env is None else env
    if backend is None:
        resolved = "uni" if world_size <= 1 else "mp"
    elif backend in ("mp", "uni"):
        resolved = backend
    else:
        logger.warning("Neuron supports the 'mp' and 'uni' distributed executor backends; got "
                       "%r, using 'mp'.", backend)
        resolved = "mp"
    if resolved == "mp" and env.get("NEURON_RT_VISIBLE_CORES"):
        raise RuntimeError(VISIBLE_CORES_WITH_MP)
    return resolved


def _is_loopback(addr: str) -> bool:
    if addr.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr.strip()).is_loopback
    except ValueError:
        return False


def validate_multinode(nnodes: int, master_addr: str | None) -> None:
    """More than one node needs a routable master address.

    Raises:
        ParallelConfigError: ``nnodes > 1`` with a loopback ``master_addr`` (our text).
    """
    if nnodes > 1 and master_addr is not None and _is_loopback(master_addr):
        raise ParallelConfigError(
            f"nnodes={nnodes} requires a routable --master-addr; got the loopback address "
            f"'{master_addr}'.")


def validate_scheduler_policy(policy: str) -> None:
    """The Neuron scheduler implements first-come-first-served only.

    Raises:
        ParallelConfigError: a policy other than ``fcfs`` (our text).
    """
    if policy != "fcfs":
        raise ParallelConfigError(
            f"The Neuron scheduler supports only scheduling policy 'fcfs', got '{policy}'.")


def validate_parallelism(*, tp: int, dp: int, enable_expert_parallel: bool, neuron_config: Any,
                         kv_transfer_config: Mapping[str, Any] | None = None,
                         world_size: int | None = None, scheduler_policy: str = "fcfs",
                         nnodes: int = 1, master_addr: str | None = None,
                         distributed_executor_backend: str | None = None,
                         env: Mapping[str, str] | None = None) -> int:
    """Every parallelism rule at once; returns the resolved ``ep_degree``.

    Args:
        tp, dp, enable_expert_parallel: vLLM's parallel config.
        neuron_config: the parsed ``NeuronConfig`` (reads ``ep_degree`` and the component DP
            sizes; missing attributes count as 1).
        kv_transfer_config: ``--kv-transfer-config`` as a dict, or None.
        world_size: TP x DP across DP (None = ``tp * dp``).
        scheduler_policy: vLLM's scheduling policy.
        nnodes, master_addr: multi-node settings.
        distributed_executor_backend, env: checked by :func:`resolve_executor_backend` (with
            ``world_size = tp``, the workers of one engine); None env = ``os.environ``.

    Raises:
        ParallelConfigError: any rule of :func:`resolve_ep_degree`,
            :func:`validate_component_dp`, :func:`validate_scheduler_policy`,
            :func:`validate_multinode`.
        RuntimeError: :data:`VISIBLE_CORES_WITH_MP`.
    """
    validate_scheduler_policy(scheduler_policy)
    validate_multinode(nnodes, master_addr)
    resolve_executor_backend(distributed_executor_backend, world_size=tp, env=env)
    component = {}
    for name in _COMPONENT_DP_FIELDS:
        component[name] = _positive(name, getattr(neuron_config, name, 1))
    ep = resolve_ep_degree(tp=tp, dp=dp, enable_expert_parallel=enable_expert_parallel,
                           ep_degree=getattr(neuron_config, "ep_degree", 1),
                           world_size=world_size)
    validate_component_dp(component, dp=dp, kv_transfer_config=kv_transfer_config)
    return ep
