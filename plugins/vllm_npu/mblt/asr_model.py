"""vLLM's model class for Mobilint Qwen3-ASR releases (architecture
``MobilintQwen3ASRForConditionalGeneration``), as the API server and the engine see it.

They need a class to plan a request: a multimodal processor (audio -> log-mel features and
``<|audio_pad|>`` placeholders) and the transcription hooks (``get_generation_prompt``,
``get_speech_to_text_config``...). vLLM 0.32 has both for Qwen3-ASR, but its module imports the
Qwen2-VL image processor, which needs torchvision, and this environment keeps torchvision out
(its PyPI wheels are GPU builds that break torch 2.13.0+cpu). So they are written here, on
vLLM's multimodal processing API and transformers' ``Qwen3ASRProcessor``, following what vLLM's
and the Qwen3-ASR SDK's code does (facts: the prompt format, the placeholder count, the feature
fields), with vllm-mblt 0.8.0's differences:

- **The native preface is kept.** Without ``language`` the model writes
  ``language English<asr_text>`` before the text; vllm-mblt returns it as part of the text, once
  per chunk (vLLM 0.32 strips it): :meth:`post_process_output` and the streaming post-processor
  pass the text through.
- **Transcription only.** ``/v1/audio/translations`` is refused with HTTP 400: the model
  transcribes and does not translate.
- **One clip per prompt** (the platform sets the limit; :mod:`vllm_npu.mblt.asr`).

The class is never built: the MBLT worker runs the release's MXQs through the runtime API
(:mod:`vllm_npu.mblt.asr`). Building it raises
:class:`vllm_npu.mblt.models.MobilintModelNotBuildable`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from transformers.feature_extraction_utils import BatchFeature
from transformers.models.qwen3_asr import Qwen3ASRProcessor
from vllm.model_executor.models.interfaces import (
    StreamingTranscriptionPostProcessor,
    SupportsMultiModal,
    SupportsTranscription,
)
from vllm.model_executor.models.whisper import ISO639_1_SUPPORTED_LANGS
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
)

from vllm_npu.mblt.asr import audio_token_count
from vllm_npu.mblt.models import MobilintForCausalLM, MobilintModelNotBuildable

__all__ = ["MobilintQwen3ASRForConditionalGeneration", "TRANSLATION_REFUSAL", "sanitize_context"]

TRANSLATION_REFUSAL = ("task_type 'translate': Mobilint Qwen3-ASR transcribes and does not translate; "
                       "use /v1/audio/transcriptions")
#: What the placeholder of one audio clip is in a prompt before the processor expands it.
AUDIO_PLACEHOLDER = "<|audio_start|><|audio_pad|><|audio_end|>"
ASR_TEXT_TAG = "<asr_text>"
_CHATML_TOKEN = re.compile(r"<\|[^|]+\|>")


def sanitize_context(text: str | None) -> str:
    """A transcription request's ``prompt`` as it may enter the system turn: ChatML-like control
    tokens (``<|...|>``) and ``<asr_text>`` removed until none is left (so a nested one cannot
    reassemble)."""
    if not text:
        return ""
    prev = None
    while prev != text:
        prev = text
        text = _CHATML_TOKEN.sub("", text).replace(ASR_TEXT_TAG, "")
    return text


def _feature_fields(hf_inputs: Mapping[str, torch.Tensor]) -> dict[str, MultiModalFieldConfig]:
    lengths = hf_inputs.get("audio_feature_lengths", torch.empty((0,)))
    return {
        # one clip's features are [mel_bins, its frames]: the clips are concatenated along frames
        "input_audio_features": MultiModalFieldConfig.flat_from_sizes("audio", lengths, dim=1),
        "feature_attention_mask": MultiModalFieldConfig.batched("audio", keep_on_cpu=True),
        "audio_feature_lengths": MultiModalFieldConfig.batched("audio", keep_on_cpu=True),
    }


class Qwen3AsrProcessingInfo(BaseProcessingInfo):
    """The release's processor (transformers' ``Qwen3ASRProcessor``: a Whisper-style log-mel
    feature extractor and the tokenizer) and its limits."""

    def get_hf_config(self) -> Any:
        return self.ctx.get_hf_config().thinker_config

    def get_hf_processor(self, **kwargs: object) -> Qwen3ASRProcessor:
        return self.ctx.get_hf_processor(Qwen3ASRProcessor, **kwargs)

    def get_feature_extractor(self, **kwargs: object) -> Any:
        return self.get_hf_processor(**kwargs).feature_extractor

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"audio": 1}

    def get_data_parser(self) -> Any:
        from vllm.multimodal.parse import MultiModalDataParser

        return MultiModalDataParser(target_sr=self.get_feature_extractor().sampling_rate,
                                    expected_hidden_size=self._get_expected_hidden_size())


class Qwen3AsrDummyInputs(BaseDummyInputsBuilder[Qwen3AsrProcessingInfo]):
    """Profiling inputs: one placeholder per clip, clips of the feature extractor's window."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return self.info.get_hf_processor().audio_token * mm_counts.get("audio", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Any) -> Any:  # noqa: ARG002
        fe = self.info.get_feature_extractor()
        length = min(int(fe.chunk_length), 30) * int(fe.sampling_rate)
        return {"audio": self._get_dummy_audios(length=length, num_audios=mm_counts.get("audio", 0),
                                                 overrides=mm_options.get("audio") if mm_options else None)}


class Qwen3AsrMultiModalProcessor(BaseMultiModalProcessor[Qwen3AsrProcessingInfo]):
    """Audio -> ``input_audio_features`` ``[mel_bins, frames]`` (the padding frames dropped) and
    ``audio_feature_lengths``; the prompt's ``<|audio_pad|>`` becomes one token per audio
    embedding (:func:`vllm_npu.mblt.asr.audio_token_count` of the clip's frames)."""

    def _get_hf_mm_text(self, mm_counts: Mapping[str, int]) -> str:
        return self.dummy_inputs.get_dummy_text(mm_counts)

    def _postprocess_hf_mm_data(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object],
                                processed_data: BatchFeature) -> BatchFeature:
        if "input_features" not in processed_data:
            return processed_data
        features = processed_data.pop("input_features")
        masks = processed_data.pop("input_features_mask")
        processed_data["input_audio_features"] = torch.cat(
            [f[:, m.bool()] for f, m in zip(features, masks)], dim=1)
        processed_data["feature_attention_mask"] = masks
        processed_data["audio_feature_lengths"] = torch.stack([m.sum() for m in masks])
        return processed_data

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> BatchFeature:
        if not hf_data.get("audio"):
            return BatchFeature()
        return super()._call_hf_processor(hf_data, hf_kwargs)

    def _get_mm_fields_config(self, hf_inputs: BatchFeature,
                              hf_processor_mm_kwargs: Mapping[str, object]) -> Mapping[str, MultiModalFieldConfig]:  # noqa: ARG002
        return _feature_fields(hf_inputs)

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, Any],
                            out_mm_kwargs: Any) -> Sequence[PromptReplacement]:
        processor = self.info.get_hf_processor(**hf_processor_mm_kwargs)
        audio_token_id = self.info.get_tokenizer().get_vocab()[processor.audio_token]
        lengths = out_mm_kwargs.get_data().get("audio_feature_lengths")
        counts = [] if lengths is None else [audio_token_count(int(n)) for n in lengths.tolist()]

        def replacement(item_idx: int) -> list[int]:
            if counts[item_idx] == 0:
                raise ValueError(f"audio clip {item_idx} is too short to give one audio token")
            return [audio_token_id] * counts[item_idx]

        return [PromptReplacement(modality="audio", target=[audio_token_id], replacement=replacement)]


@MULTIMODAL_REGISTRY.register_processor(Qwen3AsrMultiModalProcessor, info=Qwen3AsrProcessingInfo,
                                        dummy_inputs=Qwen3AsrDummyInputs)
class MobilintQwen3ASRForConditionalGeneration(MobilintForCausalLM, SupportsMultiModal, SupportsTranscription):
    """Registry class of Mobilint Qwen3-ASR releases (see the module docstring).

    Raises:
        MobilintModelNotBuildable: when constructed.
    """

    supported_languages: ClassVar[Mapping[str, str]] = ISO639_1_SUPPORTED_LANGS

    def embed_multimodal(self, **kwargs: object) -> Any:  # pragma: no cover - never built
        raise MobilintModelNotBuildable("placeholder")

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:  # noqa: ARG003
        """A chat message's audio part becomes :data:`AUDIO_PLACEHOLDER`.

        Raises:
            ValueError: any other modality.
        """
        if modality.startswith("audio"):
            return AUDIO_PLACEHOLDER
        raise ValueError(f"modality {modality!r}: Mobilint Qwen3-ASR takes audio only")

    @classmethod
    def get_speech_to_text_config(cls, model_config: Any, task_type: str) -> Any:  # noqa: ARG003
        """The feature extractor's window (``chunk_length``, 30 s) and sample rate."""
        from vllm.config import SpeechToTextConfig
        from vllm.transformers_utils.processor import cached_processor_from_config

        fe = cached_processor_from_config(model_config).feature_extractor
        return SpeechToTextConfig(max_audio_clip_s=fe.chunk_length, sample_rate=fe.sampling_rate)

    @classmethod
    def get_generation_prompt(cls, stt_params: Any) -> Any:
        """The Qwen3-ASR transcription prompt: a system turn holding the request's ``prompt``
        (sanitized by :func:`sanitize_context`; none without it), the user turn with the audio,
        and the assistant turn, opened with ``language <Name><asr_text>`` when a language is
        forced.

        Raises:
            ValueError: a translation (HTTP 400).
        """
        from vllm.inputs import TokensPrompt
        from vllm.multimodal.processing import cached_encode
        from vllm.tokenizers import cached_tokenizer_from_config

        if stt_params.task_type != "transcribe":
            raise ValueError(TRANSLATION_REFUSAL)
        context = sanitize_context(stt_params.request_prompt)
        prompt = (f"<|im_start|>system\n{context}<|im_end|>\n" if context else "")
        prompt += f"<|im_start|>user\n{AUDIO_PLACEHOLDER}<|im_end|>\n<|im_start|>assistant\n"
        if stt_params.language is not None:
            name = cls.supported_languages.get(stt_params.language, stt_params.language)
            prompt += f"language {name}{ASR_TEXT_TAG}"
        tokenizer = cached_tokenizer_from_config(stt_params.model_config)
        return TokensPrompt(prompt_token_ids=cached_encode(tokenizer, prompt),
                            multi_modal_data={"audio": stt_params.audio})

    @classmethod
    def post_process_output(cls, text: str) -> str:
        """The text as the model wrote it, its ``language X<asr_text>`` preface included."""
        return text

    @classmethod
    def get_streaming_post_processor_cls(cls) -> type[StreamingTranscriptionPostProcessor]:
        """vLLM's base post-processor: deltas passed through as they come (the preface included)."""
        return StreamingTranscriptionPostProcessor
