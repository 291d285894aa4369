"""The simulated ``neuronx-cc``: one :class:`NeffSpec` (a shape bucket) -> one NEFF file.

Nothing is lowered or optimised: the "compiler" checks the spec against the model, fixes the
program's input/output signature (:func:`io_info`), checks that weights, KV cache and activations
fit one logical core's HBM (``NCC_EOOM001`` otherwise), computes a deterministic simulated compile
time and writes a :mod:`~npusim.neff.neff_file` holding all of it. The numbers are computed by
the decoder at execution time (:mod:`npusim.neff.runtime`).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..llm import ModelConfig, load_config
from ..llm.decoder import expected_tensor_shapes
from . import neff_file
from .errors import NeffCompileError
from .platform import check_target, device_info, get_platform_target

__all__ = [
    "COMPILER_VERSION",
    "SIMULATOR_VERSION",
    "KV_DTYPES",
    "NeffSpec",
    "CompileReport",
    "compile_neff",
    "io_info",
    "kv_cache_shape",
    "model_digest",
    "model_bytes",
]

SIMULATOR_VERSION = "0.1.0"
COMPILER_VERSION = "2.21.0+npusim"
KV_DTYPES = ("auto", "fp8_e4m3")
_KINDS = ("prefill", "decode")


def _pos_int(name: str, v: Any, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"NeffSpec {name} must be an integer >= {minimum}, got {v!r}")
    return v


@dataclass(frozen=True)
class NeffSpec:
    """One compile target (a NEFF).

    Attributes:
        kind: ``"prefill"`` (one sequence, ``tokens`` tokens) or ``"decode"`` (``batch`` rows, one
            token each).
        tokens: prefill token bucket (decode: 1).
        batch: decode batch bucket (prefill: 1).
        kv_segment: prefill KV segment size (0 = not segmented; else >= ``tokens`` and a
            multiple of ``block_size``). Part of the program's name and compile time only.
        context: decode context-length bucket in tokens (``None`` -> ``max_model_len``).
        max_model_len: longest sequence (tokens).
        block_size: tokens per KV block.
        num_blocks: KV blocks in the pool.
        kv_dtype: ``"auto"`` (float32) or ``"fp8_e4m3"`` (values stored clamped and rounded).
        on_device_sampling: the program also samples (``sampling_params``/``rand`` -> ``tokens``).
        logit_mask: with ``on_device_sampling``, the program also takes ``logit_mask`` (int32
            ``[rows, vocab]``, 1 = the token may be sampled): the grammar bitmask of structured
            outputs, applied to the logits before sampling (the returned logits stay raw).
        prompt_embeds: a prefill that also takes ``inputs_embeds`` (float32 ``[tokens, hidden]``)
            and ``embeds_mask`` (int32 ``[tokens]``, 1 = the position's input is its
            ``inputs_embeds`` row, 0 = its token's embedding): ``--enable-prompt-embeds``.
        max_top_k: width of the sampling kernel's top-k.
        deterministic: the sampler uses 0.5 instead of ``rand``.
    """

    kind: str
    tokens: int = 1
    batch: int = 1
    kv_segment: int = 0
    context: int | None = None
    max_model_len: int = 2048
    block_size: int = 32
    num_blocks: int = 64
    kv_dtype: str = "auto"
    on_device_sampling: bool = True
    logit_mask: bool = False
    prompt_embeds: bool = False
    max_top_k: int = 256
    deterministic: bool = False

    def __post_init__(self) -> None:
        """Normalise ``context`` and check every field.

        Raises:
            ValueError: a bad field (named with its value).
        """
        if self.kind not in _KINDS:
            raise ValueError(f"NeffSpec kind must be one of {_KINDS}, got {self.kind!r}")
        _pos_int("max_model_len", self.max_model_len)
        _pos_int("block_size", self.block_size)
        _pos_int("num_blocks", self.num_blocks)
        _pos_int("tokens", self.tokens)
        _pos_int("batch", self.batch)
        _pos_int("kv_segment", self.kv_segment, 0)
        _pos_int("max_top_k", self.max_top_k)
        if self.context is None:
            object.__setattr__(self, "context", self.max_model_len)
        _pos_int("context", self.context)
        if self.context > self.max_model_len:
            raise ValueError(f"NeffSpec context {self.context} exceeds max_model_len {self.max_model_len}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"NeffSpec kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.logit_mask is True and not self.on_device_sampling:
            raise ValueError("NeffSpec logit_mask needs on_device_sampling (the mask applies before sampling)")
        if self.prompt_embeds is True and self.kind != "prefill":
            raise ValueError("NeffSpec prompt_embeds is a prefill input (a decode step feeds a generated token)")
        for name in ("on_device_sampling", "deterministic", "logit_mask", "prompt_embeds"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"NeffSpec {name} must be a bool, got {getattr(self, name)!r}")
        if self.kind == "prefill":
            if self.batch != 1:
                raise ValueError(f"a prefill NeffSpec has batch 1 (one sequence per step), got {self.batch}")
            if self.tokens > self.max_model_len:
                raise ValueError(f"prefill bucket {self.tokens} exceeds max_model_len {self.max_model_len}")
            if self.context != self.max_model_len:
                raise ValueError("a prefill NeffSpec has no context bucket (leave context unset)")
            if self.kv_segment and (self.kv_segment < self.tokens or self.kv_segment % self.block_size):
                raise ValueError(f"kv_segment {self.kv_segment} must be >= tokens {self.tokens} and a "
                                 f"multiple of block_size {self.block_size} (or 0)")
        else:
            if self.tokens != 1:
                raise ValueError(f"a decode NeffSpec has tokens 1, got {self.tokens}")
            if self.kv_segment:
                raise ValueError("a decode NeffSpec has no kv_segment")

    @property
    def name(self) -> str:
        """``prefill_s1024``, ``prefill_s512_kv1024``, ``decode_b8``, ``decode_b8_s2048``."""
        if self.kind == "prefill":
            return f"prefill_s{self.tokens}" + (f"_kv{self.kv_segment}" if self.kv_segment else "")
        return f"decode_b{self.batch}" + (f"_s{self.context}" if self.context < self.max_model_len else "")

    @property
    def rows(self) -> int:
        """Sequences per call (1 for prefill, ``batch`` for decode)."""
        return 1 if self.kind == "prefill" else self.batch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NeffSpec:
        """Raises: ValueError/TypeError on unknown keys or bad values."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown NeffSpec fields {unknown}")
        return cls(**dict(d))


@dataclass(frozen=True)
class CompileReport:
    """What :func:`compile_neff` did.

    Attributes:
        name: the program name (``spec.name``).
        path: the NEFF written.
        neff_size_bytes: its size.
        simulated_seconds: the compile time a real ``neuronx-cc`` might take (not slept).
        target: the target compiled for.
    """

    name: str
    path: Path
    neff_size_bytes: int
    simulated_seconds: float
    target: str


def _config_of(model_dir_or_config: Any) -> ModelConfig:
    if isinstance(model_dir_or_config, ModelConfig):
        return model_dir_or_config
    if isinstance(model_dir_or_config, Mapping):
        return ModelConfig.from_dict(dict(model_dir_or_config))
    return load_config(Path(model_dir_or_config))


def kv_cache_shape(model_dir_or_config: Any, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)`` of the KV pool.

    Args:
        model_dir_or_config: an HF model directory, a :class:`~npusim.llm.ModelConfig` or a
            ``config.json`` dict.
        num_blocks, block_size: the pool geometry (blocks, tokens per block).

    Raises:
        CheckpointError / UnsupportedModelError: the config cannot be read.
        ValueError: a size below 1.
    """
    c = _config_of(model_dir_or_config)
    _pos_int("num_blocks", num_blocks)
    _pos_int("block_size", block_size)
    return (c.num_hidden_layers, 2, int(num_blocks), int(block_size), c.num_key_value_heads, c.head_dim)


def _model_files(model_dir: Path) -> list[Path]:
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and (
        p.name == "config.json" or p.name.endswith(".safetensors") or p.name.endswith(".safetensors.index.json")))
    return files


def model_digest(model_dir: str | os.PathLike) -> tuple[str, list[str]]:
    """SHA-256 (hex) over ``config.json`` and the safetensors files of ``model_dir``, and their names.

    Each file contributes its name, a NUL, its size and its bytes, in name order.

    Raises:
        OSError: the directory cannot be read.
    """
    d = Path(model_dir)
    h = hashlib.sha256()
    names = []
    for p in _model_files(d):
        data = p.read_bytes()
        h.update(p.name.encode() + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
        names.append(p.name)
    return h.hexdigest(), names


def model_bytes(config: ModelConfig) -> int:
    """Bytes of the weights on the device (float32, as the simulator holds them)."""
    return 4 * sum(math.prod(s) for s in expected_tensor_shapes(config).values())


def _activation_bytes(spec: NeffSpec, c: ModelConfig) -> int:
    n_tok = spec.tokens * spec.rows
    per_token = 4 * (4 * c.hidden_size + 2 * c.intermediate_size + c.vocab_size)
    attention = 4 * spec.rows * c.num_attention_heads * spec.tokens * spec.context
    return n_tok * per_token + attention


def io_info(spec: NeffSpec, config: ModelConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The program's inputs and outputs, in call order: ``[{"name", "shape", "dtype"}, ...]``."""
    kv = {"name": "kv_cache", "shape": list(kv_cache_shape(config, spec.num_blocks, spec.block_size)), "dtype": "float32"}
    rows = spec.rows

    def i32(name: str, *shape: int) -> dict[str, Any]:
        return {"name": name, "shape": list(shape), "dtype": "int32"}

    if spec.kind == "prefill":
        t = spec.tokens
        ins = [kv, i32("input_ids", t), i32("position_ids", t), i32("slot_mapping", t),
               i32("block_table", -(-spec.max_model_len // spec.block_size)), i32("last_token_index", 1)]
        if spec.prompt_embeds:
            ins += [{"name": "inputs_embeds", "shape": [t, config.hidden_size], "dtype": "float32"},
                    i32("embeds_mask", t)]
    else:
        b = spec.batch
        ins = [kv, i32("input_ids", b), i32("position_ids", b), i32("slot_mapping", b),
               i32("block_table", b, -(-spec.context // spec.block_size))]
    outs = [{"name": "logits", "shape": [rows, config.vocab_size], "dtype": "float32"}]
    if spec.on_device_sampling:
        ins += [{"name": "sampling_params", "shape": [rows, 3], "dtype": "float32"},
                {"name": "rand", "shape": [rows], "dtype": "float32"}]
        if spec.logit_mask:
            ins.append(i32("logit_mask", rows, config.vocab_size))
        outs.append(i32("tokens", rows))
    return ins, outs


def simulated_compile_seconds(spec: NeffSpec, c: ModelConfig, weight_bytes: int, compiler_args: Sequence[str]) -> float:
    """Deterministic compile time (s): 20 s fixed, per layer 1 s + 0.2 ms per token of the bucket,
    +10 s per GiB of weights, +1 s per 1024 tokens of context (decode), +15 % for on-device
    sampling, x0.6 at ``-O1`` and x1.5 at ``-O3``."""
    s = 20.0 + c.num_hidden_layers * (1.0 + 2e-4 * spec.tokens * spec.rows)
    s += 10.0 * weight_bytes / 2**30
    if spec.kind == "decode":
        s += spec.context / 1024.0
    if spec.on_device_sampling:
        s *= 1.15
    if "-O1" in compiler_args:
        s *= 0.6
    elif "-O3" in compiler_args:
        s *= 1.5
    return round(s, 3)


def compile_neff(spec: NeffSpec, model_dir: str | os.PathLike, output_path: str | os.PathLike, *,
                 target: str | None = None, compiler_args: Sequence[str] = ()) -> CompileReport:
    """Compile ``spec`` for the model in ``model_dir`` into the NEFF ``output_path``.

    Args:
        spec: the bucket.
        model_dir: HF model directory (``config.json`` + safetensors).
        output_path: file to write (parent directories are created).
        target: ``"trn2"``/``"trn3"``/``"trn3pre"``; default :func:`get_platform_target`.
        compiler_args: extra ``neuronx-cc`` arguments (recorded; ``-O1``/``-O3`` scale the time).

    Raises:
        TypeError: ``spec`` is not a NeffSpec, or ``compiler_args`` not strings.
        NeffTargetError: unknown target.
        CheckpointError / UnsupportedModelError: the model cannot be read.
        NeffCompileError: ``NCC_EOOM001``, weights + KV + activations exceed a logical core's HBM
            (all byte figures named); a ``max_model_len`` beyond the model's positions is allowed.
    """
    if not isinstance(spec, NeffSpec):
        raise TypeError(f"compile_neff expects a NeffSpec, got {type(spec).__name__}")
    args = list(compiler_args)
    if not all(isinstance(a, str) for a in args):
        raise TypeError(f"compiler_args must be strings, got {args!r}")
    target = check_target(target, "compile_neff target") if target is not None else get_platform_target()
    mdir = Path(model_dir).resolve()
    config = load_config(mdir)
    digest, files = model_digest(mdir)
    weight_bytes = model_bytes(config)
    kv_bytes = 4 * math.prod(kv_cache_shape(config, spec.num_blocks, spec.block_size))
    act = _activation_bytes(spec, config)
    hbm = device_info(target).hbm_bytes_per_logical_core
    if weight_bytes + kv_bytes + act > hbm:
        raise NeffCompileError(
            "NCC_EOOM001: The combined memory needed for the model tensors exceeds the high-bandwidth "
            f"memory limit. Program {spec.name!r} needs {weight_bytes + kv_bytes + act} bytes "
            f"(weights {weight_bytes}, KV cache {kv_bytes}, activations {act}); a {target} logical core "
            f"has {hbm} bytes.")
    ins, outs = io_info(spec, config)
    seconds = simulated_compile_seconds(spec, config, weight_bytes, args)
    header = {
        "name": spec.name, "spec": spec.to_dict(), "target": target,
        "compiler_version": COMPILER_VERSION, "simulator_version": SIMULATOR_VERSION,
        "compiler_args": args, "model_dir": str(mdir), "model_digest": digest, "model_files": files,
        "inputs": ins, "outputs": outs, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
        "activation_bytes": act, "simulated_seconds": seconds,
    }
    size = neff_file.write(output_path, header)
    return CompileReport(spec.name, Path(output_path), size, seconds, target)
