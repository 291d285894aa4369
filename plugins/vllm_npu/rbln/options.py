"""The ``--rbln-*`` options: config classes, CLI flags, resolution and the compile-cache key.

Each model path has a config class, and ``vllm_config.additional_config`` carries it:

* :class:`RBLNConfigBase` -- fields both paths read.
* :class:`RBLNConfig` -- the ``vllm`` path (torch.compile of vLLM's own model code).
* :class:`OptimumRBLNConfig` -- the ``optimum`` (``transformers``) path (optimum-rbln graphs).

Every field carries its documentation and deprecated environment variable(s) as dataclass
``metadata``. A field is set, highest precedence first, by ``additional_config`` (which the
``--rbln-<field-with-dashes>`` flags write: ``--rbln-use-w8a8`` is
``additional_config={"use_w8a8": true}``), by its deprecated ``VLLM_RBLN_*`` variable, or by
its default (:func:`resolve`). ``no_flag`` fields are reachable through ``additional_config``
only; ``derived`` fields are filled in by the plugin (the optimum sync) and get no flag either.

:func:`cache_key` names the optimum path's compile-cache directory. Unlike vllm-rbln 0.12.0 (a
FIXME there), the key includes the rebel-compiler and optimum-rbln versions.

This module imports only the standard library (no vLLM, torch or ``rebel``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import logging
import os
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, NoneType, UnionType
from typing import Any, ClassVar

from vllm_npu.settings import (RBLN_ENV_WORDS, SWITCH_WORDS, SettingError, SwitchWords, parse_int, parse_json,
                               parse_switch)

logger = logging.getLogger("vllm.vllm_npu.rbln")

#: Title of the argparse group holding every ``--rbln-*`` flag.
GROUP_TITLE = "RBLNConfig"
#: Prefix of every RBLN flag; a field's ``additional_config`` key is the flag without it.
FLAG_PREFIX = "--rbln-"
#: Release in which the deprecated variables and keys go away (quoted in the warnings).
REMOVAL_RELEASE = "0.14.0"
#: Old ``additional_config`` keys still accepted, and the field each one now names.
RENAMED_KEYS: Mapping[str, str] = MappingProxyType({
    "rbln_config": "optimum_overrides",
    "prefix_block_size": "sub_block_size",
})
#: ``optimum_overrides`` keys that only affect the runtime, never the compiled graph: left out
#: of :func:`cache_key` at every nesting level.
RUNTIME_ONLY_KEYS: frozenset[str] = frozenset({"create_runtimes", "device", "kvcache_num_blocks"})
#: ``decode_batch_bucket_strategy`` values (``exp`` is accepted from the environment only).
BUCKET_STRATEGIES: tuple[str, ...] = ("exponential", "linear", "manual")
#: ``compile_dtype`` values; ``""`` leaves the dtype to the model config.
COMPILE_DTYPES: tuple[str, ...] = ("", "float16", "bfloat16")

_DEFAULT_ENV = object()


class RBLNConfigError(ValueError):
    """An ``additional_config``, flag or environment value the RBLN config classes refuse.

    A ValueError, as the vendor raises; the message names the field (or key, or variable).
    """


def option(default: Any = dataclasses.MISSING, doc: str = "", *,
           default_factory: Any = dataclasses.MISSING,
           env: Any = _DEFAULT_ENV, no_flag: bool = False, derived: bool = False,
           hashed: bool = True, choices: Sequence[Any] | None = None,
           min_value: int | None = None) -> Any:
    """A config-class field with its metadata.

    Args:
        default, default_factory: as :func:`dataclasses.field`.
        doc: one-paragraph description; the flag's ``--help`` text.
        env: deprecated environment variable name(s) read by :func:`resolve`, first set wins;
            default ``VLLM_RBLN_<FIELD>``; None for none.
        no_flag: set through ``additional_config`` only (no ``--rbln-*`` flag).
        derived: filled in by the plugin; no flag, not in :meth:`RBLNConfigBase.compute_hash`.
        hashed: False leaves the field out of :meth:`RBLNConfigBase.compute_hash` (it does not
            change any compiled graph).
        choices: the allowed values.
        min_value: the smallest allowed integer (for int fields and list-of-int items).
    """
    return field(default=default, default_factory=default_factory, metadata=MappingProxyType({
        "doc": doc, "env": env, "no_flag": no_flag or derived, "derived": derived,
        "hashed": hashed and not derived, "choices": tuple(choices) if choices else None,
        "min_value": min_value,
    }))


# --------------------------------------------------------------------------------------------
# Value coercion (additional_config arrives as JSON; direct construction too)


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) if not typing.get_args(hint) else str(hint)


def _as_bool(value: Any, words: SwitchWords = SWITCH_WORDS) -> bool:
    """A switch (:func:`vllm_npu.settings.parse_switch`); raises ValueError naming ``words``."""
    try:
        return parse_switch(value, name="value", words=words)
    except SettingError:
        raise ValueError(f"expected a switch: {words.describe()}") from None


def _as_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer, not a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return parse_int(value, name="value")
        except SettingError:
            raise ValueError("expected an integer (an int or a decimal digit string)") from None
    if isinstance(value, float) and value.is_integer():
        return int(value)  # a JSON number such as 8.0 (additional_config)
    raise ValueError("expected an integer")


def _as_int_list(value: Any) -> list[int]:
    if isinstance(value, str):
        return [_as_int(v) for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        return [_as_int(v) for v in value]
    raise ValueError("expected a list of integers (or a comma-separated string)")


def _as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = parse_json(value, name="value")
    if isinstance(value, Mapping):
        return dict(value)
    raise ValueError("expected a JSON object")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The evaluated field type hints of config class ``cls``."""
    return typing.get_type_hints(cls)


def _coerce(value: Any, hint: Any, words: SwitchWords = SWITCH_WORDS) -> Any:
    """``value`` converted to type hint ``hint`` (a switch read with ``words``); raises
    ValueError (or TypeError) if it cannot be. Handles exactly the hints the config classes use."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (UnionType, typing.Union):
        if value is None and NoneType in args:
            return None
        (inner,) = [a for a in args if a is not NoneType]
        return _coerce(value, inner, words)
    origin = typing.get_origin(hint) or hint
    if origin is bool:
        return _as_bool(value, words)
    if origin is int:
        return _as_int(value)
    if origin is str:
        if not isinstance(value, str):
            raise ValueError("expected a string")
        return value
    if origin is list:
        return _as_int_list(value)
    if origin is dict:
        return _as_dict(value)
    raise TypeError(f"unsupported field type {hint!r}")  # pragma: no cover - a class bug


# --------------------------------------------------------------------------------------------
# The config classes


@dataclass(frozen=True)
class RBLNConfigBase:
    """``--rbln-*`` options both model paths read."""

    #: The model path this class configures (``"vllm"`` or ``"optimum"``); None on the base.
    MODEL_PATH: ClassVar[str | None] = None

    num_devices_per_local_rank: int = option(
        1, "Number of NPU devices assigned to each local rank. On the optimum path this is the "
           "RSD width the model is compiled for.",
        env=("VLLM_RBLN_NUM_DEVICES_PER_LOCAL_RANK", "VLLM_RBLN_TP_SIZE"), min_value=1)
    use_custom_sampler: bool = option(
        True, "Sample with the RBLN sampler instead of vLLM's.", env="VLLM_RBLN_SAMPLER",
        hashed=False)
    sub_block_size: int | None = option(
        None, "Prefix-cache hit granularity in tokens (> 0). Unset uses the prefill chunk size.",
        min_value=1, hashed=False)

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            raw = getattr(self, f.name)
            try:
                value = _coerce(raw, hints[f.name])
            except (ValueError, TypeError) as exc:
                raise RBLNConfigError(
                    f"{type(self).__name__}.{f.name} must be {_type_name(hints[f.name])}, "
                    f"got {raw!r}: {exc}") from None
            _check_value(type(self), f, value)
            object.__setattr__(self, f.name, value)

    def compute_hash(self) -> str:
        """A hex digest of the fields that change a compiled graph (vLLM's ``SupportsHash``,
        folded into ``VllmConfig.compute_hash()``). Leaves out ``hashed=False`` and derived
        fields; the class name is included, so the two paths never share a hash."""
        factors = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if f.metadata["hashed"]}
        factors = self._hash_factors(factors)
        text = json.dumps([type(self).__name__, factors], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def _hash_factors(self, factors: dict[str, Any]) -> dict[str, Any]:
        return factors


def _check_value(cls: type, f: dataclasses.Field, value: Any) -> None:
    """Range and choice checks of one coerced field value; raises RBLNConfigError."""
    choices, low = f.metadata["choices"], f.metadata["min_value"]
    where = f"{cls.__name__}.{f.name}"
    if choices is not None and value not in choices:
        raise RBLNConfigError(f"{where} must be one of {list(choices)}, got {value!r}")
    if low is None or value is None:
        return
    for item in value if isinstance(value, list) else (value,):
        if isinstance(item, int) and item < low:
            raise RBLNConfigError(f"{where} must be >= {low}, got {value}")


@dataclass(frozen=True)
class RBLNConfig(RBLNConfigBase):
    """``--rbln-*`` options of the ``vllm`` model path (``--model-impl vllm``)."""

    MODEL_PATH: ClassVar[str | None] = "vllm"

    enforce_model_fp32: bool = option(
        False, "Run the model in float32 whatever dtype the model config names.")
    use_batch_attn_opt: bool = option(
        False, "Use the batched decode-attention kernel.", env="VLLM_RBLN_BATCH_ATTN_OPT")
    use_custom_kernel: bool = option(
        False, "Use RBLN custom kernels where the model has them.", env="RBLN_USE_CUSTOM_KERNEL")
    use_dynamic_kv_cache: bool | None = option(
        None, "Compile the KV cache with dynamic shapes (unset: the RBLN default, which is the "
              "dynamic graph; --no-rbln-use-dynamic-kv-cache compiles a static one).")
    enable_sub_block_cache: bool = option(
        True, "Cache prefixes at sub_block_size granularity.", env="VLLM_RBLN_SUB_BLOCK_CACHE",
        hashed=False)
    specialize_moe_decode: bool = option(
        True, "Compile a decode-specialised MoE graph.")
    use_moe_tokens_mask: bool = option(
        True, "Mask padded tokens out of MoE expert routing.")
    use_all2all_dispatch: bool = option(
        False, "Dispatch MoE tokens to experts with all-to-all.", env="VLLM_RBLN_DISPATCH_ALL2ALL")
    use_all2all_combine: bool = option(
        False, "Combine MoE expert outputs with all-to-all.", env="VLLM_RBLN_COMBINE_ALL2ALL")
    decode_batch_bucket_strategy: str = option(
        "exponential", "How decode batch buckets are chosen: exponential, linear or manual.",
        choices=BUCKET_STRATEGIES)
    decode_batch_bucket_min: int = option(
        1, "Smallest decode batch bucket.", min_value=1)
    decode_batch_bucket_step: int = option(
        2, "Divisor (exponential) or decrement (linear) between decode batch buckets.",
        min_value=1)
    decode_batch_bucket_limit: int = option(
        1, "Largest number of decode batch buckets.", min_value=1)
    decode_batch_bucket_manual_buckets: list[int] = option(
        doc="Decode batch buckets for the manual strategy: positive and unique (the variable "
            "takes them comma-separated).", default_factory=list, min_value=1)
    use_w8a8: bool = option(
        False, "Run W8A8 quantized weights with fp8 activations (only on NPUs whose kernels "
               "take an fp8 activation; W8A16 runs everywhere).")
    compile_dtype: str = option(
        "", "dtype the graphs are compiled in: float16, bfloat16, or empty for the model "
            "config's dtype.", env=None, choices=COMPILE_DTYPES)

    def __post_init__(self) -> None:
        super().__post_init__()
        buckets = self.decode_batch_bucket_manual_buckets
        if len(set(buckets)) != len(buckets):
            raise RBLNConfigError(
                f"decode_batch_bucket_manual_buckets must be unique, got {buckets}")
        if self.decode_batch_bucket_strategy == "manual" and not buckets:
            raise RBLNConfigError(
                "decode_batch_bucket_strategy='manual' needs at least one entry in "
                "decode_batch_bucket_manual_buckets")

    def _hash_factors(self, factors: dict[str, Any]) -> dict[str, Any]:
        # Unset and True compile the same (dynamic) graph.
        if factors.get("use_dynamic_kv_cache") is None:
            factors["use_dynamic_kv_cache"] = True
        return factors


@dataclass(frozen=True)
class OptimumRBLNConfig(RBLNConfigBase):
    """``--rbln-*`` options of the ``optimum`` model path (``--model-impl transformers``)."""

    MODEL_PATH: ClassVar[str | None] = "optimum"

    optimum_overrides: dict[str, Any] = option(
        doc="Entries for optimum-rbln's own model config (a JSON object), laid over what the "
            "plugin derives from the vLLM config; they may not change a derived value. With a "
            "pre-compiled model only the `device` entries apply.",
        default_factory=dict, env=None)
    user_max_num_batched_tokens: int | None = option(
        None, "The user's own --max-num-batched-tokens, saved before vLLM defaults it.",
        env=None, no_flag=True)
    num_blocks_override: int | None = option(
        None, "KV block count to use instead of the compiled one.", env=None, no_flag=True,
        min_value=1)
    attn_block_size: int | None = option(
        None, "Attention (KV partition) block size in tokens of the compiled model.",
        env=None, derived=True)
    image_prefill_chunk_size: int | None = option(
        None, "Prefill chunk size in tokens of the compiled image prefill graph.",
        env=None, derived=True)
    cached_model_path: str | None = option(
        None, "Compile-cache directory of this configuration (see cache_key).",
        env=None, derived=True)
    num_blocks_synced: int | None = option(
        None, "KV block count taken from the compiled model.", env=None, derived=True)


CONFIG_CLASSES: tuple[type[RBLNConfigBase], ...] = (RBLNConfig, OptimumRBLNConfig)


# --------------------------------------------------------------------------------------------
# Field metadata accessors


def fields_of(cls: type[RBLNConfigBase]) -> tuple[dataclasses.Field, ...]:
    """Every field of ``cls``, base-class fields first."""
    return dataclasses.fields(cls)


def flag_for(name: str) -> str:
    """The flag of field ``name``: ``--rbln-`` plus the name with dashes."""
    return FLAG_PREFIX + name.replace("_", "-")


def env_vars(f: dataclasses.Field) -> tuple[str, ...]:
    """The deprecated environment variables of field ``f``, in lookup order (may be empty)."""
    env = f.metadata["env"]
    if env is _DEFAULT_ENV:
        return (f"VLLM_RBLN_{f.name.upper()}",)
    if env is None:
        return ()
    return (env,) if isinstance(env, str) else tuple(env)


def flag_fields() -> Iterator[dataclasses.Field]:
    """Fields that get a ``--rbln-*`` flag (both classes, each name once, base first)."""
    seen: set[str] = set()
    for cls in CONFIG_CLASSES:
        for f in fields_of(cls):
            if f.name not in seen and not f.metadata["no_flag"]:
                seen.add(f.name)
                yield f


# --------------------------------------------------------------------------------------------
# CLI flags


def _write(namespace: argparse.Namespace, entries: Mapping[str, Any]) -> None:
    """Lay ``entries`` over ``namespace.additional_config`` without mutating the old dict
    (argparse shares the default object between parses)."""
    current = getattr(namespace, "additional_config", None)
    merged = dict(current) if isinstance(current, Mapping) else {}
    merged.update(entries)
    namespace.additional_config = merged


class _SetAdditionalConfig(argparse.Action):
    """``--rbln-<field> VALUE`` -> ``namespace.additional_config[<field>] = VALUE``."""

    def __init__(self, *args: Any, key: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key = key

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        if self.nargs == "+":  # list-of-int flags: each token may itself be "1,2"
            values = [v for chunk in values for v in chunk]
        _write(namespace, {self.key: values})


class _SetAdditionalConfigBool(argparse.BooleanOptionalAction):
    """``--rbln-<field>`` / ``--no-rbln-<field>`` -> ``additional_config[<field>] = bool``."""

    def __init__(self, *args: Any, key: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key = key

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        if option_string in self.option_strings:
            _write(namespace, {self.key: not option_string.startswith("--no-")})


class _MergeAdditionalConfig:
    """Mixin laid over the parser's own ``--additional-config`` action: a JSON object merges
    into the ``additional_config`` the ``--rbln-*`` flags wrote (later keys win) instead of
    replacing it."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        before = getattr(namespace, self.dest, None)
        super().__call__(parser, namespace, values, option_string)  # type: ignore[misc]
        after = getattr(namespace, self.dest, None)
        if isinstance(before, Mapping) and isinstance(after, Mapping):
            setattr(namespace, self.dest, {**before, **after})


def _flag_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _flag_optional_int(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none") else _flag_int(text)


def _flag_int_list(text: str) -> list[int]:
    return [_flag_int(v) for v in text.split(",") if v.strip()]


def _flag_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _help(f: dataclasses.Field) -> str:
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    text = f"{f.metadata['doc']} Default: {default!r}."
    envs = env_vars(f)
    if envs:
        text += f" Replaces the deprecated {' / '.join(envs)}."
    return text.replace("%", "%%")


def _flag_kwargs(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    args = [a for a in typing.get_args(hint) if a is not NoneType]
    base = args[0] if typing.get_origin(hint) in (UnionType, typing.Union) else hint
    origin = typing.get_origin(base) or base
    kwargs: dict[str, Any] = {"dest": f"rbln_{f.name}", "default": argparse.SUPPRESS,
                              "help": _help(f), "key": f.name}
    if origin is bool:
        return {**kwargs, "action": _SetAdditionalConfigBool}
    kwargs["action"] = _SetAdditionalConfig
    if origin is int:
        kwargs.update(type=_flag_optional_int if base is not hint else _flag_int, metavar="INT")
    elif origin is list:
        kwargs.update(type=_flag_int_list, nargs="+", metavar="INT")
    elif origin is dict:
        kwargs.update(type=_flag_json_object, metavar="JSON")
    else:
        choices = f.metadata["choices"]
        kwargs.update(type=str, metavar="{" + ",".join(c or "''" for c in choices) + "}"
                      if choices else "STR", choices=choices)
    return kwargs


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``RBLNConfig`` group of ``--rbln-*`` flags to ``parser`` and return it.

    One flag per field of both config classes except ``no_flag`` and ``derived`` ones; bools
    are ``--rbln-x`` / ``--no-rbln-x``. A flag writes ``namespace.additional_config[field]``
    (creating the dict when the namespace has none or None); nothing is written for a flag
    not given. If ``parser`` has ``--additional-config`` already (vLLM's
    ``EngineArgs.add_cli_args`` adds it), its action is made to merge a JSON object into that
    dict instead of replacing it, so flag and JSON order does not matter (a key given by both
    takes the later value). Calling this again on the same parser changes nothing.

    Args:
        parser: an ``argparse.ArgumentParser`` (vLLM's ``FlexibleArgumentParser`` is one).
    """
    group = next((g for g in parser._action_groups if g.title == GROUP_TITLE), None)
    if group is None:
        group = parser.add_argument_group(
            GROUP_TITLE, "RBLN NPU options (vllm_npu.rbln). Each writes the additional_config "
                         "key that is the flag without --rbln-; each applies to one model path.")
    hints_by_cls = {cls: _hints(cls) for cls in CONFIG_CLASSES}
    for f in flag_fields():
        flag = flag_for(f.name)
        if flag in parser._option_string_actions:
            continue
        hint = next(h[f.name] for h in hints_by_cls.values() if f.name in h)
        group.add_argument(flag, **_flag_kwargs(f, hint))
    action = parser._option_string_actions.get("--additional-config")
    if action is not None and not isinstance(action, _MergeAdditionalConfig):
        action.__class__ = type(f"Merging{type(action).__name__}",
                                (_MergeAdditionalConfig, type(action)), {})
    return parser


# --------------------------------------------------------------------------------------------
# Resolution: additional_config > deprecated environment variable > default


def _parse_env(f: dataclasses.Field, hint: Any, var: str, raw: str) -> Any:
    """The value of field ``f`` that variable ``var`` holds; raises RBLNConfigError."""
    text = raw.strip()
    try:
        if f.name == "decode_batch_bucket_strategy" and text.lower() == "exp":
            return "exponential"
        return _coerce(text, hint, RBLN_ENV_WORDS)  # vllm-rbln's envs.py reads only these alike
    except (ValueError, TypeError) as exc:
        raise RBLNConfigError(f"{var}={raw!r} is not a valid {f.name}: {exc}") from None


def _apply_renames(cls: type[RBLNConfigBase], given: dict[str, Any],
                   warnings: list[str]) -> None:
    names = {f.name for f in fields_of(cls)}
    for old, new in RENAMED_KEYS.items():
        if old not in given or new not in names:
            continue  # a rename into another class's field stays foreign, named as typed
        if new in given:
            raise RBLNConfigError(
                f"additional_config sets both {old!r} and {new!r}, its new name; keep {new!r}.")
        warnings.append(f"additional_config[{old!r}] is deprecated and will be removed in "
                        f"{REMOVAL_RELEASE}; use {new!r}.")
        given[new] = given.pop(old)


def resolve(cls: type[RBLNConfigBase], additional_config: Any,
            environ: Mapping[str, str] | None = None) -> tuple[RBLNConfigBase, list[str]]:
    """Build the ``cls`` the run uses from ``additional_config`` and the environment.

    Precedence per field: ``additional_config`` > deprecated environment variable > default.
    An instance of ``cls`` is returned as is (the environment is not applied to it).

    Args:
        cls: :class:`RBLNConfig` or :class:`OptimumRBLNConfig`.
        additional_config: vLLM's ``additional_config``: a mapping of field names (JSON values
            are coerced: ``"false"``, ``"8"``), an instance of ``cls``, or None (empty).
        environ: the environment to read (default ``os.environ``).

    Returns:
        The config and the warnings issued, in order (each is also logged on the
        ``vllm_npu.rbln`` logger): renamed keys, the one deprecation warning naming every
        variable in use, then one "Both the environment and additional_config set ..." per
        field set both ways. The changed fields are logged at INFO level
        (``RBLN config: {...}``), not returned.

    Raises:
        RBLNConfigError: another config class's instance, a value that is neither an instance
            nor a mapping, keys that are not fields of ``cls`` (sorted in the message), a
            renamed key given under both names, or a value a field refuses (including
            environment values).
    """
    env = os.environ if environ is None else environ
    warnings: list[str] = []
    known = {f.name for f in fields_of(cls)}
    if isinstance(additional_config, RBLNConfigBase):
        if not isinstance(additional_config, cls):
            raise RBLNConfigError(
                f"additional_config is an {type(additional_config).__name__}, and the "
                f"{cls.__name__} path is the one being resolved. A config class belongs to "
                "one model path.")
        given = {name: getattr(additional_config, name) for name in known}
    elif additional_config is None or isinstance(additional_config, Mapping):
        given = dict(additional_config or {})
        _apply_renames(cls, given, warnings)
        unknown = sorted((k for k in given if k not in known), key=str)
        if unknown:
            raise RBLNConfigError(
                f"additional_config takes only {cls.__name__} fields, and {unknown} are not "
                f"fields. The fields are {sorted(known)}.")
    else:
        raise RBLNConfigError(
            f"additional_config must be a {cls.__name__} or a mapping of its field names, got "
            f"{type(additional_config).__name__}")

    hints = _hints(cls)
    from_env: dict[str, Any] = {}
    in_use: list[str] = []
    both: list[str] = []
    for f in fields_of(cls):
        set_vars = [v for v in env_vars(f) if env.get(v, "").strip()]
        if not set_vars:
            continue
        in_use += [f"{v} -> {flag_for(f.name)}" for v in set_vars]
        if f.name in given:
            both.append(f"Both the environment and additional_config set {set_vars[0]}; "
                        f"{f.name} takes the additional_config value.")
        else:
            from_env[f.name] = _parse_env(f, hints[f.name], set_vars[0], env[set_vars[0]])
    if in_use:
        warnings.append(
            f"These environment variables are deprecated and will be removed in "
            f"{REMOVAL_RELEASE}. Use the flag instead, or the additional_config key it writes, "
            f"which is the flag without the --rbln- prefix: {', '.join(in_use)}")
    warnings += both
    for text in warnings:
        logger.warning("%s", text)

    if isinstance(additional_config, cls):
        config: RBLNConfigBase = additional_config
    else:
        config = cls(**{**from_env, **given})
    changed = changed_fields(config)
    if changed:
        logger.info("RBLN config: %s", changed)
    return config, warnings


def changed_fields(config: RBLNConfigBase) -> dict[str, Any]:
    """The fields of ``config`` that differ from their defaults, in field order."""
    defaults = type(config)()
    return {f.name: getattr(config, f.name) for f in fields_of(type(config))
            if getattr(config, f.name) != getattr(defaults, f.name)}


# --------------------------------------------------------------------------------------------
# The optimum path's compile-cache key


@dataclass(frozen=True)
class CacheKey:
    """A compile-cache key: ``digest`` (16 hex digits of a sha256), ``dirname`` (the cache
    directory's name) and ``factors`` (the dict that was hashed)."""

    digest: str
    dirname: str
    factors: Mapping[str, Any]


def compile_overrides(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """``optimum_overrides`` without :data:`RUNTIME_ONLY_KEYS`, at every nesting level
    (including dicts inside lists). A dict emptied by the removal is dropped too, so a
    ``{"language_model": {"device": [0]}}`` keys like no overrides at all."""

    def strip(value: Any) -> Any:
        if isinstance(value, Mapping):
            out = {}
            for key, item in value.items():
                if key in RUNTIME_ONLY_KEYS:
                    continue
                item = strip(item)
                if isinstance(item, dict) and not item and isinstance(value[key], Mapping) \
                        and value[key]:
                    continue  # emptied by the strip (an empty dict given as such stays)
                out[key] = item
            return out
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        return value

    return strip(overrides or {})


def cache_key(*, model_name: str, batch_size: int, block_size: int | None, max_model_len: int,
              num_devices: int, dtype: Any, max_num_batched_tokens: int | None,
              memory_budget: float, optimum_overrides: Mapping[str, Any] | None,
              compiler_version: str | None, optimum_rbln_version: str | None) -> CacheKey:
    """The compile-cache key of an optimum-path configuration.

    ``sha256(json.dumps(factors, sort_keys=True, default=str)).hexdigest()[:16]``; the
    directory name is ``f"{model_name with '/' and ':' replaced by '_'}_{digest}"`` (it goes
    under ``$VLLM_CACHE_ROOT/compiled_models``, see :func:`cached_model_path`).

    ``factors`` holds ``model_name`` (``str(...)``), ``batch_size`` (``max_num_seqs``),
    ``block_size`` (before the sync), ``max_model_len``, ``num_devices``, ``dtype``
    (``str(...)``), ``max_num_batched_tokens`` (the user's own value or None), ``memory_budget``
    (``gpu_memory_utilization``), ``rbln_config`` (:func:`compile_overrides` of
    ``optimum_overrides``; only when non-empty), and -- **a deliberate deviation from
    vllm-rbln 0.12.0**, whose key has a FIXME for it -- ``compiler`` (the ``rebel-compiler``
    version) and ``optimum_rbln`` (the optimum-rbln version), so an upgrade never loads a graph
    another compiler built. Keys therefore never equal the vendor's.
    """
    factors: dict[str, Any] = {
        "model_name": str(model_name),
        "batch_size": batch_size,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "num_devices": num_devices,
        "dtype": str(dtype),
        "max_num_batched_tokens": max_num_batched_tokens,
        "memory_budget": memory_budget,
        "compiler": compiler_version,
        "optimum_rbln": optimum_rbln_version,
    }
    overrides = compile_overrides(optimum_overrides)
    if overrides:
        factors["rbln_config"] = overrides
    text = json.dumps(factors, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    safe = str(model_name).replace("/", "_").replace(":", "_")
    return CacheKey(digest, f"{safe}_{digest}", MappingProxyType(factors))


def cached_model_path(cache_root: str | os.PathLike[str], key: CacheKey) -> str:
    """``<cache_root>/compiled_models/<key.dirname>`` (``cache_root`` is vLLM's
    ``VLLM_CACHE_ROOT``, ``~/.cache/vllm`` by default)."""
    return os.path.join(os.fspath(cache_root), "compiled_models", key.dirname)
