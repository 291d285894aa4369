"""vllm_npu.neuron.quantization: FP8 KV, MXFP4 and checkpoint schemes (features guide
"Quantization"; neuron.md §6)."""

from __future__ import annotations

import pytest

from vllm_npu.neuron import quantization as Q
from vllm_npu.neuron.quantization import QuantizationConfigError


@pytest.mark.parametrize("platform_target, value", [("trn3", 448.0), ("trn3pre", 448.0), ("trn2", 240.0),
                                           ("trn1", 240.0), ("inf2", 240.0), (None, 448.0)])
def test_fp8_clamp(platform_target, value):
    assert Q.fp8_clamp_max(platform_target) == value


def test_kv_cache_dtype():
    assert Q.resolve_kv_cache_dtype("auto") == "auto"
    assert Q.resolve_kv_cache_dtype(None) == "auto"
    assert Q.resolve_kv_cache_dtype("fp8") == "float8_e4m3fn"
    assert Q.resolve_kv_cache_dtype("fp8_e4m3") == "float8_e4m3fn"
    assert Q.resolve_kv_cache_dtype("auto", segmented_prefill=True) == "auto"
    assert Q.resolve_kv_cache_dtype("fp8", segmented_prefill=True, fp8_packed_kv=True) == \
        "float8_e4m3fn"
    for bad in ("fp8_e5m2", "bfloat16", "FP8"):
        with pytest.raises(QuantizationConfigError) as info:
            Q.resolve_kv_cache_dtype(bad)
        assert str(info.value) == (f"Unsupported kv_cache_dtype '{bad}' on Neuron. Supported "
                                   "values: 'auto', 'fp8', 'fp8_e4m3'")
        assert isinstance(info.value, ValueError)
    with pytest.raises(NotImplementedError, match="fp8_packed_kv"):
        Q.resolve_kv_cache_dtype("fp8", segmented_prefill=True)


def test_mxfp4():
    Q.validate_mxfp4("trn3", "gpt_oss", "mxfp4")
    Q.validate_mxfp4("trn3pre", "gpt_oss", "mxfp4")
    Q.validate_mxfp4("trn2", "gpt_oss", "bf16")
    Q.validate_mxfp4("trn2", "llama", None)
    for tgt in ("trn2", None):
        with pytest.raises(QuantizationConfigError) as info:
            Q.validate_mxfp4(tgt, "gpt_oss", "mxfp4")
        assert str(info.value) == ("quantization='mxfp4' is not supported on TRN2. Please use "
                                   "quantization='bf16'")
    with pytest.raises(QuantizationConfigError) as info:
        Q.validate_mxfp4("trn3", "llama", "mxfp4")
    assert str(info.value) == ("quantization='mxfp4' is only supported for gpt-oss models "
                               "(model_type 'gpt_oss') on Neuron, got model_type 'llama'")


def test_checkpoint_unquantized_and_modelopt():
    v = Q.validate_checkpoint_quantization
    assert v(None, None) is None
    assert v({}, "") is None
    assert v({"quant_method": "modelopt", "quant_algo": "FP8"}, None) == "modelopt_fp8"
    assert v({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}}, None) == \
        "modelopt_fp8"
    with pytest.raises(QuantizationConfigError) as info:
        v({"quant_method": "modelopt", "quant_algo": "NVFP4"}, None)
    assert str(info.value) == ("Unsupported ModelOpt quantization scheme 'NVFP4' on Neuron: only "
                               "static per-tensor FP8 ModelOpt checkpoints (quant_algo 'FP8') "
                               "are supported.")


def test_checkpoint_cli_flag_refused():
    with pytest.raises(QuantizationConfigError) as info:
        Q.validate_checkpoint_quantization({"quant_method": "modelopt", "quant_algo": "FP8"},
                                           "modelopt")
    assert str(info.value).startswith("Do not set --quantization on Neuron (got 'modelopt')")


def test_checkpoint_compressed_tensors():
    v = Q.validate_checkpoint_quantization
    kv_only = {"quant_method": "compressed-tensors", "config_groups": {},
               "kv_cache_scheme": {"num_bits": 8, "type": "float"}}
    assert v(kv_only, None) == "compressed_tensors_kv_scales"
    weights = {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8}, "targets": ["Linear"]}}}
    with pytest.raises(QuantizationConfigError) as info:
        v(weights, None)
    assert str(info.value) == (
        "Unsupported compressed-tensors quantization scheme on Neuron: weight/activation "
        "quantization (config_groups ['group_0']) is not supported; only the KV-cache "
        "q_scale/k_scale/v_scale are accepted.")


@pytest.mark.parametrize("method", ["awq", "gptq", "mxfp4", "fp8", "bitsandbytes"])
def test_checkpoint_other_schemes(method):
    with pytest.raises(QuantizationConfigError) as info:
        Q.validate_checkpoint_quantization({"quant_method": method}, None)
    assert str(info.value).startswith(
        f"Unsupported checkpoint quantization scheme '{method}' on Neuron.")


def test_checkpoint_without_method():
    with pytest.raises(QuantizationConfigError, match="has no quant_method"):
        Q.validate_checkpoint_quantization({"bits": 4}, None)
