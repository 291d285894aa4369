"""The user's own scheduler arguments, recorded before vLLM fills its defaults (MBLT).

By the time the platform's ``check_and_update_config`` runs, ``max_num_seqs``,
``max_num_batched_tokens`` and ``max_model_len`` hold vLLM's defaults when the user gave none (256 and 2048 for
``vllm serve``, 128 and 2048 for a bare ``EngineArgs``), and the plan cannot tell them from
user values: every default start of a batch artifact logged a spurious clamp warning, and an
artifact without ``max_batch_size`` was scheduled at 256 sequences on its one slot, where the
vendor defaults ``max_batch_size`` to 1; and a ``max_model_len`` taken from the artifact's
``max_position_embeddings`` cannot be told from a ``--max-model-len`` (only the first may be
clamped to the MXQ's KV capacity).

vLLM's ``EngineArgs`` fields are None until ``create_engine_config`` fills them, so, as
vllm-rbln does for its own arguments (and :mod:`vllm_npu.rbln.engine_args` for ours),
:func:`install` wraps ``EngineArgs.create_engine_config`` from the MBLT general plugin (which
every vLLM process runs first) and records the three values as given (None when not given) in
an environment variable, which a spawned engine process inherits. The same wrapper refuses a
multimodal release of a model type the plugin does not serve
(:func:`vllm_npu.mblt.models.refuse_unsupported_release`), before vLLM parses its config. Active only for the ``mblt-*`` targets; idempotent.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from vllm_npu.engine_args_hook import run_before_create_engine_config
from vllm_npu.settings import env_json

__all__ = ["USER_ARGS_ENV", "captured", "install"]

USER_ARGS_ENV = "_NPU_HARNESS_MBLT_USER_SCHEDULER_ARGS"
_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len")


def install() -> bool:
    """Wrap ``EngineArgs.create_engine_config`` (once). Returns whether it is wrapped now."""
    from vllm_npu.mblt.models import refuse_unsupported_release

    run_before_create_engine_config("_npu_harness_mblt_release_kind",
                                    lambda args: refuse_unsupported_release(args.model))
    return run_before_create_engine_config("_npu_harness_mblt_patched", _record)


def _record(args) -> None:
    os.environ[USER_ARGS_ENV] = json.dumps({name: getattr(args, name, None) for name in _FIELDS})


def captured(environ: Mapping[str, str] | None = None) -> dict[str, int | None] | None:
    """The values :func:`install` recorded (``{"max_num_seqs": ..., "max_num_batched_tokens":
    ..., "max_model_len": ...}``, None where the user gave none), or None when nothing was (a config built without
    ``EngineArgs``: the caller then takes the config's values as the user's).

    Raises:
        SettingError: the variable holds something other than a JSON object (it is ours to
            write; a hand-set value that is not one is named, not read as "nothing recorded").
    """
    data = env_json(USER_ARGS_ENV, default=None, kind=dict, environ=environ)
    return None if data is None else {name: data.get(name) for name in _FIELDS}
