"""Which model path a run takes: ``vllm`` (torch.compile of vLLM's model code) or ``optimum``
(optimum-rbln graphs, upstream's ``--model-impl transformers``).

:func:`resolve_model_impl` decides, in this order:

1. An :class:`~vllm_npu.rbln.options.RBLNConfig` / ``OptimumRBLNConfig`` instance as
   ``additional_config`` names its own path; a ``--model-impl`` naming the other is an error.
2. ``--model-impl`` (after :data:`ALIASES`; ``auto`` names nothing here).
3. If 1 or 2 named a path, the deprecated ``VLLM_RBLN_USE_VLLM_MODEL`` may only agree (a
   deprecation warning) -- disagreeing is an error.
4. Otherwise the path a parent process published in ``_VLLM_RBLN_RESOLVED_MODEL_IMPL``, else
   ``VLLM_RBLN_USE_VLLM_MODEL`` (``true``/``1`` -> vllm, anything else -> optimum), else
   ``auto``: a compiled optimum-rbln directory, or a checkpoint whose ``config.json``
   architecture optimum-rbln implements, takes the optimum path; anything else the vllm path.

:func:`reject_disabled` then refuses the vllm path on ATOM (``RBLN-CA*``) hosts, naming what
selected it and how to undo that.

This module imports only the standard library and its sibling decision modules.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from vllm_npu.rbln import architectures
from vllm_npu.rbln.device import is_ca
from vllm_npu.rbln.options import OptimumRBLNConfig, RBLNConfig
from vllm_npu.settings import RBLN_ENV_WORDS, parse_switch

logger = logging.getLogger("vllm.vllm_npu.rbln")

Impl = Literal["vllm", "optimum"]

#: ``--model-impl`` values on RBLN -> model path (None: ``auto``, decided by the model).
ALIASES: Mapping[str, Impl | None] = MappingProxyType(
    {"auto": None, "transformers": "optimum", "optimum": "optimum", "vllm": "vllm"})
#: The deprecated variable that selected the vllm path (``true``/``1``) before ``--model-impl``.
LEGACY_ENV = "VLLM_RBLN_USE_VLLM_MODEL"
#: Where the resolved path is published for worker processes (and read back in them).
RESOLVED_ENV = "_VLLM_RBLN_RESOLVED_MODEL_IMPL"
#: Name of the optimum-rbln config file of a compiled model directory.
RBLN_CONFIG_FILE = "rbln_config.json"
#: Glob of a compiled graph file of a compiled model directory.
RBLN_GRAPH_GLOB = "*.rbln"

#: ``selected_by`` of each source that can pick the vllm path -> the remedy the refusal on
#: ATOM gives for it.
REMEDIES: Mapping[str, str] = MappingProxyType({
    "--model-impl vllm": "Use --model-impl optimum.",
    "an RBLNConfig additional_config": "Pass an OptimumRBLNConfig instead.",
    RESOLVED_ENV: "Start the process that published it on the optimum path.",
    LEGACY_ENV: f"Unset {LEGACY_ENV}.",
    "the model's architecture": "Use a model optimum-rbln implements.",
    "a model whose config could not be read":
        "Make the config readable, or use --model-impl optimum.",
})


class ModelImplError(ValueError):
    """A ``--model-impl`` value, config class or environment that cannot name one path.

    A ValueError, as the vendor raises.
    """


class ModelPathDisabledError(ValueError):
    """The resolved model path does not run on this host's NPU (the vllm path on ATOM)."""


@dataclass(frozen=True)
class Resolution:
    """The model path a run takes and why.

    Attributes:
        impl: ``"vllm"`` or ``"optimum"``.
        selected_by: what chose it, as the refusal on ATOM words it (``"--model-impl vllm"``).
        remedy: how to undo that choice (``""`` for optimum choices: never refused).
        log: one line for the engine log saying why.
        warnings: deprecation warnings the resolution issued (also logged).
    """

    impl: Impl
    selected_by: str
    remedy: str
    log: str
    warnings: tuple[str, ...] = field(default=())


def normalize(value: Any) -> Impl | None:
    """The model path ``--model-impl value`` names: ``"vllm"``, ``"optimum"``, or None for
    ``auto``. Exact spelling only (``"vLLM"`` is refused); None counts as ``auto``.

    Raises:
        ModelImplError: any other value (e.g. upstream's ``terratorch``, ``""``, ``True``).
    """
    if value is None:
        return None
    if isinstance(value, str) and value in ALIASES:
        return ALIASES[value]
    raise ModelImplError(f"unsupported model implementation {value!r}; --model-impl takes "
                         f"{sorted(ALIASES)} on RBLN")


def is_compiled_dir(path: str | os.PathLike[str] | None) -> bool:
    """True if ``path`` is a directory holding ``rbln_config.json`` and at least one
    ``*.rbln`` graph (a model compiled by optimum-rbln). False for hub ids and missing paths."""
    if path is None:
        return False
    p = Path(path)
    try:
        return (p / RBLN_CONFIG_FILE).is_file() and any(p.glob(RBLN_GRAPH_GLOB))
    except OSError:
        return False


def read_architectures(model_path: str | os.PathLike[str]) -> list[str]:
    """The ``architectures`` list of ``<model_path>/config.json`` (``[]`` when absent).

    A plain read of a local directory; a hub id (no such directory) raises OSError. The
    platform may pass a reader that resolves hub ids through vLLM instead.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON, not an object, or ``architectures`` is not a list of
            strings.
    """
    if model_path is None:
        raise OSError("no model path was given")
    with open(Path(model_path) / "config.json", encoding="utf-8") as fh:
        config = json.load(fh)
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config.json architectures is not a list of names: {archs!r}")
    return archs


def _config_class_path(additional_config: Any) -> tuple[Impl, str] | None:
    if isinstance(additional_config, RBLNConfig):
        return "vllm", "RBLNConfig"
    if isinstance(additional_config, OptimumRBLNConfig):
        return "optimum", "OptimumRBLNConfig"
    return None


def _legacy_path(raw: str) -> Impl:
    """``VLLM_RBLN_USE_VLLM_MODEL``'s path: ``1``/``true`` the vllm path, ``0``/``false`` the
    optimum one (:data:`vllm_npu.settings.RBLN_ENV_WORDS`; vllm-rbln reads every other word as
    the optimum path, so ``yes`` would take a different path here and on the board).

    Raises:
        ModelImplError: any other word (named, with the accepted ones).
    """
    return "vllm" if parse_switch(raw, name=LEGACY_ENV, words=RBLN_ENV_WORDS, error=ModelImplError) else "optimum"


def _remedy(selected_by: str, impl: Impl) -> str:
    return REMEDIES.get(selected_by, "") if impl == "vllm" else ""


def _auto(model_path: str | os.PathLike[str] | None,
          reader: Callable[[Any], Sequence[str]]) -> tuple[Impl, str, str]:
    """``auto``'s choice for ``model_path``: (impl, selected_by, log)."""
    if is_compiled_dir(model_path):
        return ("optimum", "a compiled optimum-rbln artifact",
                f"--model-impl auto takes the optimum model path: {model_path} holds a "
                "compiled optimum-rbln artifact.")
    try:
        archs = list(reader(model_path))
    except (ValueError, OSError) as exc:
        return ("vllm", "a model whose config could not be read",
                f"--model-impl auto takes the vllm model path: {model_path}'s config could "
                f"not be read ({exc}). Name the path to be sure of it.")
    arch = architectures.supported_by_optimum(archs)
    if arch is not None:
        return ("optimum", "the model's architecture",
                f"--model-impl auto takes the optimum model path: optimum-rbln runs {arch}.")
    return ("vllm", "the model's architecture",
            f"--model-impl auto takes the vllm model path: optimum-rbln has no implementation "
            f"for {archs}.")


def resolve_model_impl(flag: Any, additional_config: Any, environ: Mapping[str, str] | None,
                       model_path: str | os.PathLike[str] | None, *,
                       hf_architectures_reader: Callable[[Any], Sequence[str]]
                       = read_architectures) -> Resolution:
    """The model path for ``--model-impl flag`` with ``additional_config`` (order in the module
    docstring). Does not check the device: see :func:`reject_disabled`.

    Args:
        flag: upstream's ``model_impl`` (``"auto"``, ``"vllm"``, ``"transformers"``,
            ``"optimum"``; None is ``auto``).
        additional_config: vLLM's ``additional_config`` (a mapping or a config instance).
        environ: the environment (default ``os.environ``).
        model_path: the model id or directory (after any redirect), for ``auto``.
        hf_architectures_reader: ``model_path -> architectures``; raises OSError/ValueError
            when the config cannot be read (default :func:`read_architectures`).

    Raises:
        ModelImplError: an unsupported ``flag``; a flag contradicting the config class; a
            ``VLLM_RBLN_USE_VLLM_MODEL`` contradicting the explicit choice; an unusable
            ``_VLLM_RBLN_RESOLVED_MODEL_IMPL``.
    """
    env = os.environ if environ is None else environ
    flagged = normalize(flag)
    legacy_raw = env.get(LEGACY_ENV, "")
    warnings: list[str] = []

    chosen: tuple[Impl, str] | None = None  # (impl, selected_by) of steps 1-2
    by_class = _config_class_path(additional_config)
    if by_class is not None:
        given, cls_name = by_class
        if flagged is not None and flagged != given:
            raise ModelImplError(
                f"--model-impl names the {flagged} model path and additional_config is an "
                f"{cls_name}, which holds the {given} one's options. Pass the config class "
                "for the path you want, or leave --model-impl at auto.")
        chosen = (given, f"an {cls_name} additional_config")
    elif flagged is not None:
        chosen = (flagged, f"--model-impl {flag}")

    if chosen is not None:
        impl, selected_by = chosen
        if legacy_raw.strip():
            legacy = _legacy_path(legacy_raw)
            if legacy != impl:
                raise ModelImplError(
                    f"{LEGACY_ENV} selects the {legacy!r} model path and model_impl selects "
                    f"{impl!r}. {LEGACY_ENV} is deprecated: unset it and keep --model-impl.")
            warnings.append(_legacy_warning())
        log = f"{selected_by} selects the {impl} model path."
    elif env.get(RESOLVED_ENV, "").strip():
        raw = env[RESOLVED_ENV].strip()
        if raw not in ("vllm", "optimum"):
            raise ModelImplError(
                f"{RESOLVED_ENV}={raw!r} names no model path; the process that starts this one "
                "publishes 'vllm' or 'optimum' there.")
        impl, selected_by = raw, RESOLVED_ENV  # type: ignore[assignment]
        log = f"{RESOLVED_ENV} hands down the {impl} model path."
    elif legacy_raw.strip():
        impl, selected_by = _legacy_path(legacy_raw), LEGACY_ENV
        warnings.append(_legacy_warning())
        log = f"{LEGACY_ENV}={legacy_raw} selects the {impl} model path."
    else:
        impl, selected_by, log = _auto(model_path, hf_architectures_reader)

    for text in warnings:
        logger.warning("%s", text)
    logger.info("%s", log)
    return Resolution(impl, selected_by, _remedy(selected_by, impl), log, tuple(warnings))


def _legacy_warning() -> str:
    return (f"{LEGACY_ENV} is deprecated and will be removed in 0.14.0. Use --model-impl, or "
            "hand additional_config the config class of the path you want, instead.")


def reject_disabled(resolution: Resolution, device_name: str | None) -> None:
    """Refuse a model path the host's NPU does not run: the vllm path on ATOM (``RBLN-CA*``).

    Args:
        resolution: from :func:`resolve_model_impl`.
        device_name: the NPU name, or None when it is not known yet (a compile-only worker
            names its target later): then nothing is refused.

    Raises:
        ModelPathDisabledError: ``The vllm model path is not supported on {device};
            {selected_by} selected it. {remedy}``.
    """
    if resolution.impl != "vllm" or device_name is None or not is_ca(device_name):
        return
    raise ModelPathDisabledError(
        f"The vllm model path is not supported on {device_name}; {resolution.selected_by} "
        f"selected it. {resolution.remedy}")

