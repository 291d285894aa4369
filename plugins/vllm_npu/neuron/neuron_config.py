"""``additional_config["neuron_config"]``: the Neuron plugin's own options, parsed and checked.

vLLM hands the plugin ``vllm_config.additional_config`` (the ``--additional-config`` JSON); the
Neuron options live under its ``neuron_config`` key, the multimodal encoder's under
``encoder_neuron_config`` (seed: features guide; reference neuron.md §2, §5, §6):

* the bucket lists (checked here for shape, against the scheduler in :mod:`.buckets`);
* ``on_device_sampling_config``: **absent** -> on-device sampling (ODS) on with the defaults;
  explicit ``null`` -> CPU sampling; an object -> ODS with those options;
* parallelism degrees (``ep_degree``, component DP sizes), all positive integers;
* ``quantization`` (``"bf16"``, ``"mxfp4"``, ...), ``fp8_packed_kv``, ``gk_decode``.

An unknown key is refused with its name and the known keys: **our own rule** (the vendor's
parser is not published); a typo then fails at startup instead of being ignored.

This module imports only the standard library (no vLLM, torch or npusim).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from vllm_npu.neuron.buckets import BucketConfigError, check_bucket_list
from vllm_npu.settings import parse_switch

__all__ = ["NeuronConfigError", "OnDeviceSamplingConfig", "EncoderNeuronConfig", "NeuronConfig",
           "COMPONENT_DP_FIELDS", "DEFAULT_MAX_TOP_K"]

#: Width (tokens) of the on-device top-k; ``top_k=-1`` is limited to it.
DEFAULT_MAX_TOP_K = 256
#: The component data-parallel degrees (attention/embedding/MLP/LM-head sharded across DP).
COMPONENT_DP_FIELDS: tuple[str, ...] = (
    "attention_dp_size", "embedding_dp_size", "mlp_dp_size", "lm_head_dp_size")



class NeuronConfigError(ValueError):
    """A ``neuron_config`` / ``encoder_neuron_config`` value the Neuron plugin refuses.

    A ValueError, as the vendor raises; the message names the key.
    """


def _bool(name: str, value: Any) -> bool:
    """A switch (:func:`vllm_npu.settings.parse_switch`: a bool, 1/0, ``"true"``, ``"off"``...).

    Raises:
        NeuronConfigError: any other value (named, with the accepted words).
    """
    return parse_switch(value, name=name, error=NeuronConfigError)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NeuronConfigError(f"{name} must be a positive integer, got {value}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise NeuronConfigError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise NeuronConfigError(f"{name} must be a number, got {value!r}") from None


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise NeuronConfigError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    elif isinstance(value, int):
        return value
    elif isinstance(value, float) and value.is_integer():
        return int(value)
    raise NeuronConfigError(f"{name} must be an integer, got {value!r}")


def _mapping(name: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise NeuronConfigError(f"{name} must be a dict, got {type(value).__name__}")
    return value


def _check_keys(name: str, given: Mapping[str, Any], cls: type) -> None:
    known = [f.name for f in fields(cls)]
    unknown = [k for k in given if k not in known]
    if unknown:
        raise NeuronConfigError(
            f"Unknown {name} key(s) {sorted(map(str, unknown))}. Known keys: {known}")


def _buckets(name: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, tuple):  # the stored form, when constructing directly
        value = list(value)
    try:
        return tuple(check_bucket_list(name, value))
    except BucketConfigError as exc:
        raise NeuronConfigError(str(exc)) from None


@dataclass(frozen=True)
class OnDeviceSamplingConfig:
    """Options of on-device sampling (the ``on_device_sampling_config`` object).

    Attributes:
        all_greedy: every request is greedy (argmax); bool or its string spelling.
        max_top_k: width of the on-device top-k (tokens), >= 1; ``top_k=-1`` is limited to it.
        deterministic: the multinomial draw uses 0.5 instead of a random number.
        sampling_dp_degree: data-parallel degree of the sampler, >= 1.
        capture_topk: capture the top-k candidates (an int count, or a bool; our reading, the
            vendor's type is not published); False / 0 off.
        temperature, top_k, top_p: optional server-wide sampling overrides (the features
            guide's speculative-decoding example passes ``{"temperature": "0"}``); strings are
            converted; None leaves each request's own value.
    """

    all_greedy: bool = False
    max_top_k: int = DEFAULT_MAX_TOP_K
    deterministic: bool = False
    sampling_dp_degree: int = 1
    capture_topk: bool | int = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "all_greedy", _bool("all_greedy", self.all_greedy))
        set_(self, "deterministic", _bool("deterministic", self.deterministic))
        set_(self, "max_top_k", _positive_int("max_top_k", self.max_top_k))
        set_(self, "sampling_dp_degree", _positive_int("sampling_dp_degree",
                                                       self.sampling_dp_degree))
        if not isinstance(self.capture_topk, bool):
            if not isinstance(self.capture_topk, int) or self.capture_topk < 0:
                raise NeuronConfigError(
                    f"capture_topk must be a boolean or a non-negative integer, got "
                    f"{self.capture_topk!r}")
        if self.temperature is not None:
            set_(self, "temperature", _float("temperature", self.temperature))
            if self.temperature < 0:
                raise NeuronConfigError(
                    f"temperature must be non-negative, got {self.temperature}")
        if self.top_k is not None:
            set_(self, "top_k", _int("top_k", self.top_k))
        if self.top_p is not None:
            set_(self, "top_p", _float("top_p", self.top_p))
            if not 0.0 < self.top_p <= 1.0:
                raise NeuronConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OnDeviceSamplingConfig:
        """Parse the ``on_device_sampling_config`` object.

        Raises:
            NeuronConfigError: not a dict (names the type); an unknown key (our rule); a value
                of the wrong type or range (names the key).
        """
        data = _mapping("on_device_sampling_config", data)
        _check_keys("on_device_sampling_config", data, cls)
        return cls(**data)


@dataclass(frozen=True)
class EncoderNeuronConfig:
    """The multimodal encoder's options (``additional_config["encoder_neuron_config"]``).

    Attributes:
        tp_size, dp_size: the encoder's own TP / DP degrees (>= 1), decoupled from the text
            model's; None = derived from the world size (default full DP: tp 1, dp world);
            resolved by :func:`vllm_npu.neuron.parallel.resolve_encoder_tp_dp`.
        num_encoder_input_buckets: encoder input buckets (tokens), None = auto-generated.
        encoder_attention_block_size: encoder attention block (tokens), None = default.
    """

    tp_size: int | None = None
    dp_size: int | None = None
    num_encoder_input_buckets: tuple[int, ...] | None = None
    encoder_attention_block_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp_size", "dp_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise NeuronConfigError(f"vision {name} must be a positive integer, got {value}")
        object.__setattr__(self, "num_encoder_input_buckets",
                           _buckets("num_encoder_input_buckets", self.num_encoder_input_buckets))
        if self.encoder_attention_block_size is not None:
            _positive_int("encoder_attention_block_size", self.encoder_attention_block_size)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> EncoderNeuronConfig:
        """Parse ``encoder_neuron_config``; None gives the defaults.

        Raises:
            NeuronConfigError: not a dict (names the type); an unknown key (our rule);
                "vision tp_size must be a positive integer, got X" (and ``dp_size``).
        """
        if data is None:
            return cls()
        data = _mapping("encoder_neuron_config", data)
        _check_keys("encoder_neuron_config", data, cls)
        return cls(**data)


_ODS_DEFAULT = OnDeviceSamplingConfig()


@dataclass(frozen=True)
class NeuronConfig:
    """The parsed ``neuron_config`` (plus the encoder's config).

    Attributes:
        num_batched_tokens_buckets: prefill token buckets (tokens), None = default / segmented
            list (:func:`vllm_npu.neuron.buckets.resolve_buckets`).
        num_seqs_buckets: decode batch buckets (sequences), None = default.
        decode_context_length_buckets: opt-in decode context buckets (tokens), None = off.
        kv_segment_size_buckets: explicit segmented-prefill KV segment sizes (tokens), None =
            decided from ``max_num_batched_tokens``.
        on_device_sampling_config: ODS options; None = CPU sampling.
        ep_degree: expert-parallel degree, >= 1 (1 with ``--enable-expert-parallel`` expands
            to the full EP width, :mod:`.parallel`).
        attention_dp_size, embedding_dp_size, mlp_dp_size, lm_head_dp_size: component DP
            degrees, >= 1.
        quantization: Neuron weight quantization (``"bf16"``, ``"mxfp4"``...), None = the
            model's default; not vLLM's ``--quantization``.
        fp8_packed_kv: the packed FP8 KV-cache layout.
        gk_decode: the GPT-OSS GK decode kernel.
        encoder: the multimodal encoder's config.
    """

    num_batched_tokens_buckets: tuple[int, ...] | None = None
    num_seqs_buckets: tuple[int, ...] | None = None
    decode_context_length_buckets: tuple[int, ...] | None = None
    kv_segment_size_buckets: tuple[int, ...] | None = None
    on_device_sampling_config: OnDeviceSamplingConfig | None = _ODS_DEFAULT
    ep_degree: int = 1
    attention_dp_size: int = 1
    embedding_dp_size: int = 1
    mlp_dp_size: int = 1
    lm_head_dp_size: int = 1
    quantization: str | None = None
    fp8_packed_kv: bool = False
    gk_decode: bool = False
    encoder: EncoderNeuronConfig = field(default_factory=EncoderNeuronConfig)

    #: ``neuron_config`` keys (``encoder`` comes from ``encoder_neuron_config``).
    KEYS = ("num_batched_tokens_buckets", "num_seqs_buckets", "decode_context_length_buckets",
            "kv_segment_size_buckets", "on_device_sampling_config", "ep_degree",
            "attention_dp_size", "embedding_dp_size", "mlp_dp_size", "lm_head_dp_size",
            "quantization", "fp8_packed_kv", "gk_decode")

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name in ("num_batched_tokens_buckets", "num_seqs_buckets",
                     "decode_context_length_buckets", "kv_segment_size_buckets"):
            value = getattr(self, name)
            set_(self, name, _buckets(name, value))
        ods = self.on_device_sampling_config
        if isinstance(ods, Mapping):
            set_(self, "on_device_sampling_config", OnDeviceSamplingConfig.from_dict(ods))
        elif ods is not None and not isinstance(ods, OnDeviceSamplingConfig):
            raise NeuronConfigError(
                f"on_device_sampling_config must be a dict or null, got {type(ods).__name__}")
        for name in ("ep_degree", *COMPONENT_DP_FIELDS):
            _positive_int(name, getattr(self, name))
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise NeuronConfigError(
                f"quantization must be a string, got {type(self.quantization).__name__}")
        set_(self, "fp8_packed_kv", _bool("fp8_packed_kv", self.fp8_packed_kv))
        set_(self, "gk_decode", _bool("gk_decode", self.gk_decode))
        if isinstance(self.encoder, Mapping):
            set_(self, "encoder", EncoderNeuronConfig.from_dict(self.encoder))

    @classmethod
    def from_additional_config(cls, additional_config: Mapping[str, Any] | None) -> NeuronConfig:
        """Parse vLLM's ``additional_config``.

        ``additional_config`` None, or without ``neuron_config`` (or with it null), gives the
        defaults, on-device sampling on. Keys of ``additional_config`` other than
        ``neuron_config`` and ``encoder_neuron_config`` are left to their owners.

        Raises:
            NeuronConfigError: ``additional_config``, ``neuron_config`` or
                ``encoder_neuron_config`` is not a dict ("neuron_config must be a dict, got
                <type name>"); an unknown key ("Unknown neuron_config key(s) [...]. Known keys:
                [...]", our rule); a bad value, e.g. "ep_degree must be a positive integer,
                got 0", or a bucket list's vendor text.
        """
        if additional_config is None:
            return cls()
        additional_config = _mapping("additional_config", additional_config)
        raw = additional_config.get("neuron_config")
        raw = {} if raw is None else _mapping("neuron_config", raw)
        unknown = [k for k in raw if k not in cls.KEYS]
        if unknown:
            raise NeuronConfigError(
                f"Unknown neuron_config key(s) {sorted(map(str, unknown))}. "
                f"Known keys: {list(cls.KEYS)}")
        encoder = EncoderNeuronConfig.from_dict(additional_config.get("encoder_neuron_config"))
        return cls(**raw, encoder=encoder)

    @property
    def on_device_sampling(self) -> bool:
        """On-device sampling is on (False = CPU sampling)."""
        return self.on_device_sampling_config is not None

    @property
    def component_dp(self) -> dict[str, int]:
        """The component DP degrees above 1, by key (empty = component DP off)."""
        return {n: getattr(self, n) for n in COMPONENT_DP_FIELDS if getattr(self, n) > 1}
