"""Runtime-layout overrides and scheduler sizing for the mblt vLLM plugin (pure policy).

This module turns ``--model-loader-extra-config`` and the model's ``config.json`` into the
numbers the platform writes into vLLM's scheduler config: block size, prefix caching,
``max_num_seqs``, ``max_num_batched_tokens`` and the long-prefill threshold. It imports only
the standard library (no vLLM, torch or simulator), so every rule here is testable on its own.

Rules, as vllm-mblt 0.8.0 applies them (docs: the vllm-mblt README "Runtime Layout Overrides",
"Chunked Prefill Auto-Tuning", "Model-Configured Batch Capacity", "Multi-Card Software
Batching"):

* ``core_mode`` comes from the loader extra config first, then ``config.json``.
* ``max_batch_size`` comes from the loader extra config first, then ``config.json``
  ``max_batch_size`` / ``npu_max_batch_size``; absent means 1 (a non-batch MXQ).
* ``npu_prefill_chunk_size`` (``config.json``) sets the chunked-prefill size, 128 when absent;
  a batch model (``max_batch_size > 1``) is clamped to 128, the qbruntime batch limit.
* Both int-or-dict values are resolved by :func:`resolve_positive_int`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from vllm_npu.mblt.placement import CORE_MODES, topology_for  # one list of core modes, one Aries
from vllm_npu.settings import parse_int as _parse_int
from vllm_npu.settings import parse_json, parse_switch

logger = logging.getLogger("vllm.vllm_npu.mblt")

#: KV block size (tokens) when the user passes no ``--block-size``.
DEFAULT_BLOCK_SIZE = 128
#: Chunked-prefill size (tokens) when the model config names none.
DEFAULT_PREFILL_CHUNK = 128
#: Largest chunked-prefill size (tokens) a batch MXQ (``max_batch_size > 1``) runs.
BATCH_MODEL_MAX_PREFILL_CHUNK = 128

#: Loader-extra-config keys this module reads.
LAYOUT_KEYS: tuple[str, ...] = (
    "dev_no", "target_cores", "target_clusters", "core_mode", "max_batch_size",
)
#: ``prefix_cache_*`` loader-extra-config keys (read by ``vllm_npu.mblt.prefix_cache``).
PREFIX_CACHE_KEYS: tuple[str, ...] = (
    "prefix_cache_auto_threshold",
    "prefix_cache_min_hit_tokens",
    "prefix_cache_load_margin",
    "prefix_cache_max_host_mib",
    "prefix_cache_calibrate",
)
#: Unprefixed keys accepted and passed through in :attr:`LayoutOverrides.extra` (the worker's
#: model kwargs; this module does not interpret them).
PASSTHROUGH_KEYS: tuple[str, ...] = ("mxq_path", "num_expert_workers", "npu_prefill_chunk_size")
#: Submodule prefixes (VLM, encoder/decoder, EAGLE-3, MoE roles): any key starting with one of
#: these goes to :attr:`LayoutOverrides.extra` verbatim.
SUBMODULE_PREFIXES: tuple[str, ...] = (
    "text_", "vision_", "encoder_", "decoder_", "base_", "draft_", "fc_", "shared_", "expert_",
    "lm_head_",
)
#: Dict keys, besides core modes, that a core-mode keyed value may use as its fallback.
DEFAULT_KEYS: tuple[str, ...] = ("default", "DEFAULT")

# Loader-config targets are checked against an Aries card (placement re-checks the artifact's).
_CLUSTERS_PER_DEVICE = topology_for("aries").clusters
_CORES_PER_CLUSTER = topology_for("aries").cores_per_cluster


class MbltConfigError(ValueError):
    """A loader-extra-config, ``config.json`` or environment value that breaks an mblt rule.

    The message names the offending key (or variable), its value and the rule it breaks.
    """


# --------------------------------------------------------------------------------------------
# Scalar parsers shared with vllm_npu.mblt.prefix_cache: the plugins' one reader, raising ours


def parse_boolish(value: object, *, name: str) -> bool:
    """A switch (:func:`vllm_npu.settings.parse_switch`: a bool, 1/0, or ``1 true yes on`` /
    ``0 false no off``).

    Raises:
        MbltConfigError: any other value; the message names ``name``, the value and the words.
    """
    return parse_switch(value, name=name, error=MbltConfigError)


def parse_int(value: object, *, name: str, minimum: int) -> int:
    """An int ``>= minimum`` (:func:`vllm_npu.settings.parse_int`).

    Raises:
        MbltConfigError: not an int or digit string, or below ``minimum`` (named).
    """
    return _parse_int(value, name=name, minimum=minimum, error=MbltConfigError)


def parse_positive_float(value: object, *, name: str) -> float:
    """Parse a finite float ``> 0``: an int or float (not a bool) or a numeric string.

    Raises:
        MbltConfigError: a non-number, a non-finite number, or a value ``<= 0``.
    """
    parsed: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        parsed = float(value)
    elif isinstance(value, str):
        try:
            parsed = float(value.strip())
        except ValueError:
            parsed = None
    if parsed is None or not math.isfinite(parsed):
        raise MbltConfigError(f"{name}={value!r} is not a finite number")
    if parsed <= 0:
        raise MbltConfigError(f"{name}={value!r} must be a number > 0")
    return parsed


#: Parser per ``prefix_cache_*`` key (units: tokens, a ratio, MiB).
PREFIX_CACHE_PARSERS = {
    "prefix_cache_auto_threshold": lambda v, name: parse_boolish(v, name=name),
    "prefix_cache_min_hit_tokens": lambda v, name: parse_int(v, name=name, minimum=0),
    "prefix_cache_load_margin": lambda v, name: parse_positive_float(v, name=name),
    "prefix_cache_max_host_mib": lambda v, name: parse_int(v, name=name, minimum=0),
    "prefix_cache_calibrate": lambda v, name: parse_boolish(v, name=name),
}


# --------------------------------------------------------------------------------------------
# Core-mode keyed positive ints (max_batch_size, npu_prefill_chunk_size)


def _check_core_mode(value: object, *, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in CORE_MODES:
        raise MbltConfigError(
            f"{name}={value!r} is not a core mode: expected one of {list(CORE_MODES)}"
        )
    return value


def _positive_int_spec(raw: object, *, name: str) -> int | dict[str, int]:
    """Validate an int-or-core-mode-dict value; return an int or a ``{key: int}`` copy."""
    if isinstance(raw, Mapping):
        if not raw:
            raise MbltConfigError(f"{name}={raw!r}: a core-mode dict must name at least one entry")
        allowed = CORE_MODES + DEFAULT_KEYS
        out: dict[str, int] = {}
        for key, value in raw.items():
            if key not in allowed:
                raise MbltConfigError(
                    f"{name} key {key!r} is not a core mode: expected one of {list(allowed)}"
                )
            out[key] = parse_int(value, name=f"{name}[{key!r}]", minimum=1)
        return out
    return parse_int(raw, name=name, minimum=1)


def _usable_entries(raw: Mapping[object, object], *, name: str) -> dict[str, int]:
    """A model config's core-mode dict, its unusable entries skipped with a warning each:
    keys that are not core modes or ``default``/``DEFAULT`` (``auto`` is never a key, the
    seed says), and values that are not positive ints or digit strings."""
    keys = tuple(m for m in CORE_MODES if m != "auto") + DEFAULT_KEYS
    out: dict[str, int] = {}
    for key, value in raw.items():
        if key not in keys:
            logger.warning("Skipping %s entry %r=%r: the key is not a core mode (auto is never a key; "
                           "expected one of %s).", name, key, value, list(keys))
            continue
        try:
            out[key] = parse_int(value, name=f"{name}[{key!r}]", minimum=1)
        except MbltConfigError as exc:
            logger.warning("Skipping %s entry %r=%r: %s", name, key, value, exc)
    return out


def resolve_positive_int(raw: object, *, name: str, core_mode: str | None) -> int | None:
    """Resolve a model-configured positive int that may be keyed by core mode.

    ``raw`` is a positive int, a digit string, or a dict from core modes (and ``"default"`` /
    ``"DEFAULT"``) to such values. A dict's unusable entries (an ``auto`` or unknown key, a
    value that is not a positive int) are skipped with a warning, as vllm-mblt skips them;
    the usable ones resolve to, in order: the entry for ``core_mode`` (never for ``auto``,
    which is never a key); the ``"default"`` then ``"DEFAULT"`` entry; when ``core_mode`` is
    None or ``"auto"`` and exactly one usable entry exists, that entry (a global-scheme batch
    MXQ ships only the mode it was compiled for; logged at info). Otherwise a warning is
    logged and None returned.

    Args:
        raw: the value; None resolves to None.
        name: the key's name, for messages.
        core_mode: the resolved core mode (one of :data:`CORE_MODES`) or None.

    Raises:
        MbltConfigError: a non-dict ``raw`` that is not a positive int or digit string (0,
            negatives, bools, floats, other strings), or ``core_mode`` is not a core mode.
    """
    core_mode = _check_core_mode(core_mode, name="core_mode")
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        return parse_int(raw, name=name, minimum=1)
    spec = _usable_entries(raw, name=name)
    if core_mode not in (None, "auto") and core_mode in spec:
        return spec[core_mode]
    for key in DEFAULT_KEYS:
        if key in spec:
            return spec[key]
    if core_mode in (None, "auto") and len(spec) == 1:
        (key, value), = spec.items()
        logger.info(
            "Using the only %s entry %r=%d from model config for core_mode=%s.",
            name, key, value, core_mode,
        )
        return value
    logger.warning("Could not resolve %s from model config for core_mode=%s: %r",
                   name, core_mode, raw)
    return None


# --------------------------------------------------------------------------------------------
# Loader extra config


def _empty_mapping() -> Mapping[str, object]:
    return MappingProxyType({})


@dataclass(frozen=True)
class LayoutOverrides:
    """``--model-loader-extra-config`` after validation (see :func:`parse_loader_extra_config`).

    Attributes:
        dev_no: device numbers; an int given becomes ``(n,)``; None when absent.
        target_cores: canonical ``"d:c:k"`` strings (device, cluster 0-1, core 0-3).
        target_clusters: canonical ``"d:c"`` strings (device, cluster 0-1).
        core_mode: one of :data:`CORE_MODES`, or None.
        max_batch_size: a positive int, a validated ``{core_mode|default: int}`` dict, or None.
        prefix_cache: the ``prefix_cache_*`` keys as given (validated, not converted).
        extra: accepted keys this module does not interpret (submodule-prefixed keys,
            ``mxq_path``, ``num_expert_workers``, ``npu_prefill_chunk_size``), verbatim.
    """

    dev_no: tuple[int, ...] | None = None
    target_cores: tuple[str, ...] | None = None
    target_clusters: tuple[str, ...] | None = None
    core_mode: str | None = None
    max_batch_size: int | dict[str, int] | None = None
    prefix_cache: Mapping[str, object] = field(default_factory=_empty_mapping)
    extra: Mapping[str, object] = field(default_factory=_empty_mapping)


def _accepted_keys_text() -> str:
    keys = sorted(LAYOUT_KEYS + PREFIX_CACHE_KEYS + PASSTHROUGH_KEYS)
    prefixes = ", ".join(p + "*" for p in SUBMODULE_PREFIXES)
    return f"accepted keys: {', '.join(keys)}, and keys prefixed {prefixes}"


def _device_number(value: object, *, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MbltConfigError(f"{name}={value!r} must be an int >= 0 (a device number)")
    if value < 0:
        raise MbltConfigError(f"{name}={value!r} must be an int >= 0 (a device number)")
    return value


def parse_dev_no(raw: object, *, source: str = "") -> tuple[int, ...]:
    """``dev_no`` (an int >= 0, or a non-empty list of distinct ints >= 0) as a tuple.

    Args:
        source: where the value came from (``<dir>/config.json``), named in the error.

    Raises:
        MbltConfigError: anything else (``true``, ``"1"``, ``[]``, a repeated device), naming
            the value (and ``source``).
    """
    try:
        return _parse_dev_no(raw)
    except MbltConfigError as exc:
        if not source:
            raise
        raise MbltConfigError(f"{source}: {exc}") from None


def _parse_dev_no(raw: object) -> tuple[int, ...]:
    if isinstance(raw, (list, tuple)):
        if not raw:
            raise MbltConfigError("dev_no=[] must name at least one device")
        devs = tuple(_device_number(d, name="dev_no entry") for d in raw)
        if len(set(devs)) != len(devs):
            raise MbltConfigError(f"dev_no={list(raw)!r} names a device more than once")
        return devs
    if isinstance(raw, int) and not isinstance(raw, bool):
        return (_device_number(raw, name="dev_no"),)
    raise MbltConfigError(
        f"dev_no={raw!r} must be an int >= 0 or a non-empty list of distinct ints >= 0"
    )


def _parse_index(text: str, *, key: str, entry: object, what: str, limit: int | None) -> int:
    if not (text.isascii() and text.isdecimal()):
        raise MbltConfigError(
            f"{key} entry {entry!r}: {what} {text!r} is not a non-negative integer"
        )
    value = int(text)
    if limit is not None and value >= limit:
        raise MbltConfigError(f"{key} entry {entry!r}: {what} {value} must be in 0..{limit - 1}")
    return value


def _parse_target_cores(raw: object, default_dev: int) -> tuple[str, ...]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise MbltConfigError(f"target_cores={raw!r} must be a non-empty list of 'd:c:k' strings")
    out: list[str] = []
    for entry in raw:
        if not isinstance(entry, str):
            raise MbltConfigError(f"target_cores entry {entry!r} must be a 'd:c:k' string")
        parts = entry.split(":")
        if len(parts) == 2:
            parts = [str(default_dev), *parts]
        if len(parts) != 3:
            raise MbltConfigError(
                f"target_cores entry {entry!r} must be 'd:c:k' (device:cluster:core) "
                "or legacy 'c:k'"
            )
        dev = _parse_index(parts[0], key="target_cores", entry=entry, what="device", limit=None)
        cluster = _parse_index(parts[1], key="target_cores", entry=entry, what="cluster",
                               limit=_CLUSTERS_PER_DEVICE)
        core = _parse_index(parts[2], key="target_cores", entry=entry, what="core",
                            limit=_CORES_PER_CLUSTER)
        out.append(f"{dev}:{cluster}:{core}")
    _check_distinct("target_cores", raw, out)
    return tuple(out)


def _parse_target_clusters(raw: object, default_dev: int) -> tuple[str, ...]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise MbltConfigError(
            f"target_clusters={raw!r} must be a non-empty list of 'd:c' strings or legacy ints"
        )
    out: list[str] = []
    for entry in raw:
        if isinstance(entry, int) and not isinstance(entry, bool):
            parts = [str(default_dev), str(entry)]
        elif isinstance(entry, str):
            parts = entry.split(":")
            if len(parts) != 2:
                raise MbltConfigError(
                    f"target_clusters entry {entry!r} must be 'd:c' (device:cluster) "
                    "or a legacy int"
                )
        else:
            raise MbltConfigError(
                f"target_clusters entry {entry!r} must be a 'd:c' string or a legacy int cluster"
            )
        dev = _parse_index(parts[0], key="target_clusters", entry=entry, what="device", limit=None)
        cluster = _parse_index(parts[1], key="target_clusters", entry=entry, what="cluster",
                               limit=_CLUSTERS_PER_DEVICE)
        out.append(f"{dev}:{cluster}")
    _check_distinct("target_clusters", raw, out)
    return tuple(out)


def _check_distinct(key: str, raw: object, canonical: list[str]) -> None:
    if len(set(canonical)) != len(canonical):
        raise MbltConfigError(f"{key}={list(raw)!r} names a target more than once (as {canonical})")


def _target_devices(targets: tuple[str, ...]) -> set[int]:
    return {int(t.split(":")[0]) for t in targets}


def parse_loader_extra_config(raw: Mapping[str, object] | str | None) -> LayoutOverrides:
    """Validate ``--model-loader-extra-config`` and return its layout overrides.

    Args:
        raw: a JSON object as a mapping or a JSON string; None means no overrides.

    Accepted keys: ``dev_no`` (int >= 0, or non-empty list of distinct ints >= 0);
    ``target_cores`` (``"d:c:k"``, or legacy ``"c:k"`` on the first ``dev_no`` or device 0;
    cluster 0-1, core 0-3); ``target_clusters`` (``"d:c"``, or a legacy int cluster on the
    first ``dev_no`` or device 0); ``core_mode`` (:data:`CORE_MODES`); ``max_batch_size``
    (positive int, digit string, or core-mode dict); the ``prefix_cache_*`` keys; and the
    pass-through keys (:data:`PASSTHROUGH_KEYS`, keys with a :data:`SUBMODULE_PREFIXES` prefix).

    Cross-key rules: not both ``target_cores`` and ``target_clusters``; ``target_cores`` only
    with ``core_mode`` single, auto or unset (single mode places on cores, the others on
    clusters); ``target_clusters`` not with ``single``; with ``dev_no`` given, the devices the
    targets name must be exactly the ``dev_no`` set; ``global8`` with ``target_clusters`` needs
    both clusters of every named device.

    Raises:
        MbltConfigError: invalid JSON, a non-object, an unknown key (the message lists the
            accepted ones), or any rule above broken; the message names key, value and rule.
    """
    if raw is None:
        return LayoutOverrides()
    if isinstance(raw, str):
        raw = parse_json(raw, name="model_loader_extra_config", error=MbltConfigError)
    if not isinstance(raw, Mapping):
        raise MbltConfigError(
            f"model loader extra config must be a JSON object, got {type(raw).__name__}: {raw!r}"
        )

    prefix_cache: dict[str, object] = {}
    extra: dict[str, object] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise MbltConfigError(f"model loader extra config key {key!r} is not a string")
        if key in LAYOUT_KEYS:
            continue
        if key in PREFIX_CACHE_KEYS:
            PREFIX_CACHE_PARSERS[key](value, key)
            prefix_cache[key] = value
        elif key in PASSTHROUGH_KEYS or key.startswith(SUBMODULE_PREFIXES):
            extra[key] = value
        else:
            raise MbltConfigError(
                f"unknown model loader extra config key {key!r} (value {value!r}); "
                + _accepted_keys_text()
            )

    dev_no = _parse_dev_no(raw["dev_no"]) if "dev_no" in raw else None
    default_dev = dev_no[0] if dev_no else 0
    core_mode = _check_core_mode(raw.get("core_mode"), name="core_mode")
    if "target_cores" in raw and "target_clusters" in raw:
        raise MbltConfigError(
            f"target_cores={raw['target_cores']!r} and target_clusters="
            f"{raw['target_clusters']!r}: give one or the other, not both"
        )
    target_cores = (_parse_target_cores(raw["target_cores"], default_dev)
                    if "target_cores" in raw else None)
    target_clusters = (_parse_target_clusters(raw["target_clusters"], default_dev)
                       if "target_clusters" in raw else None)

    if target_cores is not None and core_mode not in (None, "single", "auto"):
        raise MbltConfigError(
            f"target_cores={list(target_cores)!r} with core_mode={core_mode!r}: core placement "
            "is for core_mode 'single' (or 'auto'); use target_clusters for cluster modes"
        )
    if target_clusters is not None and core_mode == "single":
        raise MbltConfigError(
            f"target_clusters={list(target_clusters)!r} with core_mode='single': single mode "
            "places on cores; use target_cores"
        )
    targets = target_cores or target_clusters
    if targets is not None and dev_no is not None:
        devices = _target_devices(targets)
        if devices != set(dev_no):
            raise MbltConfigError(
                f"target device set {sorted(devices)} does not match dev_no {sorted(dev_no)}"
            )
    if core_mode == "global8" and target_clusters is not None:
        by_dev: dict[int, list[int]] = {}
        for t in target_clusters:
            d, c = (int(x) for x in t.split(":"))
            by_dev.setdefault(d, []).append(c)
        for d in sorted(by_dev):
            if len(set(by_dev[d])) != _CLUSTERS_PER_DEVICE:
                raise MbltConfigError(
                    f"core_mode='global8' requires both clusters for device {d}; "
                    f"got clusters {sorted(by_dev[d])}"
                )

    max_batch_size = (_positive_int_spec(raw["max_batch_size"], name="max_batch_size")
                      if "max_batch_size" in raw else None)
    return LayoutOverrides(
        dev_no=dev_no,
        target_cores=target_cores,
        target_clusters=target_clusters,
        core_mode=core_mode,
        max_batch_size=max_batch_size,
        prefix_cache=MappingProxyType(prefix_cache),
        extra=MappingProxyType(extra),
    )


# --------------------------------------------------------------------------------------------
# Model-config resolution


def mxq_path_of(model_dir: str, artifact: Mapping[str, object], overrides: LayoutOverrides) -> str | None:
    """The MXQ file the worker loads: ``mxq_path`` of ``--model-loader-extra-config``, else of
    the artifact's ``config.json``, joined to ``model_dir``; None when neither names one. For a
    Qwen3-ASR release, its text decoder's (:class:`vllm_npu.mblt.asr.AsrRelease`); for a VLM
    release, its text MXQ's (:func:`vlm_role_view`).

    Raises:
        MbltConfigError: ``mxq_path`` given for a Qwen3-ASR or VLM release (they have two MXQs).
    """
    from vllm_npu.mblt.asr import AsrRelease, is_asr_release
    from vllm_npu.mblt.vlm import is_vlm_release

    if is_vlm_release(artifact):
        refuse_vlm_mxq_path(overrides)
        rel_text = vlm_role_view(artifact, overrides, "text")[0].get("mxq_path")
        return str(Path(model_dir) / str(rel_text)) if rel_text else None
    if is_asr_release(artifact):
        from vllm_npu.mblt.errors import MbltBackendError

        if overrides.extra.get("mxq_path"):
            raise MbltConfigError(
                f"mxq_path={overrides.extra['mxq_path']!r}: a Qwen3-ASR release has two MXQs; a single "
                "top-level mxq_path is only meaningful for single-module text models, use "
                "encoder_mxq_path and/or decoder_mxq_path")
        try:
            return AsrRelease.resolve(model_dir, artifact, overrides.extra, 0).decoder_mxq
        except MbltBackendError:
            return None
    rel = overrides.extra.get("mxq_path") or artifact.get("mxq_path")
    return str(Path(model_dir) / str(rel)) if rel else None


def resolve_core_mode(overrides: LayoutOverrides, hf_config: Mapping[str, object]) -> str | None:
    """The core mode: the loader extra config's ``core_mode``, else ``config.json``'s, else None.

    Raises:
        MbltConfigError: ``config.json`` ``core_mode`` is not one of :data:`CORE_MODES`.
    """
    if overrides.core_mode is not None:
        return overrides.core_mode
    return _check_core_mode(hf_config.get("core_mode"), name="config.json core_mode")


def resolve_max_batch_size(
    overrides: LayoutOverrides, hf_config: Mapping[str, object]
) -> int | None:
    """The model's batch capacity (sequences): the first value that resolves among the loader
    extra config ``max_batch_size``, then ``config.json`` ``max_batch_size``, then
    ``npu_max_batch_size``, each through :func:`resolve_positive_int` with the resolved core
    mode. None when none resolves (callers treat that as 1).

    Raises:
        MbltConfigError: a value breaks :func:`resolve_positive_int`'s rules, or the core mode
            is invalid.
    """
    core_mode = resolve_core_mode(overrides, hf_config)
    candidates = (
        ("max_batch_size", overrides.max_batch_size),
        ("config.json max_batch_size", hf_config.get("max_batch_size")),
        ("config.json npu_max_batch_size", hf_config.get("npu_max_batch_size")),
    )
    for name, raw in candidates:
        value = resolve_positive_int(raw, name=name, core_mode=core_mode)
        if value is not None:
            return value
    return None


def resolve_prefill_chunk(
    hf_config: Mapping[str, object], core_mode: str | None, max_batch_size: int | None
) -> tuple[int, list[str]]:
    """The chunked-prefill size (tokens per prefill chunk) for one sequence.

    ``config.json`` ``npu_prefill_chunk_size`` through :func:`resolve_positive_int`;
    :data:`DEFAULT_PREFILL_CHUNK` when absent or unresolved; clamped to
    :data:`BATCH_MODEL_MAX_PREFILL_CHUNK` when ``max_batch_size > 1``.

    Returns:
        ``(chunk, warnings)``: the warning lines logged while resolving (the clamp), so the
        caller can report them.

    Raises:
        MbltConfigError: ``npu_prefill_chunk_size`` or ``core_mode`` is invalid.
    """
    warnings: list[str] = []
    chunk = resolve_positive_int(
        hf_config.get("npu_prefill_chunk_size"), name="npu_prefill_chunk_size", core_mode=core_mode
    )
    if chunk is None:
        chunk = DEFAULT_PREFILL_CHUNK
    if max_batch_size is not None and max_batch_size > 1 and chunk > BATCH_MODEL_MAX_PREFILL_CHUNK:
        fmt = "Clamping model-configured chunked prefill size from %d to %d for batch execution."
        args = (chunk, BATCH_MODEL_MAX_PREFILL_CHUNK)
        logger.warning(fmt, *args)
        warnings.append(fmt % args)
        chunk = BATCH_MODEL_MAX_PREFILL_CHUNK
    return chunk, warnings


@dataclass(frozen=True)
class SchedulerPlan:
    """The scheduler settings the platform writes into vLLM's config.

    Attributes:
        max_num_seqs: sequences per step (<= ``max_batch_size``).
        max_num_batched_tokens: tokens per step.
        long_prefill_token_threshold: tokens per prefill chunk of one sequence.
        block_size: KV block size (tokens).
        enable_prefix_caching: whether vLLM prefix caching is on.
        max_batch_size: the model's batch capacity (sequences; 1 for a non-batch MXQ).
        core_mode: the resolved core mode, or None.
        prefill_chunk: the effective chunked-prefill size (tokens).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    block_size: int
    enable_prefix_caching: bool
    max_batch_size: int
    core_mode: str | None
    prefill_chunk: int


def _user_positive(value: object, flag: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MbltConfigError(f"{flag}={value!r} must be a positive int")
    return value


def plan_scheduler(
    hf_config: Mapping[str, object],
    overrides: LayoutOverrides,
    *,
    user_max_num_seqs: int | None,
    user_max_num_batched_tokens: int | None,
    user_block_size: int | None,
    user_enable_prefix_caching: bool | None,
) -> SchedulerPlan:
    """Plan vLLM's scheduler settings for an mblt model.

    ``user_*`` are the user's CLI values (None when not given). Rules:

    * block size: the user's, else :data:`DEFAULT_BLOCK_SIZE`; prefix caching: the user's,
      else True.
    * ``max_batch_size`` from :func:`resolve_max_batch_size`, 1 when unresolved.
    * ``max_num_seqs``: unresolved ``max_batch_size`` keeps the user's value (1 when
      unset): the requests then share one cache slot; else ``max_batch_size`` when unset; a larger user value is clamped to it
      (warning); a smaller one is kept.
    * chunk from :func:`resolve_prefill_chunk` (at most 128 for batch models).
    * ``max_num_seqs > 1``: ``max_num_batched_tokens = chunk * max_num_seqs``, replacing a user
      ``--max-num-batched-tokens`` (with a warning naming both), as the reference's rule 8 and
      vllm-mblt do. ``max_num_seqs == 1``: a user ``--max-num-batched-tokens`` lowers the chunk
      to ``min(user, chunk)``, and ``max_num_batched_tokens`` is that chunk.
    * long-prefill threshold: the chunk.

    Raises:
        MbltConfigError: a ``user_*`` value is not a positive int (or bool for prefix
            caching), or the model config / overrides break a resolution rule.
    """
    user_max_num_seqs = _user_positive(user_max_num_seqs, "max_num_seqs")
    user_max_num_batched_tokens = _user_positive(user_max_num_batched_tokens,
                                                 "max_num_batched_tokens")
    user_block_size = _user_positive(user_block_size, "block_size")
    if user_enable_prefix_caching is not None and not isinstance(user_enable_prefix_caching, bool):
        raise MbltConfigError(
            f"enable_prefix_caching={user_enable_prefix_caching!r} must be a bool or None"
        )

    block_size = DEFAULT_BLOCK_SIZE if user_block_size is None else user_block_size
    enable_prefix_caching = (True if user_enable_prefix_caching is None
                             else user_enable_prefix_caching)
    core_mode = resolve_core_mode(overrides, hf_config)
    resolved_batch = resolve_max_batch_size(overrides, hf_config)
    max_batch_size = 1 if resolved_batch is None else resolved_batch
    logger.info("MBLT block_size=%d, enable_prefix_caching=%s, core_mode=%s, max_batch_size=%d.",
                block_size, enable_prefix_caching, core_mode, max_batch_size)

    if resolved_batch is None:
        # No max_batch_size in the artifact (as Mobilint's Qwen3-ASR release): the scheduler
        # keeps its own cap and the requests share the batch-1 MXQ's one cache slot.
        max_num_seqs = 1 if user_max_num_seqs is None else user_max_num_seqs
        logger.info("The model config declares no max_batch_size: keeping scheduler "
                    "max_num_seqs %d; requests share one cache slot.", max_num_seqs)
    elif user_max_num_seqs is None:
        max_num_seqs = max_batch_size
        logger.info("Setting scheduler max_num_seqs to model-configured max batch size %d.",
                    max_num_seqs)
    elif user_max_num_seqs > max_batch_size:
        logger.warning(
            "Clamping scheduler max_num_seqs from %d to model-configured max batch size %d.",
            user_max_num_seqs, max_batch_size,
        )
        max_num_seqs = max_batch_size
    else:
        max_num_seqs = user_max_num_seqs
        logger.info("Keeping scheduler max_num_seqs %d (model-configured max batch size %d).",
                    max_num_seqs, max_batch_size)

    chunk, _ = resolve_prefill_chunk(hf_config, core_mode, max_batch_size)
    if user_max_num_batched_tokens is not None and max_num_seqs > 1:
        if user_max_num_batched_tokens != chunk * max_num_seqs:
            logger.warning(
                "Replacing --max-num-batched-tokens %d with chunked prefill size %d x max_num_seqs %d "
                "= %d: with several sequences per step every one may prefill a chunk (as vllm-mblt).",
                user_max_num_batched_tokens, chunk, max_num_seqs, chunk * max_num_seqs,
            )
    elif user_max_num_batched_tokens is not None and user_max_num_batched_tokens < chunk:
        logger.info("Using the user max_num_batched_tokens %d below the chunked prefill size %d.",
                    user_max_num_batched_tokens, chunk)
        chunk = user_max_num_batched_tokens

    # max_num_seqs > 1: every scheduled sequence may prefill a chunk per step. With
    # max_num_seqs == 1 the same formula gives one chunk per step. (vllm-mblt on vLLM 0.11.2
    # also set max_num_partial_prefills / max_long_partial_prefills; vLLM 0.32 has neither.)
    plan = SchedulerPlan(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk * max_num_seqs,
        long_prefill_token_threshold=chunk, block_size=block_size,
        enable_prefix_caching=enable_prefix_caching, max_batch_size=max_batch_size,
        core_mode=core_mode, prefill_chunk=chunk,
    )
    logger.info(
        "MBLT chunked prefill: chunk=%d tokens, max_num_batched_tokens=%d, "
        "long_prefill_token_threshold=%d.",
        plan.prefill_chunk, plan.max_num_batched_tokens, plan.long_prefill_token_threshold,
    )
    return plan


# --------------------------------------------------------------------------------------------
# VLM releases: vision_* / text_* layout keys (vllm-mblt's _normalize_model_kwargs_for_hf_config)

#: Unprefixed loader keys a VLM forwards to both roles (``setdefault``: a prefixed key wins).
VLM_SHARED_KEYS: tuple[str, ...] = (
    "dev_no", "max_batch_size", "core_mode", "target_cores", "target_clusters", "npu_prefill_chunk_size",
)
#: Per-role keys of a VLM release (``vision_<key>`` / ``text_<key>``, or ``<role>_config.<key>``).
VLM_ROLE_KEYS: tuple[str, ...] = ("mxq_path", "target_device", *VLM_SHARED_KEYS)
VLM_MXQ_PATH_REFUSAL = (
    "mxq_path={value!r}: a vision-language release has two MXQs; a single top-level mxq_path is only meaningful "
    "for single-module text models, use vision_mxq_path and/or text_mxq_path")


def refuse_vlm_mxq_path(overrides: LayoutOverrides) -> None:
    """An unprefixed ``mxq_path`` in the loader extra config of a VLM release.

    Raises:
        MbltConfigError: naming ``vision_mxq_path`` / ``text_mxq_path``.
    """
    if overrides.extra.get("mxq_path"):
        raise MbltConfigError(VLM_MXQ_PATH_REFUSAL.format(value=overrides.extra["mxq_path"]))


def vlm_role_view(artifact: Mapping[str, object], overrides: LayoutOverrides,
                  role: str) -> tuple[dict[str, object], LayoutOverrides]:
    """One role's (``"vision"`` / ``"text"``) layout as a single-MXQ model's: ``(config view,
    loader view)`` that :func:`resolve_core_mode`, :func:`resolve_max_batch_size`,
    :func:`resolve_prefill_chunk` and :func:`plan_scheduler` read as they read a text model's.

    Precedence per key (vllm-mblt's, fact sheet §4.7): the loader extra config's ``<role>_<key>``,
    then its unprefixed key (only :data:`VLM_SHARED_KEYS`; never ``mxq_path``), then
    ``config.json``'s top-level ``<role>_<key>``, then ``<role>_config.<key>``. The loader values
    go to the loader view (validated as the loader extra config is), the config values to the config
    view's top level (``mxq_path`` included, relative to the model directory).

    Raises:
        MbltConfigError: a loader value breaking :func:`parse_loader_extra_config`'s rules; the
            message names the role.
    """
    if role not in ("vision", "text"):
        raise ValueError(f"role must be 'vision' or 'text', got {role!r}")
    sub = artifact.get(f"{role}_config")
    sub = sub if isinstance(sub, Mapping) else {}
    unprefixed = {"dev_no": list(overrides.dev_no) if overrides.dev_no is not None else None,
                  "max_batch_size": overrides.max_batch_size, "core_mode": overrides.core_mode,
                  "target_cores": list(overrides.target_cores) if overrides.target_cores else None,
                  "target_clusters": list(overrides.target_clusters) if overrides.target_clusters else None,
                  "npu_prefill_chunk_size": overrides.extra.get("npu_prefill_chunk_size")}
    loader: dict[str, object] = {}
    for key in VLM_ROLE_KEYS:
        value = overrides.extra.get(f"{role}_{key}")
        if value is None and key in VLM_SHARED_KEYS:
            value = unprefixed.get(key)
        if value is not None:
            loader[key] = value
    if "target_cores" in loader and "target_clusters" in loader:  # a prefixed kind beats a shared other kind
        drop = "target_clusters" if overrides.extra.get(f"{role}_target_cores") is not None else "target_cores"
        loader.pop(drop)
    layout_keys = {k: v for k, v in loader.items() if k in LAYOUT_KEYS}
    try:
        parsed = parse_loader_extra_config(layout_keys)
    except MbltConfigError as exc:
        raise MbltConfigError(f"the {role} MXQ's layout ({role}_* keys and the shared keys): {exc}") from None
    extra = {k: v for k, v in overrides.extra.items() if k != "mxq_path" and not k.startswith(("vision_", "text_"))}
    for key in ("mxq_path", "npu_prefill_chunk_size", "target_device"):
        if key in loader:
            extra[key] = loader[key]
    loader_view = LayoutOverrides(dev_no=parsed.dev_no, target_cores=parsed.target_cores,
                                  target_clusters=parsed.target_clusters, core_mode=parsed.core_mode,
                                  max_batch_size=parsed.max_batch_size, prefix_cache=overrides.prefix_cache,
                                  extra=MappingProxyType(extra))
    config_view = {k: v for k, v in artifact.items() if k not in VLM_ROLE_KEYS}
    for key in VLM_ROLE_KEYS:
        value = artifact.get(f"{role}_{key}")
        if value is None:
            value = sub.get(key)
        if value is not None:
            config_view[key] = value
    if loader.get("npu_prefill_chunk_size") is not None:  # read from the config view by resolve_prefill_chunk
        config_view["npu_prefill_chunk_size"] = loader["npu_prefill_chunk_size"]
    for key in ("mxq_path", "target_device"):  # loader wins; read from the config view
        if loader.get(key) is not None:
            config_view[key] = loader[key]
    return config_view, loader_view
