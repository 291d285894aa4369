"""npusim.mxq's Qwen3-ASR release (``mxq compile`` of a qwen3_asr checkpoint) and its audio_encoder kind.

Reference: the golden pieces (``npusim.llm.audio_encoder.AudioEncoder.encode_window`` and
``npusim.llm.asr_reference.AsrReference``). The audio-encoder MXQ computes with that same code, so
its output must equal it bit for bit in float32; the decoder MXQ is the ordinary decoder kind over
the thinker's text model, which must reproduce the reference decoder's logits exactly (both are
``npusim.llm.Decoder`` on the same tensors). The MXQs are opened through ``npusim.mxq``'s
qbruntime surface (Accelerator / ModelConfig / Model / launch / infer), as the vendor's host code
opens them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import npusim.mxq as qb
from npusim.llm.audio_encoder import WINDOW_FRAMES, WINDOW_TOKENS, AudioEncoder
from npusim.mxq.asr_kinds import AudioInputError
from npusim.mxq.compile import compile_artifact
from npusim.mxq.compile_asr import ASR_KV_CAPACITY
from npusim.mxq.mxqfile import read_mxq

build_qwen3_asr = pytest.importorskip("npusim.tinymodel.asr").build_qwen3_asr


@pytest.fixture(scope="module")
def asr_dir(tmp_path_factory) -> Path:
    """The tiny original-layout Qwen3-ASR checkpoint (``npusim.tinymodel.asr``)."""
    return build_qwen3_asr(tmp_path_factory.mktemp("asr_hf") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def release(asr_dir, tmp_path_factory) -> Path:
    """Its release, compiled with the defaults."""
    return compile_artifact(asr_dir, tmp_path_factory.mktemp("asr_rel") / "rel")


@pytest.fixture(scope="module")
def golden_encoder(asr_dir) -> AudioEncoder:
    return AudioEncoder.from_pretrained(asr_dir)


def _launch(path: Path, config: qb.ModelConfig | None = None) -> qb.Model:
    m = qb.Model(str(path), config)
    m.launch(qb.Accelerator())
    return m


def _windows(bins: int) -> list[np.ndarray]:
    """Mel windows ``[bins, 100]``: random, zeros, constant, a log-mel of a tone (if the golden
    mel code is there) and one with large values."""
    rng = np.random.default_rng(7)
    wins = [rng.standard_normal((bins, WINDOW_FRAMES)).astype(np.float32), np.zeros((bins, WINDOW_FRAMES), np.float32),
            np.full((bins, WINDOW_FRAMES), -0.75, np.float32),
            (rng.standard_normal((bins, WINDOW_FRAMES)) * 30).astype(np.float32)]
    try:
        from npusim.llm.mel import SAMPLE_RATE, log_mel
    except ImportError:
        return wins
    t = np.arange(SAMPLE_RATE, dtype=np.float64) / SAMPLE_RATE
    mel = log_mel((0.3 * np.sin(2 * np.pi * 440 * t) + 0.01 * rng.standard_normal(t.size)).astype(np.float32))
    if mel.shape[0] == bins and mel.shape[1] >= WINDOW_FRAMES:
        wins.append(np.ascontiguousarray(mel[:, :WINDOW_FRAMES]))
    return wins


# ---------------------------------------------------------------------------------------- audio_encoder kind
def test_audio_encoder_equals_golden_bit_for_bit(mxq_machine, release, golden_encoder):
    cfg = golden_encoder.config
    mc = qb.ModelConfig()
    mc.set_single_core_mode(1)
    m = _launch(release / "audio_encoder.mxq", mc)
    assert m.get_model_input_shape() == [(1, cfg.num_mel_bins, WINDOW_FRAMES)]
    assert m.get_model_output_shape() == [(cfg.output_dim, 1, WINDOW_TOKENS)]
    assert m.get_cache_infos() == [] and m.dump_cache_memory(0) == []
    m.load_cache_memory([], 0)  # nothing to load, accepted
    assert m.get_input_buffer_info()[0].max_cache_size == 0
    for mel in _windows(cfg.num_mel_bins):
        (out,) = m.infer([mel[None, None]], None, 0)  # transformers-mblt's call
        assert out.shape == (1, cfg.output_dim, 1, WINDOW_TOKENS) and out.dtype == np.float32
        want = golden_encoder.encode_window(mel)
        # the host's own post-processing: squeeze axis 2, transpose to [13, D]
        assert np.array_equal(np.transpose(np.squeeze(out, axis=2), (0, 2, 1))[0], want)
    mel = _windows(cfg.num_mel_bins)[0]
    (again,) = m.infer([mel[None, None]], None, 17)  # cache_size is ignored: no KV
    assert np.array_equal(again[0, :, 0, :].T, golden_encoder.encode_window(mel))
    (r3,) = m.infer([mel[None]])  # rank 3 in (HWC), rank 3 out
    want = golden_encoder.encode_window(mel)
    assert r3.shape == (cfg.output_dim, 1, WINDOW_TOKENS) and np.array_equal(r3[:, 0, :].T, want)
    buf = np.empty((1, cfg.output_dim, 1, WINDOW_TOKENS), np.float32)
    assert m.infer([mel[None, None]], [buf]) is None and np.array_equal(buf[0, :, 0, :].T, want)
    m.dispose()


@pytest.mark.parametrize("shape", [
    (1, 1, 128, 99), (1, 1, 128, 101), (1, 1, 128, 200), (1, 1, 127, 100), (2, 1, 128, 100), (1, 2, 128, 100),
    (128, 100), (1, 1, 1, 128, 100), (1, 1, 100, 128),
])
def test_audio_encoder_refuses_any_other_shape(mxq_machine, release, golden_encoder, shape):
    assert golden_encoder.config.num_mel_bins == 128
    m = _launch(release / "audio_encoder.mxq")
    clock = m.device_clock_us()
    with pytest.raises(AudioInputError, match=r"^Input shape is invalid\. .*\[1, 1, 128, 100\].*got "
                                              + json.dumps(list(shape)).replace("[", r"\[").replace("]", r"\]")):
        m.infer([np.zeros(shape, np.float32)], None, 0)
    assert m.device_clock_us() == clock  # nothing ran
    m.dispose()


def test_audio_encoder_refuses_other_arguments(mxq_machine, release):
    m = _launch(release / "audio_encoder.mxq")
    x = np.zeros((1, 1, 128, WINDOW_FRAMES), np.float32)
    with pytest.raises(ValueError, match=r"The number of inputs is invalid \(expected 1, got 2\)"):
        m.infer([x, x])
    with pytest.raises(qb.QbRuntimeError, match="Model_InvalidBatchParam"):
        m.infer([x], None, 0, [qb.BatchParam(1, 0, 0)])
    with pytest.raises(ValueError, match="cache_size -1"):
        m.infer([x], None, -1)
    bad = x.copy()
    bad[0, 0, 3, 4] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        m.infer([bad])
    with pytest.raises(qb.QbRuntimeError, match="NotImplemented"):
        m.infer_npu_data([])
    m.dispose()
    with pytest.raises(qb.QbRuntimeError, match="Model_NotLaunched"):
        m.infer([x])


def test_audio_encoder_paced_cost(mxq_machine, release):
    m = _launch(release / "audio_encoder.mxq")
    x = np.zeros((1, 1, 128, WINDOW_FRAMES), np.float32)
    s = mxq_machine.settings()
    t0 = m.device_clock_us()
    m.infer([x])
    run = s.infer_fixed_us + s.infer_us_per_token * WINDOW_TOKENS  # 13 audio tokens
    assert m.device_clock_us() - t0 == pytest.approx(2 * s.io_fixed_us + run)
    mxq_machine.configure(infer_costs={"audio_encoder": {"fixed_us": 4000, "us_per_token": 10}})
    t1 = m.device_clock_us()
    m.infer([x])
    assert m.device_clock_us() - t1 == pytest.approx(2 * s.io_fixed_us + 4000 + 10 * WINDOW_TOKENS)
    m.dispose()


def test_audio_encoder_summary_and_header(release, golden_encoder):
    from npusim.mxq.model import _check_header
    from npusim.mxq.mxqfile import MxqFormatError

    text = qb.get_model_summary(str(release / "audio_encoder.mxq"))
    assert "kind: audio_encoder" in text and "cache infos: 0" in text
    header, tensors = read_mxq(release / "audio_encoder.mxq")
    assert header["kind"] == "audio_encoder" and header["max_batch_size"] == 1
    assert header["llm_config"]["output_dim"] == golden_encoder.config.output_dim
    assert tensors and all(n.startswith("thinker.audio_tower.") for n in tensors)
    with pytest.raises(MxqFormatError, match="max_batch_size"):
        _check_header({**header, "max_batch_size": 2})
    with pytest.raises(MxqFormatError, match="input_scales"):
        _check_header({**header, "input_scales": [1.0, 1.0]})
    with pytest.raises(MxqFormatError, match="outputs"):
        _check_header({**header, "outputs": ["logits"]})


def test_a_corrupt_audio_payload_fails_to_load(tmp_path, release, capsys):
    from npusim.mxq.mxqfile import write_mxq

    header, tensors = read_mxq(release / "audio_encoder.mxq")
    name = sorted(tensors)[0]
    bad = {**tensors, name: np.zeros((3,), np.float32)}
    kept = {k: v for k, v in header.items() if k not in ("format", "version", "payload_bytes")}
    write_mxq(tmp_path / "bad.mxq", kept, bad)
    with pytest.raises(qb.QbRuntimeError, match="Model_FailedToLoadMXQ"):
        qb.Model(str(tmp_path / "bad.mxq"))
    assert name.removeprefix("thinker.audio_tower.") in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- decoder MXQ
def _audio_via_mxq(enc: qb.Model, mel: np.ndarray) -> np.ndarray:
    """transformers-mblt's ``MobilintQwen3ASRAudioEncoder.forward`` on our MXQ, in numpy: zero-pad to
    whole windows, one ``infer([chunk], None, 0)`` each, ``[13, D]`` per window, the tail window cut
    to its frames' tokens."""
    from npusim.llm.audio_encoder import window_token_count

    t = mel.shape[1]
    n = -(-t // WINDOW_FRAMES)
    x = np.zeros((1, 1, mel.shape[0], n * WINDOW_FRAMES), np.float32)
    x[0, 0, :, :t] = mel
    rows = []
    for i in range(n):
        (out,) = enc.infer([x[..., i * WINDOW_FRAMES:(i + 1) * WINDOW_FRAMES]], None, 0)
        rows.append(np.transpose(np.squeeze(out, axis=2), (0, 2, 1))[0])
    if t % WINDOW_FRAMES:
        rows[-1] = rows[-1][:window_token_count(t % WINDOW_FRAMES)]
    return np.concatenate(rows, axis=0)


def _greedy_via_mxq(dec: qb.Model, embed: np.ndarray, prompt: np.ndarray, new: int, chunk: int) -> list[int]:
    """Chunked prefill of the prompt embeddings (``chunk`` rows per infer), then greedy decoding
    fed the host embedding table's rows: the tokens."""
    logits = None
    for start in range(0, prompt.shape[0], chunk):
        (logits,) = dec.infer([prompt[None, None, start:start + chunk]], None, start)
    pos, out = prompt.shape[0], []
    while True:
        tok = int(np.argmax(logits.reshape(-1, logits.shape[-1])[-1]))
        out.append(tok)
        if len(out) == new:
            return out
        (logits,) = dec.infer([embed[tok][None, None, None]], None, pos)
        pos += 1


@pytest.mark.parametrize("clip", ["river_snow", "lamp_wind_nine", "red_river_bridge_snow"])
def test_release_transcribes_as_the_reference(mxq_machine, asr_dir, release, clip):
    """Audio MXQ per window -> merge -> decoder MXQ (chunked prefill, greedy): the reference's
    audio embeddings, prompt logits and tokens exactly (both run the same float32 code)."""
    from npusim.llm.asr_reference import AsrReference
    from npusim.llm.audio_encoder import audio_token_count
    from npusim.llm.mel import log_mel
    from npusim.llm.safetensors import load_safetensors
    from npusim.tinymodel.asr import TRANSCRIPTS, asr_tokenizer, clip_samples, prompt_ids

    ref = AsrReference.from_pretrained(asr_dir)
    tok = asr_tokenizer()
    mel = log_mel(clip_samples(clip))
    ids = np.array(prompt_ids(tok, audio_token_count(mel.shape[1])))
    enc, dec = _launch(release / "audio_encoder.mxq"), _launch(release / "decoder.mxq")
    audio = _audio_via_mxq(enc, mel)
    assert np.array_equal(audio, ref.encode(mel))
    embed = load_safetensors(release / "embedding.safetensors")["model.embed_tokens.weight"]
    prompt = ref.merge(ids, audio)
    assert np.array_equal(np.where((ids == ref.audio_token_id)[:, None], prompt, embed[ids]), prompt)
    (all_rows,) = dec.infer([prompt[None, None, :16]], None, 0)
    want = ref.decoder.forward_embeddings(prompt, ref.decoder.new_cache(len(prompt)))
    assert np.array_equal(all_rows.reshape(-1, want.shape[-1])[-1], want[15])  # last-logit MXQ: row 15
    new = len(tok.encode(TRANSCRIPTS[clip]).ids) + 1
    got = _greedy_via_mxq(dec, embed, prompt, new, chunk=16)
    assert got == ref.generate_greedy(ids, mel, new)
    assert tok.decode(got[:-1]).strip() == TRANSCRIPTS[clip]
    enc.dispose()
    dec.dispose()


def test_decoder_mxq_shapes(release, asr_dir):
    from npusim.llm.asr_reference import AsrReference

    ref = AsrReference.from_pretrained(asr_dir)
    c = ref.decoder.config
    m = qb.Model(str(release / "decoder.mxq"))
    assert m.get_model_input_shape() == [(1, -1, c.hidden_size)]
    assert m.get_model_output_shape() == [(1, 1, c.vocab_size)]
    assert m.get_input_buffer_info()[0].max_cache_size == ASR_KV_CAPACITY >= 2048
    assert len(m.get_cache_infos()) == c.num_hidden_layers and m.get_cache_infos()[0].num_batches == 1
    header, tensors = read_mxq(release / "decoder.mxq")
    assert header.get("kind", "decoder") == "decoder" and header["max_batch_size"] == 1
    assert header["llm_config"]["model_type"] == "qwen3" and "mrope_section" not in json.dumps(header["llm_config"])
    assert not any(n.startswith("thinker.") for n in tensors) and "lm_head.weight" in tensors


# ---------------------------------------------------------------------------------------- release layout
def test_release_config(asr_dir, release):
    src = json.loads((asr_dir / "config.json").read_text())
    cfg = json.loads((release / "config.json").read_text())
    assert cfg["model_type"] == "mobilint-qwen3_asr"
    assert cfg["architectures"] == ["MobilintQwen3ASRForConditionalGeneration"]
    assert cfg["support_languages"] == src["support_languages"]
    assert "max_batch_size" not in json.dumps(cfg)  # declared nowhere (the seed: --max-num-seqs 1)
    assert not any(k.startswith(("vision_", "text_", "encoder_", "decoder_")) for k in cfg)
    th, sth = cfg["thinker_config"], src["thinker_config"]
    assert th["model_type"] == "mobilint-qwen3_asr_thinker"
    for key in ("audio_token_id", "audio_start_token_id", "audio_end_token_id"):
        assert th[key] == sth[key]
    tok = json.loads((asr_dir / "tokenizer.json").read_text())
    added = {a["content"]: a["id"] for a in tok["added_tokens"]}
    assert (th["im_start_token_id"], th["im_end_token_id"], th["asr_text_token_id"]) == (
        added["<|im_start|>"], added["<|im_end|>"], added["<asr_text>"])
    a, t = th["audio_config"], th["text_config"]
    assert a["model_type"] == "mobilint-qwen3_asr_audio_encoder" and t["model_type"] == "mobilint-qwen3_asr_text"
    assert {k: a[k] for k in ("mxq_path", "dev_no", "core_mode", "target_device")} == {
        "mxq_path": "audio_encoder.mxq", "dev_no": 0, "core_mode": "single", "target_device": "aries"}
    assert {k: t[k] for k in ("mxq_path", "dev_no", "core_mode", "target_device")} == {
        "mxq_path": "decoder.mxq", "dev_no": 0, "core_mode": "single", "target_device": "aries"}
    assert all(a[k] == v for k, v in sth["audio_config"].items() if k != "model_type")
    assert t["max_position_embeddings"] == sth["text_config"]["max_position_embeddings"] == 65536
    assert t["npu_prefill_chunk_size"] == cfg["npu_prefill_chunk_size"] == 128
    assert t["tie_word_embeddings"] is False and t["vocab_size"] == sth["text_config"]["vocab_size"]
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "chat_template.jinja",
                 "generation_config.json"):
        assert (release / name).read_bytes() == (asr_dir / name).read_bytes()


def test_release_host_embedding(asr_dir, release):
    from npusim.llm.safetensors import load_safetensors

    src = load_safetensors(asr_dir)["thinker.model.embed_tokens.weight"]
    vendor = load_safetensors(release / "model.safetensors")
    worker = load_safetensors(release / "embedding.safetensors")
    assert sorted(vendor) == ["thinker.model.embed_tokens.weight"] and sorted(worker) == ["model.embed_tokens.weight"]
    assert np.array_equal(vendor["thinker.model.embed_tokens.weight"], src)
    assert np.array_equal(worker["model.embed_tokens.weight"], src)


def test_release_options(asr_dir, tmp_path):
    root = compile_artifact(asr_dir, tmp_path / "rel", max_cache_size=4096, max_width=64, core_mode="auto",
                            prefill_chunk_size={"single": 32, "global4": 64}, output_logits="all", hub_proxy=True)
    cfg = json.loads((root / "config.json").read_text())
    th = cfg["thinker_config"]
    assert th["audio_config"]["core_mode"] == th["text_config"]["core_mode"] == "auto"
    assert th["text_config"]["npu_prefill_chunk_size"] == {"single": 32, "global4": 64}
    assert cfg["auto_map"]["AutoConfig"] == "proxy_qwen3_asr.MobilintQwen3ASRConfig"
    # vllm-mblt's worker loads it with AutoModelForCausalLM
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "proxy_qwen3_asr.MobilintQwen3ASRForConditionalGeneration"
    assert (root / "proxy_qwen3_asr.py").is_file()
    hd, _ = read_mxq(root / "decoder.mxq")
    ha, _ = read_mxq(root / "audio_encoder.mxq")
    assert (hd["max_cache_size"], hd["max_width"], hd["output_logits"]) == (4096, 64, "all")
    assert hd["core_modes"] == ha["core_modes"] == ["single", "multi", "global4", "global8"]


@pytest.mark.parametrize("kwargs, match", [
    ({"max_batch_size": 2}, r"max_batch_size=2: a Qwen3-ASR release supports only max_batch_size=1 \(its decoder MXQ "
                            r"is compiled for batch 1"),
    ({"moe": {"devices": 2}}, r"Mixture-of-Experts options \['devices'\] do not apply to a Qwen3-ASR checkpoint"),
    ({"eagle3": {}}, r"EAGLE-3 base model_type 'qwen3_asr'"),
    ({"max_cache_size": 70000}, r"max_cache_size 70000 must be <= max_position_embeddings 65536"),
    ({"max_width": 8, "prefill_chunk_size": 16}, r"max_width 8 must be >= every prefill chunk size"),
    ({"core_mode": "turbo"}, r"core_mode 'turbo' must be one of"),
    ({"output_logits": "some"}, r"output_logits 'some'"),
])
def test_compile_refusals(asr_dir, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        compile_artifact(asr_dir, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out" / "decoder.mxq").exists()


def test_compile_refuses_a_foreign_config(asr_dir, tmp_path):
    import shutil

    from npusim.mxq.compile_asr import compile_asr_release

    src = shutil.copytree(asr_dir, tmp_path / "ckpt")
    raw = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**raw, "model_type": "qwen3"}))
    with pytest.raises(ValueError, match="model_type 'qwen3' is not 'qwen3_asr': not a Qwen3-ASR checkpoint"):
        compile_asr_release(src, tmp_path / "o")
    del raw["thinker_config"]["text_config"]
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="thinker_config with audio_config and text_config"):
        compile_artifact(src, tmp_path / "o")


# ---------------------------------------------------------------------------------------- CLI
def test_cli_compiles_a_qwen3_asr_release(asr_dir, tmp_path, capsys):
    from npu_conformance.cli import main

    out = tmp_path / "rel"
    assert main(["mxq", "compile", str(asr_dir), "--out", str(out), "--max-cache-size", "2048"]) == 0
    assert "Qwen3-ASR release: audio_encoder.mxq, decoder.mxq" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["model_type"] == "mobilint-qwen3_asr"


@pytest.mark.parametrize("flags, named", [
    (["--max-batch-size", "4"], "--max-batch-size 4: a Qwen3-ASR release's decoder MXQ is compiled for batch 1"),
    (["--moe-devices", "2"], "--moe-devices: Mixture-of-Experts options do not apply to a Qwen3-ASR checkpoint"),
    (["--moe-last-only"], "--moe-last-only: Mixture-of-Experts options do not apply"),
    (["--eagle3"], "--eagle3: EAGLE-3 options do not apply to a Qwen3-ASR checkpoint"),
    (["--eagle3-tree", "3", "4", "12"], "--eagle3-tree: EAGLE-3 options do not apply"),
])
def test_cli_refuses_options_that_do_not_apply(asr_dir, tmp_path, capsys, flags, named):
    from npu_conformance.cli import main

    assert main(["mxq", "compile", str(asr_dir), "--out", str(tmp_path / "rel"), *flags]) == 2
    err = capsys.readouterr().err
    assert "is a Qwen3-ASR checkpoint" in err and named in err
    assert not (tmp_path / "rel").exists()
