"""The golden numpy Qwen3-ASR (mel, NPU-windowed audio encoder, decoder) and its tiny fitted checkpoint.

Compared with transformers 5.19 (``Qwen3ASRProcessor`` with the checkpoint's
``WhisperFeatureExtractor``; ``Qwen3ASRForConditionalGeneration``, whose "-hf" layout is mapped
from the original one) and vLLM 0.32's Qwen3-ASR multimodal processor (in a subprocess with the
repository's torchvision import placeholder, which vLLM's qwen3_asr module needs to import here).

Windowing: transformers and vLLM run the conv stack per 100-frame chunk as the NPU does, but
attend over up to ``n_window_infer`` (800) frames and only over a tail chunk's valid tokens; the
NPU attends within each 100-frame window, padded tokens included. They agree for a clip of
exactly one window (``river_snow``, 100 frames), which is where logits are compared; for a
half window (``honey``) the difference is measured and shown to be real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from npusim.llm.asr_reference import AsrReference, AudioTokenMismatchError, text_model_config
from npusim.llm.audio_encoder import (WINDOW_FRAMES, WINDOW_TOKENS, AudioConfigError, AudioEncoderConfig,
                                      AudioShapeError, audio_token_count)
from npusim.llm.errors import UnsupportedModelError
from npusim.llm.mel import SAMPLE_RATE, AudioInputError, log_mel

pytest.importorskip("tokenizers", reason="building the tiny Qwen3-ASR checkpoint needs tokenizers")

from npusim.tinymodel import asr as tiny  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PLACEHOLDERS = REPO / "tools" / "vllm-rbln-env" / "import-placeholders"
SECONDS = (0.3, 1.0, 2.5, 35.0)


def _nmse(ref: np.ndarray, got: np.ndarray) -> float:
    ref = np.asarray(ref, np.float64)
    return float(((np.asarray(got, np.float64) - ref) ** 2).sum() / (ref ** 2).sum())


def _long_clip(seconds: float) -> np.ndarray:
    """The clips concatenated (repeated) and cut to ``seconds``."""
    parts, n = [], 0
    want = int(round(seconds * SAMPLE_RATE))
    while n < want:
        for name in tiny.CLIPS:
            s = tiny.clip_samples(name)
            parts.append(s)
            n += len(s)
    return np.concatenate(parts)[:want]


def _samples(seconds: float) -> np.ndarray:
    return _long_clip(seconds)


@pytest.fixture(scope="module")
def asr_dir(tmp_path_factory) -> Path:
    t0 = time.perf_counter()
    out = tiny.build_qwen3_asr(tmp_path_factory.mktemp("qwen3_asr"))
    print(f"\nbuild_qwen3_asr: {time.perf_counter() - t0:.2f} s")
    return out


@pytest.fixture(scope="module")
def ref(asr_dir) -> AsrReference:
    return AsrReference.from_pretrained(asr_dir)


@pytest.fixture(scope="module")
def tok():
    return tiny.asr_tokenizer()


@pytest.fixture(scope="module")
def hf_processor(asr_dir):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen3ASRProcessor.from_pretrained(asr_dir)


def _hf_layout(name: str) -> str:
    """Original Qwen3-ASR tensor name -> transformers 5.19's (``Qwen/Qwen3-ASR-1.7B-hf``) name."""
    for old, new in (("thinker.audio_tower.proj1.", "model.multi_modal_projector.linear_1."),
                     ("thinker.audio_tower.proj2.", "model.multi_modal_projector.linear_2."),
                     ("thinker.audio_tower.", "model.audio_tower."),
                     ("thinker.model.", "model.language_model."),
                     ("thinker.lm_head.", "lm_head.")):
        if name.startswith(old):
            return new + name[len(old):]
    raise AssertionError(name)


@pytest.fixture(scope="module")
def hf_model(asr_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from npusim.llm.safetensors import load_safetensors

    raw = json.loads((asr_dir / "config.json").read_text())
    th = raw["thinker_config"]
    a, t = th["audio_config"], th["text_config"]
    audio = {k: a[k] for k in ("num_mel_bins", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
                               "d_model", "activation_function", "n_window", "output_dim", "n_window_infer",
                               "downsample_hidden_size")}
    text = {k: t[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                              "max_position_embeddings")}
    text.update(model_type="qwen3", tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": t["rope_theta"]})
    cfg = transformers.Qwen3ASRConfig(audio_config=audio, text_config=text, audio_token_id=th["audio_token_id"],
                                      tie_word_embeddings=False, pad_token_id=t["pad_token_id"],
                                      eos_token_id=t["eos_token_id"])
    cfg._attn_implementation = "eager"
    model = transformers.Qwen3ASRForConditionalGeneration(cfg).eval().float()
    sd = {_hf_layout(n): torch.from_numpy(np.ascontiguousarray(v)) for n, v in load_safetensors(asr_dir).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def _hf_features(mel: np.ndarray):
    """transformers' encoder input: the mel zero-padded to whole 100-frame chunks, and its mask."""
    import torch

    t = mel.shape[1]
    n = -(-t // WINDOW_FRAMES) * WINDOW_FRAMES
    x = np.zeros((1, mel.shape[0], n), np.float32)
    x[0, :, :t] = mel
    mask = np.zeros((1, n), np.int64)
    mask[0, :t] = 1
    return torch.from_numpy(x), torch.from_numpy(mask)


# ---------------------------------------------------------------------------- counts and features


def test_audio_token_count_rule():
    expected = {0: 0, 1: 1, 8: 1, 9: 2, 30: 4, 50: 7, 99: 13, 100: 13, 101: 14, 135: 18, 250: 33, 3500: 455}
    assert {f: audio_token_count(f) for f in expected} == expected
    assert (WINDOW_FRAMES, WINDOW_TOKENS) == (100, 13)
    with pytest.raises(ValueError, match="frames must be an integer >= 0"):
        audio_token_count(-1)


def test_log_mel_matches_the_processors_features(hf_processor, record_diff):
    fe = hf_processor.feature_extractor
    assert type(fe).__name__ == "WhisperFeatureExtractor"
    clips = {name: tiny.clip_samples(name) for name in tiny.CLIPS}
    clips.update({f"{s} s": _samples(s) for s in SECONDS})
    worst = 0.0
    for name, x in clips.items():
        got = log_mel(x)
        want = fe(x, sampling_rate=SAMPLE_RATE, padding=True, truncation=False, return_attention_mask=True,
                  return_tensors="np")
        assert got.shape == want["input_features"][0].shape == (128, len(x) // 160), name
        assert int(want["attention_mask"].sum()) == got.shape[1], name
        worst = max(worst, float(np.abs(got - want["input_features"][0]).max()))
    record_diff("asr log_mel vs WhisperFeatureExtractor", worst)
    assert worst < 1e-4


def test_audio_token_count_matches_the_transformers_processor(hf_processor):
    placeholder = tiny.AUDIO_START + tiny.AUDIO_PAD + tiny.AUDIO_END
    for s in SECONDS:
        x = _samples(s)
        out = hf_processor(text=[placeholder], audio=[x], sampling_rate=SAMPLE_RATE)
        n = int((out["input_ids"] == hf_processor.audio_token_id).sum())
        assert n == audio_token_count(log_mel(x).shape[1]), s


_VLLM_SCRIPT = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    import numpy as np
    sys.path.insert(0, {sim!r})
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing import ProcessorInputs
    from vllm.multimodal.processing.context import TimingContext
    from vllm.model_executor.models.qwen3_asr import Qwen3ASRForConditionalGeneration
    from npusim.tinymodel.asr import prompt_ids
    mc = ModelConfig(model={d!r}, tokenizer={d!r}, dtype="float32", max_model_len=2048)
    proc = MULTIMODAL_REGISTRY.create_processor(mc)
    tok = proc.info.get_tokenizer()
    audio_id = tok.get_vocab()["<|audio_pad|>"]
    res = {{"hf_config": type(mc.hf_config).__name__, "uses_mrope": mc.uses_mrope,
            "feature_extractor": type(proc.info.get_feature_extractor()).__name__, "counts": {{}}, "rows_equal": []}}
    for s, path in {clips!r}:
        x = np.load(path)
        out = proc.apply(ProcessorInputs(prompt_ids(tok, 1), proc.data_parser.parse_mm_data({{"audio": [x]}})),
                         TimingContext(enabled=False))
        ids = out["prompt_token_ids"]
        n = sum(1 for i in ids if i == audio_id)
        res["counts"][str(s)] = n
        start = ids.index(audio_id)
        feat = SimpleNamespace(mm_position=SimpleNamespace(offset=start, length=n))
        pos, delta = Qwen3ASRForConditionalGeneration.get_mrope_input_positions(None, ids, [feat])
        ar = np.arange(len(ids))
        res["rows_equal"].append(bool(delta == 0 and all((pos[r].numpy() == ar).all() for r in range(3))))
    from vllm.config.speech_to_text import SpeechToTextParams
    stt = Qwen3ASRForConditionalGeneration.get_speech_to_text_config(mc, "transcribe")
    res["max_audio_clip_s"] = stt.max_audio_clip_s
    res["generation_prompt"] = {{}}
    for lang, name in (("en", "English"), (None, None)):
        gp = Qwen3ASRForConditionalGeneration.get_generation_prompt(
            SpeechToTextParams(audio=np.zeros(16000, np.float32), stt_config=stt, model_config=mc, language=lang))
        res["generation_prompt"][str(lang)] = list(gp["prompt_token_ids"]) == prompt_ids(tok, 1, language=name)
    print("RESULT" + json.dumps(res))
""")


def test_vllm_processor_counts_and_mrope_positions(asr_dir, tmp_path):
    """vLLM 0.32 loads the checkpoint (its own Qwen3ASRConfig, M-RoPE on, WhisperFeatureExtractor),
    inserts audio_token_count(frames) placeholders, its M-RoPE positions for an audio-only
    prompt are three equal rows 0..T-1 (so plain RoPE, as AsrReference assumes), and its
    transcription prompt is ``prompt_ids`` (30 s chunks)."""
    pytest.importorskip("vllm")
    if not (PLACEHOLDERS / "torchvision" / "__init__.py").is_file():
        pytest.skip("no torchvision import placeholder")
    clips = []
    for s in SECONDS:
        p = tmp_path / f"{s}.npy"
        np.save(p, _samples(s))
        clips.append((s, str(p)))
    code = _VLLM_SCRIPT.format(sim=str(REPO / "simulators"), d=str(asr_dir), clips=clips)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLACEHOLDERS), str(REPO / "simulators")]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT"):])
    assert res["hf_config"] == "Qwen3ASRConfig" and res["uses_mrope"] is True
    assert res["feature_extractor"] == "WhisperFeatureExtractor"
    assert res["counts"] == {str(s): audio_token_count(log_mel(_samples(s)).shape[1]) for s in SECONDS}
    assert res["counts"] == {"0.3": 4, "1.0": 13, "2.5": 33, "35.0": 455}
    assert all(res["rows_equal"])
    # the transcription endpoint's prompt is npusim.tinymodel.asr.prompt_ids (one placeholder, then expanded)
    assert res["generation_prompt"] == {"en": True, "None": True}
    assert res["max_audio_clip_s"] == 30


def test_mrope_with_equal_rows_is_plain_rope(ref):
    """transformers' interleaved M-RoPE (Qwen3-VL's, mrope_section [6, 5, 5]) with three equal
    position rows gives the decoder's plain RoPE cos/sin; unequal rows do not."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    t = ref.config["thinker_config"]["text_config"]
    cfg = SimpleNamespace(max_position_embeddings=t["max_position_embeddings"], head_dim=t["head_dim"],
                          hidden_size=t["hidden_size"], num_attention_heads=t["num_attention_heads"],
                          rope_parameters={"rope_type": "default", "rope_theta": t["rope_theta"],
                                           "mrope_section": t["rope_scaling"]["mrope_section"]})
    rot = Qwen3VLTextRotaryEmbedding(cfg)
    n = 300
    pos = torch.arange(n)[None, None, :].expand(3, 1, n)
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    gc, gs = ref.decoder.config.rope.cos_sin(np.arange(n), dtype=np.float64)
    assert np.abs(cos[0].numpy() - gc).max() < 1e-5 and np.abs(sin[0].numpy() - gs).max() < 1e-5
    cos2, _ = rot(torch.zeros(1), torch.stack([pos[0], pos[1] * 0, pos[2] * 2]))
    assert np.abs(cos2[0].numpy() - gc).max() > 0.1


# ---------------------------------------------------------------------------- against transformers


def test_encode_window_matches_transformers_audio_tower(ref, hf_model, record_diff):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    windows = {"river_snow": log_mel(tiny.clip_samples("river_snow")),
               "random": rng.normal(0.0, 0.5, (128, WINDOW_FRAMES)).astype(np.float32)}
    worst = 0.0
    for name, mel in windows.items():
        x, mask = _hf_features(mel)
        with torch.no_grad():
            want = hf_model.model.get_audio_features(x, mask).pooler_output.numpy()
        got = ref.encoder.encode_window(mel)
        assert got.shape == want.shape == (WINDOW_TOKENS, 128) and got.dtype == np.float32
        worst = max(worst, _nmse(want, got))
    record_diff("asr encode_window vs transformers NMSE", worst)
    assert worst <= 1e-10


def test_full_golden_logits_match_transformers_on_one_window(ref, hf_model, tok, record_diff):
    """A 1.0 s clip (exactly one NPU window): the golden prompt logits equal transformers'."""
    torch = pytest.importorskip("torch")
    mel = log_mel(tiny.clip_samples("river_snow"))
    assert mel.shape[1] == WINDOW_FRAMES
    for lang in ("English", None):
        ids = tiny.prompt_ids(tok, audio_token_count(mel.shape[1]), language=lang)
        x, mask = _hf_features(mel)
        with torch.no_grad():
            want = hf_model(input_ids=torch.tensor([ids]), input_features=x, input_features_mask=mask).logits[0].numpy()
        got = ref.prefill_logits(ids, mel)
        nmse = _nmse(want, got)
        record_diff("asr golden logits vs transformers NMSE (1 window)", nmse)
        assert nmse <= 1e-10
        assert int(np.argmax(got[-1])) == int(np.argmax(want[-1]))


def test_tail_window_differs_from_transformers_as_documented(ref, hf_model, record_diff):
    """A 0.5 s clip: transformers attends over the 7 valid tokens only, the NPU over all 13 of
    its zero-padded window, so the audio embeddings differ (the golden follows the NPU)."""
    torch = pytest.importorskip("torch")
    mel = log_mel(tiny.clip_samples("honey"))
    x, mask = _hf_features(mel)
    with torch.no_grad():
        want = hf_model.model.get_audio_features(x, mask).pooler_output.numpy()
    got = ref.encode(mel)
    assert got.shape == want.shape == (7, 128)
    nmse = _nmse(want, got)
    record_diff("asr NPU tail window vs transformers NMSE (differs)", nmse)
    assert nmse > 1e-4
    # the encoder's 7 tokens are the first 7 of the zero-padded window's 13
    padded = np.zeros((128, WINDOW_FRAMES), np.float32)
    padded[:, :50] = mel
    np.testing.assert_array_equal(got, ref.encoder.encode_window(padded)[:7])


# ---------------------------------------------------------------------------- known transcripts


@pytest.mark.parametrize("name", list(tiny.CLIPS))
def test_known_transcripts_both_prompt_forms(ref, tok, name):
    im_end = tok.token_to_id("<|im_end|>")
    mel = log_mel(tiny.clip_samples(name))
    n = audio_token_count(mel.shape[1])
    forced = ref.generate_greedy(tiny.prompt_ids(tok, n), mel, 32, [im_end])
    assert tok.decode(forced, skip_special_tokens=False) == tiny.TRANSCRIPTS[name] + "<|im_end|>"
    assert tok.decode(forced, skip_special_tokens=True) == tiny.TRANSCRIPTS[name]
    plain = ref.generate_greedy(tiny.prompt_ids(tok, n, language=None), mel, 32, [im_end])
    assert tok.decode(plain, skip_special_tokens=False) == (
        "language English<asr_text>" + tiny.TRANSCRIPTS[name] + "<|im_end|>")


def test_fit_margin(ref, tok, record_diff):
    margin = tiny.fit_margin(ref, tok)
    print(f"\nqwen3_asr fitted LM head: smallest target-vs-other logit margin {margin:.3f} "
          f"(target logit {tiny.FIT_LOGIT})")
    record_diff("asr fit margin (logits; larger is better)", margin)
    assert margin > 0.5 * tiny.FIT_LOGIT


def test_clips_are_as_documented():
    frames = {name: len(tiny.clip_samples(name)) // 160 for name in tiny.CLIPS}
    assert frames["river_snow"] == 100 and frames["honey"] == 50
    assert any(f > 100 and f % 100 for f in frames.values())
    assert any(f > 100 and f % 100 == 0 for f in frames.values())
    assert 4 <= len(tiny.CLIPS) <= 8 and set(tiny.CLIPS) == set(tiny.TRANSCRIPTS)
    np.testing.assert_array_equal(tiny.clip_samples("honey"), tiny.clip_samples("honey"))
    with pytest.raises(KeyError, match="unknown clip"):
        tiny.clip_samples("nope")


def test_a_35_second_clip_runs(ref, tok):
    x = _long_clip(35.0)
    t0 = time.perf_counter()
    mel = log_mel(x)
    audio = ref.encode(mel)
    assert mel.shape == (128, 3500) and audio.shape == (455, 128) and np.isfinite(audio).all()
    out = ref.generate_greedy(tiny.prompt_ids(tok, 455), mel, 8)
    assert 1 <= len(out) <= 8
    print(f"\n35 s clip: mel + encoder + 8-token decode in {time.perf_counter() - t0:.2f} s")


def test_encode_is_independent_windows_trimmed(ref):
    mel = log_mel(tiny.clip_samples("lamp_wind_nine"))  # 135 frames: a full window and 35 frames
    got = ref.encode(mel)
    assert got.shape == (18, 128)
    tail = np.zeros((128, WINDOW_FRAMES), np.float32)
    tail[:, :35] = mel[:, 100:]
    np.testing.assert_array_equal(got[:13], ref.encoder.encode_window(mel[:, :100]))
    np.testing.assert_array_equal(got[13:], ref.encoder.encode_window(tail)[:5])


# ---------------------------------------------------------------------------- the checkpoint


def test_build_is_deterministic(asr_dir, tmp_path):
    again = tiny.build_qwen3_asr(tmp_path / "again")
    names = sorted(p.name for p in asr_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for n in names:
        assert (asr_dir / n).read_bytes() == (again / n).read_bytes(), n


def test_checkpoint_layout_and_token_ids(asr_dir, tok):
    from npusim.llm.safetensors import read_safetensors_header

    cfg = json.loads((asr_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_asr" and cfg["architectures"] == ["Qwen3ASRForConditionalGeneration"]
    th = cfg["thinker_config"]
    assert th["audio_start_token_id"] == tok.token_to_id("<|audio_start|>")
    assert th["audio_end_token_id"] == tok.token_to_id("<|audio_end|>")
    assert th["audio_token_id"] == tok.token_to_id("<|audio_pad|>")
    assert th["text_config"]["vocab_size"] == tok.get_vocab_size()
    assert th["text_config"]["tie_word_embeddings"] is False
    assert "English" in cfg["support_languages"]
    infos, _, _ = read_safetensors_header(asr_dir / "model.safetensors")
    assert {n.split(".")[1] for n in infos} == {"audio_tower", "model", "lm_head"}
    assert all(n.startswith("thinker.") and i.dtype == "F32" for n, i in infos.items())
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "preprocessor_config.json",
              "generation_config.json", "chat_template.jinja"):
        assert (asr_dir / f).is_file(), f


def test_chat_template_keeps_only_system_and_audio(hf_processor):
    msgs = [{"role": "system", "content": [{"type": "text", "text": "names: Orla"}]},
            {"role": "user", "content": [{"type": "text", "text": "please transcribe"},
                                         {"type": "audio", "audio": "clip.wav"}]}]
    text = hf_processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nnames: Orla<|im_end|>\n<|im_start|>user\n"
                    "<|audio_start|><|audio_pad|><|audio_end|><|im_end|>\n<|im_start|>assistant\n")


def test_cli_make_model_qwen3_asr(tmp_path, asr_dir):
    from npu_conformance.cli import main

    assert main(["make-model", "--arch", "qwen3_asr", "--out", str(tmp_path / "m"), "--seed", "0"]) == 0
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == (asr_dir / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------------- bad input


def test_bad_mel_shapes_are_named(ref):
    enc = ref.encoder
    for bad in (np.zeros((128, 99), np.float32), np.zeros((127, 100), np.float32), np.zeros(100, np.float32)):
        with pytest.raises(AudioShapeError, match=r"\[128, 100\] \(one window\).*got shape"):
            enc.encode_window(bad)
    with pytest.raises(AudioShapeError, match="float array"):
        enc.encode_window(np.zeros((128, 100), np.int32))
    with pytest.raises(AudioShapeError, match=r"\[128, T\] with T >= 1.*\(128, 0\)"):
        enc.encode(np.zeros((128, 0), np.float32))
    with pytest.raises(AudioShapeError, match="non-finite"):
        enc.encode(np.full((128, 10), np.nan, np.float32))


def test_bad_audio_config_values_are_named(ref):
    good = ref.config["thinker_config"]["audio_config"]
    for key, value, msg in (("n_window", 64, "n_window'] 64: the NPU encoder window is fixed at 100"),
                            ("activation_function", "swish", "activation_function'] 'swish' is not supported"),
                            ("d_model", 0, "d_model'] must be a positive integer, got 0"),
                            ("encoder_attention_heads", 5, "must be even and a multiple of encoder_attention_heads 5"),
                            ("max_source_positions", 12, "max_source_positions'] 12 must be >= 13")):
        with pytest.raises(AudioConfigError, match=msg.replace("[", r"\[").replace("(", r"\(")):
            AudioEncoderConfig.from_dict({**good, key: value})
    missing = {k: v for k, v in good.items() if k != "output_dim"}
    with pytest.raises(AudioConfigError, match="output_dim"):
        AudioEncoderConfig.from_dict(missing)
    with pytest.raises(UnsupportedModelError, match="mrope_section"):
        text_model_config({**ref.config["thinker_config"]["text_config"],
                           "rope_scaling": {"rope_type": "default", "mrope_section": [8, 8, 8]}})


def test_merge_count_mismatch_names_both_counts(ref, tok):
    ids = tiny.prompt_ids(tok, 5)
    with pytest.raises(AudioTokenMismatchError, match="5 audio tokens .* 4 audio embeddings"):
        ref.merge(ids, np.zeros((4, 128), np.float32))
    merged = ref.merge(ids, np.ones((5, 128), np.float32))
    assert merged.shape == (len(ids), 128)
    assert (merged[np.asarray(ids) == ref.audio_token_id] == 1).all()


def test_bad_samples_are_named():
    with pytest.raises(AudioInputError, match=r"1-D mono audio, got shape \(2, 400\)"):
        log_mel(np.zeros((2, 400), np.float32))
    with pytest.raises(AudioInputError, match="float array"):
        log_mel(np.zeros(400, np.int16))
    with pytest.raises(AudioInputError, match=r"at least 201 samples .* got shape \(200,\)"):
        log_mel(np.zeros(200, np.float32))
