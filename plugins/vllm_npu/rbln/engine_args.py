"""What the RBLN platform must see of the user's arguments before vLLM fills its defaults.

vLLM builds its config in ``EngineArgs.create_engine_config``; by the time the platform's
``check_and_update_config`` runs, ``--model-impl`` has been validated against upstream's
backends (which know no ``optimum``) and ``max_num_seqs`` / ``max_num_batched_tokens`` hold
upstream's defaults. As vllm-rbln does, :func:`install` wraps ``create_engine_config`` (from the
general-plugin hook that every vLLM process runs first) to record:

* the raw ``--model-impl`` (then hands upstream ``auto``; the platform resolves the path);
* the user's own ``--max-num-batched-tokens`` (None when not given);
* ``--max-num-seqs`` defaulting to 1 (``RBLN_DEFAULT_MAX_NUM_SEQS``) when not given.

They travel to the platform in environment variables, so a spawned engine process inherits
them. The wrapper is idempotent and active only for the ``rbln-*`` targets.
"""

from __future__ import annotations

import os

from vllm_npu.engine_args_hook import run_before_create_engine_config

__all__ = ["MODEL_IMPL_ENV", "USER_TOKENS_ENV", "RBLN_DEFAULT_MAX_NUM_SEQS", "install", "captured"]

MODEL_IMPL_ENV = "_NPU_HARNESS_RBLN_MODEL_IMPL"
USER_TOKENS_ENV = "_NPU_HARNESS_RBLN_USER_MAX_NUM_BATCHED_TOKENS"
RBLN_DEFAULT_MAX_NUM_SEQS = 1


def install() -> bool:
    """Wrap ``EngineArgs.create_engine_config`` (once). Returns whether it is wrapped now."""
    return run_before_create_engine_config("_npu_harness_rbln_patched", _record)


def _record(args) -> None:
    raw = args.model_impl
    os.environ[MODEL_IMPL_ENV] = str(getattr(raw, "value", raw) or "auto")
    args.model_impl = "auto"
    tokens = args.max_num_batched_tokens
    os.environ[USER_TOKENS_ENV] = "" if tokens is None else str(int(tokens))
    if args.max_num_seqs is None:
        args.max_num_seqs = RBLN_DEFAULT_MAX_NUM_SEQS


def captured(environ=None) -> tuple[str, int | None]:
    """``(model_impl flag, user max_num_batched_tokens or None)`` recorded by :func:`install`
    (``("auto", None)`` when nothing was recorded, e.g. a config built without EngineArgs)."""
    env = os.environ if environ is None else environ
    tokens = env.get(USER_TOKENS_ENV, "")
    return env.get(MODEL_IMPL_ENV, "auto") or "auto", int(tokens) if tokens else None
