"""A performance model of the Banana Pi SM10 (SpacemiT K3) board: IME2 GEMM and tokens/s (numpy only).

Predicts the three tables of seed ``004_c20b689d24c6ef7a`` (one A100 core's ``Ime2HpGemm`` GOP/s
at M = 1 and 4; prompt and decode tokens/s of ten models on the IME2 path and on the stock RVV
bf16 path) from

* **instruction counts** of our own IME2 kernel path (``kernels/ime2/src/gemm_ime2.c``), taken
  from its loop structure (:func:`instruction_counts`; the ``.hp`` count is checked against the
  driver's emulated count under QEMU by ``tests/npu_conformance/test_ime2_perf_counts.py``);
* **facts** of the tile format and the run (``shared/reference/ime2.md`` section 2, the seed):
  576-byte K32 x N32 weight blocks, 256-K superblocks of 8 sub-blocks, 4-row groups then single
  rows, N tiles of 32 split over eight A100 cores, a 128-token prompt (129 for TinyLlama),
  32 new tokens of which 31 are timed, seven X100 cores and bf16 weights on the RVV path;
* **six fitted parameters**, fitted only on the visible rows (SmolLM2 135M and TinyLlama 1.1B)
  by deterministic relative least squares (:func:`fit`), two per stage:

  1. GEMM (4 visible points): ``pass_s`` (one row-group pass over one tile and superblock: 64
     ``.hp`` plus 56 other vector instructions and 4608 B of weights streamed) and ``row_s``
     (the per-row epilogue of a tile and superblock: zero-point terms and fp32 accumulation).
  2. Host (the 4 visible IME2 tokens/s points, given stage 1): ``step_s`` (the Python/vLLM
     overhead of one engine step) and ``element_s`` (seconds per host element: norms, RoPE,
     activations, residuals and attention multiply-adds, see :func:`host_elements`).
  3. RVV (the 4 visible RVV points, given stage 2): ``bytes_per_s`` (bf16 weight bytes streamed)
     and ``macs_per_s`` (the seven X100 cores' bf16 multiply-add rate).

All times are seconds, sizes bytes, rates per second; GOP/s is ``2*M*N*K / t / 1e9`` as the seed
defines it. No torch, no vLLM: stdlib and numpy. The withheld rows are predicted, never used.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from .errors import Q4x32Error

__all__ = [
    "GemmParams", "HostParams", "RvvParams", "FittedParams", "InstructionCounts", "GemmPrediction",
    "ModelConfig", "TokensPrediction", "TableRow", "PerfModelInputError", "GemmShapeError",
    "UnknownModelError", "ModelConfigError", "PathError", "instruction_counts", "predict_gemm",
    "fit", "fitted_params", "load_board_models", "model_config", "config_from_hf", "resolve_model",
    "linear_shapes", "host_elements", "predict_tokens", "predict_table", "format_table",
    "format_params", "VISIBLE_GEMM", "VISIBLE_TOKENS", "SEED_GEMM_SHAPES",
]

# ---------------------------------------------------------------------------------------------
# facts (each with its source)

#: K per superblock, sub-blocks per superblock, columns per tile, rows per group, bytes per
#: K32 x N32 block: shared/reference/ime2.md section 2.1 and 2.2; kernels/ime2/src/internal.h.
SUPERBLOCK_K = 256
SUBBLOCKS = 8
TILE_N = 32
ROW_GROUP = 4
B_BLOCK_BYTES = 576
#: Per K32 sub-block, hp_subblock() in gemm_ime2.c issues 8 .hp (vmadotsu.hp + vmadotu.hp for
#: each of 4 column groups), 6 vle8.v (A hi/lo planes, 4 x 128 B of nibbles), 5 vle16.v (v0
#: scales, 4 accumulators), 4 vse16.v (the accumulators back) and 2 vsetvli.
HP_PER_SUBBLOCK = 8
VLE8_PER_SUBBLOCK = 6
VLE16_PER_SUBBLOCK = 5
VSE16_PER_SUBBLOCK = 4
VSETVLI_PER_SUBBLOCK = 2
#: The seed: IME2 generation on eight A100 cores (VLEN 1024), one core per slice of the N tiles;
#: the stock RVV path on the seven X100 cores vLLM binds the worker to (VLEN 256), bf16 weights.
IME2_CORES = 8
RVV_CORES = 7
IME2_VLEN = 1024
RVV_VLEN = 256
BF16_BYTES = 2
#: The seed's run: 32 new tokens at temperature 0; decode tokens/s is the 31 after the first.
NEW_TOKENS = 32
DECODE_TIMED = NEW_TOKENS - 1
#: Per-call overhead of Ime2HpGemm (s): an assumption, not fitted. The four visible GEMM rows are
#: fitted within 3 % without it, so it is not identifiable from them.
CALL_OVERHEAD_S = 0.0

#: The seed's GEMM table: (model, K, N), every shape (the feed-forward gate: K = hidden, N =
#: intermediate).
SEED_GEMM_SHAPES: tuple[tuple[str, int, int], ...] = (
    ("SmolLM2 135M", 576, 1536), ("SmolLM2 360M", 960, 2560), ("Qwen2.5 0.5B", 896, 4864),
    ("TinyLlama 1.1B", 2048, 5632), ("Qwen2.5 1.5B", 1536, 8960), ("StableLM 2 1.6B", 2048, 5632),
    ("SmolLM2 1.7B", 2048, 8192), ("Phi-2", 2560, 10240), ("Qwen2.5 3B", 2048, 11008))
#: The seed's visible GEMM rows: (model, M) -> measured GOP/s on one A100 core (K, N from
#: :data:`SEED_GEMM_SHAPES`; StableLM 2 1.6B has TinyLlama's shape but its row is withheld).
VISIBLE_GEMM: Mapping[tuple[str, int], float] = {
    ("SmolLM2 135M", 1): 28.18, ("SmolLM2 135M", 4): 69.37, ("TinyLlama 1.1B", 1): 37.20,
    ("TinyLlama 1.1B", 4): 95.25}
#: The seed's visible tokens/s rows: (model, path) -> (prompt, decode).
VISIBLE_TOKENS: Mapping[tuple[str, str], tuple[float, float]] = {
    ("SmolLM2 135M", "ime2"): (87.11, 11.14), ("TinyLlama 1.1B", "ime2"): (30.09, 7.38),
    ("SmolLM2 135M", "rvv"): (1.95, 1.27), ("TinyLlama 1.1B", "rvv"): (0.23, 0.17)}
PATHS = ("ime2", "rvv")
#: Fields every model config needs (HF config.json names).
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                   "vocab_size")
#: HF model types whose MLP is plain (fc1 -> activation -> fc2) rather than gated.
PLAIN_MLP_TYPES = frozenset({"phi", "gpt2", "gpt_neox", "gptj", "opt", "falcon", "starcoder2"})
BOARD_MODELS_FILE = "board_models.json"


# ---------------------------------------------------------------------------------------------
# errors


class PerfModelInputError(Q4x32Error):
    """Bad input to the performance model (a :class:`ValueError`); the message names the value
    and the rule it breaks."""


class GemmShapeError(PerfModelInputError):
    """K is not a positive multiple of 32, or N or M is not a positive integer."""


class UnknownModelError(PerfModelInputError):
    """A model argument is neither one of the ten shipped names nor a config.json / HF directory."""


class ModelConfigError(PerfModelInputError):
    """A model config lacks a required field, or a field has an impossible value."""


class PathError(PerfModelInputError):
    """The execution path is not ``ime2`` or ``rvv``."""


# ---------------------------------------------------------------------------------------------
# parameters and results


@dataclass(frozen=True)
class GemmParams:
    """IME2 GEMM cost on one A100 core (seconds).

    ``pass_s``: one row-group pass (4 rows, or 1 remainder row) over one full 32-column tile and
    one 256-K superblock: 64 ``.hp`` + 56 other vector instructions, 4608 weight bytes streamed.
    ``row_s``: per row, tile and superblock (the epilogue: 8 zero-point terms and the d16 term
    into 32 fp32 accumulators). ``call_s``: per call (:data:`CALL_OVERHEAD_S`, assumed).
    """

    pass_s: float
    row_s: float
    call_s: float = CALL_OVERHEAD_S

    @property
    def hp_s(self) -> float:
        """Seconds per ``.hp`` if a pass were bound by instruction issue alone (an upper bound)."""
        return self.pass_s / (SUBBLOCKS * HP_PER_SUBBLOCK)

    @property
    def pass_bytes_per_s(self) -> float:
        """Weight bandwidth (bytes/s) if a pass were bound by streaming its 4608 B alone (a lower
        bound on the core's real bandwidth)."""
        return SUBBLOCKS * B_BLOCK_BYTES / self.pass_s


@dataclass(frozen=True)
class HostParams:
    """Host-side cost of a step (seconds): ``step_s`` once per engine step (Python/vLLM), and
    ``element_s`` per host element (:func:`host_elements`); also used for the scalar N tail."""

    step_s: float
    element_s: float


@dataclass(frozen=True)
class RvvParams:
    """The stock RVV bf16 path on seven X100 cores: weight ``bytes_per_s`` (bf16 bytes of every
    linear layer streamed once per step) and ``macs_per_s`` (multiply-adds per second, all seven
    cores together)."""

    bytes_per_s: float
    macs_per_s: float


@dataclass(frozen=True)
class FittedParams:
    """The six fitted parameters and each stage's relative residuals on its visible rows."""

    gemm: GemmParams
    host: HostParams
    rvv: RvvParams
    gemm_residuals: tuple[float, ...]
    host_residuals: tuple[float, ...]
    rvv_residuals: tuple[float, ...]


@dataclass(frozen=True)
class InstructionCounts:
    """What our IME2 path (gemm_ime2.c) issues for one GEMM on one core.

    ``passes``: row-group passes x full tiles x superblocks; ``row_passes``: rows x full tiles x
    superblocks; ``hp`` etc.: vector instructions; ``weight_bytes``: packed weight bytes read
    (each pass reads its tile's superblock: 4608 B); ``tail_columns``: N % 32 (scalar tail).
    """

    k: int
    n: int
    m: int
    superblocks: int
    full_tiles: int
    row_groups: int
    passes: int
    row_passes: int
    hp: int
    vle8: int
    vle16: int
    vse16: int
    vsetvli: int
    weight_bytes: int
    tail_columns: int


@dataclass(frozen=True)
class GemmPrediction:
    """Predicted GEMM time (seconds) and its split; ``gops`` is 2*M*N*K / seconds / 1e9."""

    k: int
    n: int
    m: int
    cores: int
    seconds: float
    pass_seconds: float
    row_seconds: float
    tail_seconds: float
    call_seconds: float
    gops: float

    @property
    def bound(self) -> str:
        """Which term dominates: ``"pass"`` (.hp issue / weight streaming), ``"row"`` or ``"tail"``."""
        terms = {"pass": self.pass_seconds, "row": self.row_seconds, "tail": self.tail_seconds}
        return max(terms, key=terms.__getitem__)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the model needs (HF config.json names) and the run's prompt length."""

    name: str
    hf_id: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    mlp: str
    partial_rotary_factor: float
    prompt_tokens: int
    head_dim: int


@dataclass(frozen=True)
class TokensPrediction:
    """Predicted prompt and decode tokens/s of one model on one path, with the times (seconds)."""

    model: str
    path: str
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    prompt_tps: float
    decode_tps: float


@dataclass(frozen=True)
class TableRow:
    """One predicted figure of the seed's tables; ``measured`` is None for a withheld row."""

    table: str
    label: str
    predicted: float
    measured: float | None

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured, or None for a withheld row."""
        return None if self.measured is None else (self.predicted - self.measured) / self.measured


# ---------------------------------------------------------------------------------------------
# instruction counts and the GEMM time


def _positive_int(value: object, what: str) -> int:
    """``value`` as an int >= 1. Raises: GemmShapeError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise GemmShapeError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _check_shape(k: object, n: object, m: object) -> tuple[int, int, int]:
    """Validated (K, N, M). Raises: GemmShapeError (K not a positive multiple of 32, N or M < 1)."""
    kk = _positive_int(k, "K")
    if kk % 32:
        raise GemmShapeError(f"K must be a multiple of 32 (the Q4_0 block length), got {kk}")
    return kk, _positive_int(n, "N"), _positive_int(m, "M")


def instruction_counts(k: int, n: int, m: int, *, cores: int = 1) -> InstructionCounts:
    """Instructions our IME2 path issues for C[M, N] = A[M, K] x B on the slowest of ``cores``.

    From gemm_ime2.c: rows in 4-row groups then single rows (M // 4 + M % 4 passes per tile);
    ``N // 32`` full tiles (split over ``cores``: the slowest core gets ``ceil(tiles / cores)``);
    ``ceil(K / 256)`` superblocks (K % 256 != 0 is padded to a full superblock); 8 sub-blocks per
    superblock, each one :func:`hp_subblock` call. Columns past 32 * (N // 32) take the scalar
    tail (no vector instruction counted).

    Raises:
        GemmShapeError: K not a positive multiple of 32, N, M or cores not a positive integer.
    """
    k, n, m = _check_shape(k, n, m)
    cores = _positive_int(cores, "cores")
    superblocks = math.ceil(k / SUPERBLOCK_K)
    full_tiles = math.ceil((n // TILE_N) / cores)
    row_groups = m // ROW_GROUP + m % ROW_GROUP
    passes = row_groups * full_tiles * superblocks
    sub = passes * SUBBLOCKS
    return InstructionCounts(
        k=k, n=n, m=m, superblocks=superblocks, full_tiles=full_tiles, row_groups=row_groups,
        passes=passes, row_passes=m * full_tiles * superblocks, hp=sub * HP_PER_SUBBLOCK,
        vle8=sub * VLE8_PER_SUBBLOCK, vle16=sub * VLE16_PER_SUBBLOCK, vse16=sub * VSE16_PER_SUBBLOCK,
        vsetvli=sub * VSETVLI_PER_SUBBLOCK, weight_bytes=sub * B_BLOCK_BYTES, tail_columns=n % TILE_N)


def _gemm_terms(k: int, n: int, m: int, cores: int) -> tuple[float, float, float]:
    """(passes, row passes, scalar-tail multiply-adds) of the slowest core: the regressors."""
    c = instruction_counts(k, n, m, cores=cores)
    return float(c.passes), float(c.row_passes), float(m * c.tail_columns * k)


def predict_gemm(k: int, n: int, m: int, *, cores: int = 1, params: FittedParams | None = None) -> GemmPrediction:
    """Predicted time of one ``Ime2HpGemm`` call on ``cores`` A100 cores (N tiles split, the
    slowest core decides; the scalar tail on one core).

    ``t = passes * pass_s + row_passes * row_s + tail_macs * element_s + call_s`` (seconds).

    Raises:
        GemmShapeError: see :func:`instruction_counts`.
    """
    p = params or fitted_params()
    passes, rows, tail = _gemm_terms(k, n, m, cores)
    t_pass, t_row = passes * p.gemm.pass_s, rows * p.gemm.row_s
    t_tail, t_call = tail * p.host.element_s, p.gemm.call_s
    seconds = t_pass + t_row + t_tail + t_call
    return GemmPrediction(k=k, n=n, m=m, cores=cores, seconds=seconds, pass_seconds=t_pass, row_seconds=t_row,
                          tail_seconds=t_tail, call_seconds=t_call, gops=2.0 * m * n * k / seconds / 1e9)


# ---------------------------------------------------------------------------------------------
# model configs


def _config_int(cfg: Mapping[str, object], key: str, source: str) -> int:
    """A positive int field. Raises: ModelConfigError (missing or not a positive integer)."""
    if key not in cfg or cfg[key] is None:
        raise ModelConfigError(f"{source}: config field {key!r} is missing (required: {', '.join(REQUIRED_FIELDS)})")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelConfigError(f"{source}: config field {key!r} must be a positive integer, got {value!r}")
    return value


def config_from_hf(cfg: Mapping[str, object], *, name: str = "", source: str = "config") -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face config.json mapping (or a board_models.json entry).

    Defaults where config.json may omit a field (as transformers applies them):
    ``num_key_value_heads`` = heads, ``tie_word_embeddings`` = True, ``partial_rotary_factor`` =
    1.0, ``head_dim`` = hidden / heads; ``mlp`` from ``model_type`` (plain for Phi-2's family,
    else gated); ``prompt_tokens`` = 128 (the seed's prompt).

    Raises:
        ModelConfigError: a required field is missing or not a positive integer, heads do not
            divide the hidden size, KV heads do not divide heads, ``mlp`` or the rotary factor is
            invalid.
    """
    if not isinstance(cfg, Mapping):
        raise ModelConfigError(f"{source}: a config must be a JSON object, got {type(cfg).__name__}")
    ints = {key: _config_int(cfg, key, source) for key in REQUIRED_FIELDS}
    heads = ints["num_attention_heads"]
    kv = _config_int(cfg, "num_key_value_heads", source) if cfg.get("num_key_value_heads") is not None else heads
    if heads % kv:
        raise ModelConfigError(f"{source}: num_key_value_heads {kv} must divide num_attention_heads {heads}")
    if cfg.get("head_dim") is not None:
        head_dim = _config_int(cfg, "head_dim", source)
    elif ints["hidden_size"] % heads:
        raise ModelConfigError(f"{source}: num_attention_heads {heads} must divide hidden_size "
                               f"{ints['hidden_size']} (or give head_dim)")
    else:
        head_dim = ints["hidden_size"] // heads
    mlp = cfg.get("mlp") or ("plain" if cfg.get("model_type") in PLAIN_MLP_TYPES else "gated")
    if mlp not in ("gated", "plain"):
        raise ModelConfigError(f"{source}: mlp must be 'gated' or 'plain', got {mlp!r}")
    rot = cfg.get("partial_rotary_factor", 1.0)
    if isinstance(rot, bool) or not isinstance(rot, (int, float)) or not 0.0 < rot <= 1.0:
        raise ModelConfigError(f"{source}: partial_rotary_factor must be in (0, 1], got {rot!r}")
    prompt = cfg.get("prompt_tokens", 128)
    if isinstance(prompt, bool) or not isinstance(prompt, int) or prompt < 1:
        raise ModelConfigError(f"{source}: prompt_tokens must be a positive integer, got {prompt!r}")
    return ModelConfig(
        name=name or str(cfg.get("name") or cfg.get("_name_or_path") or source),
        hf_id=str(cfg.get("hf_id") or cfg.get("_name_or_path") or ""),
        hidden_size=ints["hidden_size"], num_hidden_layers=ints["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=ints["intermediate_size"],
        vocab_size=ints["vocab_size"], tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        mlp=mlp, partial_rotary_factor=float(rot), prompt_tokens=prompt, head_dim=head_dim)


@functools.cache
def load_board_models() -> tuple[ModelConfig, ...]:
    """The ten models of the seed's tables, from the package's ``board_models.json``.

    Raises:
        ModelConfigError: an entry lacks a field (a broken package).
    """
    text = resources.files(__package__).joinpath(BOARD_MODELS_FILE).read_text(encoding="utf-8")
    return tuple(config_from_hf(entry, source=f"{BOARD_MODELS_FILE}[{i}]")
                 for i, entry in enumerate(json.loads(text)["models"]))


def model_config(name: str) -> ModelConfig:
    """One of the ten shipped models by its seed name (case-insensitive) or HF id.

    Raises:
        UnknownModelError: no shipped model has that name or id.
    """
    for cfg in load_board_models():
        if name.lower() in (cfg.name.lower(), cfg.hf_id.lower()):
            return cfg
    names = ", ".join(repr(c.name) for c in load_board_models())
    raise UnknownModelError(f"unknown model {name!r}: not one of the shipped models ({names}), "
                            "and not a config.json or a directory holding one")


def resolve_model(arg: str) -> ModelConfig:
    """A model from a CLI argument: a local HF directory with config.json, a config.json path, or
    one of the ten shipped names (or HF ids).

    Raises:
        UnknownModelError: none of the three. ModelConfigError: the config.json is unreadable,
            not JSON, or lacks a field.
    """
    path = Path(arg)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise UnknownModelError(f"{arg!r} is a directory without config.json")
    if path.is_file():
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelConfigError(f"{path}: not a readable JSON config ({exc})") from exc
        return config_from_hf(cfg, name=path.parent.name if path.name == "config.json" else path.stem,
                              source=str(path))
    return model_config(arg)


# ---------------------------------------------------------------------------------------------
# the model: linear layers, host work, tokens/s


def linear_shapes(cfg: ModelConfig) -> tuple[tuple[str, int, int], ...]:
    """The linear layers of one decoder layer as vLLM runs them: (name, K, N).

    vLLM fuses q, k, v into ``qkv_proj`` (N = (heads + 2 kv heads) * head_dim) and gate and up
    into ``gate_up_proj`` (N = 2 * intermediate); a plain MLP (Phi-2) has ``fc1`` and ``fc2``.
    """
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attn = (("qkv_proj", h, q + 2 * kv), ("o_proj", q, h))
    if cfg.mlp == "plain":
        return attn + (("fc1", h, cfg.intermediate_size), ("fc2", cfg.intermediate_size, h))
    return attn + (("gate_up_proj", h, 2 * cfg.intermediate_size), ("down_proj", cfg.intermediate_size, h))


def host_elements(cfg: ModelConfig, tokens: int, context: Sequence[int]) -> float:
    """Host elements of one step over all layers (the unit ``HostParams.element_s`` prices).

    Per token and layer: 2 norms and 2 residual adds (4 * hidden), RoPE on the rotary part of q
    and k (``partial_rotary_factor * (heads + kv heads) * head_dim``), the MLP activation (gated:
    SiLU and the product, 2 * intermediate; plain: intermediate), and attention's multiply-adds
    (``2 * heads * head_dim * context`` for QK^T and PV). ``context[i]`` is the number of
    positions token i attends to. Neglected: biases, embedding lookup, sampling.
    """
    hd, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    act = 2 * cfg.intermediate_size if cfg.mlp == "gated" else cfg.intermediate_size
    per_token = 4 * cfg.hidden_size + cfg.partial_rotary_factor * (heads + kv) * hd + act
    attention = 2 * heads * hd * float(sum(context))
    return cfg.num_hidden_layers * (tokens * per_token + attention)


def _weights(cfg: ModelConfig) -> tuple[float, float]:
    """(parameters of all decoder linear layers, lm_head parameters). A tied lm_head is the
    embedding matrix, but the logits GEMM reads it all the same, so tying changes no cost."""
    per_layer = sum(k * n for _, k, n in linear_shapes(cfg))
    return float(cfg.num_hidden_layers * per_layer), float(cfg.hidden_size * cfg.vocab_size)


def _ime2_gemm_terms(cfg: ModelConfig, tokens: int) -> np.ndarray:
    """GEMM regressors (passes, row passes, tail MACs) of one step on 8 A100 cores: every linear
    layer at M = ``tokens``, the lm_head at M = 1 (vLLM computes logits for the last token only)."""
    layer = sum(np.array(_gemm_terms(k, n, tokens, IME2_CORES)) for _, k, n in linear_shapes(cfg))
    return cfg.num_hidden_layers * layer + np.array(_gemm_terms(cfg.hidden_size, cfg.vocab_size, 1, IME2_CORES))


def _rvv_terms(cfg: ModelConfig, tokens: int) -> np.ndarray:
    """RVV regressors of one step: (bf16 weight bytes, multiply-adds); lm_head at M = 1."""
    layers, lm_head = _weights(cfg)
    return np.array([BF16_BYTES * (layers + lm_head), tokens * layers + lm_head])


def _steps(cfg: ModelConfig) -> tuple[tuple[int, list[int]], list[tuple[int, list[int]]]]:
    """The seed's run as steps (tokens, context per token): one prefill of the prompt (causal:
    token i attends to i + 1 positions), then the 31 timed decode steps (one token each)."""
    p = cfg.prompt_tokens
    prefill = (p, list(range(1, p + 1)))
    decode = [(1, [p + i]) for i in range(1, DECODE_TIMED + 1)]
    return prefill, decode


def _step_seconds(cfg: ModelConfig, path: str, tokens: int, context: list[int], p: FittedParams) -> float:
    """Seconds of one engine step on ``path`` (host + GEMMs)."""
    host = p.host.step_s + p.host.element_s * host_elements(cfg, tokens, context)
    if path == "ime2":
        passes, rows, tail = _ime2_gemm_terms(cfg, tokens)
        n_calls = cfg.num_hidden_layers * len(linear_shapes(cfg)) + 1
        return host + passes * p.gemm.pass_s + rows * p.gemm.row_s + tail * p.host.element_s + n_calls * p.gemm.call_s
    nbytes, macs = _rvv_terms(cfg, tokens)
    return host + nbytes / p.rvv.bytes_per_s + macs / p.rvv.macs_per_s


def _check_path(path: str) -> str:
    """Raises: PathError (not ``ime2`` or ``rvv``)."""
    if path not in PATHS:
        raise PathError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    return path


def predict_tokens(cfg: ModelConfig | str, path: str = "ime2", *, params: FittedParams | None = None) -> TokensPrediction:
    """Predicted prompt and decode tokens/s for the seed's run (prompt of ``cfg.prompt_tokens``,
    32 new tokens, 31 timed): prompt tokens/s = prompt / prefill time; decode tokens/s = 31 / the
    31 decode steps' time.

    Raises:
        PathError: ``path`` is not ime2 or rvv. UnknownModelError, ModelConfigError: see
            :func:`resolve_model` (when ``cfg`` is a string).
    """
    _check_path(path)
    if isinstance(cfg, str):
        cfg = resolve_model(cfg)
    p = params or fitted_params()
    (pt, pc), decode = _steps(cfg)
    prefill_s = _step_seconds(cfg, path, pt, pc, p)
    decode_s = sum(_step_seconds(cfg, path, t, c, p) for t, c in decode)
    return TokensPrediction(model=cfg.name, path=path, prompt_tokens=cfg.prompt_tokens, prefill_seconds=prefill_s,
                            decode_seconds=decode_s, prompt_tps=cfg.prompt_tokens / prefill_s,
                            decode_tps=DECODE_TIMED / decode_s)


# ---------------------------------------------------------------------------------------------
# the fit


def _relative_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, tuple[float, ...]]:
    """Least squares of ``x @ theta = y`` in relative error (rows scaled by 1/y); deterministic.
    Returns theta and the relative residuals (pred - y) / y."""
    theta = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)[0]
    return theta, tuple(float(r) for r in (x @ theta - y) / y)


def _measured_times(cfg: ModelConfig, prompt_tps: float, decode_tps: float) -> tuple[float, float]:
    """(prefill seconds, mean decode-step seconds) implied by a visible row."""
    return cfg.prompt_tokens / prompt_tps, 1.0 / decode_tps


def _step_rows(cfg: ModelConfig) -> list[tuple[int, list[int], float]]:
    """(tokens, context, weight) for the prefill and the mean decode step (weight 1/31 each)."""
    (pt, pc), decode = _steps(cfg)
    return [(pt, pc, 1.0)] + [(t, c, 1.0 / DECODE_TIMED) for t, c in decode]


def fit() -> FittedParams:
    """Fit the six parameters on the visible rows only, in three closed-form stages (numpy
    least squares on relative error): GEMM on :data:`VISIBLE_GEMM`; host on the visible IME2
    tokens/s rows given the GEMM; RVV on the visible RVV rows given the host. Deterministic.
    """
    gx, gy = [], []
    shapes = {model: (k, n) for model, k, n in SEED_GEMM_SHAPES}
    for (model, m), gops in VISIBLE_GEMM.items():
        k, n = shapes[model]
        passes, rows, _ = _gemm_terms(k, n, m, 1)
        gx.append([passes, rows])
        gy.append(2.0 * m * n * k / (gops * 1e9))
    (pass_s, row_s), g_res = _relative_lstsq(np.array(gx), np.array(gy))
    gemm = GemmParams(pass_s=float(pass_s), row_s=float(row_s))

    hx, hy, rx, ry = [], [], [], []
    for (name, path), (prompt_tps, decode_tps) in VISIBLE_TOKENS.items():
        cfg = model_config(name)
        targets = _measured_times(cfg, prompt_tps, decode_tps)
        for (rows_, target) in zip(([_step_rows(cfg)[0]], _step_rows(cfg)[1:]), targets):
            steps = sum(w for _, _, w in rows_)
            elements = sum(w * host_elements(cfg, t, c) for t, c, w in rows_)
            if path == "ime2":
                g = sum(w * _ime2_gemm_terms(cfg, t) for t, _, w in rows_)
                gemm_s = g[0] * gemm.pass_s + g[1] * gemm.row_s  # tails are zero on these shapes
                hx.append([steps, elements])
                hy.append(target - gemm_s)
            else:
                rx.append((rows_, cfg, target))
    (step_s, element_s), h_res = _relative_lstsq(np.array(hx), np.array(hy))
    host = HostParams(step_s=float(step_s), element_s=float(element_s))

    x, y = [], []
    for rows_, cfg, target in rx:
        host_s = sum(w * (host.step_s + host.element_s * host_elements(cfg, t, c)) for t, c, w in rows_)
        x.append(sum(w * _rvv_terms(cfg, t) for t, _, w in rows_))
        y.append(target - host_s)
    (inv_bw, inv_rate), r_res = _relative_lstsq(np.array(x), np.array(y))
    rvv = RvvParams(bytes_per_s=float(1.0 / inv_bw), macs_per_s=float(1.0 / inv_rate))
    return FittedParams(gemm=gemm, host=host, rvv=rvv, gemm_residuals=g_res, host_residuals=h_res,
                        rvv_residuals=r_res)


@functools.cache
def fitted_params() -> FittedParams:
    """:func:`fit`, computed once per process."""
    return fit()


# ---------------------------------------------------------------------------------------------
# tables and text


def predict_table(params: FittedParams | None = None) -> list[TableRow]:
    """Every figure of the seed's three tables, predicted; the visible ones with their measured
    value. GEMM rows are labelled ``"<model> K=.. N=.. M=.."`` (GOP/s, one A100 core); tokens
    rows ``"<model> <ime2|rvv> <prompt|decode>"`` (tokens/s)."""
    p = params or fitted_params()
    rows = []
    for model, k, n in SEED_GEMM_SHAPES:
        for m in (1, 4):
            rows.append(TableRow("gemm", f"{model} K={k} N={n} M={m}", predict_gemm(k, n, m, params=p).gops,
                                 VISIBLE_GEMM.get((model, m))))
    for path in PATHS:
        for cfg in load_board_models():
            pred = predict_tokens(cfg, path, params=p)
            seen = VISIBLE_TOKENS.get((cfg.name, path))
            rows.append(TableRow(path, f"{cfg.name} {path} prompt", pred.prompt_tps, seen and seen[0]))
            rows.append(TableRow(path, f"{cfg.name} {path} decode", pred.decode_tps, seen and seen[1]))
    return rows


def _fmt(value: float) -> str:
    return f"{value:.3g}" if value < 10 else f"{value:.2f}"


def format_table(params: FittedParams | None = None) -> str:
    """The predicted tables as Markdown (GEMM GOP/s; IME2 and RVV prompt/decode tokens/s), the
    visible rows with their measured value and relative error."""
    p = params or fitted_params()
    by = {r.label: r for r in predict_table(p)}

    def cell(label: str) -> str:
        r = by[label]
        if r.measured is None:
            return f"{_fmt(r.predicted)} | (withheld)"
        return f"{_fmt(r.predicted)} | {_fmt(r.measured)} ({r.error:+.1%})"

    out = ["IME2 GEMM, one A100 core, GOP/s (predicted | measured (error))", "",
           "| model | K | N | M=1 | seed | M=4 | seed |", "|---|---|---|---|---|---|---|"]
    for model, k, n in SEED_GEMM_SHAPES:
        out.append(f"| {model} | {k} | {n} | {cell(f'{model} K={k} N={n} M=1')} | {cell(f'{model} K={k} N={n} M=4')} |")
    for path, title in (("ime2", "IME2 generation, eight A100 cores"), ("rvv", "RVV bf16, seven X100 cores")):
        out += ["", f"{title}, tokens/s (predicted | measured (error))", "",
                "| model | prompt tokens | prompt | seed | decode | seed |", "|---|---|---|---|---|---|"]
        for cfg in load_board_models():
            out.append(f"| {cfg.name} | {cfg.prompt_tokens} | {cell(f'{cfg.name} {path} prompt')} | "
                       f"{cell(f'{cfg.name} {path} decode')} |")
    return "\n".join(out)


def format_params(params: FittedParams | None = None) -> str:
    """The fitted parameters with their units, derived quantities and each fit's residuals."""
    p = params or fitted_params()

    def res(values: tuple[float, ...]) -> str:
        return ", ".join(f"{v:+.1%}" for v in values)

    return "\n".join([
        "fitted on the visible rows only (SmolLM2 135M, TinyLlama 1.1B):",
        f"  gemm.pass_s      = {p.gemm.pass_s:.4e} s  per row-group pass (64 .hp, 4608 B of weights): "
        f"{p.gemm.hp_s * 1e9:.2f} ns per .hp if issue-bound, {p.gemm.pass_bytes_per_s / 1e9:.1f} GB/s if memory-bound",
        f"  gemm.row_s       = {p.gemm.row_s:.4e} s  per row, tile and superblock (epilogue)",
        f"  host.step_s      = {p.host.step_s:.4e} s  per engine step (Python/vLLM)",
        f"  host.element_s   = {p.host.element_s:.4e} s  per host element (norms, RoPE, activation, attention MAC)",
        f"  rvv.bytes_per_s  = {p.rvv.bytes_per_s:.4e} B/s  bf16 weight stream, seven X100 cores",
        f"  rvv.macs_per_s   = {p.rvv.macs_per_s:.4e} MAC/s  bf16 multiply-adds, seven X100 cores",
        "assumed (not fitted):",
        f"  gemm.call_s      = {p.gemm.call_s:.1e} s  per Ime2HpGemm call",
        "relative residuals of each stage's fit:",
        f"  gemm (K576 M1, K576 M4, K2048 M1, K2048 M4 times): {res(p.gemm_residuals)}",
        f"  host (SmolLM2 prefill, decode; TinyLlama prefill, decode host times): {res(p.host_residuals)}",
        f"  rvv  (SmolLM2 prefill, decode; TinyLlama prefill, decode GEMM times): {res(p.rvv_residuals)}",
    ])
