"""A tiny Qwen3-ASR checkpoint in the original Qwen release layout, fitted to transcribe synthetic clips.

``build_qwen3_asr(out_dir, seed=0)`` writes what Qwen/Qwen3-ASR-1.7B ships (and vLLM 0.32 /
transformers' ``Qwen3ASRProcessor`` load), scaled down:

- ``config.json``: ``model_type`` ``qwen3_asr``, ``Qwen3ASRForConditionalGeneration``,
  ``thinker_config`` {``audio_config`` (d_model 64, 2 layers, 4 heads, ffn 128, conv width 16,
  output_dim 128, n_window 50, n_window_infer 800), ``text_config`` (Qwen3: hidden 128, 2 layers,
  4 heads / 2 KV heads, head_dim 32, q/k norms, M-RoPE ``rope_scaling`` {mrope_section [6, 5, 5],
  interleaved}, rope_theta 1e6, untied), ``audio_token_id``, ``audio_start_token_id``,
  ``audio_end_token_id``, ``user_token_id``}, ``support_languages``;
- ``model.safetensors`` (float32; ``thinker.audio_tower.*``, ``thinker.model.*``,
  ``thinker.lm_head.weight``);
- the tiny BPE tokenizer of :func:`npusim.tinymodel.build.train_tokenizer` plus
  :data:`ASR_SPECIAL_TOKENS` (ids 1024-1026, special) and ``<asr_text>`` (1027, a normal added
  token, so it survives ``skip_special_tokens`` as in the release); ``tokenizer_config.json``,
  ``special_tokens_map.json``;
- ``preprocessor_config.json``: ``WhisperFeatureExtractor`` (128 bins, hop 160, n_fft 400,
  chunk 30 s), ``processor_class`` ``Qwen3ASRProcessor``;
- ``chat_template.jinja`` (also in ``tokenizer_config.json``): :data:`CHAT_TEMPLATE`;
- ``generation_config.json`` (greedy; eos ``<|im_end|>``, ``<|endoftext|>``).

Known transcripts. :data:`CLIPS` are synthetic clips (a tone per word, :data:`WORD_TONES`);
:data:`TRANSCRIPTS` their text. Random weights would transcribe nothing, so the untied
``thinker.lm_head.weight`` is *fitted* (numpy ridge regression, deterministic): the golden
pipeline (:class:`npusim.llm.asr_reference.AsrReference`: log-mel, NPU-windowed encoder, merge,
decoder) is run teacher-forced over, per clip,
``prompt(no language) + "language English<asr_text>" + TRANSCRIPT + "<|im_end|>"``, and the head
(a random ``N(0, 1/hidden)`` head plus a ridge correction, so no row is zero) maps each of those
positions' final hidden state to :data:`FIT_LOGIT` on the next token and 0 elsewhere.
The forced-language prompt is a prefix of that sequence, so greedy decoding gives
``TRANSCRIPT<|im_end|>`` after the forced-language prompt and
``language English<asr_text>TRANSCRIPT<|im_end|>`` after the plain one; :func:`build_qwen3_asr`
checks both for every clip and raises if not. :func:`fit_margin` is the smallest gap between
the target logit and the best other logit on those positions: 15.97 for seed 0, printed by
``pytest -s tests/npusim/test_asr_golden.py -k fit_margin`` (which asserts > 8).

Only these clips have known transcripts; other audio (e.g. a 35 s concatenation, which runs)
decodes to arbitrary tokens.

Every file is a pure function of ``seed``.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..llm.asr_reference import AsrReference, decoder_tensors, text_model_config
from ..llm.audio_encoder import TOWER_PREFIX, AudioEncoderConfig, audio_token_count, tower_tensor_shapes
from ..llm.config import ModelConfig
from ..llm.decoder import Decoder
from ..llm.mel import SAMPLE_RATE, log_mel
from ..llm.safetensors import save_safetensors
from .build import EOS_TOKEN, IM_END, IM_START, SPECIAL_TOKENS, TRANSFORMERS_VERSION, make_weights, train_tokenizer

__all__ = ["ASR_SPECIAL_TOKENS", "ASR_TEXT", "AUDIO_END", "AUDIO_PAD", "AUDIO_START", "CHAT_TEMPLATE", "CLIPS",
           "Clip", "FIT_LOGIT", "TRANSCRIPTS", "WORD_TONES", "asr_tokenizer", "build_qwen3_asr", "clip_samples",
           "fit_margin", "make_asr_config", "prompt_ids"]

AUDIO_START = "<|audio_start|>"
AUDIO_END = "<|audio_end|>"
AUDIO_PAD = "<|audio_pad|>"
ASR_TEXT = "<asr_text>"
#: Added special tokens, in id order after the BPE vocabulary (1024, 1025, 1026).
ASR_SPECIAL_TOKENS = (AUDIO_START, AUDIO_END, AUDIO_PAD)
LANGUAGE = "English"

#: Like the Mobilint artifact's: only the system message's text and the user turns' audio are
#: kept (a user turn's text parts are dropped); an assistant turn's text is kept (prefill).
#: Content is a string or a list of parts ({"type": "text"|"audio"|"audio_url"|"input_audio", ...}).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'user' %}"
    "{{- '<|im_start|>user\\n' }}"
    "{%- if message['content'] is not string %}{%- for part in message['content'] %}"
    "{%- if 'audio' in part['type'] %}{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- if not loop.last %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: Tone (fundamental, Hz) of each word; a word is that tone plus its second harmonic at half level.
WORD_TONES: dict[str, float] = {
    "red": 350.0, "river": 500.0, "bridge": 700.0, "lamp": 950.0,
    "snow": 1250.0, "honey": 1650.0, "wind": 2200.0, "nine": 2900.0,
}
WORD_SECONDS = 0.32
WORD_STEP_SECONDS = 0.40
LEAD_SECONDS = 0.10
AMPLITUDE = 0.4


@dataclass(frozen=True)
class Clip:
    """A synthetic clip: ``words`` as tones every 0.4 s from 0.1 s (0.32 s each), ``seconds`` long."""

    words: tuple[str, ...]
    seconds: float


#: The fitted clips. ``river_snow`` is exactly one NPU window (100 frames, 13 audio tokens); ``honey``
#: is half of one; the others span 2-4 windows, ``red_river_bridge_snow`` a whole number of them.
CLIPS: dict[str, Clip] = {
    "honey": Clip(("honey",), 0.5),
    "river_snow": Clip(("river", "snow"), 1.0),
    "lamp_wind_nine": Clip(("lamp", "wind", "nine"), 1.35),
    "red_river_bridge_snow": Clip(("red", "river", "bridge", "snow"), 2.0),
    "snow_honey_lamp_river_wind": Clip(("snow", "honey", "lamp", "river", "wind"), 2.5),
    "nine_bridge_red_wind_lamp_honey": Clip(("nine", "bridge", "red", "wind", "lamp", "honey"), 3.05),
}
TRANSCRIPTS: dict[str, str] = {name: " ".join(c.words) for name, c in CLIPS.items()}

#: The fitted head puts this logit on the target token (and 0 on the others) at each fit position.
FIT_LOGIT = 16.0
RIDGE = 1e-6
#: Seed offsets of the parts drawn from ``numpy.random.default_rng(seed + offset)``.
_AUDIO_SEED_OFFSET = 7919
_HEAD_SEED_OFFSET = 104729

_AUDIO_CONFIG: dict[str, Any] = {
    "activation_dropout": 0.0,
    "activation_function": "gelu",
    "attention_dropout": 0.0,
    "conv_chunksize": 500,
    "d_model": 64,
    "downsample_hidden_size": 16,
    "dropout": 0.0,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "encoder_layers": 2,
    "initializer_range": 0.02,
    "max_source_positions": 1500,
    "model_type": "qwen3_asr_audio_encoder",
    "n_window": 50,
    "n_window_infer": 800,
    "num_mel_bins": 128,
    "output_dim": 128,
    "scale_embedding": False,
}

_TEXT_CONFIG: dict[str, Any] = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "dtype": "float32",
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 128,
    "initializer_range": 0.02,
    "intermediate_size": 256,
    "max_position_embeddings": 65536,
    "model_type": "qwen3_asr_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"interleaved": True, "mrope_interleaved": True, "mrope_section": [6, 5, 5],
                     "rope_type": "default"},
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "use_cache": True,
}


def clip_samples(name: str) -> np.ndarray:
    """The samples of clip ``name``: float32 mono 16 kHz, ``round(seconds * 16000)`` of them.

    Raises:
        KeyError: unknown clip (names the choices).
    """
    if name not in CLIPS:
        raise KeyError(f"unknown clip {name!r} (choices: {', '.join(CLIPS)})")
    clip = CLIPS[name]
    n = int(round(clip.seconds * SAMPLE_RATE))
    out = np.zeros(n, np.float64)
    m = int(round(WORD_SECONDS * SAMPLE_RATE))
    t = np.arange(m) / SAMPLE_RATE
    fade = int(0.01 * SAMPLE_RATE)
    env = np.ones(m)
    ramp = 0.5 - 0.5 * np.cos(np.pi * np.arange(fade) / fade)
    env[:fade], env[-fade:] = ramp, ramp[::-1]
    for i, word in enumerate(clip.words):
        f = WORD_TONES[word]
        start = int(round((LEAD_SECONDS + i * WORD_STEP_SECONDS) * SAMPLE_RATE))
        tone = np.sin(2 * np.pi * f * t) + 0.5 * np.sin(2 * np.pi * 2 * f * t)
        out[start:start + m] += AMPLITUDE / 1.5 * env * tone
    return out.astype(np.float32)


def asr_tokenizer():
    """The tiny BPE tokenizer plus :data:`ASR_SPECIAL_TOKENS` (special) and ``<asr_text>`` (not special).

    Raises:
        ImportError: ``tokenizers`` is missing.
    """
    from tokenizers import AddedToken

    tok = train_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ASR_SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(ASR_TEXT, special=False, normalized=False)])
    return tok


def prompt_ids(tokenizer: Any, n_audio_tokens: int, language: str | None = LANGUAGE, context: str = "") -> list[int]:
    """vLLM 0.32's Qwen3-ASR transcription prompt (``get_generation_prompt``) with the audio expanded:

    ``[<|im_start|>system\\n{context}<|im_end|>\\n]<|im_start|>user\\n<|audio_start|>``
    ``<|audio_pad|> * n<|audio_end|><|im_end|>\\n<|im_start|>assistant\\n[language {language}<asr_text>]``

    ``tokenizer``: a ``tokenizers.Tokenizer`` (``encode(s).ids``) or a transformers tokenizer
    (``encode(s, add_special_tokens=False)``).
    """
    system = f"{IM_START}system\n{context}{IM_END}\n" if context else ""
    s = (f"{system}{IM_START}user\n{AUDIO_START}{AUDIO_PAD * int(n_audio_tokens)}{AUDIO_END}{IM_END}\n"
         f"{IM_START}assistant\n")
    if language is not None:
        s += f"language {language}{ASR_TEXT}"
    try:
        return list(tokenizer.encode(s, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(s).ids)


def make_asr_config(vocab_size: int, token_ids: dict[str, int]) -> dict[str, Any]:
    """The ``config.json`` dict (original Qwen3-ASR layout) for a tokenizer of ``vocab_size``
    tokens with the given ids of ``<|audio_start|>``, ``<|audio_end|>``, ``<|audio_pad|>``,
    ``<|im_end|>``, ``<|endoftext|>`` and ``user``."""
    text = copy.deepcopy(_TEXT_CONFIG)
    text.update(vocab_size=int(vocab_size), bos_token_id=None, eos_token_id=token_ids[IM_END],
                pad_token_id=token_ids[EOS_TOKEN])
    thinker = {
        "audio_config": copy.deepcopy(_AUDIO_CONFIG),
        "audio_end_token_id": token_ids[AUDIO_END],
        "audio_start_token_id": token_ids[AUDIO_START],
        "audio_token_id": token_ids[AUDIO_PAD],
        "dtype": "float32",
        "initializer_range": 0.02,
        "model_type": "qwen3_asr_thinker",
        "text_config": text,
        "user_token_id": token_ids["user"],
    }
    return {
        "architectures": ["Qwen3ASRForConditionalGeneration"],
        "model_type": "qwen3_asr",
        "support_languages": [LANGUAGE, "Chinese"],
        "thinker_config": thinker,
        "transformers_version": TRANSFORMERS_VERSION,
    }


def _audio_weights(cfg: AudioEncoderConfig, seed: int) -> dict[str, np.ndarray]:
    """Random tower tensors (names without the prefix): projections ``N(0, 1/fan_in)`` (``proj2``
    ``N(0, 2/fan_in)``, so audio embeddings are about as large as token embeddings), layer-norm
    weights ``1 + N(0, 0.05^2)``, biases ``N(0, 0.05^2)``."""
    rng = np.random.default_rng(seed + _AUDIO_SEED_OFFSET)
    out: dict[str, np.ndarray] = {}
    for name, shape in tower_tensor_shapes(cfg).items():
        if name.endswith(".bias"):
            w = rng.normal(0.0, 0.05, shape)
        elif len(shape) == 1:
            w = 1.0 + rng.normal(0.0, 0.05, shape)
        else:
            fan_in = int(np.prod(shape[1:]))
            gain = 2.0 if name.startswith("proj2") else 1.0
            w = rng.normal(0.0, np.sqrt(gain / fan_in), shape)
        out[name] = w.astype(np.float32)
    return out


def _token_ids(tok: Any) -> dict[str, int]:
    ids = {t: tok.token_to_id(t) for t in (*SPECIAL_TOKENS, *ASR_SPECIAL_TOKENS, ASR_TEXT)}
    user = tok.encode("user").ids
    ids["user"] = user[0] if len(user) == 1 else -1
    return ids


def _fit_sequences(tok: Any, ref: AsrReference) -> list[tuple[np.ndarray, int, np.ndarray]]:
    """Per clip: (merged embeddings of the whole teacher-forced sequence, index of the first
    target, the sequence's token ids)."""
    im_end = tok.token_to_id(IM_END)
    out = []
    for name in CLIPS:
        mel = log_mel(clip_samples(name))
        n = audio_token_count(mel.shape[1])
        plain = prompt_ids(tok, n, language=None)
        forced = prompt_ids(tok, n)
        if forced[:len(plain)] != plain:
            raise RuntimeError("the forced-language prompt does not extend the plain one token by token")
        seq = np.array(forced + tok.encode(TRANSCRIPTS[name]).ids + [im_end], np.int64)
        out.append((ref.merge(seq, ref.encode(mel)), len(plain), seq))
    return out


def _fit_head(ref: AsrReference, text_weights: dict[str, np.ndarray],
              seqs: list[tuple[np.ndarray, int, np.ndarray]], seed: int) -> np.ndarray:
    """Ridge fit of the LM head ``[vocab, hidden]`` (module docstring); ``text_weights`` are the
    decoder's tensors (Decoder names)."""
    c = ref.decoder.config
    h, vocab = c.hidden_size, c.vocab_size
    probe_head = np.zeros((vocab, h), np.float32)
    probe_head[:h] = np.eye(h, dtype=np.float32)  # logits[:, :h] = the final-normed hidden state
    probe = Decoder(c, {**text_weights, "lm_head.weight": probe_head}, source="probe")
    xs, ys = [], []
    for emb, first, seq in seqs:
        hid = probe.forward_embeddings(emb, probe.new_cache(len(emb)))[:, :h].astype(np.float64)
        xs.append(hid[first - 1:len(seq) - 1])
        ys.append(seq[first:])
    x = np.concatenate(xs)
    y = np.zeros((len(x), vocab))
    y[np.arange(len(x)), np.concatenate(ys)] = FIT_LOGIT
    # a random head N(0, 1/hidden) (no all-zero rows), corrected so the fit positions hit y exactly
    base = np.random.default_rng(seed + _HEAD_SEED_OFFSET).normal(0.0, 1.0 / np.sqrt(h), (h, vocab))
    w = base + np.linalg.solve(x.T @ x + RIDGE * len(x) * np.eye(h), x.T @ (y - x @ base))
    return np.ascontiguousarray(w.T).astype(np.float32)


def fit_margin(ref: AsrReference, tokenizer: Any) -> float:
    """Smallest ``target logit - best other logit`` over every fitted position of every clip
    (teacher-forced), in logits (the head aims for :data:`FIT_LOGIT`)."""
    margins = []
    for emb, first, seq in _fit_sequences(tokenizer, ref):
        logits = ref.decoder.forward_embeddings(emb, ref.decoder.new_cache(len(emb))).astype(np.float64)
        for pos in range(first - 1, len(seq) - 1):
            row = logits[pos].copy()
            tgt = int(seq[pos + 1])
            best = row[tgt]
            row[tgt] = -np.inf
            margins.append(best - row.max())
    return float(min(margins))


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def build_qwen3_asr(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write the tiny fitted Qwen3-ASR checkpoint (module docstring) into ``out_dir``.

    Args:
        out_dir: destination directory (created if missing; our files are overwritten).
        seed: weight seed, an integer in [0, 2**32). Same seed -> byte-identical files.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: bad ``seed``; ``out_dir`` is an existing file.
        RuntimeError: (should not happen) the fitted head does not reproduce every transcript.
        ImportError: ``tokenizers`` is not installed.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed {seed!r} must be an integer in [0, 2**32)")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {str(out)!r} exists and is not a directory")
    tok = asr_tokenizer()
    ids = _token_ids(tok)
    cfg = make_asr_config(tok.get_vocab_size(), ids)
    th = cfg["thinker_config"]
    enc_cfg = AudioEncoderConfig.from_dict(th["audio_config"])
    text_cfg = ModelConfig.from_dict(text_model_config(th["text_config"]))
    text_w = make_weights(text_cfg, int(seed))
    tensors = {TOWER_PREFIX + n: t for n, t in _audio_weights(enc_cfg, int(seed)).items()}
    tensors.update({("thinker.lm_head.weight" if n == "lm_head.weight" else "thinker." + n): t
                    for n, t in text_w.items()})
    ref = AsrReference.from_config_and_tensors(cfg, tensors, source="tiny qwen3_asr")
    tensors["thinker.lm_head.weight"] = _fit_head(ref, decoder_tensors(tensors), _fit_sequences(tok, ref), int(seed))
    ref = AsrReference.from_config_and_tensors(cfg, tensors, source="tiny qwen3_asr")
    _check_transcripts(ref, tok)

    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids[SPECIAL_TOKENS[0]],
        "do_sample": False,
        "eos_token_id": [ids[IM_END], ids[EOS_TOKEN]],
        "pad_token_id": ids[EOS_TOKEN],
        "transformers_version": TRANSFORMERS_VERSION,
    })
    save_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    special = {
        "additional_special_tokens": [IM_START, IM_END, *ASR_SPECIAL_TOKENS],
        "audio_bos_token": AUDIO_START,
        "audio_eos_token": AUDIO_END,
        "audio_token": AUDIO_PAD,
        "eos_token": IM_END,
        "pad_token": EOS_TOKEN,
    }
    _write_json(out / "special_tokens_map.json", special)
    _write_json(out / "tokenizer_config.json", {
        "add_bos_token": False,
        "add_eos_token": False,
        "additional_special_tokens": [IM_START, IM_END, *ASR_SPECIAL_TOKENS],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "extra_special_tokens": {"audio_bos_token": AUDIO_START, "audio_eos_token": AUDIO_END,
                                 "audio_token": AUDIO_PAD},
        "model_max_length": 65536,
        "pad_token": EOS_TOKEN,
        "processor_class": "Qwen3ASRProcessor",
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    _write_json(out / "preprocessor_config.json", {
        "chunk_length": 30,
        "dither": 0.0,
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128,
        "hop_length": 160,
        "n_fft": 400,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "processor_class": "Qwen3ASRProcessor",
        "return_attention_mask": True,
        "sampling_rate": SAMPLE_RATE,
    })
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n", encoding="utf-8")
    return out


def _check_transcripts(ref: AsrReference, tok: Any) -> None:
    """Greedy decoding of every clip, both prompt forms, gives the known text (else RuntimeError)."""
    im_end = tok.token_to_id(IM_END)
    for name in CLIPS:
        mel = log_mel(clip_samples(name))
        n = audio_token_count(mel.shape[1])
        want = tok.encode(TRANSCRIPTS[name]).ids + [im_end]
        preface = prompt_ids(tok, n)[len(prompt_ids(tok, n, language=None)):]
        for lang, expect in (("English", want), (None, preface + want)):
            got = ref.generate_greedy(prompt_ids(tok, n, language=lang), mel, len(expect) + 4, [im_end])
            if got != expect:
                got_s, want_s = tok.decode(got, skip_special_tokens=False), tok.decode(expect, skip_special_tokens=False)
                raise RuntimeError(f"clip {name!r} (language {lang!r}): decoded {got_s!r}, expected {want_s!r}")
