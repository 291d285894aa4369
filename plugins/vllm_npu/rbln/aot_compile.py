"""Ahead-of-time compile of a Hugging Face decoder with the vendor's optimum-rbln
(``npu-harness rbln compile HF_DIR --out DIR``).

The result is a directory ``vllm serve DIR`` loads on the optimum path without compiling:
optimum-rbln's ``*.rbln`` programs and ``rbln_config.json`` beside the model's ``config.json``,
``generation_config.json`` and tokenizer files (copied from ``HF_DIR`` when optimum-rbln did
not save them). The ``rbln_config`` is :func:`vllm_npu.rbln.compile_plan.rbln_config_for` of the
settings, exactly what the platform would compile on a cache miss, so vLLM's scheduler plan
(:func:`~vllm_npu.rbln.compile_plan.scheduler_plan`) reads back the same batch, block and chunk.

``rebel`` is imported by name. Without a real rebel-compiler, the ``npusim.rbln`` simulator is
used through :mod:`npusim.alias` when ``NPU_HARNESS_TARGET`` is unset or ``rbln-sim`` (a
hardware target never falls back to the simulator).

Nothing heavy is imported at module level: ``rebel``, torch and optimum-rbln load in
:func:`compile_model`, after the input has been checked.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_npu.rbln.runtime import load_rebel_for_compile
from vllm_npu.settings import parse_json

__all__ = ["AotInputError", "AotCompileError", "SERVING_FILES", "TOKENIZER_FILES", "compile_model",
           "parse_batch_sizes", "parse_overrides"]

#: Model files ``vllm serve`` reads besides the compiled programs.
SERVING_FILES: tuple[str, ...] = ("config.json", "generation_config.json")
#: Tokenizer files copied from ``HF_DIR`` when the compiled directory lacks them.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt",
    "merges.txt", "chat_template.jinja", "chat_template.json")
#: Files of which one makes a loadable tokenizer (with ``tokenizer_config.json``).
_TOKENIZER_MODELS = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                     "vocab.json", "vocab.txt")


class AotInputError(ValueError):
    """Bad input: the checkpoint, the settings or the environment cannot give a compile
    (one line; the CLI exits 2)."""


class AotCompileError(RuntimeError):
    """The compile itself failed (one line; the CLI exits 1)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def parse_batch_sizes(text: str | None) -> list[int] | None:
    """``--decoder-batch-sizes 4,2,1`` -> ``[4, 2, 1]`` (None for None).

    Raises:
        AotInputError: not a comma-separated list of positive integers.
    """
    if text is None:
        return None
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 for b in sizes):
        raise AotInputError(f"--decoder-batch-sizes {text!r} must be comma-separated positive integers, e.g. 4,2,1")
    return sizes


def parse_overrides(text: str | None) -> dict[str, Any]:
    """``--optimum-overrides JSON`` -> a dict (``{}`` for None).

    Raises:
        AotInputError: not JSON, or not a JSON object.
    """
    if text is None:
        return {}
    return parse_json(text, name="--optimum-overrides", kind=dict, error=AotInputError)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AotInputError(f"{name} {value!r} must be a positive integer")
    return value


def _read_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise AotInputError(f"{path}: cannot read the model's config.json ({exc.strerror or exc})") from exc
    except ValueError as exc:
        raise AotInputError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AotInputError(f"{path}: not a model config (a JSON object)")
    return config


def _has_tokenizer(d: Path) -> bool:
    return (d / "tokenizer_config.json").is_file() and any((d / f).is_file() for f in _TOKENIZER_MODELS)


def _complete_serving_files(hf_dir: Path, out: Path) -> list[str]:
    """Copy the serving and tokenizer files ``out`` lacks from ``hf_dir``; returns their names."""
    copied = []
    for name in SERVING_FILES + TOKENIZER_FILES:
        src, dst = hf_dir / name, out / name
        if src.is_file() and not dst.exists():
            shutil.copy2(src, dst)
            copied.append(name)
    return copied


def compile_model(hf_dir: str | os.PathLike[str], out: str | os.PathLike[str], *,
                  max_model_len: int | None = None, block_size: int | None = None, max_num_seqs: int = 1,
                  npu: str | None = None, decoder_batch_sizes: Sequence[int] | None = None,
                  optimum_overrides: Mapping[str, Any] | None = None,
                  log: Callable[[str], None] = print, environ: Mapping[str, str] | None = None) -> Any:
    """Compile the decoder in ``hf_dir`` into the directory ``out`` (which must not exist, or be
    empty) and return its :class:`~vllm_npu.rbln.compile_plan.CompiledModelSpec`.

    Defaults: ``max_model_len`` = ``config.json`` ``max_position_embeddings``, ``block_size`` =
    ``max_model_len`` (eager attention), the NPU = ``rebel.get_npu_name(0)``, else
    ``$RBLN_FORCE_NPU_NAME`` / ``$RBLN_TARGET_SOC``; the prefill chunk is the NPU family's
    (:func:`vllm_npu.rbln.device.prefill_chunk_size`). No runtime is created (a host without an
    NPU compiles for the named one) unless ``optimum_overrides`` sets ``create_runtimes``.
    The compile goes to a sibling ``.partial`` directory, renamed to ``out`` when complete.

    Raises:
        AotInputError: bad input (unknown or non-decoder architecture, a block that does not
            divide the model length, conflicting overrides, an unknown NPU, an ``out`` that is
            not empty, no usable ``rebel``...), including optimum-rbln's own ``ValueError``s.
        AotCompileError: the compile failed otherwise.
    """
    from vllm_npu.rbln import architectures, compile_plan, device

    env = os.environ if environ is None else environ
    hf, dest = Path(hf_dir), Path(out)
    config = _read_config(hf)
    try:
        arch = architectures.require_supported(config.get("architectures"))
    except architectures.UnsupportedArchitectureError as exc:
        raise AotInputError(f"{hf}: {exc}") from None
    cls_name = architectures.optimum_class_for(arch)
    if max_model_len is None:
        max_model_len = config.get("max_position_embeddings")
        if max_model_len is None:
            raise AotInputError(f"{hf / 'config.json'} has no max_position_embeddings; pass --max-model-len")
        max_model_len = _positive("config.json max_position_embeddings", max_model_len)
    max_model_len = _positive("--max-model-len", max_model_len)
    max_num_seqs = _positive("--max-num-seqs", max_num_seqs)
    block_size = max_model_len if block_size is None else _positive("--block-size", block_size)
    overrides = dict(optimum_overrides or {})
    if decoder_batch_sizes is not None:
        sizes = [int(b) for b in decoder_batch_sizes]
        if any(b < 1 or b > max_num_seqs for b in sizes):
            raise AotInputError(f"--decoder-batch-sizes {','.join(map(str, sizes))}: every size must be "
                                f"between 1 and --max-num-seqs {max_num_seqs}")
        if "decoder_batch_sizes" in overrides and list(overrides["decoder_batch_sizes"]) != sizes:
            raise AotInputError(f"--decoder-batch-sizes {sizes} and --optimum-overrides decoder_batch_sizes "
                                f"{overrides['decoder_batch_sizes']} differ; give one")
        overrides["decoder_batch_sizes"] = sizes
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise AotInputError(f"--out {dest} exists and is not an empty directory")

    def plan(npu: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
        try:
            chunk = device.prefill_chunk_size(npu)
        except device.UnknownDeviceError as exc:
            raise AotInputError(f"--npu {npu!r}: {exc}") from None
        try:
            return compile_plan.rbln_config_for(
                max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size, num_devices=1,
                prefill_chunk_size=chunk, npu=npu, overrides={"create_runtimes": False, **overrides})
        except compile_plan.CompilePlanError as exc:
            raise AotInputError(str(exc)) from None

    # Fail fast on the settings alone, before rebel and torch load: the block (any NPU gives the
    # same answer without overrides) and, with --npu, the whole config.
    plan(npu or "RBLN-CA25", overrides if npu is not None else {})
    rebel, which = load_rebel_for_compile(env, error=AotInputError)
    log(f"rebel: {which}")
    if npu is None:
        try:
            npu = device.device_name(rebel, 0, env)
        except device.NpuNameUnavailableError as exc:
            raise AotInputError(f"{exc} Or pass --npu.") from None
    rbln_config = plan(npu, overrides)

    try:
        orbln = importlib.import_module("optimum.rbln")
    except ImportError as exc:
        raise AotInputError(f"optimum-rbln is not importable ({exc}); pip install optimum-rbln==0.12.0") from exc
    cls = getattr(orbln, str(cls_name), None)
    if cls is None:
        raise AotInputError(f"optimum-rbln {getattr(orbln, '__version__', '?')} has no {cls_name} (for {arch})")
    if not issubclass(cls, orbln.RBLNDecoderOnlyModelForCausalLM):
        raise AotInputError(f"{arch} ({cls_name}) is not a decoder-only model: rbln compile builds decoders only")

    log(f"compiling {hf} as {cls_name} for {npu} with rbln_config {json.dumps(rbln_config, sort_keys=True)}")
    partial = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        try:
            model = cls.from_pretrained(str(hf), export=True, model_save_dir=str(partial), rbln_config=rbln_config)
        except ValueError as exc:   # optimum-rbln's checks of the config (ranges, limits...)
            raise AotInputError(f"optimum-rbln refused the compile: {_first_line(exc)}") from exc
        except Exception as exc:  # noqa: BLE001 - reported in one line; the CLI exits 1
            raise AotCompileError(f"the compile failed: {type(exc).__name__}: {_first_line(exc)}") from exc
        del model
        copied = _complete_serving_files(hf, partial)
        if copied:
            log(f"copied from {hf}: {', '.join(copied)}")
        if not _has_tokenizer(partial):
            log(f"warning: no tokenizer in {hf} or the compile; vllm serve needs --tokenizer")
        try:
            spec = compile_plan.CompiledModelSpec.from_dir(partial)
        except compile_plan.CompilePlanError as exc:
            raise AotCompileError(f"the compiled directory does not read back: {exc}") from exc
        if dest.exists():
            dest.rmdir()   # checked empty above
        partial.rename(dest)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    spec = compile_plan.CompiledModelSpec.from_dir(dest)
    blocks = spec.kvcache_num_blocks or spec.batch_size * (spec.max_seq_len // spec.block_size)
    log(f"compiled {spec.model_class} for {npu}: batch {spec.batch_size} (decoders "
        f"{list(spec.decoder_batch_sizes)}), max_seq_len {spec.max_seq_len}, KV block {spec.block_size} "
        f"({spec.attn_impl}), {blocks} KV blocks, prefill chunk {spec.prefill_chunk_size}")
    log(f"written to {dest}; serve it with: vllm serve {dest}")
    return spec
