"""npusim.neff compile: spec names and checks, signatures, simulated time, HBM at compile and load."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import npusim.neff as nrt
from npusim.llm import ModelConfig, save_safetensors
from npusim.neff.compiler import model_bytes
from npusim.tinymodel import make_config, make_weights

pytestmark = pytest.mark.usefixtures("neff_env")

GIB = 2**30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("neff_compile_model")
    cfg = make_config("llama")
    (d / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    save_safetensors(d / "model.safetensors", make_weights(ModelConfig.from_dict(cfg)))
    return d


def S(**kw):
    return nrt.NeffSpec(**{"max_model_len": 2048, "block_size": 32, "num_blocks": 64, **kw})


def test_spec_names():
    assert S(kind="prefill", tokens=1024).name == "prefill_s1024"
    assert S(kind="prefill", tokens=512, kv_segment=1024).name == "prefill_s512_kv1024"
    assert S(kind="decode", batch=8).name == "decode_b8"
    assert S(kind="decode", batch=8, context=2048).name == "decode_b8"
    assert S(kind="decode", batch=8, context=1024).name == "decode_b8_s1024"
    assert S(kind="decode", batch=8).context == 2048 and S(kind="decode", batch=8).rows == 8


@pytest.mark.parametrize("kw,match", [
    ({"kind": "verify"}, "kind"), ({"kind": "prefill", "batch": 2}, "batch 1"),
    ({"kind": "decode", "tokens": 4}, "tokens 1"), ({"kind": "decode", "context": 4096}, "exceeds max_model_len"),
    ({"kind": "prefill", "tokens": 512, "kv_segment": 256}, "kv_segment"),
    ({"kind": "prefill", "tokens": 16, "kv_segment": 40}, "multiple of block_size"),
    ({"kind": "decode", "kv_dtype": "int8"}, "kv_dtype"), ({"kind": "decode", "batch": 0}, "batch"),
    ({"kind": "decode", "on_device_sampling": 1}, "on_device_sampling")])
def test_spec_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        S(**kw)


def test_kv_cache_shape(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    want = (2, 2, 10, 16, 2, 32)
    assert nrt.kv_cache_shape(model_dir, 10, 16) == want
    assert nrt.kv_cache_shape(cfg, 10, 16) == want
    assert nrt.kv_cache_shape(ModelConfig.from_dict(cfg), 10, 16) == want


def test_signatures(model_dir, tmp_path):
    spec = S(kind="decode", batch=4, context=1024)
    m = nrt.NrtpyModel.load_from_neff(nrt.compile_neff(spec, model_dir, tmp_path / "d.neff").path)
    assert m.input_tensors_info == [
        {"name": "kv_cache", "shape": [2, 2, 64, 32, 2, 32], "dtype": "float32"},
        {"name": "input_ids", "shape": [4], "dtype": "int32"},
        {"name": "position_ids", "shape": [4], "dtype": "int32"},
        {"name": "slot_mapping", "shape": [4], "dtype": "int32"},
        {"name": "block_table", "shape": [4, 32], "dtype": "int32"},
        {"name": "sampling_params", "shape": [4, 3], "dtype": "float32"},
        {"name": "rand", "shape": [4], "dtype": "float32"}]
    assert m.output_tensors_info == [{"name": "logits", "shape": [4, 1024], "dtype": "float32"},
                                     {"name": "tokens", "shape": [4], "dtype": "int32"}]
    spec = S(kind="prefill", tokens=128, on_device_sampling=False)
    m = nrt.NrtpyModel.load_from_neff(nrt.compile_neff(spec, model_dir, tmp_path / "p.neff").path)
    assert [i["name"] for i in m.input_tensors_info] == [
        "kv_cache", "input_ids", "position_ids", "slot_mapping", "block_table", "last_token_index"]
    assert m.input_tensors_info[4]["shape"] == [64] and m.output_tensors_info == [
        {"name": "logits", "shape": [1, 1024], "dtype": "float32"}]


def test_report_and_simulated_time(model_dir, tmp_path):
    a = nrt.compile_neff(S(kind="prefill", tokens=128), model_dir, tmp_path / "a.neff")
    b = nrt.compile_neff(S(kind="prefill", tokens=128), model_dir, tmp_path / "b.neff")
    c = nrt.compile_neff(S(kind="prefill", tokens=1024), model_dir, tmp_path / "c.neff")
    o1 = nrt.compile_neff(S(kind="prefill", tokens=128), model_dir, tmp_path / "o.neff", compiler_args=["-O1"])
    assert a.name == "prefill_s128" and a.target == "trn2" and a.path == tmp_path / "a.neff"
    assert a.neff_size_bytes == (tmp_path / "a.neff").stat().st_size
    assert a.simulated_seconds == b.simulated_seconds and a.simulated_seconds > 20
    assert c.simulated_seconds > a.simulated_seconds > o1.simulated_seconds
    assert (tmp_path / "a.neff").read_bytes() == (tmp_path / "b.neff").read_bytes()
    assert nrt.compile_neff(S(kind="decode"), model_dir, tmp_path / "t3.neff", target="trn3").target == "trn3"
    with pytest.raises(nrt.NeffTargetError, match="'trn9'"):
        nrt.compile_neff(S(kind="decode"), model_dir, tmp_path / "x.neff", target="trn9")
    with pytest.raises(TypeError):
        nrt.compile_neff(S(kind="decode"), model_dir, tmp_path / "x.neff", compiler_args=[3])


def test_eoom_at_compile(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("NPUSIM_NEFF", json.dumps({"hbm_gib_per_core": 0.001}))
    with pytest.raises(nrt.NeffCompileError) as e:
        nrt.compile_neff(S(kind="decode", batch=4), model_dir, tmp_path / "d.neff")
    msg = str(e.value)
    assert msg.startswith("NCC_EOOM001: The combined memory needed for the model tensors exceeds the "
                          "high-bandwidth memory limit.")
    w = model_bytes(ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text())))
    assert f"weights {w}" in msg and f"has {int(0.001 * GIB)} bytes" in msg
    assert not (tmp_path / "d.neff").exists()
    monkeypatch.delenv("NPUSIM_NEFF")
    huge = S(kind="decode", batch=4, num_blocks=900_000)  # KV of 900k blocks x 32 tokens: 27.5 GiB
    with pytest.raises(nrt.NeffCompileError, match="NCC_EOOM001"):
        nrt.compile_neff(huge, model_dir, tmp_path / "h.neff")
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")  # 36 GiB per core
    nrt.compile_neff(huge, model_dir, tmp_path / "h.neff")


def test_memory_at_load(model_dir, tmp_path, monkeypatch):
    p1 = nrt.compile_neff(S(kind="decode", batch=4), model_dir, tmp_path / "d.neff").path
    p2 = nrt.compile_neff(S(kind="prefill", tokens=128), model_dir, tmp_path / "p.neff").path
    w = model_bytes(ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text())))
    hbm = 24 * GIB
    m1 = nrt.NrtpyModel.load_from_neff(p1)
    m2 = nrt.NrtpyModel.load_from_neff(p2)
    assert nrt.get_vnc_memory_stats(0) == (w, hbm - w)  # weights counted once for both NEFFs
    m3 = nrt.NrtpyModel.load_from_neff(p1, core_id=1)  # noqa: F841 (a collected model is unloaded)
    assert nrt.get_vnc_memory_stats(1) == (w, hbm - w)
    kv = nrt.NrtpyTensor.from_numpy(np.zeros(nrt.kv_cache_shape(model_dir, 64, 32), np.float32), core_id=0)
    kv_bytes = kv.numpy().nbytes
    assert nrt.get_vnc_memory_stats(0)[0] == w + kv_bytes
    del kv
    assert nrt.get_vnc_memory_stats(0)[0] == w
    m1.unload()
    assert nrt.get_vnc_memory_stats(0)[0] == w
    m2.unload()
    assert nrt.get_vnc_memory_stats(0)[0] == 0
    with pytest.raises(nrt.NrtError, match="not loaded"):
        m2(inputs={})
    # a core with less HBM than the weights
    monkeypatch.setenv("NPUSIM_NEFF", json.dumps({"hbm_gib_per_core": w / 2 / GIB}))
    with pytest.raises(nrt.NrtError, match=r"^NRT Error NRT_RESOURCE\(4\): Failed to allocate tensor 'weights of "):
        nrt.NrtpyModel.load_from_neff(p1, core_id=2)
    # weights fit, the KV pool does not
    monkeypatch.setenv("NPUSIM_NEFF", json.dumps({"hbm_gib_per_core": (w + 1000) / GIB}))
    m4 = nrt.NrtpyModel.load_from_neff(p1, core_id=3)  # noqa: F841
    with pytest.raises(nrt.NrtError, match=r"NRT_RESOURCE\(4\): Failed to allocate tensor 'kv' .* logical core 3"):
        nrt.NrtpyTensor.from_numpy(np.zeros(nrt.kv_cache_shape(model_dir, 64, 32), np.float32), name="kv", core_id=3)
    nrt.reset()
    assert nrt.get_vnc_memory_stats(3) == (0, int((w + 1000) / GIB * GIB))
    with pytest.raises(nrt.NrtError, match="NRT_LOAD_NOT_ENOUGH_NC"):
        nrt.NrtpyModel.load_from_neff(p1, core_id=4)


def test_tensor_api():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = nrt.NrtpyTensor.from_numpy(a, name="x")
    a[0, 0] = 99  # from_numpy copied to the device
    assert t.numpy()[0, 0] == 0 and t.shape == (2, 3) and t.dtype == np.float32
    t.numpy()[1, 1] = 7  # numpy() is the live device array
    assert t.numpy()[1, 1] == 7
    t.write_from_numpy(np.ones((2, 3), np.float32))
    assert t.numpy().sum() == 6
    with pytest.raises(nrt.NrtpyError, match="shape"):
        t.write_from_numpy(np.ones(3, np.float32))
    with pytest.raises(nrt.NrtpyError):
        nrt.NrtpyTensor(a)
    assert math.isclose(nrt.get_total_available_memory(), 24.0)
