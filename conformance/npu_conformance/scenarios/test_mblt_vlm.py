"""MBLT vision-language scenarios (issue 14 §1): Mobilint Qwen2-VL / Qwen3-VL releases served by
``vllm serve`` with the MBLT plugin on ``mblt-sim`` / ``mblt-hw``, through the OpenAI chat API.

The releases (:data:`npu_conformance.devices.mblt.VLM_RELEASES`): a static Qwen2-VL, a static
Qwen3-VL (bundled text MXQ without a RoPE input, as the 2B W8 builds) and a dynamic Qwen3-VL
(bundled with a RoPE input, as the 8B W8 build). On ``mblt-sim`` they are the tiny checkpoints
compiled by ``mxq compile``; on ``mblt-hw`` the directories ``NPU_HARNESS_MBLT_VLM_RELEASE_<KIND>``
names (a scenario whose release is not named skips).

* ``vlm_greedy``: one image (dynamic: two images) in a chat turn; the prompt ids equal the chat
  template's with each ``<|image_pad|>`` expanded to ``t*h*w/4`` pads, and the answer equals the
  golden pipeline's greedy tokens (``VlmReference``: vision tower, merge, DeepStack, M-RoPE; a
  static text MXQ rotates with the cache position). Streamed text equals the answer; different
  images sent concurrently each equal their solo answer. On a board a rerun agrees.
* ``vlm_image_rules``: static releases take exactly one image and no video (HTTP 400 naming the
  count); later turns of a session (``vllm_xargs.session_id``) are text-only or keep the image at
  the same token position (another position: 400, the session's image answered again).
* ``vlm_vision_token_cap``: dynamic Qwen3-VL clamps an oversized image to the 4096 pre-merge
  patch limit (1024 image pads) and refuses ``do_resize=False`` with 400.
* ``vlm_start_rules``: a top-level ``mxq_path`` is refused for a VLM; explicit ``vision_*`` /
  ``text_*`` keys win over the shared ones; a static release's ``--limit-mm-per-prompt`` above
  one image stops start-up naming it.
* ``vlm_prefix_cache_lm_only``: with prefix caching on, a repeated image prompt hits vLLM's prefix
  cache and the vision encoder still runs for every request (image features are not cached); the
  same text with another image gets that image's answer.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import json
from typing import Any

import pytest

from npu_conformance.devices.base import ArtifactUnavailable
from npu_conformance import vllm_server as vs

pytestmark = pytest.mark.scenario(devices=("mblt",))

VLM_ARGS = ["--max-model-len", "2048"]
#: The images each release's scenarios send (tiny test images whose sizes need no resize).
IMAGES = {"qwen2_vl": ("sunset", "dots"), "qwen3_vl": ("sunset", "dots"), "qwen3_vl_dynamic": ("checker", "stripes"),
          "qwen3_vl_batch": ("checker", "stripes")}


def _lab(device_labs, target):
    return device_labs(target.name)


class _VlmCase:
    """One release, its server and (on the simulator) the golden tokens of a chat turn."""

    def __init__(self, lab, kind: str) -> None:
        self.lab, self.kind = lab, kind
        try:
            self.release = lab.vlm_release(kind)
        except ArtifactUnavailable as exc:
            pytest.skip(str(exc))
        self.golden = lab.vlm_golden(kind)
        self.config = json.loads((self.release / "config.json").read_text())
        self.dynamic = bool(self.config.get("is_dynamic", self.config.get("dynamic_vision", False)))
        self._tok = None

    def server(self, args=(), **env) -> vs.Server:
        return self.lab.server(self.release, [*VLM_ARGS, *args], **env)

    @property
    def tokenizer(self):
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(str(self.release))
        return self._tok

    def pixels(self, image):
        """``(pixel_values, grid)`` of one image as the release's processor must make them:
        transformers' PIL Qwen2-VL image processor on the release's ``preprocessor_config.json``,
        after the vendor's fixed 224x224 resize for a static release."""
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        cfg = json.loads((self.release / "preprocessor_config.json").read_text())
        keep = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "min_pixels",
                "max_pixels", "size", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb")
        proc = Qwen2VLImageProcessorPil(**{k: cfg[k] for k in keep if k in cfg})
        pil = Image.fromarray(image).convert("RGB")
        if not self.dynamic:
            pil = pil.resize((224, 224), Image.BICUBIC)
        out = proc(images=[pil], return_tensors="np")
        return out["pixel_values"].astype("float32"), [int(v) for v in out["image_grid_thw"][0]]

    def expected(self, messages: list[dict], images: list, max_tokens: int) -> tuple[list[int], list[int] | None]:
        """The prompt ids the chat template and the processor must give, and the golden answer
        (None on hardware). ``messages`` use ``{"type": "image"}`` parts in place of the images."""
        import numpy as np

        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        parts = text.split("<|image_pad|>")
        assert len(parts) == len(images) + 1, text
        encoded = [self.pixels(im) for im in images]
        merge = int(json.loads((self.release / "preprocessor_config.json").read_text()).get("merge_size", 2))
        expanded = parts[0]
        for (_, grid), rest in zip(encoded, parts[1:]):
            expanded += "<|image_pad|>" * (grid[0] * grid[1] * grid[2] // (merge * merge)) + rest
        ids = list(self.tokenizer.encode(expanded, add_special_tokens=False))
        if self.golden is None:
            return ids, None
        eos = json.loads((self.release / "generation_config.json").read_text())["eos_token_id"]
        pv = np.concatenate([p for p, _ in encoded]) if encoded else None
        out = self.golden.generate_greedy(ids, pixel_values=pv, image_grid_thw=[g for _, g in encoded],
                                          max_new_tokens=max_tokens, eos_token_ids=eos if isinstance(eos, list) else [eos],
                                          positions="mrope" if self.dynamic else "linear")
        return ids, list(out)


def _vlm(device_labs, target, kind: str) -> _VlmCase:
    return _VlmCase(_lab(device_labs, target), kind)


def _image(name: str):
    from npusim.tinymodel.vlm import test_image

    return test_image(name)


def _image_part(image) -> dict:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}


def _video_jpegs(name: str = "square") -> list[bytes]:
    """The frames of a tiny test video, each a JPEG (quality 95)."""
    from PIL import Image

    from npusim.tinymodel.vlm import test_video

    out = []
    for frame in test_video(name):
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="JPEG", quality=95)
        out.append(buf.getvalue())
    return out


def _video_part(jpegs: list[bytes]) -> dict:
    """A ``video_url`` part carrying the frames inline (vLLM's ``video/jpeg`` data URL: base64
    JPEG frames joined by commas; 1 frame per second unless the server says otherwise)."""
    data = ",".join(base64.b64encode(j).decode() for j in jpegs)
    return {"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + data}}


def _user(text: str, images=()) -> tuple[dict, dict]:
    """One user turn as sent (image_url parts) and as the chat template sees it (image parts)."""
    sent = {"role": "user", "content": [*(_image_part(im) for im in images), {"type": "text", "text": text}]}
    seen = {"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}
    return sent, seen


def _chat(server, messages, max_tokens: int = 12, **extra: Any):
    return server.request("POST", "/v1/chat/completions", {"model": server.model, "messages": messages,
                                                           "max_tokens": max_tokens, "temperature": 0,
                                                           "return_token_ids": True, **extra})


def _answer(res) -> tuple[list[int], list[int], str]:
    assert res.status == 200, (res.status, str(res.body)[:800])
    choice = res.body["choices"][0]
    return list(res.body["prompt_token_ids"]), list(choice["token_ids"]), choice["message"]["content"]


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl", "qwen3_vl_dynamic", "qwen3_vl_batch"], scope="module")
def test_vlm_greedy(target, record, device_labs, kind):
    """A chat turn with an image: the prompt ids are the template's with the image pads expanded,
    and the answer is the golden pipeline's greedy tokens (dynamic Qwen3-VL: two images too);
    streaming gives the same text; two images sent concurrently each equal their solo answer (on
    the batch release, decoded together in one batch infer)."""
    case = _vlm(device_labs, target, kind)
    server = case.server()
    answers = {}
    for name in IMAGES[kind]:
        image = _image(name)
        sent, seen = _user("What is in the picture?", [image])
        prompt, out, text = _answer(_chat(server, [sent]))
        want_prompt, want_out = case.expected([seen], [image], 12)
        assert prompt == want_prompt
        if want_out is not None:
            assert out == want_out, (name, out, want_out)
        answers[name] = (sent, out, text)
    if case.golden is not None:  # the images make a difference to the answer
        assert len({tuple(a[1]) for a in answers.values()}) == len(answers), answers
    with cf.ThreadPoolExecutor(len(answers)) as ex:
        together = dict(zip(answers, ex.map(lambda n: _answer(_chat(server, [answers[n][0]]))[1], answers)))
    assert together == {n: a[1] for n, a in answers.items()}
    name = IMAGES[kind][0]
    lines = vs.stream_lines(server, "/v1/chat/completions", {"model": server.model, "messages": [answers[name][0]],
                                                               "max_tokens": 12, "temperature": 0, "stream": True})
    streamed = "".join(d["choices"][0].get("delta", {}).get("content") or "" for d in lines if d.get("choices"))
    assert streamed == answers[name][2]
    if case.dynamic:
        images = [_image(n) for n in IMAGES[kind]]
        sent, seen = _user("Compare the two pictures.", images)
        prompt, out, _ = _answer(_chat(server, [sent]))
        want_prompt, want_out = case.expected([seen], images, 12)
        assert prompt == want_prompt
        if want_out is not None:
            assert out == want_out
    record.figure("prompt_tokens", len(prompt))


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl"], scope="module")
def test_vlm_image_rules(target, record, device_labs, kind):
    """A static release takes exactly one image and no video per request (400 naming the count);
    in a session (``vllm_xargs.session_id``) later turns are text-only or re-send the image at the
    same token position, and a turn that moves it is refused while the session goes on."""
    case = _vlm(device_labs, target, kind)
    server = case.server()
    a, b = (_image(n) for n in IMAGES[kind])
    sent, _ = _user("Two pictures?", [a, b])
    res = _chat(server, [sent])
    assert res.status == 400 and "2" in json.dumps(res.body), (res.status, res.body)
    video = _video_part(_video_jpegs())
    res = _chat(server, [{"role": "user", "content": [video, {"type": "text", "text": "a video"}]}])
    assert res.status == 400 and "video" in json.dumps(res.body).lower(), (res.status, res.body)
    session = {"vllm_xargs": {"session_id": f"{kind}-s1"}}
    first, seen_first = _user("What is in the picture?", [a])
    _, out1, text1 = _answer(_chat(server, [first], **session))
    history = [first, {"role": "assistant", "content": text1}]
    follow, seen_follow = _user("And the colours?")
    prompt2, out2, _ = _answer(_chat(server, [*history, follow], **session))  # the image at the same position
    seen_history = [seen_first, {"role": "assistant", "content": text1}]
    want_prompt, want_out = case.expected([*seen_history, seen_follow], [a], 12)
    assert prompt2 == want_prompt
    if want_out is not None:
        assert out2 == want_out
    moved = {"role": "user", "content": [{"type": "text", "text": "Look again:"}, _image_part(a)]}
    res = _chat(server, [moved], **session)
    assert res.status == 400 and "fixed image-token position" in json.dumps(res.body), (res.status, res.body)
    assert _answer(_chat(server, [first], **session))[1] == out1  # the session still works
    assert _answer(_chat(server, [moved]))[0]  # without a session the moved image is a request of its own
    record.figure("follow_up_prompt_tokens", len(prompt2))


def test_vlm_video(target, record, device_labs):
    """Dynamic Qwen3-VL takes a video (4 frames at 1 fps: two frame groups): each group becomes its
    timestamp text and its own vision block, and the answer equals the golden pipeline's on the
    frames as decoded (each group one encoder call). A video and an image in one request are
    served too."""
    import numpy as np
    from PIL import Image

    from npusim.llm.vision_inputs import patchify

    case = _vlm(device_labs, target, "qwen3_vl_dynamic")
    server = case.server()
    jpegs = _video_jpegs()
    frames = np.stack([np.asarray(Image.open(io.BytesIO(j)).convert("RGB")) for j in jpegs])
    pp = json.loads((case.release / "preprocessor_config.json").read_text())
    pv, grid = patchify(frames, patch_size=pp["patch_size"], temporal_patch_size=pp["temporal_patch_size"],
                        merge_size=pp["merge_size"], image_mean=pp["image_mean"], image_std=pp["image_std"])
    res = _chat(server, [{"role": "user", "content": [_video_part(jpegs), {"type": "text", "text": "What happens?"}]}])
    prompt, out, _ = _answer(res)
    text = case.tokenizer.decode(prompt)
    assert "<0.5 seconds>" in text and "<2.5 seconds>" in text, text
    video_pad = case.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert prompt.count(video_pad) == grid[0] * grid[1] * grid[2] // pp["merge_size"] ** 2
    if case.golden is not None:
        eos = json.loads((case.release / "generation_config.json").read_text())["eos_token_id"]
        want = case.golden.generate_greedy(prompt, pixel_values_videos=pv, video_grid_thw=[list(grid)],
                                           max_new_tokens=12, eos_token_ids=eos if isinstance(eos, list) else [eos])
        assert out == list(want)
    image = _image(IMAGES["qwen3_vl_dynamic"][0])
    both = _chat(server, [{"role": "user", "content": [_image_part(image), _video_part(jpegs),
                                                       {"type": "text", "text": "And now?"}]}])
    prompt2, out2, _ = _answer(both)
    if case.golden is not None:
        ipv, igrid = case.pixels(image)
        want = case.golden.generate_greedy(prompt2, pixel_values=ipv, image_grid_thw=[igrid], pixel_values_videos=pv,
                                           video_grid_thw=[list(grid)], max_new_tokens=12,
                                           eos_token_ids=eos if isinstance(eos, list) else [eos])
        assert out2 == list(want)
    record.figure("video_pads", prompt.count(video_pad))


def test_vlm_vision_token_cap(target, record, device_labs):
    """Dynamic Qwen3-VL: an image above the 4096 pre-merge patch limit is resized to fit (1024
    image pads at most), a larger ``max_pixels`` override is clamped, and ``do_resize=False`` is
    refused with 400 naming the limit."""
    import numpy as np

    case = _vlm(device_labs, target, "qwen3_vl_dynamic")
    server = case.server(["--trust-request-mm-kwargs"])
    big = np.tile(_image("checker"), (6, 6, 1))  # 1536x1536: 96x96 = 9216 patches unclamped
    sent, _ = _user("Describe.", [big])
    pad = case.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    prompt, _, _ = _answer(_chat(server, [sent], max_tokens=4))
    pads = prompt.count(pad)
    assert 0 < pads <= 4096 // 4, pads
    prompt2, _, _ = _answer(_chat(server, [sent], max_tokens=4, mm_processor_kwargs={"max_pixels": 16 * 4096 * 256}))
    assert prompt2.count(pad) == pads
    res = _chat(server, [sent], max_tokens=4, mm_processor_kwargs={"do_resize": False})
    assert res.status == 400 and "do_resize=False" in json.dumps(res.body) and "4096" in json.dumps(res.body), (
        res.status, res.body)
    assert server.healthy()
    record.figure("clamped_image_pads", pads)


def test_vlm_start_rules(target, record, device_labs):
    """Start-up rules of a VLM release: a top-level ``mxq_path`` is refused (its MXQs are named by
    ``vision_mxq_path`` / ``text_mxq_path``); a static release's ``--limit-mm-per-prompt`` above
    one image stops start-up naming it; shared layout keys reach both MXQs and an explicit
    ``vision_*`` key wins for the vision MXQ; (simulator) a batch-compiled Qwen3-VL text MXQ
    without a RoPE input is refused at load."""
    import re

    lab = _lab(device_labs, target)
    case = _vlm(device_labs, target, "qwen2_vl")
    runs = lab.engine_configs([["--model", str(case.release)],
                               ["--model", str(case.release), "--limit-mm-per-prompt", json.dumps({"image": 2})]])
    assert "error" not in runs[0], runs[0]
    assert "--limit-mm-per-prompt image=2" in runs[1].get("error", ""), runs[1]
    log = lab.refused_start(case.release, ["--model-loader-extra-config", json.dumps({"mxq_path": "text.mxq"})])  # refused
    assert "vision_mxq_path" in log and "text_mxq_path" in log, log[-3000:]
    if lab.simulated:
        env = {"NPUSIM_MXQ": json.dumps({"devices": 2})}
    else:
        import importlib

        env = {}
        devices = importlib.import_module("qbruntime").get_available_device_numbers()
        if len(devices) < 2:
            pytest.skip(f"needs 2 Mobilint cards; qbruntime sees {devices}")
    server = case.server(["--model-loader-extra-config", json.dumps({"dev_no": 1, "vision_dev_no": 0})], **env)
    text = server.log_text()
    assert re.search(r"vision MXQ \S+ \(.*\) on device 0;", text), text[-3000:]
    assert re.search(r"MBLT backend: \d+ MXQ instance\(s\) on device\(s\) \[?1\]?", text), text[-3000:]
    image = _image(IMAGES["qwen2_vl"][0])
    sent, seen = _user("What is in the picture?", [image])
    _, out, _ = _answer(_chat(server, [sent]))
    want = case.expected([seen], [image], 12)[1]
    if want is not None:
        assert out == want
    if lab.simulated:
        from npusim.mxq.compile import compile_artifact

        lab.vlm_release("qwen3_vl")  # builds the tiny Qwen3-VL checkpoint
        batch = compile_artifact(lab.workdir / "tiny-qwen3_vl", lab.workdir / "qwen3_vl-batch-static-release",
                                 max_batch_size=4, prefill_chunk_size=64,
                                 vlm={"vision": "static", "text_layout": "bundled"})
        log = lab.refused_start(batch)  # a fresh start: the release itself is refused at load
        assert "Batched Qwen3-VL text MXQs without a RoPE input are unsupported" in log, log[-3000:]
    record.figure("max_model_len", runs[0]["max_model_len"])


def _encoded(server, since: int) -> int:
    """How many image/video items the MBLT worker encoded since log offset ``since``."""
    import re

    return sum(int(m) for m in re.findall(r"MBLT vision: req_id=\S+ encoded (\d+) item", server.log_text()[since:]))


def test_vlm_prefix_cache_lm_only(target, record, device_labs):
    """Prefix caching covers the language model's KV only, never image features: the same image
    behind another prefix is encoded again; the repeated prompt hits vLLM's prefix cache, whose KV
    already holds the image (vLLM 0.32 sends no pixels for an item the cached KV covers, so it is
    not encoded); the same text with another image is encoded and gets that image's answer."""
    case = _vlm(device_labs, target, "qwen3_vl_dynamic")
    server = case.server(["--enable-prefix-caching"])
    a, b = (_image(n) for n in IMAGES["qwen3_vl_dynamic"])
    # a question long enough that the cached blocks of the repeated prompt reach past the image
    question = " ".join(["Describe the picture: its colours, its shapes and how they are laid out."] * 4)
    sent_a, seen_a = _user(question, [a])
    sent_b, seen_b = _user(question, [b])
    system = {"role": "system", "content": "Answer briefly."}
    mark = len(server.log_text())
    first = _answer(_chat(server, [sent_a]))
    assert _encoded(server, mark) == 1
    mark = len(server.log_text())
    behind = _answer(_chat(server, [system, sent_a]))
    assert _encoded(server, mark) == 1  # the same image, not cached: encoded again
    mark = len(server.log_text())
    again = _answer(_chat(server, [sent_a]))
    assert again[1] == first[1]
    covered = _encoded(server, mark)
    mark = len(server.log_text())
    other = _answer(_chat(server, [sent_b]))
    assert _encoded(server, mark) == 1
    if case.golden is not None:
        assert first[1] == case.expected([seen_a], [a], 12)[1]
        assert behind[1] == case.expected([system, seen_a], [a], 12)[1]
        assert other[1] == case.expected([seen_b], [b], 12)[1]
    metrics = server.request("GET", "/metrics").body
    hits = sum(float(line.split()[-1]) for line in str(metrics).splitlines()
               if line.startswith("vllm:prefix_cache_hits"))
    assert hits > 0, "the repeated prompt did not hit the prefix cache"
    assert covered == 0, covered
    record.figure("prefix_cache_hit_tokens", hits)
