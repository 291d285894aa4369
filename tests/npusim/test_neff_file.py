"""npusim.neff NEFF files: round trip, corruption, version, stale model, target mismatch."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest

import npusim.neff as nrt
from npusim.llm import ModelConfig, save_safetensors
from npusim.neff import neff_file
from npusim.tinymodel import make_config, make_weights

pytestmark = pytest.mark.usefixtures("neff_env")

SPEC = nrt.NeffSpec(kind="decode", batch=2, max_model_len=64, block_size=8, num_blocks=16)


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    cfg = make_config("llama", num_hidden_layers=1)
    (d / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    save_safetensors(d / "model.safetensors", make_weights(ModelConfig.from_dict(cfg)))
    return d


def test_round_trip(tmp_path, model_dir):
    rep = nrt.compile_neff(SPEC, model_dir, tmp_path / "out" / "d.neff")
    data = rep.path.read_bytes()
    assert data[:12] == b"NPUSIM-NEFF\x00" and struct.unpack_from("<I", data, 12)[0] == 1
    assert hashlib.sha256(data[:-32]).digest() == data[-32:] and rep.neff_size_bytes == len(data)
    h = neff_file.read(rep.path)
    assert h["spec"] == SPEC.to_dict() and h["name"] == "decode_b2" and h["target"] == "trn2"
    assert h["compiler_version"] == nrt.COMPILER_VERSION and h["model_dir"] == str(model_dir.resolve())
    assert h["model_files"] == ["config.json", "model.safetensors"] and len(h["model_digest"]) == 64
    assert h["kv_bytes"] == 4 * int(np.prod(nrt.kv_cache_shape(model_dir, 16, 8)))
    m = nrt.NrtpyModel.load_from_neff(rep.path)
    assert m.spec == SPEC and m.input_tensors_info == h["inputs"] and m.output_tensors_info == h["outputs"]


def _compiled(tmp_path, model_dir):
    return nrt.compile_neff(SPEC, model_dir, tmp_path / "d.neff").path


def test_corrupt_byte(tmp_path, model_dir):
    p = _compiled(tmp_path, model_dir)
    data = bytearray(p.read_bytes())
    data[40] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(nrt.NeffFileError, match=r"d\.neff'.*checksum mismatch"):
        nrt.NrtpyModel.load_from_neff(p)


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d[:20], "truncated"), (lambda d: b"NOT-A-NEFF\x00\x00" + d[12:], "bad magic"),
    (lambda d: d[:-1], "checksum mismatch")])
def test_bad_bytes(tmp_path, model_dir, mutate, match):
    p = _compiled(tmp_path, model_dir)
    p.write_bytes(mutate(p.read_bytes()))
    with pytest.raises(nrt.NeffFileError, match=match):
        neff_file.read(p)


def test_missing_file(tmp_path):
    with pytest.raises(nrt.NeffFileError, match="cannot be read"):
        nrt.NrtpyModel.load_from_neff(tmp_path / "nope.neff")


def test_version_and_fields(tmp_path, model_dir):
    p = _compiled(tmp_path, model_dir)
    header = neff_file.read(p)
    p.write_bytes(neff_file.encode(header, version=2))
    with pytest.raises(nrt.NeffFileError, match="format version 2, this simulator reads 1"):
        neff_file.read(p)
    p.write_bytes(neff_file.encode({k: v for k, v in header.items() if k != "kv_bytes"}))
    with pytest.raises(nrt.NeffFileError, match="'kv_bytes' is missing"):
        neff_file.read(p)
    p.write_bytes(neff_file.encode({**header, "weight_bytes": "many"}))
    with pytest.raises(nrt.NeffFileError, match="'weight_bytes' has the wrong type"):
        neff_file.read(p)
    p.write_bytes(neff_file.encode({**header, "spec": {**header["spec"], "kind": "train"}}))
    with pytest.raises(nrt.NeffFileError, match="not a valid NeffSpec"):
        nrt.NrtpyModel.load_from_neff(p)


def test_model_changed_since_compile(tmp_path, model_dir):
    p = _compiled(tmp_path, model_dir)
    cfg = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    save_safetensors(model_dir / "model.safetensors", make_weights(cfg, seed=1))
    with pytest.raises(nrt.NeffFileError, match="model changed since compile"):
        nrt.NrtpyModel.load_from_neff(p)


@pytest.mark.parametrize("compiled,device", [("trn3", "trn2"), ("trn2", "trn3"), ("trn3", "trn3pre"), ("trn3pre", "trn3")])
def test_target_mismatch(tmp_path, model_dir, monkeypatch, compiled, device):
    p = nrt.compile_neff(SPEC, model_dir, tmp_path / "d.neff", target=compiled).path
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", device)
    with pytest.raises(nrt.NeffTargetError, match=f"compiled for target '{compiled}' but the device is '{device}'"):
        nrt.NrtpyModel.load_from_neff(p)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", compiled)
    assert nrt.NrtpyModel.load_from_neff(p).target == compiled
