"""Read and write ``.safetensors`` files with numpy alone.

The format (https://huggingface.co/docs/safetensors): an unsigned little-endian 64-bit header
length ``N``, then ``N`` bytes of UTF-8 JSON mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the byte after the
header) plus an optional ``"__metadata__"`` string-to-string map, then the raw little-endian
tensor data. Tensors must tile the data buffer exactly: no gaps, no overlaps, nothing left over.

Supported dtypes: ``F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL``. numpy has no
bfloat16, so ``BF16`` tensors are returned as ``float32`` (exactly: every bfloat16 value is a
float32 value), and are written from floating arrays with round-to-nearest-even.

Sharded checkpoints (``model.safetensors.index.json`` with a ``weight_map``) are read by
:func:`load_safetensors` when given the index file or the model directory.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CheckpointError

__all__ = [
    "SAFETENSORS_DTYPES",
    "TensorInfo",
    "bf16_bits_to_float32",
    "float32_to_bf16_bits",
    "load_safetensors",
    "read_safetensors_header",
    "save_safetensors",
]

#: Largest header accepted, in bytes (the reference implementation's limit: 100 MB).
MAX_HEADER_BYTES = 100_000_000

INDEX_FILENAME = "model.safetensors.index.json"
SINGLE_FILENAME = "model.safetensors"

#: safetensors dtype name -> numpy dtype of the stored bytes (BF16 is stored as raw uint16 bits).
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

# numpy dtype kind+itemsize -> default safetensors dtype name when writing.
_NUMPY_TO_ST: dict[tuple[str, int], str] = {
    ("f", 8): "F64",
    ("f", 4): "F32",
    ("f", 2): "F16",
    ("i", 8): "I64",
    ("i", 4): "I32",
    ("i", 2): "I16",
    ("i", 1): "I8",
    ("u", 8): "U64",
    ("u", 4): "U32",
    ("u", 2): "U16",
    ("u", 1): "U8",
    ("b", 1): "BOOL",
}


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: ``dtype`` (safetensors name), ``shape``, byte range in the data buffer."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 bit patterns (``uint16``) to ``float32`` values, exactly."""
    return (np.asarray(bits, dtype="<u2").astype("<u4") << np.uint32(16)).view("<f4")


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round floating values to bfloat16 (nearest, ties to even); return the ``uint16`` bits.

    NaNs stay NaN (quiet), infinities stay infinite, values beyond the bfloat16 range round
    to infinity as in IEEE arithmetic.
    """
    x = np.ascontiguousarray(values, dtype="<f4")
    bits = x.view("<u4")
    rounding = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    with np.errstate(over="ignore"):
        out = ((bits + rounding) >> np.uint32(16)).astype("<u2")
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype("<u2")
    return out


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse and validate the header of one ``.safetensors`` file.

    Args:
        path: the file.

    Returns:
        ``(tensors, metadata, data_start)``: tensor name -> :class:`TensorInfo` (offsets relative
        to the data buffer), the ``__metadata__`` map (empty if absent), and the absolute file
        offset of the data buffer.

    Raises:
        CheckpointError: the file is missing, truncated, or its header is not valid JSON, names
            an unknown dtype, has a bad shape, or its offsets do not tile the data buffer exactly.
            The message names the file and the problem.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        with p.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{p}: file is {size} bytes, too short for the 8-byte header length of a safetensors file"
                )
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{p}: header length {n} bytes exceeds the limit of {MAX_HEADER_BYTES} bytes")
            if 8 + n > size:
                raise CheckpointError(f"{p}: header length {n} bytes runs past the end of the {size}-byte file")
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot read safetensors file: {exc}") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{p}: header is not valid UTF-8 JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{p}: header must be a JSON object, got {type(header).__name__}")

    metadata: dict[str, str] = {}
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in entry.items()
            ):
                raise CheckpointError(f"{p}: __metadata__ must map strings to strings")
            metadata = dict(entry)
            continue
        tensors[name] = _parse_entry(p, name, entry)

    data_len = size - 8 - n
    expected = 0
    for name, info in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if info.begin != expected:
            what = "overlaps the previous tensor" if info.begin < expected else "leaves a gap after the previous tensor"
            raise CheckpointError(
                f"{p}: tensor {name!r} data_offsets [{info.begin}, {info.end}] {what} (expected begin {expected})"
            )
        expected = info.end
    if expected != data_len:
        raise CheckpointError(
            f"{p}: tensors cover {expected} bytes of data but the file holds {data_len} bytes after the header"
        )
    return tensors, metadata, 8 + n


def _parse_entry(p: Path, name: str, entry: object) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{p}: header entry for tensor {name!r} must be an object")
    dtype = entry.get("dtype")
    if dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{p}: tensor {name!r} has unsupported dtype {dtype!r} (supported: {', '.join(SAFETENSORS_DTYPES)})"
        )
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise CheckpointError(f"{p}: tensor {name!r} has invalid shape {shape!r} (need a list of non-negative ints)")
    offs = entry.get("data_offsets")
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        or not 0 <= offs[0] <= offs[1]
    ):
        raise CheckpointError(f"{p}: tensor {name!r} has invalid data_offsets {offs!r} (need [begin, end], 0 <= begin <= end)")
    nbytes = int(np.prod(shape, dtype=np.int64)) * SAFETENSORS_DTYPES[dtype].itemsize
    if offs[1] - offs[0] != nbytes:
        raise CheckpointError(
            f"{p}: tensor {name!r} ({dtype}, shape {tuple(shape)}) needs {nbytes} bytes "
            f"but data_offsets [{offs[0]}, {offs[1]}] span {offs[1] - offs[0]}"
        )
    return TensorInfo(dtype=dtype, shape=tuple(shape), begin=offs[0], end=offs[1])


def _load_file(p: Path, names: set[str] | None) -> dict[str, np.ndarray]:
    tensors, _, start = read_safetensors_header(p)
    out: dict[str, np.ndarray] = {}
    with p.open("rb") as f:
        for name, info in tensors.items():
            if names is not None and name not in names:
                continue
            f.seek(start + info.begin)
            buf = bytearray(info.end - info.begin)
            if f.readinto(buf) != len(buf):
                raise CheckpointError(f"{p}: tensor {name!r} data is truncated")
            arr = np.frombuffer(buf, dtype=SAFETENSORS_DTYPES[info.dtype]).reshape(info.shape)
            if info.dtype == "BF16":
                arr = bf16_bits_to_float32(arr).reshape(info.shape)
            out[name] = arr
    return out


def _shard_map(index: Path) -> dict[str, list[str]]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index}: cannot read the shard index: {exc}") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
    shards: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        if Path(shard).name != shard:
            raise CheckpointError(f"{index}: shard {shard!r} for tensor {tensor!r} must be a file name in the same directory")
        shards.setdefault(shard, []).append(tensor)
    return shards


def load_safetensors(path: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Load tensors from a ``.safetensors`` file, a shard index, or a model directory.

    Args:
        path: a ``.safetensors`` file; a ``model.safetensors.index.json`` (its shards are read
            from the same directory); or a directory holding either (the index wins).
        names: if given, load only these tensors (others are not read from disk).

    Returns:
        Tensor name -> writable numpy array in the stored dtype, except ``BF16`` which is
        returned as ``float32``.

    Raises:
        CheckpointError: a file is missing or malformed (see :func:`read_safetensors_header`);
            a tensor appears in two shards; a shard lacks a tensor its index assigns to it; or
            a requested name is not in the checkpoint.
    """
    p = Path(path)
    wanted = set(names) if names is not None else None
    if p.is_dir():
        if (p / INDEX_FILENAME).is_file():
            p = p / INDEX_FILENAME
        elif (p / SINGLE_FILENAME).is_file():
            p = p / SINGLE_FILENAME
        else:
            raise CheckpointError(f"{p}: no {SINGLE_FILENAME} or {INDEX_FILENAME} in this directory")
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint file")

    if p.name.endswith(".index.json"):
        out: dict[str, np.ndarray] = {}
        where: dict[str, str] = {}
        for shard, tensors in sorted(_shard_map(p).items()):
            shard_path = p.parent / shard
            if not shard_path.is_file():
                raise CheckpointError(f"{p}: shard {shard_path} (holding e.g. {tensors[0]!r}) does not exist")
            subset = None if wanted is None else wanted & set(tensors)
            if subset is not None and not subset:
                continue
            loaded = _load_file(shard_path, set(tensors) if subset is None else subset)
            for t in tensors if subset is None else subset:
                if t not in loaded:
                    raise CheckpointError(f"{shard_path}: tensor {t!r} listed in {p.name} is not in this shard")
            for t, arr in loaded.items():
                if t in where:
                    raise CheckpointError(f"{p}: tensor {t!r} is in both {where[t]} and {shard}")
                where[t] = shard
                out[t] = arr
    else:
        out = _load_file(p, wanted)
    if wanted is not None:
        missing = sorted(wanted - out.keys())
        if missing:
            raise CheckpointError(f"{p}: checkpoint has no tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return out


def save_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
    *,
    dtypes: Mapping[str, str] | None = None,
) -> Path:
    """Write tensors to one ``.safetensors`` file, deterministically.

    The byte layout is a pure function of the arguments: the header is compact JSON with
    ``__metadata__`` first, padded with spaces to a multiple of 8 bytes; tensors are laid out
    by decreasing element size, then by name, so every tensor is aligned to its element size.
    The file is written to a temporary name and renamed into place.

    Args:
        path: destination file.
        tensors: name -> array. The stored dtype follows the array's dtype (``float64`` ->
            F64, ``float32`` -> F32, ``float16`` -> F16, ``int8`` ... ``uint64``, ``bool``).
        metadata: optional string -> string map stored as ``__metadata__``.
        dtypes: optional per-tensor storage dtype override by safetensors name, e.g.
            ``{"w": "BF16"}`` (rounded to nearest even) or ``{"w": "F16"}`` (numpy cast).

    Returns:
        ``Path(path)``.

    Raises:
        ValueError: a name is empty or ``__metadata__``, an array dtype has no safetensors
            equivalent (complex, object, ...), an override names an unknown dtype, or
            metadata is not string -> string.
    """
    p = Path(path)
    overrides = dict(dtypes or {})
    unknown = sorted(set(overrides) - set(tensors))
    if unknown:
        raise ValueError(f"dtypes overrides name tensors that are not being saved: {unknown}")
    encoded: list[tuple[str, str, tuple[int, ...], bytes]] = []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(f"invalid tensor name {name!r}")
        arr = np.asarray(value)
        st = overrides.get(name)
        if st is None:
            st = _NUMPY_TO_ST.get((arr.dtype.kind, arr.dtype.itemsize))
            if st is None:
                raise ValueError(f"tensor {name!r}: numpy dtype {arr.dtype} has no safetensors equivalent")
        if st not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r}: unknown safetensors dtype {st!r} (supported: {', '.join(SAFETENSORS_DTYPES)})")
        if st == "BF16":
            data = float32_to_bf16_bits(arr)
        else:
            data = np.ascontiguousarray(arr, dtype=SAFETENSORS_DTYPES[st])
        encoded.append((name, st, tuple(int(d) for d in arr.shape), data.tobytes()))
    encoded.sort(key=lambda e: (-SAFETENSORS_DTYPES[e[1]].itemsize, e[0]))

    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("metadata must map strings to strings")
        header["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    offset = 0
    for name, st, shape, blob in encoded:
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)

    tmp = p.with_name(p.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, _, _, blob in encoded:
            f.write(blob)
    os.replace(tmp, p)
    return p
