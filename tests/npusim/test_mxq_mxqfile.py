"""npusim.mxq .mxq files: round trip, and every corruption is Model_FailedToLoadMXQ with a precise detail."""

from __future__ import annotations

import pytest

import npusim.mxq as qb
from npusim.mxq.mxqfile import read_mxq


def _load_fails(path, glog) -> str:
    glog()
    with pytest.raises(qb.QbRuntimeError) as exc:
        qb.Model(str(path))
    assert exc.value.status == "Model_FailedToLoadMXQ"
    assert str(exc.value).startswith("Model_FailedToLoadMXQ occurred.\n")
    assert glog() == ["Failed to load model."]  # as the real core: the reason goes to stderr
    [line] = glog.stderr
    assert line.startswith("Unable to load; ")
    return line.removeprefix("Unable to load; ")


def test_header_round_trip(mxq_artifact):
    header, tensors = read_mxq(mxq_artifact(max_batch_size=2, core_mode="auto"))
    assert header["format"] == "npusim-mxq" and header["version"] == 1
    assert (header["max_batch_size"], header["max_cache_size"], header["max_width"]) == (2, 64, 16)
    assert header["core_modes"] == ["single"] and header["target_device"] == "aries"
    assert "model.layers.1.mlp.down_proj.weight" in tensors


@pytest.mark.parametrize(
    ("where", "detail"),
    [("magic", "Invalid magic value detected. The MXQ file may be broken or corrupeted."),
     ("version", "Unsupported MXQ format version 257 (supported: 1)."),
     ("header", "MXQ checksum mismatch"),
     ("payload", "MXQ checksum mismatch"),
     ("digest", "MXQ checksum mismatch")],
)
def test_one_flipped_byte_fails_to_load(mxq_artifact, tmp_path, glog, where, detail):
    data = bytearray(mxq_artifact().read_bytes())
    pos = {"magic": 3, "version": 9, "header": 40, "payload": len(data) - 500, "digest": len(data) - 1}[where]
    data[pos] ^= 0x01
    p = tmp_path / "bad.mxq"
    p.write_bytes(bytes(data))
    assert _load_fails(p, glog).startswith(detail)


def test_truncated_file_fails_to_load(mxq_artifact, tmp_path, glog):
    data = mxq_artifact().read_bytes()
    p = tmp_path / "short.mxq"
    p.write_bytes(data[:-10])
    assert _load_fails(p, glog).startswith("MXQ checksum mismatch")
    p.write_bytes(data[:60])
    assert "runs past the end of the 60-byte file" in _load_fails(p, glog)


def test_foreign_and_missing_files(mxq_hf_dir, tmp_path, glog):
    assert _load_fails(mxq_hf_dir / "model.safetensors", glog) == (
        "Invalid magic value detected. The MXQ file may be broken or corrupeted.")
    assert _load_fails(tmp_path / "nope.mxq", glog).startswith(f"Failed to open MXQ file '{tmp_path / 'nope.mxq'}'")


def test_model_summary(mxq_artifact):
    text = qb.get_model_summary(mxq_artifact(max_batch_size=2))
    assert "max_batch_size (K): 2, max_cache_size (T): 64, max_width (W): 16" in text
