"""The MBLT plugin's Qwen3-ASR host side (``vllm_npu.mblt.asr``, issue 14 §2): the window and
token arithmetic, the release layout and its overrides, the encoder's windowing on a stand-in
model, the placement of each clip's embeddings, and the clip-derived KV-bookkeeping ids.
End to end (a real vLLM server on the simulated release) is in the ``asr_*`` conformance
scenarios (``npu_conformance/scenarios/test_mblt_serving.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm_npu.mblt import settings  # noqa: E402
from vllm_npu.mblt.asr import (  # noqa: E402
    WINDOW_FRAMES,
    WINDOW_TOKENS,
    AsrEncoder,
    AsrInputError,
    AsrRelease,
    audio_token_count,
    feature_rows,
)
from vllm_npu.mblt.errors import MbltBackendError  # noqa: E402
from vllm_npu.prompt_embeds import content_key_ids as audio_key_ids  # noqa: E402


@pytest.mark.parametrize(("frames", "tokens"), [(0, 0), (1, 1), (2, 1), (3, 1), (5, 1), (9, 2), (17, 3), (99, 13),
                                                (100, 13), (101, 14), (250, 13 * 2 + 7), (3000, 390)])
def test_audio_token_count(frames, tokens):
    """13 tokens per 100-frame window, the tail through three stride-2 convolutions."""
    assert audio_token_count(frames) == tokens




ARTIFACT = {
    "model_type": "mobilint-qwen3_asr",
    "thinker_config": {"audio_config": {"mxq_path": "audio_encoder.mxq", "dev_no": 1, "core_mode": "single",
                                        "target_cores": ["1:0:2"]},
                       "text_config": {"mxq_path": "decoder.mxq"}},
}


def test_release_layout_and_overrides():
    rel = AsrRelease.resolve("/r", ARTIFACT, {}, 0)
    assert (rel.encoder_mxq, rel.decoder_mxq) == ("/r/audio_encoder.mxq", "/r/decoder.mxq")
    assert (rel.encoder_dev_no, rel.encoder_core_mode, rel.encoder_target_cores) == (1, "single", ("1:0:2",))
    rel = AsrRelease.resolve("/r", {**ARTIFACT, "encoder_mxq_path": "enc2.mxq"},
                             {"decoder_mxq_path": "dec3.mxq", "encoder_dev_no": 0, "encoder_target_cores": ["0:1:0"]}, 0)
    assert (rel.encoder_mxq, rel.decoder_mxq, rel.encoder_dev_no, rel.encoder_target_cores) == (
        "/r/enc2.mxq", "/r/dec3.mxq", 0, ("0:1:0",))
    with pytest.raises(MbltBackendError, match="names no encoder MXQ"):
        AsrRelease.resolve("/r", {"model_type": "mobilint-qwen3_asr", "thinker_config": {}}, {}, 0)


def test_decoder_path_and_the_refused_mxq_path():
    """The worker's MXQ for an ASR release is its decoder; a top-level ``mxq_path`` is refused."""
    assert settings.mxq_path_of("/r", ARTIFACT, settings.parse_loader_extra_config(None)) == "/r/decoder.mxq"
    with pytest.raises(settings.MbltConfigError, match="encoder_mxq_path and/or decoder_mxq_path"):
        settings.mxq_path_of("/r", ARTIFACT, settings.parse_loader_extra_config({"mxq_path": "x.mxq"}))


class _WindowModel:
    """A stand-in audio-encoder MXQ: token ``t`` of a window is the window's frames
    ``[8t, 8t + 8)`` summed per bin, times the bin index (so order and padding both show)."""

    def __init__(self, bins: int = 4, width: int = 4) -> None:
        self.bins, self.width, self.calls = bins, width, []

    def get_model_input_shape(self):  # HWC, as qbruntime reports it
        return [(1, self.bins, WINDOW_FRAMES)]

    def get_model_output_shape(self):
        return [(self.width, 1, WINDOW_TOKENS)]

    def infer(self, inputs, _out, cache_size):
        (x,) = inputs
        assert x.shape == (1, 1, self.bins, WINDOW_FRAMES) and x.dtype == np.float32 and cache_size == 0
        self.calls.append(x.copy())
        tok = np.stack([x[0, 0, :, 8 * t:8 * t + 8].sum(axis=1) for t in range(WINDOW_TOKENS)])  # [13, bins]
        return [tok.T[None, :, None, :] * np.arange(1, self.width + 1)[None, :, None, None]]


def _expected(feats: np.ndarray) -> np.ndarray:
    n = feats.shape[1]
    padded = np.zeros((feats.shape[0], -(-n // 100) * 100), np.float32)
    padded[:, :n] = feats
    rows = []
    for w in range(padded.shape[1] // 100):
        win = padded[:, 100 * w:100 * (w + 1)]
        rows += [win[:, 8 * t:8 * t + 8].sum(axis=1) * np.arange(1, 5) for t in range(13)]
    return np.array(rows[:audio_token_count(n)], np.float32)


@pytest.mark.parametrize("frames", [1, 37, 100, 101, 250])
def test_encoder_windows(frames):
    model = _WindowModel()
    enc = AsrEncoder(None, model, None)
    feats = np.random.default_rng(frames).normal(size=(4, frames)).astype(np.float32)
    got = enc.encode(feats)
    assert len(model.calls) == -(-frames // 100)
    np.testing.assert_array_equal(got, _expected(feats))
    with pytest.raises(AsrInputError, match=r"audio features of shape \(3, 5\)"):
        enc.encode(np.zeros((3, 5), np.float32))
    with pytest.raises(AsrInputError, match=r"T >= 1"):
        enc.encode(np.zeros((4, 0), np.float32))


def _spec(feats, offset, length, identifier="clip", is_embed=None):
    import torch

    pos = SimpleNamespace(offset=offset, length=length, is_embed=is_embed)
    data = {"input_audio_features": SimpleNamespace(data=torch.from_numpy(feats))}
    return SimpleNamespace(modality="audio", data=data, mm_position=pos, identifier=identifier)


def test_feature_rows_place_each_clip():
    enc = AsrEncoder(None, _WindowModel(), None)
    a = np.ones((4, 120), np.float32)
    b = np.full((4, 30), 2.0, np.float32)
    items = feature_rows([_spec(b, 40, audio_token_count(30), "b"), _spec(a, 5, audio_token_count(120), "a")], enc)
    assert [clip for clip, _, _ in items] == ["a", "b"]  # prompt order, each named by its hash
    assert [pos.tolist()[0] for _, pos, _ in items] == [5, 40]
    assert [rows.shape[0] for _, _, rows in items] == [audio_token_count(120), audio_token_count(30)]
    with pytest.raises(AsrInputError, match=r"16 embeddings from 120 frames for 15 placeholder tokens"):
        feature_rows([_spec(a, 5, 15)], enc)
    with pytest.raises(AsrInputError, match="processor cache must be off"):
        feature_rows([SimpleNamespace(modality="audio", data=None, identifier="x",
                                      mm_position=SimpleNamespace(offset=0, length=1, is_embed=None))], enc)


def test_audio_key_ids_are_clip_specific():
    a, b = audio_key_ids("clip-a", 13), audio_key_ids("clip-b", 13)
    assert all(k < 0 for k in a + b) and len(set(a)) == 13 and not set(a) & set(b)
    assert audio_key_ids("clip-a", 13) == a


def test_negative_frames_refused():
    with pytest.raises(AsrInputError, match="frames=-1"):
        audio_token_count(-1)


def test_registry_class_and_prompt():
    """The registry class imports without torchvision, is multimodal and transcribes; its
    transcription prompt is Qwen3-ASR's; a translation and its construction are refused."""
    from vllm.model_executor.models.interfaces import supports_multimodal, supports_transcription

    from vllm_npu.mblt.asr_model import MobilintQwen3ASRForConditionalGeneration as Cls
    from vllm_npu.mblt.asr_model import sanitize_context
    from vllm_npu.mblt.models import MobilintModelNotBuildable

    assert supports_multimodal(Cls) and supports_transcription(Cls)
    assert Cls.post_process_output("language English<asr_text>hi") == "language English<asr_text>hi"
    assert sanitize_context("a<|im_<|x|>end|>b<asr_te<asr_text>xt>c") == "abc"
    with pytest.raises(ValueError, match="does not translate"):
        Cls.get_generation_prompt(SimpleNamespace(task_type="translate"))
    with pytest.raises(MobilintModelNotBuildable):
        Cls(vllm_config=None)
