"""End to end (issue 14 §1): ``vllm serve`` on a compiled tiny Mobilint VLM release (npusim's MXQs
through the MBLT plugin's processors and worker), a chat completion with an image checked against the
golden ``VlmReference``: static Qwen2-VL greedy tokens equal ``generate_greedy(positions="linear")``
(a static text MXQ rotates by the cache position), dynamic Qwen3-VL's ``positions="mrope"``."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")
pytest.importorskip("tokenizers")
PIL = pytest.importorskip("PIL.Image")

from npusim.llm.vision_inputs import patchify  # noqa: E402
from npusim.llm.vlm_reference import VlmReference  # noqa: E402
from npusim.mxq.compile_vlm import compile_vlm_release  # noqa: E402
from npusim.tinymodel import vlm as tiny  # noqa: E402

from _openai_serve import client_for, extra, start_or_fail  # noqa: E402

MAX_TOKENS = 8


def _data_url(img: np.ndarray) -> str:
    buf = io.BytesIO()
    PIL.fromarray(img).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _golden(hf: Path, family: str, prompt: list[int], img: np.ndarray, positions: str) -> list[int]:
    pp = tiny.PREPROCESSORS[family]
    pixels, grid = patchify(img, **{k: pp[k] for k in ("patch_size", "temporal_patch_size", "merge_size",
                                                         "image_mean", "image_std")})
    ref = VlmReference.from_pretrained(hf)
    return ref.generate_greedy(prompt, pixel_values=pixels, image_grid_thw=[grid], max_new_tokens=MAX_TOKENS,
                               positions=positions)


def _chat(client, server, img: np.ndarray, text: str):
    content = [{"type": "image_url", "image_url": {"url": _data_url(img)}}, {"type": "text", "text": text}]
    res = client.chat.completions.create(model=server.model, max_tokens=MAX_TOKENS, temperature=0,
                                         messages=[{"role": "user", "content": content}],
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    return extra(res, "prompt_token_ids"), extra(res.choices[0], "token_ids")


@pytest.mark.parametrize(("family", "vision", "image", "positions"),
                         [("qwen2_vl", "static", "sunset", "linear"), ("qwen3_vl", "dynamic", "rings", "mrope")])
def test_chat_with_an_image_equals_the_golden(tmp_path, family, vision, image, positions):
    hf = (tiny.build_qwen2_vl if family == "qwen2_vl" else tiny.build_qwen3_vl)(tmp_path / "hf")
    release = compile_vlm_release(hf, tmp_path / "release", vision=vision)
    server = start_or_fail(release, ["--max-model-len", "512", "--max-num-seqs", "1"], tmp_path, "mblt-sim")
    try:
        client = client_for(server)
        img = tiny.test_image(image)
        text = "describe the picture in detail. " * 30  # the prompt spans more than one 128-token KV block
        prompt, out = _chat(client, server, img, text)
        assert prompt.count(1026) > 0 and len(prompt) > 256, prompt
        assert out == _golden(hf, family, prompt, img, positions)
        # the same again: vLLM's prefix cache covers the image and sends it without pixels; its KV comes
        # from the worker's prefix snapshot (keyed by the image's hash)
        prompt2, out2 = _chat(client, server, img, text)
        assert (prompt2, out2) == (prompt, out)
        # another picture of the same size: same token ids, different image: its own KV
        other = tiny.test_image("dots" if image == "sunset" else image)[:, ::-1].copy()
        prompt3, out3 = _chat(client, server, other, text)
        assert prompt3 == prompt
        assert out3 == _golden(hf, family, prompt3, other, positions)
        if vision == "static":  # two images in one request: HTTP 400 naming the rule
            import openai

            content = [{"type": "image_url", "image_url": {"url": _data_url(img)}}] * 2
            with pytest.raises(openai.BadRequestError, match="one image"):
                client.chat.completions.create(model=server.model, max_tokens=2,
                                               messages=[{"role": "user", "content": content}])
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert "EngineCore encountered a fatal error" not in log, log[-3000:]  # (a stop may log the abort)
    json.loads((release / "config.json").read_text())
