"""The golden decoder's q4x32 layers (npusim.llm, linear="q4x32") equal the plugin's PackedQ4Weight
on the same weights, bit for bit: the reference the ime2_q4 quantization method is checked against."""

from __future__ import annotations

import numpy as np
import pytest

from npusim.llm import Decoder, ModelConfig
from npusim.tinymodel import make_config, make_weights


@pytest.fixture(scope="module")
def linear_module():
    from vllm_npu.ime2 import kernel, linear

    try:
        kernel.load_library()
    except kernel.KernelUnavailableError as exc:
        pytest.skip(str(exc))
    return linear


@pytest.mark.parametrize("fused, parts", [("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj"))])
@pytest.mark.parametrize("m", [1, 6])
def test_decoder_fused_layer_equals_packed_weight(linear_module, fused, parts, m):
    cfg = ModelConfig.from_dict(make_config("qwen2", vocab_size=1024))
    weights = make_weights(cfg, 2)
    dec = Decoder(cfg, weights, linear="q4x32")
    prefix = "model.layers.1." + ("self_attn." if fused == "qkv" else "mlp.")
    w = np.concatenate([np.asarray(weights[f"{prefix}{p}.weight"], dtype=np.float32) for p in parts])
    x = np.random.default_rng(m).standard_normal((m, cfg.hidden_size)).astype(np.float32)
    outs = dec._q4[1][fused](x, [None] * len(parts), np.dtype(np.float32))
    got = np.concatenate(outs, axis=1)
    ref = linear_module.PackedQ4Weight.from_float(w, name=fused).apply(x)
    assert got.shape == ref.shape == (m, w.shape[0])
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
