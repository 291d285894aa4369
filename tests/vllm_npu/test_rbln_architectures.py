"""vllm_npu.rbln.architectures: the seed's supported-architecture tables, the ``auto`` registry
(docs/reference rbln.md §10) and the ``npu-harness rbln architectures`` verb."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from npu_conformance.cli import main
from vllm_npu.rbln import architectures as A

# The seed's tables, typed out again here (not derived from the module's own helpers).
VLLM = [("GptOssForCausalLM", "gpt-oss-120b"), ("MiniMaxM2ForCausalLM", "MiniMax-M2.7"),
        ("DeepseekV32ForCausalLM", "DeepSeek-V3.2"), ("AXK2ForCausalLM", "A.X-K2")]
DECODER_REBEL100 = [
    ("LlamaForCausalLM", "RBLNLlamaForCausalLM", "Llama-3.1-8B-Instruct"),
    ("GemmaForCausalLM", "RBLNGemmaForCausalLM", "gemma-7b-it"),
    ("Gemma2ForCausalLM", "RBLNGemma2ForCausalLM", "gemma-2-9b-it"),
    ("PhiForCausalLM", "RBLNPhiForCausalLM", "phi-2"),
    ("OPTForCausalLM", "RBLNOPTForCausalLM", "opt-6.7b"),
    ("GPT2LMHeadModel", "RBLNGPT2LMHeadModel", "gpt2"),
    ("MistralForCausalLM", "RBLNMistralForCausalLM", "Mistral-7B-Instruct-v0.3"),
    ("ExaoneForCausalLM", "RBLNExaoneForCausalLM", "EXAONE-3.5-7.8B-Instruct"),
    ("Qwen2ForCausalLM", "RBLNQwen2ForCausalLM", "Qwen2.5-7B-Instruct"),
    ("Qwen3ForCausalLM", "RBLNQwen3ForCausalLM", "Qwen3-8B"),
    ("GptOssForCausalLM", "RBLNGptOssForCausalLM", "gpt-oss-20b"),
]
DECODER_ATOM = [*DECODER_REBEL100[:10],
                ("Qwen3MoeForCausalLM", "RBLNQwen3MoeForCausalLM", "Qwen3-30B-A3B"),
                DECODER_REBEL100[10]]
ENC_DEC = [("WhisperForConditionalGeneration", "RBLNWhisperForConditionalGeneration",
            "whisper-large-v3")]
MM_REBEL100 = [
    ("LlavaNextForConditionalGeneration", "RBLNLlavaNextForConditionalGeneration",
     "llava-v1.6-mistral-7b-hf"),
    ("Qwen2VLForConditionalGeneration", "RBLNQwen2VLForConditionalGeneration",
     "Qwen2-VL-7B-Instruct"),
    ("Qwen2_5_VLForConditionalGeneration", "RBLNQwen2_5_VLForConditionalGeneration",
     "Qwen2.5-VL-7B-Instruct"),
    ("Qwen3VLForConditionalGeneration", "RBLNQwen3VLForConditionalGeneration",
     "Qwen3-VL-8B-Instruct"),
    ("Qwen3_5ForConditionalGeneration", "RBLNQwen3_5ForConditionalGeneration",
     "Qwen3.5-9B, Qwen3.6-27B"),
    ("Idefics3ForConditionalGeneration", "RBLNIdefics3ForConditionalGeneration",
     "Idefics3-8B-Llama3"),
    ("Gemma3ForConditionalGeneration", "RBLNGemma3ForConditionalGeneration", "gemma-3-12b-it"),
    ("Gemma4ForConditionalGeneration", "RBLNGemma4ForConditionalGeneration", "gemma-4-31B-it"),
    ("Blip2ForConditionalGeneration", "RBLNBlip2ForConditionalGeneration", "blip2-opt-2.7b"),
    ("PaliGemmaForConditionalGeneration", "RBLNPaliGemmaForConditionalGeneration",
     "paligemma-3b-mix-224"),
]
MM_ATOM = [
    *MM_REBEL100[:8],
    ("LlavaForConditionalGeneration", "RBLNLlavaForConditionalGeneration", "llava-1.5-7b-hf"),
    *MM_REBEL100[8:],
    ("PaliGemmaForConditionalGeneration", "RBLNPaliGemmaForConditionalGeneration",
     "paligemma2-3b-mix-224"),
    ("Exaone4_5_ForConditionalGeneration", "RBLNExaone4_5_ForConditionalGeneration",
     "EXAONE-4.5-33B"),
]
POOLING_ATOM = [
    ("BertModel", "RBLNBertModel", "bge-base-en-v1.5"),
    ("XLMRobertaModel", "RBLNXLMRobertaModel", "bge-m3"),
    ("XLMRobertaForSequenceClassification", "RBLNXLMRobertaForSequenceClassification",
     "bge-reranker-v2-m3"),
    ("RobertaForSequenceClassification", "RBLNRobertaForSequenceClassification",
     "twitter-roberta-base-emotion"),
    ("Qwen3ForSequenceClassification", "RBLNQwen3ForCausalLM", "Qwen3-Reranker-4B"),
    ("Qwen3Model", "RBLNQwen3Model", "Qwen3-Embedding-4B"),
]
SEED = {
    "rebel100": {"decoder-only": DECODER_REBEL100, "encoder-decoder": ENC_DEC,
                 "multimodal": MM_REBEL100, "pooling": []},
    "atom": {"decoder-only": DECODER_ATOM, "encoder-decoder": ENC_DEC, "multimodal": MM_ATOM,
             "pooling": POOLING_ATOM},
}


def _triples(entries):
    return [(e.architecture, e.model_class, e.recipe) for e in entries]


def test_vllm_table_is_the_seeds():
    assert [(e.architecture, e.recipe) for e in A.VLLM_TABLE] == VLLM


@pytest.mark.parametrize("device", ["rebel100", "atom"])
@pytest.mark.parametrize("category", A.CATEGORIES)
def test_optimum_tables_are_the_seeds(device, category):
    assert _triples(A.OPTIMUM_TABLES[device][category]) == SEED[device][category]


def test_the_device_tabs_differ_where_the_seed_does():
    def archs(device, category):
        return [e.architecture for e in A.OPTIMUM_TABLES[device][category]]

    assert "Qwen3MoeForCausalLM" in archs("atom", "decoder-only")
    assert "Qwen3MoeForCausalLM" not in archs("rebel100", "decoder-only")
    for arch in ("LlavaForConditionalGeneration", "Exaone4_5_ForConditionalGeneration"):
        assert arch in archs("atom", "multimodal") and arch not in archs("rebel100", "multimodal")
    recipes = {d: [e.recipe for e in A.OPTIMUM_TABLES[d]["multimodal"]] for d in A.DEVICES}
    assert "paligemma2-3b-mix-224" in recipes["atom"]
    assert "paligemma2-3b-mix-224" not in recipes["rebel100"]
    assert A.OPTIMUM_TABLES["rebel100"]["pooling"] == ()
    assert A.NOT_SUPPORTED == {("rebel100", "pooling")}


def test_every_documented_optimum_row_is_in_the_auto_registry():
    for device in A.DEVICES:
        for category in A.CATEGORIES:
            for e in A.OPTIMUM_TABLES[device][category]:
                assert A.optimum_class_for(e.architecture) == e.model_class, e


def test_registry_matches_the_reference():
    reg = dict(A.OPTIMUM_REGISTRY)
    assert reg["Qwen3ForSequenceClassification"] == "RBLNQwen3ForCausalLM"
    assert reg["Qwen3Model"] == "RBLNQwen3Model"
    # In the registry, not in the documented tables.
    for arch in ("MidmLMHeadModel", "Qwen3VLMoeForConditionalGeneration",
                 "Qwen3ASRForConditionalGeneration", "Qwen3MoeForCausalLM"):
        assert reg[arch] == f"RBLN{arch}"
    assert len(reg) == 13 + 1 + 1 + 14 + 5
    assert A.optimum_class_for("gpt-oss") == "RBLNGptOssForCausalLM"


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "llamaforcausallm", "AXK2ForCausalLM",
                                  "DeepseekV32ForCausalLM", "T5ForConditionalGeneration", ""])
def test_archs_outside_the_registry_have_no_class(arch):
    assert A.optimum_class_for(arch) is None


def test_supported_by_optimum_takes_the_first_supported_arch():
    assert A.supported_by_optimum(["MixtralForCausalLM", "Qwen3Model", "BertModel"]) == "Qwen3Model"
    assert A.supported_by_optimum(["MixtralForCausalLM"]) is None
    assert A.supported_by_optimum([]) is None
    assert A.supported_by_optimum(None) is None


def test_require_supported_message():
    assert A.require_supported(["Foo", "LlamaForCausalLM"]) == "LlamaForCausalLM"
    with pytest.raises(A.UnsupportedArchitectureError) as err:
        A.require_supported(["MixtralForCausalLM"])
    assert isinstance(err.value, ValueError)
    assert str(err.value) == (
        "Model architectures ['MixtralForCausalLM'] are not supported on RBLN for now. "
        f"Supported architectures: {list(A.OPTIMUM_REGISTRY)}")


def test_listing_filters():
    every = A.listing(None, None)
    assert len(every) == 4 + sum(len(r) for d in SEED.values() for r in d.values())
    assert [(r.architecture, r.recipe) for r in A.listing("rebel100", "vllm")] == VLLM
    assert all(r.model_class is None and r.device == "rebel100" for r in A.listing(None, "vllm"))
    assert A.listing("atom", "vllm") == []
    assert A.listing("atom", "optimum") == A.listing("atom", "transformers")
    atom = A.listing("atom", "transformers")
    assert {r.impl for r in atom} == {"transformers"} and {r.device for r in atom} == {"atom"}
    assert [(r.architecture, r.model_class, r.recipe) for r in atom if r.category == "pooling"] \
        == POOLING_ATOM
    assert not [r for r in A.listing("rebel100") if r.category == "pooling"]
    assert A.not_supported() == [("rebel100", "pooling")]
    assert A.not_supported("atom") == [] and A.not_supported(None, "vllm") == []


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"device": "ATOM"}, "unknown RBLN device 'ATOM'; expected one of: rebel100, atom"),
    ({"device": "rebel"}, "unknown RBLN device 'rebel'; expected one of: rebel100, atom"),
    ({"impl": "auto"},
     "unknown RBLN implementation 'auto'; expected one of: vllm, transformers, optimum"),
])
def test_listing_rejects_unknown_names(kwargs, message):
    with pytest.raises(A.UnknownChoiceError) as err:
        A.listing(**kwargs)
    assert isinstance(err.value, ValueError) and str(err.value) == message
    with pytest.raises(A.UnknownChoiceError):
        A.not_supported(**kwargs)


def test_rows_are_frozen():
    row = A.listing()[0]
    with pytest.raises(AttributeError):
        row.recipe = "x"  # type: ignore[misc]


def _columns(text: str) -> list[list[str]]:
    """Split aligned text into cells by the header's column offsets."""
    lines = text.splitlines()
    header = lines[0]
    starts = [header.index(name) for name in A.COLUMNS]
    ends = starts[1:] + [None]
    return [[line[s:e].strip() for s, e in zip(starts, ends)] for line in lines]


def test_format_listing_is_aligned_columns():
    text = A.format_listing("atom", "transformers")
    rows = _columns(text)
    assert rows[0] == list(A.COLUMNS)
    assert rows[1:] == [["transformers", "atom", r.category, r.architecture, r.model_class, r.recipe]
                        for r in A.listing("atom", "transformers")]
    vllm = _columns(A.format_listing("rebel100", "vllm"))
    assert vllm[1:] == [["vllm", "rebel100", "decoder-only", a, "-", r] for a, r in VLLM]


def test_format_listing_shows_not_supported_in_table_order():
    rows = _columns(A.format_listing("rebel100", "optimum"))
    assert rows[-1] == ["transformers", "rebel100", "pooling", "Not supported.", "-", "-"]
    rows = _columns(A.format_listing())
    index = rows.index(["transformers", "rebel100", "pooling", "Not supported.", "-", "-"])
    assert rows[index - 1][1:3] == ["rebel100", "multimodal"]
    assert rows[index + 1][1:3] == ["atom", "decoder-only"]


def test_format_listing_says_why_it_is_empty():
    assert A.format_listing("atom", "vllm").splitlines()[1] == \
        "(none: the vllm implementation runs on Rebel100 only)"


def test_cli_verb_prints_the_listing(capsys):
    assert main(["rbln", "architectures", "--device", "atom", "--impl", "optimum"]) == 0
    assert capsys.readouterr().out == A.format_listing("atom", "optimum") + "\n"
    assert main(["rbln", "architectures"]) == 0
    assert capsys.readouterr().out == A.format_listing() + "\n"


@pytest.mark.parametrize(("args", "message"), [
    (["--device", "ca"], "argument --device: invalid choice: 'ca'"),
    (["--impl", "auto"], "argument --impl: invalid choice: 'auto'"),
])
def test_cli_verb_rejects_bad_choices(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main(["rbln", "architectures", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_installed_command_runs_the_verb():
    exe = shutil.which("npu-harness") or str(Path(sys.executable).with_name("npu-harness"))
    proc = subprocess.run([exe, "rbln", "architectures", "--impl", "vllm"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == A.format_listing(None, "vllm") + "\n"
    assert "AXK2ForCausalLM" in proc.stdout
