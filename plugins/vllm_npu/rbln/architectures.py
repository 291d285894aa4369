"""Which model architectures the RBLN plugin runs, and through which model implementation.

Two kinds of data live here, and they answer different questions:

* The **documented tables** (:data:`VLLM_TABLE`, :data:`OPTIMUM_TABLES`): the seed's "Supported
  Architectures" section, row for row. The ``vllm`` implementation has one table (Rebel100 only:
  that implementation does not run on ATOM). The ``transformers`` (``optimum``) implementation
  has one table per device family and category; the Rebel100 tab lists what was *verified* on
  Rebel100, the ATOM tab every architecture the implementation supports, so the two differ
  (``Qwen3MoeForCausalLM``, ``LlavaForConditionalGeneration``,
  ``Exaone4_5_ForConditionalGeneration``, paligemma2, and pooling, which is "Not supported." on
  Rebel100). The encoder-decoder table has no device tabs, so it is listed for both families.
  :func:`listing` serves these (the ``npu-harness rbln architectures`` verb).
* The **registry** (:data:`OPTIMUM_REGISTRY`): the one list, for both device families, that
  ``--model-impl auto`` consults to decide whether optimum-rbln implements a checkpoint
  (HF architecture -> optimum-rbln class). It is wider than the tables (``MidmLMHeadModel``,
  ``Qwen3VLMoeForConditionalGeneration``, ``Qwen3ASRForConditionalGeneration``) and does not
  vary by device: device differences on the optimum path are defaults and limits only.
  :func:`optimum_class_for` and :func:`supported_by_optimum` serve it.

This module imports only the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

#: Device families, in display order (see :func:`vllm_npu.rbln.device.family`).
DEVICES: tuple[str, ...] = ("rebel100", "atom")
#: Implementation names :func:`listing` takes; ``optimum`` is an alias of ``transformers``.
IMPLS: tuple[str, ...] = ("vllm", "transformers", "optimum")
#: Optimum-path table categories, in display order.
CATEGORIES: tuple[str, ...] = ("decoder-only", "encoder-decoder", "multimodal", "pooling")
#: Category of every :data:`VLLM_TABLE` row (the seed does not split that table).
VLLM_CATEGORY = "decoder-only"


class UnknownChoiceError(ValueError):
    """A device or implementation name :func:`listing` does not know; names the value and the
    choices."""


class UnsupportedArchitectureError(ValueError):
    """None of a checkpoint's architectures is in :data:`OPTIMUM_REGISTRY` (the vendor's
    load-time ``ValueError``)."""


@dataclass(frozen=True)
class VllmEntry:
    """One row of the seed's ``vllm`` implementation table."""

    architecture: str
    recipe: str


@dataclass(frozen=True)
class OptimumEntry:
    """One row of a seed ``transformers`` (``optimum``) implementation table."""

    architecture: str
    model_class: str
    recipe: str


@dataclass(frozen=True)
class Row:
    """One line of :func:`listing`: a documented architecture with its implementation, device
    family and category. ``model_class`` is None for ``vllm`` rows (vLLM's own model code)."""

    impl: str
    device: str
    category: str
    architecture: str
    model_class: str | None
    recipe: str


def _opt(arch: str, recipe: str, model_class: str | None = None) -> OptimumEntry:
    return OptimumEntry(arch, model_class or f"RBLN{arch}", recipe)


#: The seed's ``vllm`` implementation table (``--model-impl vllm``; Rebel100 only).
VLLM_TABLE: tuple[VllmEntry, ...] = (
    VllmEntry("GptOssForCausalLM", "gpt-oss-120b"),
    VllmEntry("MiniMaxM2ForCausalLM", "MiniMax-M2.7"),
    VllmEntry("DeepseekV32ForCausalLM", "DeepSeek-V3.2"),
    VllmEntry("AXK2ForCausalLM", "A.X-K2"),
)

_DECODER_REBEL100: tuple[OptimumEntry, ...] = (
    _opt("LlamaForCausalLM", "Llama-3.1-8B-Instruct"),
    _opt("GemmaForCausalLM", "gemma-7b-it"),
    _opt("Gemma2ForCausalLM", "gemma-2-9b-it"),
    _opt("PhiForCausalLM", "phi-2"),
    _opt("OPTForCausalLM", "opt-6.7b"),
    _opt("GPT2LMHeadModel", "gpt2"),
    _opt("MistralForCausalLM", "Mistral-7B-Instruct-v0.3"),
    _opt("ExaoneForCausalLM", "EXAONE-3.5-7.8B-Instruct"),
    _opt("Qwen2ForCausalLM", "Qwen2.5-7B-Instruct"),
    _opt("Qwen3ForCausalLM", "Qwen3-8B"),
    _opt("GptOssForCausalLM", "gpt-oss-20b"),
)
_DECODER_ATOM: tuple[OptimumEntry, ...] = (
    *_DECODER_REBEL100[:10],
    _opt("Qwen3MoeForCausalLM", "Qwen3-30B-A3B"),
    _DECODER_REBEL100[10],
)
_ENCODER_DECODER: tuple[OptimumEntry, ...] = (
    _opt("WhisperForConditionalGeneration", "whisper-large-v3"),
)
_MULTIMODAL_REBEL100: tuple[OptimumEntry, ...] = (
    _opt("LlavaNextForConditionalGeneration", "llava-v1.6-mistral-7b-hf"),
    _opt("Qwen2VLForConditionalGeneration", "Qwen2-VL-7B-Instruct"),
    _opt("Qwen2_5_VLForConditionalGeneration", "Qwen2.5-VL-7B-Instruct"),
    _opt("Qwen3VLForConditionalGeneration", "Qwen3-VL-8B-Instruct"),
    _opt("Qwen3_5ForConditionalGeneration", "Qwen3.5-9B, Qwen3.6-27B"),
    _opt("Idefics3ForConditionalGeneration", "Idefics3-8B-Llama3"),
    _opt("Gemma3ForConditionalGeneration", "gemma-3-12b-it"),
    _opt("Gemma4ForConditionalGeneration", "gemma-4-31B-it"),
    _opt("Blip2ForConditionalGeneration", "blip2-opt-2.7b"),
    _opt("PaliGemmaForConditionalGeneration", "paligemma-3b-mix-224"),
)
_MULTIMODAL_ATOM: tuple[OptimumEntry, ...] = (
    *_MULTIMODAL_REBEL100[:8],
    _opt("LlavaForConditionalGeneration", "llava-1.5-7b-hf"),
    *_MULTIMODAL_REBEL100[8:10],
    _opt("PaliGemmaForConditionalGeneration", "paligemma2-3b-mix-224"),
    _opt("Exaone4_5_ForConditionalGeneration", "EXAONE-4.5-33B"),
)
_POOLING_ATOM: tuple[OptimumEntry, ...] = (
    _opt("BertModel", "bge-base-en-v1.5"),
    _opt("XLMRobertaModel", "bge-m3"),
    _opt("XLMRobertaForSequenceClassification", "bge-reranker-v2-m3"),
    _opt("RobertaForSequenceClassification", "twitter-roberta-base-emotion"),
    _opt("Qwen3ForSequenceClassification", "Qwen3-Reranker-4B", "RBLNQwen3ForCausalLM"),
    _opt("Qwen3Model", "Qwen3-Embedding-4B"),
)

#: The seed's ``transformers`` (``optimum``) tables: ``OPTIMUM_TABLES[device][category]``.
#: An empty tuple is a table the seed marks "Not supported." (Rebel100 pooling).
OPTIMUM_TABLES: Mapping[str, Mapping[str, tuple[OptimumEntry, ...]]] = MappingProxyType({
    "rebel100": MappingProxyType({
        "decoder-only": _DECODER_REBEL100,
        "encoder-decoder": _ENCODER_DECODER,
        "multimodal": _MULTIMODAL_REBEL100,
        "pooling": (),
    }),
    "atom": MappingProxyType({
        "decoder-only": _DECODER_ATOM,
        "encoder-decoder": _ENCODER_DECODER,
        "multimodal": _MULTIMODAL_ATOM,
        "pooling": _POOLING_ATOM,
    }),
})

#: (device, category) pairs the seed marks "Not supported." for the optimum implementation.
NOT_SUPPORTED: frozenset[tuple[str, str]] = frozenset(
    (dev, cat) for dev, cats in OPTIMUM_TABLES.items() for cat, rows in cats.items() if not rows
)


def _same_name(*archs: str) -> dict[str, str]:
    return {arch: f"RBLN{arch}" for arch in archs}


_GENERATION = {
    **_same_name(*(f"{m}ForCausalLM" for m in (
        "Llama", "Gemma", "Gemma2", "Phi", "Mistral", "Exaone", "Qwen2", "OPT", "Qwen3",
        "Qwen3Moe"))),
    **_same_name("GPT2LMHeadModel", "MidmLMHeadModel", "GptOssForCausalLM"),
    # Qwen3-Reranker, scored through ``score()``; optimum-rbln runs it as the causal LM.
    "Qwen3ForSequenceClassification": "RBLNQwen3ForCausalLM",
}
_ENC_DEC = _same_name("WhisperForConditionalGeneration")
_MULTIMODAL = _same_name(*(f"{m}ForConditionalGeneration" for m in (
    "LlavaNext", "Qwen2VL", "Qwen2_5_VL", "Qwen3VL", "Qwen3VLMoe", "Qwen3_5", "Qwen3ASR",
    "Exaone4_5_", "Idefics3", "Blip2", "Gemma3", "Gemma4", "Llava", "PaliGemma")))
_POOLING = _same_name("BertModel", "RobertaForSequenceClassification",
                      "XLMRobertaForSequenceClassification", "XLMRobertaModel", "Qwen3Model")

#: What ``--model-impl auto`` consults: HF architecture -> optimum-rbln class, one list for
#: both device families (the vendor's ``_RBLN_SUPPORTED_MODELS``), in registry order.
OPTIMUM_REGISTRY: Mapping[str, str] = MappingProxyType(
    {**_GENERATION, **_ENC_DEC, **_MULTIMODAL, **_POOLING})
#: Other names :func:`optimum_class_for` accepts for a registry architecture.
ARCH_ALIASES: Mapping[str, str] = MappingProxyType({"gpt-oss": "GptOssForCausalLM"})


_CATEGORY_OF: Mapping[str, str] = MappingProxyType({
    **{a: "decoder-only" for a in _GENERATION}, **{a: "encoder-decoder" for a in _ENC_DEC},
    **{a: "multimodal" for a in _MULTIMODAL}, **{a: "pooling" for a in _POOLING}})


def optimum_category(arch: str) -> str | None:
    """The registry category of ``arch`` (``decoder-only``, ``encoder-decoder``,
    ``multimodal``, ``pooling``), None when the registry does not have it."""
    return _CATEGORY_OF.get(ARCH_ALIASES.get(arch, arch))


def optimum_class_for(arch: str) -> str | None:
    """The optimum-rbln class name that runs HF architecture ``arch`` (or an
    :data:`ARCH_ALIASES` name), or None when optimum-rbln has no implementation of it.

    Case-sensitive, as ``config.json`` ``architectures`` entries are.
    """
    return OPTIMUM_REGISTRY.get(ARCH_ALIASES.get(arch, arch))


def supported_by_optimum(architectures: Sequence[str] | None) -> str | None:
    """The first entry of ``architectures`` (a ``config.json`` ``architectures`` list) that
    optimum-rbln implements, or None when none is (or the list is empty or None)."""
    for arch in architectures or ():
        if isinstance(arch, str) and optimum_class_for(arch) is not None:
            return arch
    return None


def require_supported(architectures: Sequence[str] | None) -> str:
    """Like :func:`supported_by_optimum`, for the optimum path's model load.

    Returns:
        The first supported architecture.

    Raises:
        UnsupportedArchitectureError: none is supported; the vendor's message
            ``Model architectures [...] are not supported on RBLN for now. Supported
            architectures: [...]`` (registry order).
    """
    arch = supported_by_optimum(architectures)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"Model architectures {list(architectures or [])} are not supported on RBLN for now. "
            f"Supported architectures: {list(OPTIMUM_REGISTRY)}")
    return arch


def _check(kind: str, value: str | None, choices: Sequence[str]) -> None:
    if value is not None and value not in choices:
        raise UnknownChoiceError(
            f"unknown RBLN {kind} {value!r}; expected one of: {', '.join(choices)}")


def listing(device: str | None = None, impl: str | None = None) -> list[Row]:
    """The documented architecture rows, filtered by device family and implementation.

    Args:
        device: ``"rebel100"``, ``"atom"`` or None (both).
        impl: ``"vllm"``, ``"transformers"``, its alias ``"optimum"``, or None (both).
            Optimum-path rows carry ``impl="transformers"``, the seed's name for it.

    Returns:
        Rows in the seed's order: the ``vllm`` table, then for each device family
        (Rebel100, ATOM) its optimum tables by category. ``vllm`` rows exist for Rebel100 only,
        so ``listing("atom", "vllm")`` is empty.

    Raises:
        UnknownChoiceError: ``device`` or ``impl`` is not one of :data:`DEVICES` /
            :data:`IMPLS`; the message names the value and the choices.
    """
    _check("device", device, DEVICES)
    _check("implementation", impl, IMPLS)
    impl = "transformers" if impl == "optimum" else impl
    rows: list[Row] = []
    if impl in (None, "vllm") and device in (None, "rebel100"):
        rows += [Row("vllm", "rebel100", VLLM_CATEGORY, e.architecture, None, e.recipe)
                 for e in VLLM_TABLE]
    if impl in (None, "transformers"):
        for dev in DEVICES:
            if device not in (None, dev):
                continue
            for cat in CATEGORIES:
                rows += [Row("transformers", dev, cat, e.architecture, e.model_class, e.recipe)
                         for e in OPTIMUM_TABLES[dev][cat]]
    return rows


def not_supported(device: str | None = None, impl: str | None = None) -> list[tuple[str, str]]:
    """The (device, category) optimum tables the seed marks "Not supported." within the same
    filter as :func:`listing` (empty for ``impl="vllm"``).

    Raises:
        UnknownChoiceError: as :func:`listing`.
    """
    _check("device", device, DEVICES)
    _check("implementation", impl, IMPLS)
    if impl == "vllm":
        return []
    return [(dev, cat) for dev in DEVICES for cat in CATEGORIES
            if (dev, cat) in NOT_SUPPORTED and device in (None, dev)]


#: Column headers of :func:`format_listing`, one per :class:`Row` field.
COLUMNS: tuple[str, ...] = ("impl", "device", "category", "architecture", "class", "recipe")


def format_listing(device: str | None = None, impl: str | None = None) -> str:
    """:func:`listing` as text: a header line and one line per row, columns left-aligned and
    separated by two spaces (``-`` for a ``vllm`` row's class). A table the seed marks "Not
    supported." is a row of its own in table order (``transformers  rebel100  pooling
    Not supported.  -  -``). With nothing to list, a line saying why follows the header.
    Ends without a newline.

    Raises:
        UnknownChoiceError: as :func:`listing`.
    """
    rows = [(r.impl, r.device, r.category, r.architecture, r.model_class or "-", r.recipe)
            for r in listing(device, impl)]
    rows += [("transformers", dev, cat, "Not supported.", "-", "-")
             for dev, cat in not_supported(device, impl)]
    order = {"impl": ("vllm", "transformers"), "device": DEVICES, "category": CATEGORIES}
    rows.sort(key=lambda r: (order["impl"].index(r[0]), order["device"].index(r[1]),
                             order["category"].index(r[2])))  # stable: table order kept
    cells = [COLUMNS, *rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    if not rows:
        lines.append("(none: the vllm implementation runs on Rebel100 only)"
                     if impl == "vllm" and device == "atom" else "(none)")
    return "\n".join(lines)
