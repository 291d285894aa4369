"""The vendor's own transformers-mblt 0.6.1 Qwen3-ASR classes run our simulated Qwen3-ASR release
(``mxq compile`` of the tiny checkpoint) on ``npusim.mxq`` as their ``qbruntime``, unpatched.

transformers-mblt's Qwen3-ASR imports the upstream ``qwen_asr`` package (PyPI ``qwen-asr``, the
vendor's ``qwen-asr`` extra). Pinned test dependency: ``qwen-asr==0.0.6`` installed ``--no-deps``
plus what its ``__init__`` imports (``librosa``, ``soundfile``, ``nagisa``). It declares
``transformers==4.57.6`` and only imports there: under transformers 5.x its modeling module fails
at import (``check_model_inputs()`` changed signature), so these tests skip in the main
environment (transformers 5.19) and run in vllm-mblt's (transformers 4.57.6, docs/mblt.md).

What is checked: the release's config.json parses as ``MobilintQwen3ASRConfig``; the vendor's
``MobilintQwen3ASRAudioEncoder`` (fixed 100-frame windows through ``infer([chunk], None, 0)``)
returns the golden encoder's embeddings bit for bit; ``generate`` (audio merged over the
``<|audio_pad|>`` rows, the thinker's text decoder MXQ with its beam-snapshot cache) gives the
golden pipeline's greedy tokens and the clip's transcript.

A local release needs absolute ``encoder_mxq_path`` / ``decoder_mxq_path`` overrides: the vendor's
Qwen3-ASR config, unlike its VL configs, does not pass the directory (``name_or_path``) on to its
sub-configs, so mblt-npu-python resolves a relative ``mxq_path`` from the working directory, else
from the Hub repository ``mobilint/<name_or_path>``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _tmblt_alias import transformers_mblt_on_simulator

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers_mblt") is None or importlib.util.find_spec("mblt_npu") is None:
    pytest.skip("transformers-mblt / mblt-npu-python (pinned test dependencies) are not installed",
                allow_module_level=True)
if importlib.util.find_spec("qwen_asr") is None:
    pytest.skip("qwen-asr (pin: qwen-asr==0.0.6 --no-deps, with librosa, soundfile, nagisa; it needs "
                "transformers==4.57.6) is not installed: transformers-mblt's Qwen3-ASR imports it",
                allow_module_level=True)
try:
    importlib.import_module("qwen_asr.core.transformers_backend")
except Exception as exc:  # noqa: BLE001 - any import failure is the skip reason
    for _name in [n for n in sys.modules if n.split(".")[0] == "qwen_asr"]:
        del sys.modules[_name]
    pytest.skip(f"qwen-asr is installed but does not import here ({type(exc).__name__}: {exc}); qwen-asr 0.0.6 "
                "needs transformers==4.57.6", allow_module_level=True)

CLIPS = ("river_snow", "lamp_wind_nine")


@pytest.fixture(scope="module")
def qbruntime() -> Iterator[Any]:
    """``import qbruntime`` on the simulator for this module only, transformers-mblt registered."""
    with transformers_mblt_on_simulator() as (mod, registered):
        assert "qwen3_asr" in registered
        yield mod


@pytest.fixture(scope="module")
def asr_dir(tmp_path_factory) -> Path:
    from npusim.tinymodel.asr import build_qwen3_asr

    return build_qwen3_asr(tmp_path_factory.mktemp("tmblt_asr_hf") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def release(asr_dir, tmp_path_factory) -> Path:
    from npusim.mxq.compile import compile_artifact

    return compile_artifact(asr_dir, tmp_path_factory.mktemp("tmblt_asr_rel") / "rel", max_width=16,
                            prefill_chunk_size=16)


@pytest.fixture(scope="module")
def vendor_model(qbruntime, release) -> Iterator[Any]:
    """``MobilintQwen3ASRForConditionalGeneration.from_pretrained`` of the release (both MXQs launched)."""
    from npusim.mxq import machine
    from transformers_mblt.models.qwen3_asr.modeling_qwen3_asr import MobilintQwen3ASRForConditionalGeneration

    machine.reset()
    model = MobilintQwen3ASRForConditionalGeneration.from_pretrained(
        str(release), encoder_mxq_path=str((release / "audio_encoder.mxq").resolve()),
        decoder_mxq_path=str((release / "decoder.mxq").resolve()))
    yield model
    model.thinker.audio_tower.dispose()
    model.thinker.model.dispose()
    machine.reset()


def test_release_config_parses(qbruntime, release, asr_dir):
    import json

    from transformers_mblt.models.qwen3_asr.configuration_qwen3_asr import MobilintQwen3ASRConfig

    cfg = MobilintQwen3ASRConfig.from_pretrained(str(release))
    src = json.loads((asr_dir / "config.json").read_text())["thinker_config"]
    a, t = cfg.thinker_config.audio_config, cfg.thinker_config.text_config
    assert (a.mxq_path, a.core_mode, a.dev_no, a.max_batch_size) == ("audio_encoder.mxq", "single", 0, 1)
    assert (t.mxq_path, t.core_mode, t.npu_prefill_chunk_size) == ("decoder.mxq", "single", 16)
    assert a.output_dim == t.hidden_size == src["text_config"]["hidden_size"]
    assert cfg.thinker_config.audio_token_id == src["audio_token_id"]
    assert cfg.encoder_mxq_path == "audio_encoder.mxq" and cfg.decoder_mxq_path == "decoder.mxq"


@pytest.mark.parametrize("clip", CLIPS)
def test_vendor_audio_encoder_equals_golden(vendor_model, asr_dir, clip):
    from npusim.llm.audio_encoder import AudioEncoder
    from npusim.llm.mel import log_mel
    from npusim.tinymodel.asr import clip_samples

    mel = log_mel(clip_samples(clip))
    out = vendor_model.thinker.audio_tower(torch.tensor(mel)[None], feature_lens=torch.tensor([mel.shape[1]]))
    got = out.last_hidden_state.numpy()
    assert np.array_equal(got, AudioEncoder.from_pretrained(asr_dir).encode(mel))


@pytest.mark.parametrize("clip", CLIPS)
def test_vendor_generate_transcribes_as_the_reference(vendor_model, asr_dir, clip):
    from npusim.llm.asr_reference import AsrReference
    from npusim.llm.audio_encoder import audio_token_count
    from npusim.llm.mel import log_mel
    from npusim.tinymodel.asr import TRANSCRIPTS, asr_tokenizer, clip_samples, prompt_ids

    tok = asr_tokenizer()
    mel = log_mel(clip_samples(clip))
    ids = prompt_ids(tok, audio_token_count(mel.shape[1]))
    new = len(tok.encode(TRANSCRIPTS[clip]).ids) + 1
    want = AsrReference.from_pretrained(asr_dir).generate_greedy(ids, mel, new)
    pid = torch.tensor([ids])
    with torch.no_grad():
        out = vendor_model.generate(input_ids=pid, attention_mask=torch.ones_like(pid),
                                    input_features=torch.tensor(mel)[None],
                                    feature_attention_mask=torch.ones((1, mel.shape[1]), dtype=torch.long),
                                    max_new_tokens=new, do_sample=False)
    seq = out.sequences if hasattr(out, "sequences") else out
    got = seq[0, len(ids):].tolist()
    assert got == want
    assert tok.decode(got[:-1]).strip() == TRANSCRIPTS[clip]
