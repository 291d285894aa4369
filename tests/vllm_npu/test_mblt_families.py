"""Every text family of the seed served by ``vllm serve`` on ``mblt-sim``, started as the seed's
quick-start command (no ``--max-model-len``): Qwen2, Qwen3, EXAONE4 and HyperCLOVAX (Llama itself is
served by ``test_mblt_serve.py``).

One server per family, one at a time (module-scoped, parametrized). Greedy completions must equal
transformers' own model of the checkpoint and the golden decoder, token for token, for a prompt
shorter than EXAONE4's sliding window and one longer than it (so the window is crossed in prefill
and in decode), streamed and not.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from npu_conformance import vllm_server  # noqa: E402

FAMILIES = ("qwen2", "qwen3", "exaone4", "hyperclovax")
#: The mobilint model type each family's release declares (HyperCLOVAX ships Llama-compatible).
RELEASE_TYPE = {"qwen2": "mobilint-qwen2", "qwen3": "mobilint-qwen3", "exaone4": "mobilint-exaone4",
                "hyperclovax": "mobilint-llama"}
PROMPTS = ([5, 17, 99, 250, 7], [(13 * i + 7) % 1000 + 1 for i in range(40)])
NEW = 16


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_model_dir, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """``{"arch", "hf", "server"}``: the family's checkpoint, its MXQ artifact served on mblt-sim."""
    from npusim.mxq.compile import compile_artifact

    arch = request.param
    hf = tiny_model_dir(arch)
    root = tmp_path_factory.mktemp(f"family-{arch}")
    art = compile_artifact(hf, root / "art", prefill_chunk_size=32)
    server = vllm_server.start(art, [], env=vllm_server.vllm_env("mblt-sim"), log=root / "serve.log")
    try:
        yield {"arch": arch, "hf": hf, "art": art, "server": server}
    finally:
        server.stop()


def _transformers_greedy(hf_model: Any, hf: Path, prompt: list[int]) -> list[int]:
    out = hf_model(hf).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_the_release_config_names_the_family(family):
    import json

    cfg = json.loads((family["art"] / "config.json").read_text(encoding="utf-8"))
    assert cfg["model_type"] == RELEASE_TYPE[family["arch"]]
    log = family["server"].log_text()
    assert "MBLT backend: 1 MXQ instance(s)" in log, log[-3000:]


def test_greedy_equals_transformers_and_golden(family, hf_model, golden_decoder):
    golden = golden_decoder(family["arch"])
    for prompt in PROMPTS:
        want = _transformers_greedy(hf_model, family["hf"], list(prompt))
        assert golden.generate_greedy(prompt, NEW) == want, "the golden decoder differs from transformers"
        assert vllm_server.greedy_ids(family["server"], list(prompt), NEW) == want


def test_streamed_greedy_equals_the_whole_answer(family):
    server, prompt = family["server"], list(PROMPTS[1])
    whole = vllm_server.greedy_ids(server, prompt, NEW)
    chunks = list(vllm_server.stream_lines(server, "/v1/completions", {
        "model": server.model, "prompt": prompt, "max_tokens": NEW, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True}))
    streamed = [t for c in chunks for ch in c.get("choices", []) for t in (ch.get("token_ids") or [])]
    assert streamed == whole
