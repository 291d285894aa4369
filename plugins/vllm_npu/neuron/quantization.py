"""Quantization rules of the Neuron plugin: FP8 KV clamp and dtype, MXFP4, checkpoint schemes.

Seed (features guide, "Quantization") and reference neuron.md §6:

* **FP8 KV cache** (``--kv-cache-dtype fp8``): stored as e4m3fn; values are clamped to 240.0 on
  TRN2 (e4m3 with inf) and 448.0 on TRN3 (e4m3fn). The unpacked FP8 layout does not combine
  with segmented prefill (``fp8_packed_kv`` needed).
* **MXFP4**: gpt-oss only, Trn3 only, set with ``neuron_config.quantization``.
* **Checkpoint quantization**: ModelOpt static FP8 checkpoints are detected from their
  ``quantization_config``; vLLM's ``--quantization`` flag must not be set; compressed-tensors
  is accepted only for KV-cache q/k/v scales; anything else fails naming the scheme.

This module imports only the standard library (no vLLM, torch or npusim).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FP8_E4M3_MAX", "FP8_E4M3FN_MAX", "SUPPORTED_KV_CACHE_DTYPES", "MXFP4_TRN2_ERROR",
           "QuantizationConfigError", "fp8_clamp_max", "resolve_kv_cache_dtype",
           "validate_mxfp4", "validate_checkpoint_quantization"]

#: Largest finite FP8 E4M3 value on TRN2 (e4m3 with inf).
FP8_E4M3_MAX = 240.0
#: Largest finite FP8 E4M3FN value on TRN3.
FP8_E4M3FN_MAX = 448.0
#: ``kv_cache_dtype`` values Neuron accepts.
SUPPORTED_KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3")
MXFP4_TRN2_ERROR = "quantization='mxfp4' is not supported on TRN2. Please use quantization='bf16'"


class QuantizationConfigError(ValueError):
    """A quantization setting or checkpoint scheme Neuron refuses (a ValueError, as the vendor
    raises)."""


def fp8_clamp_max(target: str | None) -> float:
    """The FP8 KV clamp for a platform target: 448.0 for ``trn3*`` (``trn3``, ``trn3pre``),
    240.0 otherwise; None (CPU mode without a target) gives 448.0, as the vendor does.

    Args:
        target: ``NEURON_PLATFORM_TARGET_OVERRIDE`` or the runtime's target (``trn2``...).
    """
    if target is None:
        return FP8_E4M3FN_MAX
    return FP8_E4M3FN_MAX if target.startswith("trn3") else FP8_E4M3_MAX


def resolve_kv_cache_dtype(kv_cache_dtype: str | None, *, segmented_prefill: bool = False,
                           fp8_packed_kv: bool = False) -> str:
    """vLLM's ``kv_cache_dtype`` -> ``"auto"`` (the model dtype) or ``"float8_e4m3fn"``.

    Args:
        kv_cache_dtype: ``auto``/None, ``fp8`` or ``fp8_e4m3``.
        segmented_prefill: segmented prefill is on.
        fp8_packed_kv: ``neuron_config.fp8_packed_kv``.

    Raises:
        QuantizationConfigError: another value ("Unsupported kv_cache_dtype '...' on Neuron.
            Supported values: 'auto', 'fp8', 'fp8_e4m3'").
        NotImplementedError: FP8 without ``fp8_packed_kv`` under segmented prefill (our text).
    """
    value = "auto" if kv_cache_dtype is None else kv_cache_dtype
    if value not in SUPPORTED_KV_CACHE_DTYPES:
        supported = ", ".join(f"'{v}'" for v in SUPPORTED_KV_CACHE_DTYPES)
        raise QuantizationConfigError(
            f"Unsupported kv_cache_dtype '{value}' on Neuron. Supported values: {supported}")
    if value == "auto":
        return "auto"
    if segmented_prefill and not fp8_packed_kv:
        raise NotImplementedError(
            f"kv_cache_dtype='{value}' with segmented prefill requires the packed FP8 KV layout: "
            "set neuron_config.fp8_packed_kv=true, or use kv_cache_dtype='auto'.")
    return "float8_e4m3fn"


def validate_mxfp4(target: str | None, model_type: str | None, quantization: str | None) -> None:
    """``neuron_config.quantization='mxfp4'`` is for gpt-oss (``model_type`` ``gpt_oss``) on
    Trn3 only. Other quantization values pass.

    Raises:
        QuantizationConfigError: a model other than gpt-oss (our text); a target that is not
            ``trn3*``, None included (:data:`MXFP4_TRN2_ERROR`, the vendor's text).
    """
    if quantization != "mxfp4":
        return
    if model_type != "gpt_oss":
        raise QuantizationConfigError(
            "quantization='mxfp4' is only supported for gpt-oss models (model_type 'gpt_oss') "
            f"on Neuron, got model_type '{model_type}'")
    if target is None or not target.startswith("trn3"):
        raise QuantizationConfigError(MXFP4_TRN2_ERROR)


def _compressed_tensors_weight_groups(cfg: Mapping[str, Any]) -> list[str]:
    groups = cfg.get("config_groups") or {}
    return [name for name, g in groups.items()
            if isinstance(g, Mapping) and (g.get("weights") or g.get("input_activations"))]


def validate_checkpoint_quantization(hf_quantization_config: Mapping[str, Any] | None,
                                     cli_quantization: str | None) -> str | None:
    """Check a checkpoint's ``quantization_config`` and the ``--quantization`` flag.

    Returns:
        None (unquantized checkpoint), ``"modelopt_fp8"`` (ModelOpt static FP8 weights) or
        ``"compressed_tensors_kv_scales"`` (compressed-tensors carrying KV q/k/v scales only).

    Raises:
        QuantizationConfigError: ``--quantization`` set; a ``quantization_config`` without
            ``quant_method``; a ModelOpt algorithm other than FP8; compressed-tensors weight or
            activation quantization; any other ``quant_method`` (each names the scheme; texts
            ours).
    """
    if cli_quantization:
        raise QuantizationConfigError(
            f"Do not set --quantization on Neuron (got '{cli_quantization}'): the checkpoint's "
            "quantization_config selects the quantization path (ModelOpt static FP8), and "
            "MXFP4 is set with additional_config neuron_config.quantization.")
    if not hf_quantization_config:
        return None
    cfg = hf_quantization_config
    method = cfg.get("quant_method")
    if method is None:
        raise QuantizationConfigError(
            "Unsupported checkpoint quantization_config on Neuron: it has no quant_method "
            f"(keys {sorted(cfg)}).")
    method = str(method).lower()
    if method == "modelopt":
        nested = cfg.get("quantization")
        algo = cfg.get("quant_algo")
        if algo is None and isinstance(nested, Mapping):
            algo = nested.get("quant_algo")
        if str(algo).upper() != "FP8":
            raise QuantizationConfigError(
                f"Unsupported ModelOpt quantization scheme '{algo}' on Neuron: only static "
                "per-tensor FP8 ModelOpt checkpoints (quant_algo 'FP8') are supported.")
        return "modelopt_fp8"
    if method == "compressed-tensors":
        groups = _compressed_tensors_weight_groups(cfg)
        if groups:
            raise QuantizationConfigError(
                "Unsupported compressed-tensors quantization scheme on Neuron: weight/activation "
                f"quantization (config_groups {groups}) is not supported; only the KV-cache "
                "q_scale/k_scale/v_scale are accepted.")
        return "compressed_tensors_kv_scales"
    raise QuantizationConfigError(
        f"Unsupported checkpoint quantization scheme '{method}' on Neuron. Supported: ModelOpt "
        "static FP8 (quant_method 'modelopt') and compressed-tensors KV-cache scales only. For "
        "gpt-oss MXFP4 checkpoints pass hf_overrides={\"quantization_config\": null} and "
        "neuron_config.quantization='mxfp4'.")
