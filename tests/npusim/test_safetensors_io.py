"""The numpy safetensors reader/writer: round trips, interop with the PyPI package, malformed files."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from npusim.llm import CheckpointError, load_safetensors, read_safetensors_header, save_safetensors
from npusim.llm.safetensors import bf16_bits_to_float32, float32_to_bf16_bits


def _all_dtypes(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "f64": rng.normal(size=(3, 4)),
        "f32": rng.normal(size=(5,)).astype(np.float32),
        "f16": rng.normal(size=(2, 2, 2)).astype(np.float16),
        "i64": rng.integers(-(2**40), 2**40, size=(4,)),
        "i32": rng.integers(-(2**30), 2**30, size=(2, 3)).astype(np.int32),
        "i16": rng.integers(-300, 300, size=(3,)).astype(np.int16),
        "i8": rng.integers(-128, 128, size=(7,)).astype(np.int8),
        "u8": rng.integers(0, 256, size=(1, 9)).astype(np.uint8),
        "bool": rng.integers(0, 2, size=(6,)).astype(bool),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def test_round_trip_all_dtypes(tmp_path, rng):
    tensors = _all_dtypes(rng)
    # bf16: values already representable in bfloat16 come back exactly (as float32)
    bf = bf16_bits_to_float32(float32_to_bf16_bits(rng.normal(size=(4, 3))))
    tensors["bf16"] = bf
    path = save_safetensors(tmp_path / "t.safetensors", tensors, metadata={"format": "pt", "note": "x"}, dtypes={"bf16": "BF16"})
    header, meta, start = read_safetensors_header(path)
    assert meta == {"format": "pt", "note": "x"} and start % 8 == 0
    assert header["bf16"].dtype == "BF16" and header["bool"].dtype == "BOOL" and header["i8"].dtype == "I8"
    back = load_safetensors(path)
    assert set(back) == set(tensors)
    for name, arr in tensors.items():
        got = back[name]
        assert got.shape == arr.shape, name
        assert got.dtype == (np.float32 if name == "bf16" else arr.dtype), name
        np.testing.assert_array_equal(got, arr, err_msg=name)
    back["f32"][0] = 1.0  # arrays are writable
    assert load_safetensors(path, names=["i8"]).keys() == {"i8"}
    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        load_safetensors(path, names=["nope"])


def test_writer_is_deterministic_and_aligned(tmp_path, rng):
    tensors = _all_dtypes(rng)
    a = save_safetensors(tmp_path / "a.safetensors", tensors).read_bytes()
    b = save_safetensors(tmp_path / "b.safetensors", dict(reversed(list(tensors.items())))).read_bytes()
    assert a == b
    header, _, _ = read_safetensors_header(tmp_path / "a.safetensors")
    for info in header.values():
        assert info.begin % np.dtype({"F64": "f8", "I64": "i8", "F32": "f4", "I32": "i4", "F16": "f2",
                                      "I16": "i2", "I8": "i1", "U8": "u1", "BOOL": "?"}[info.dtype]).itemsize == 0


def test_bf16_rounding():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf, -np.inf, 3.4e38, np.nan], dtype=np.float32)
    bits = float32_to_bf16_bits(x)
    assert bits.dtype == np.uint16
    back = bf16_bits_to_float32(bits)
    # ties go to even: 1 + 2^-8 -> 1.0, 1 + 3*2^-8 -> 1 + 2^-6
    np.testing.assert_array_equal(back[:6], [1.0, 1.0, 1.0 + 2**-6, -2.5, np.inf, -np.inf])
    assert back[6] == np.inf and np.isnan(back[7])


def test_sharded_index(tmp_path):
    save_safetensors(tmp_path / "s1.safetensors", {"a": np.ones(2, np.float32)})
    save_safetensors(tmp_path / "s2.safetensors", {"b": np.zeros(3, np.int64)})
    index = {"metadata": {}, "weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = load_safetensors(tmp_path)
    assert set(got) == {"a", "b"} and got["b"].dtype == np.int64
    assert set(load_safetensors(tmp_path / "model.safetensors.index.json", names=["b"])) == {"b"}
    index["weight_map"]["c"] = "s2.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"tensor 'c' listed in model.safetensors.index.json is not in this shard"):
        load_safetensors(tmp_path)
    index["weight_map"] = {"a": "s1.safetensors", "b": "s3.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"s3.safetensors.*does not exist"):
        load_safetensors(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_safetensors(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        load_safetensors(tmp_path / "missing.safetensors")


def _raw(header: dict | bytes, data: bytes = b"", declared_len: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if declared_len is None else declared_len
    return struct.pack("<Q", n) + raw + data


CORRUPT = {
    "too short": (b"\x01\x02", r"too short for the 8-byte header length"),
    "header past end": (struct.pack("<Q", 1000) + b"{}", r"header length 1000 bytes runs past the end"),
    "huge header": (struct.pack("<Q", 2**40) + b"{}", r"exceeds the limit"),
    "not json": (_raw(b"{oops"), r"not valid UTF-8 JSON"),
    "not utf8": (_raw(b"\xff\xfe"), r"not valid UTF-8 JSON"),
    "json list": (_raw([1, 2]), r"header must be a JSON object"),
    "bad dtype": (_raw({"x": {"dtype": "F8", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), r"tensor 'x' has unsupported dtype 'F8'"),
    "bad shape": (_raw({"x": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"\0"), r"tensor 'x' has invalid shape"),
    "bad offsets": (_raw({"x": {"dtype": "U8", "shape": [1], "data_offsets": [1, 0]}}, b"\0"), r"invalid data_offsets"),
    "size mismatch": (_raw({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), r"needs 8 bytes but data_offsets \[0, 4\] span 4"),
    "overlap": (_raw({"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                      "y": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"\0" * 3), r"overlaps the previous tensor"),
    "gap": (_raw({"x": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}, b"\0" * 2), r"leaves a gap"),
    "past end": (_raw({"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 2), r"cover 4 bytes of data but the file holds 2"),
    "trailing": (_raw({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\0" * 3), r"cover 1 bytes of data but the file holds 3"),
    "bad metadata": (_raw({"__metadata__": {"a": 1}}), r"__metadata__ must map strings to strings"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_files_raise_checkpoint_error(case, tmp_path):
    blob, pattern = CORRUPT[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError, match=pattern) as ei:
        load_safetensors(path)
    assert str(path) in str(ei.value)


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="complex"):
        save_safetensors(tmp_path / "x.safetensors", {"c": np.zeros(2, np.complex64)})
    with pytest.raises(ValueError, match="unknown safetensors dtype"):
        save_safetensors(tmp_path / "x.safetensors", {"c": np.zeros(2)}, dtypes={"c": "F8"})
    with pytest.raises(ValueError, match="not being saved"):
        save_safetensors(tmp_path / "x.safetensors", {"c": np.zeros(2)}, dtypes={"d": "BF16"})
    with pytest.raises(ValueError, match="invalid tensor name"):
        save_safetensors(tmp_path / "x.safetensors", {"__metadata__": np.zeros(2)})


def test_interop_with_pypi_safetensors_numpy(tmp_path, rng):
    st = pytest.importorskip("safetensors.numpy")
    tensors = _all_dtypes(rng)
    ours = save_safetensors(tmp_path / "ours.safetensors", tensors, metadata={"format": "np"})
    theirs_read = st.load_file(str(ours))
    for name, arr in tensors.items():
        np.testing.assert_array_equal(theirs_read[name], arr, err_msg=name)
        assert theirs_read[name].dtype == arr.dtype
    st.save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"k": "v"})
    ours_read = load_safetensors(tmp_path / "theirs.safetensors")
    for name, arr in tensors.items():
        np.testing.assert_array_equal(ours_read[name], arr, err_msg=name)
        assert ours_read[name].dtype == arr.dtype
    assert read_safetensors_header(tmp_path / "theirs.safetensors")[1] == {"k": "v"}


def test_bf16_interop_with_pypi_safetensors_torch(tmp_path, rng):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    x = rng.normal(size=(5, 7)).astype(np.float32)
    st.save_file({"w": torch.from_numpy(x).to(torch.bfloat16)}, str(tmp_path / "theirs.safetensors"))
    ours = load_safetensors(tmp_path / "theirs.safetensors")["w"]
    expected = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(ours, expected)
    save_safetensors(tmp_path / "ours.safetensors", {"w": x}, dtypes={"w": "BF16"})
    back = st.load_file(str(tmp_path / "ours.safetensors"))["w"]
    assert back.dtype == torch.bfloat16
    np.testing.assert_array_equal(back.float().numpy(), expected)  # same round-to-nearest-even as torch
