"""``Model``: an MXQ artifact on a simulated card, computed by the golden decoder.

The artifact (:mod:`npusim.mxq.mxqfile`) carries a Llama/Qwen2/Qwen3 config and its weights; the
Model builds a float32 :class:`npusim.llm.Decoder` from them. The other MXQ kinds (header
``kind``, FORMAT.md) compute with their golden pieces: the MoE parts (:mod:`npusim.llm.moe_parts`),
the EAGLE-3 kinds (:mod:`npusim.mxq.eagle3_kinds`), the Qwen3-ASR audio encoder
(:mod:`npusim.mxq.asr_kinds`, no KV) and the Qwen2-VL / Qwen3-VL vision encoders and text layouts
(:mod:`npusim.mxq.vlm_kinds`; the text decoders are ``decoder`` MXQs with a ``vlm_text_layout``). KV memory: one region per cache id (K = ``max_batch_size``
of the artifact), each ``T = max_cache_size`` tokens, allocated on first use after ``launch``.

KV semantics: an infer item with ``cache_size = c`` and ``n`` tokens writes positions
``[c, c + n)`` of its cache id and attends over ``[0, c + n)``. Nothing tracks what was
written: positions never written since launch hold NaN ("poison"), so attending over KV that
was never written gives NaN logits. A real card would read whatever its memory held; NaN makes
the caller's bug visible instead of silently wrong. Rewinding (a ``cache_size`` smaller than
what was written) is allowed and overwrites from there; positions past ``c + n`` keep their
old values (and are not attended).

Every argument check of ``infer`` / ``load_cache_memory`` runs before any KV is written, so a
failed call changes nothing.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..llm import Decoder, KVCache
from ..llm import ModelConfig as LlmConfig
from ..llm.errors import CheckpointError, UnsupportedModelError
from . import machine, tracing
from .accelerator import Accelerator
from .config import ModelConfig
from .errors import fail
from .mxqfile import MxqFormatError, read_mxq
from ..llm.moe_parts import DecoderPart
from .advanced import AdvancedModelApi, Scale
from .npu_data import NPUData
from .eagle3_kinds import EAGLE3_INPUTS, EAGLE3_KINDS, EAGLE3_OUTPUTS, Eagle3InputError, Eagle3Part
from .asr_kinds import ASR_INPUTS, ASR_KINDS, ASR_OUTPUTS, AudioEncoderPart
from .vlm_kinds import (VLM_VISION_KINDS, VLM_VISION_OUTPUTS, VlmHeaderError, VlmTextPart, VlmVisionPart,
                        check_vlm_header, vlm_num_inputs)
from .types import BatchParam, BufferInfo, CacheInfo, CacheType, Cluster, CoreId, CoreMode, DataType

__all__ = ["Model", "ModelVariantHandle", "get_model_summary", "load"]

CORE_MODE_NAMES: dict[str, CoreMode] = {
    "single": CoreMode.Single, "multi": CoreMode.Multi, "global4": CoreMode.Global4, "global8": CoreMode.Global8,
}
#: MXQ kinds (header ``kind``; FORMAT.md) and the names of their outputs, in the default order.
KIND_OUTPUTS: dict[str, tuple[str, ...]] = {
    "decoder": ("logits",), "moe_shared": ("residual", "expert_in", "gate"), "moe_expert": ("hidden",),
    "lm_head": ("logits",), **EAGLE3_OUTPUTS, **ASR_OUTPUTS, **VLM_VISION_OUTPUTS,
}
MXQ_KINDS: tuple[str, ...] = tuple(KIND_OUTPUTS)
_ids = itertools.count(1)
_SRC = "model.cc"


def _buffer_info(height: int, width: int, channel: int, max_cache_size: int) -> BufferInfo:
    """A buffer of ``height x width x channel`` at its maximum (not reshaped)."""
    return BufferInfo(original_height=height, original_width=width, original_channel=channel,
                      reshaped_height=height, reshaped_width=width, reshaped_channel=channel,
                      height=height, width=width, channel=channel, max_height=height, max_width=width,
                      max_channel=channel, max_cache_size=max_cache_size)


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


class ModelVariantHandle:
    """Shapes of one model variant (the simulator's artifacts have exactly one)."""

    def __init__(self, model: Model, idx: int) -> None:
        self._model, self._idx = model, idx

    def get_variant_idx(self) -> int:
        return self._idx

    def get_model_input_shape(self) -> list[tuple[int, ...]]:
        return self._model.get_model_input_shape()

    def get_model_output_shape(self) -> list[tuple[int, ...]]:
        return self._model.get_model_output_shape()

    def get_input_buffer_info(self) -> list[BufferInfo]:
        return self._model.get_input_buffer_info()

    def get_output_buffer_info(self) -> list[BufferInfo]:
        return self._model.get_output_buffer_info()


class Model(AdvancedModelApi):
    """An MXQ model: ``Model(path, model_config=None)``, then ``launch(acc)``, ``infer``, ``dispose``.

    Raises (construction):
        QbRuntimeError: ``Model_FailedToLoadMXQ`` (missing/corrupt file; the glog detail names
            the reason) or ``Model_MXQAndModelConfigNotMatch`` (the config asks for a core mode
            the artifact was not compiled for; batched artifacts allow only single or auto;
            ``CoreMode.Auto`` on an artifact compiled for several modes).
    """

    def __init__(self, path: str | os.PathLike, model_config: ModelConfig | None = None, *,
                 _summary_only: bool = False) -> None:
        self._path = str(path)
        self._config = model_config if model_config is not None else ModelConfig()
        # the accelerator launched on; ``_acc`` itself exists only from launch(), as in qbruntime's
        # Python layer (transformers-mblt reads ``hasattr(model, "_acc") and model._acc is None``
        # as "disposed")
        self._launched_on: Accelerator | None = None
        self._id = next(_ids)
        self._dev_no: int | None = None
        self._cores: list[CoreId] = []
        self._upload_bytes = 0
        self._caches: dict[int, KVCache] = {}
        try:
            header, tensors = read_mxq(path)
            self._header = _check_header(header)
            self._kind: str = header.get("kind", "decoder")
            # an audio or vision encoder's llm_config is its tower's config, which is no decoder config
            cfg = (None if self._kind in ASR_KINDS or self._kind in VLM_VISION_KINDS
                   else LlmConfig.from_dict(header["llm_config"]))
            self._decoder: Decoder | None = None
            self._part: DecoderPart | None = None
            self._e3: Eagle3Part | None = None
            self._audio: AudioEncoderPart | None = None
            self._vision: VlmVisionPart | None = None
            self._vlm_text: VlmTextPart | None = None
            if self._kind in ASR_KINDS:
                self._audio = AudioEncoderPart(header["llm_config"], tensors, source=self._path)
            elif self._kind in VLM_VISION_KINDS:
                self._vision = VlmVisionPart(self._kind, header, tensors, source=self._path)
            elif self._kind in EAGLE3_KINDS:
                self._e3 = Eagle3Part(self._kind, header["llm_config"], tensors, taps=header.get("eagle3_taps"),
                                      source=self._path)
            elif self._kind == "decoder":
                self._decoder = Decoder(cfg, tensors, np.float32, source=self._path)
                if "vlm_text_layout" in header:
                    self._vlm_text = VlmTextPart(header, self._decoder)
            else:
                self._part = DecoderPart(cfg, tensors, self._kind, layer=header.get("layer"),
                                         expert=header.get("expert"), source=self._path)
        except (MxqFormatError, CheckpointError, UnsupportedModelError, ValueError) as exc:
            # as the real core: the reason as a plain stderr line, then one glog line
            sys.stderr.write(f"Unable to load; {exc}\n")
            sys.stderr.flush()
            raise fail("Model_FailedToLoadMXQ", "Failed to load model.", "model_impl.cc:1219") from None
        self._cfg = cfg  # None for an audio or vision encoder
        self._outputs: list[str] = (list(self._vision.output_names) if self._vision is not None
                                    else list(header.get("outputs", KIND_OUTPUTS[self._kind])))
        self._in_scales: list[float] = [float(v) for v in header.get("input_scales", [1.0] * _num_inputs(self._kind, header))]
        self._out_scales: list[float] = [float(v) for v in header.get("output_scales", [1.0] * len(self._outputs))]
        self._last_only = bool(header.get("last_only", False))
        #: an MoE MXQ whose outputs have one token row whatever its input (last-only shared, lm_head)
        self._one_row = self._last_only or self._kind == "lm_head"
        self.K = int(header["max_batch_size"])
        self.T = int(header["max_cache_size"])
        self.W = int(header["max_width"])
        self._all_logits = header["output_logits"] == "all"
        self._compiled = [CORE_MODE_NAMES[m] for m in header["core_modes"]]
        mode = self._config.get_core_mode()
        if mode == CoreMode.Auto and len(self._compiled) > 1 and not _summary_only:
            allowed = ", ".join(str(m) for m in self._compiled)
            raise fail("Model_MXQAndModelConfigNotMatch",
                       f"The MXQ is compiled for several core modes [{allowed}]: CoreMode.Auto cannot pick one; "
                       "set one of them in the ModelConfig.", "model.cc:196")
        if mode != CoreMode.Auto and (mode not in self._compiled or (self.K > 1 and mode != CoreMode.Single)):
            allowed = ", ".join(str(m) for m in self._compiled)
            raise fail("Model_MXQAndModelConfigNotMatch",
                       f"The MXQ is compiled for core mode(s) [{allowed}] (batch {self.K}), but the ModelConfig asks for {mode}.",
                       "model.cc:201")
        sig = json.dumps([header["llm_config"], self.K, self.T, self.W], sort_keys=True).encode()
        layer_bytes = 0 if cfg is None else 2 * cfg.num_key_value_heads * self.T * cfg.head_dim * 4
        n_layers = 0 if cfg is None else cfg.num_hidden_layers
        kv_layers = {"decoder": range(n_layers), "moe_shared": [header.get("layer")],
                     "eagle3_base": range(n_layers), "eagle3_draft": [0]}.get(self._kind, [])
        self._infos = [
            CacheInfo(CacheType.Batch if self.K > 1 else CacheType.Default, f"layer{i}.kv",
                      hashlib.sha256(sig + f"/layer{i}".encode()).hexdigest()[:16], layer_bytes, self.K)
            for i in kv_layers
        ]
        self.get_model_input_shape()
        self.get_model_output_shape()

    def __repr__(self) -> str:
        state = "launched" if self._launched_on is not None else "not launched"
        return f"<npusim.mxq.Model {self._path!r} K={self.K} T={self.T} W={self.W} {state}>"

    # ------------------------------------------------------------------ lifecycle
    def launch(self, acc: Accelerator) -> None:
        """Allocate cores and device memory on ``acc`` and upload the model.

        Raises:
            QbRuntimeError: ``Model_AlreadyLaunched``; ``Acc_CoreAlreadyInUse`` (an explicitly
                requested core is held by a model it cannot share with: this MXQ or the
                holder's is memory-fixed; explicitly named cores are otherwise shared) or ``Driver_FailedToClaimCores`` (not enough free cores);
                ``BadAlloc`` (device memory exhausted, or the ``bad_alloc_at_launch`` fault).
            TypeError: ``acc`` is not an Accelerator.
        """
        if self._launched_on is not None:
            raise fail("Model_AlreadyLaunched", f"Model (id {self._id}) is already launched.", "model.cc:240")
        if not isinstance(acc, Accelerator):
            raise TypeError(f"launch() expects an Accelerator, got {type(acc).__name__}")
        dev = acc._device
        if machine.note_launch():
            raise fail("BadAlloc", "Failed to allocate NPU memory for model upload. "
                       f"(injected fault: bad_alloc_at_launch={machine.settings().bad_alloc_at_launch})", "memory.cc:77")
        cores = self._allocate_cores(dev)
        upload = self.upload_bytes()
        total = machine.memory_bytes()
        free = total - dev.memory_used
        if upload > free:
            machine.release_cores(dev, self._id)
            raise fail("BadAlloc", "Failed to allocate NPU memory for model upload. "
                       f"(requested {upload} bytes, available {free} of {total} bytes on device {acc.get_dev_no()})", "memory.cc:77")
        dev.memory_used += upload
        self._launched_on, self._dev_no, self._cores, self._upload_bytes, self._caches = acc, acc.get_dev_no(), cores, upload, {}
        self._acc = acc

    def _resolved_mode(self) -> CoreMode:
        mode = self._config.get_core_mode()
        return self._compiled[0] if mode == CoreMode.Auto else mode

    def _allocate_cores(self, dev: machine.Device) -> list[CoreId]:
        mode = self._resolved_mode()
        explicit = self._config.get_core_ids() if self._config.get_core_mode() == CoreMode.Single else []
        free = dev.free_cores()
        if explicit:
            needed, candidates = len(explicit), [explicit]
        elif mode == CoreMode.Single:
            needed = max(1, self._config.get_num_cores())
            candidates = [free[:needed]] if len(free) >= needed else []
        elif mode == CoreMode.Global8:
            needed, candidates = 8, [list(machine.ALL_CORES)]
        else:  # Multi / Global4: one whole cluster
            clusters = self._config.get_clusters() or [Cluster.Cluster0, Cluster.Cluster1]
            needed = 4
            candidates = [[c for c in machine.ALL_CORES if c.cluster == cl] for cl in clusters]
        flexible = bool(self._header.get("memory_flexible", True))
        try:
            got = machine.allocate_cores(dev, self._id, candidates, shared=bool(explicit), memory_flexible=flexible)
        except machine.MemoryAreaInUse as exc:
            core = int(exc.core.cluster) | int(exc.core.core)
            raise fail("Acc_CoreAlreadyInUse", machine.MEMORY_AREA_IN_USE.format(core), "core_allocator.cc:118") from None
        if got is None:
            status = "Acc_CoreAlreadyInUse" if explicit else "Driver_FailedToClaimCores"
            raise fail(status, f"Core allocation failed - available cores : {len(free)} vs requested cores : {needed}", "core_allocator.cc:133")
        return got

    def dispose(self) -> None:
        """Free the cores, device memory and KV of this model; ``_acc`` becomes None. Idempotent."""
        self._acc = None  # set by every dispose, launched or not, as qbruntime's Python layer does
        if self._launched_on is None:
            return
        dev = machine.device(self._dev_no) if self._dev_no is not None else None
        if dev is not None:
            machine.release_cores(dev, self._id)
            dev.memory_used = max(0, dev.memory_used - self._upload_bytes)
        self._launched_on, self._cores, self._caches, self._upload_bytes = None, [], {}, 0

    def upload_bytes(self) -> int:
        """Device memory a launch takes: weights + K x KV bytes per cache id (simulator addition)."""
        return int(self._header["payload_bytes"]) + self.K * sum(i.size for i in self._infos)

    def device_clock_us(self) -> float:
        """The simulated clock (µs) of the card this model is launched on (simulator addition).

        Raises:
            QbRuntimeError: ``Model_NotLaunched``.
        """
        return self._launched()._device.clock_us

    def _launched(self) -> Accelerator:
        if self._launched_on is None:
            raise fail("Model_NotLaunched", "Model is not launched. Call `launch` first.", "model.cc:310")
        return self._launched_on

    # ------------------------------------------------------------------ metadata
    def get_identifier(self) -> int:
        return self._id

    def get_model_path(self) -> str:
        return self._path

    def get_core_mode(self) -> CoreMode:
        """The mode the model runs in (Auto resolves to the artifact's first compiled mode)."""
        return self._resolved_mode()

    def get_target_cores(self) -> list[CoreId]:
        """Cores held since launch (before launch: the explicitly configured ones)."""
        return list(self._cores) if self._launched_on is not None else self._config.get_core_ids()

    @property
    def target_cores(self) -> list[CoreId]:
        """Deprecated: :meth:`get_target_cores`."""
        return self.get_target_cores()

    def is_target(self, core_id: CoreId) -> bool:
        return core_id in self.get_target_cores()

    def get_device_names(self) -> list[str]:
        return [self._launched_on.get_device_name()] if self._launched_on is not None else []

    def get_num_model_variants(self) -> int:
        return 1

    def get_model_variant_handle(self, variant_idx: int) -> ModelVariantHandle:
        """Raises: QbRuntimeError: ``Model_InvalidVariantIdx`` when ``variant_idx`` is not 0
        (the only variant), as the real core raises."""
        if variant_idx != 0:
            raise fail("Model_InvalidVariantIdx", f"Invalid variant index {variant_idx!r}: the model has 1 variant(s).",
                       "model.cc:230")
        return ModelVariantHandle(self, 0)

    def get_model_input_shape(self) -> list[tuple[int, ...]]:
        """``[(1, -1, hidden)]``: -1 is the dynamic token axis (``(1, 1, hidden)`` for an lm_head MXQ).
        EAGLE-3 MXQs: one shape per input, ``-1`` also for the mask's ``cache_size + T`` channels.
        Audio encoders: their fixed window, ``[(1, num_mel_bins, 100)]``. VLM MXQs
        (:mod:`npusim.mxq.vlm_kinds`): one shape per input, whose last-axis widths identify the
        slots as transformers-mblt reads them (``-1`` a runtime axis)."""
        if self._audio is not None:
            return [self._audio.input_shape()]
        if self._vision is not None:
            return self._vision.input_shapes()
        if self._vlm_text is not None:
            return self._vlm_text.input_shapes()
        if self._e3 is not None:
            return [(1, -1, c) for c in self._e3.input_channels()]
        return [(1, 1 if self._kind == "lm_head" else -1, self._cfg.hidden_size)]

    def get_model_output_shape(self) -> list[tuple[int, ...]]:
        """Decoder MXQs: ``[(1, 1, vocab)]`` for last-logit non-batch artifacts, else
        ``[(1, -1, vocab)]``. MoE MXQs: one shape per output (``-1`` the dynamic token axis, 1 on
        a last-only shared MXQ; channels ``hidden``, ``num_experts`` for the router gate, ``vocab``
        for the lm_head). Audio encoders: ``[(output_dim, 1, 13)]``. Vision encoders: one
        ``(1, N/m², H)`` per output (``-1`` rows for a dynamic layout)."""
        if self._audio is not None:
            return [self._audio.output_shape()]
        if self._vision is not None:
            return self._vision.output_shapes()
        if self._kind == "decoder":
            rows = 1 if (not self._all_logits and self.K == 1) else -1
            return [(1, rows, self._cfg.vocab_size)]
        rows = 1 if self._one_row else -1
        return [(1, rows, self._channels(name)) for name in self._outputs]

    def _channels(self, output: str) -> int:
        if self._e3 is not None:
            return self._e3.output_channels(output)
        c = self._cfg
        return {"gate": c.num_experts, "logits": c.vocab_size}.get(output, c.hidden_size)

    def get_input_buffer_info(self) -> list[BufferInfo]:
        """``max_width`` = W tokens per item per call, ``max_cache_size`` = T tokens per cache id (0 without KV)."""
        t = self.T if self._infos else 0
        if self._audio is not None:
            return [_buffer_info(*self._audio.input_shape(), 0)]
        if self._vision is not None:  # the widest input of each slot: W patches
            return [_buffer_info(*(self.W if d == -1 else d for d in shape), 0) for shape in self._vision.input_shapes()]
        if self._vlm_text is not None:
            shapes = self._vlm_text.input_shapes()
            if self.K > 1:  # a batch build fuses its inputs into one buffer (transformers-mblt's comment)
                shapes = shapes[:1]
            return [_buffer_info(s[0], self.W, s[2], t) for s in shapes]
        if self._e3 is not None:  # one per input; the mask's channels at their widest
            return [_buffer_info(1, self.W, self.T + self.W if c == -1 else c, t) for c in self._e3.input_channels()]
        return [_buffer_info(1, self.W, self._cfg.hidden_size, t)]

    def get_output_buffer_info(self) -> list[BufferInfo]:
        """``max_width``: W for full logits, K for last-logit batch artifacts, else 1 (MoE MXQs:
        W per output, 1 when last-only)."""
        if self._audio is not None:
            return [_buffer_info(*self._audio.output_shape(), 0)]
        if self._vision is not None:
            return [_buffer_info(*(self.W // self._vision.merge ** 2 if d == -1 else d for d in shape), 0)
                    for shape in self._vision.output_shapes()]
        if self._kind != "decoder":
            rows = 1 if self._one_row else self.W
            return [_buffer_info(1, rows, self._channels(n), 0) for n in self._outputs]
        w = self.W if self._all_logits else (self.K if self.K > 1 else 1)
        v = self._cfg.vocab_size
        return [_buffer_info(1, w, v, 0)]

    # ------------------------------------------------------------------ quantisation scales
    def get_input_scale(self) -> list[Scale]:
        """One uniform :class:`Scale` per input: the quantisation multiplier (``raw = real * scale``).
        Decoder MXQs report 1.0 (their float32 inputs are not quantised by the simulator)."""
        return [Scale(s, True, [s]) for s in self._in_scales]

    def get_output_scale(self) -> list[Scale]:
        """One uniform :class:`Scale` per output: the dequantisation multiplier (``real = raw * scale``).
        An MoE shared MXQ's ``expert_in`` output scale is the exact reciprocal of its layer's expert
        input scale, as the release's are; the others differ from it."""
        return [Scale(s, True, [s]) for s in self._out_scales]

    def get_model_input_data_type(self) -> DataType:
        """``DataType.Float32`` (one ``DataType``, as the real module returns): inputs and
        outputs are float32."""
        return DataType.Float32

    get_model_output_data_type = get_model_input_data_type

    def get_cache_infos(self) -> list[CacheInfo]:
        """One CacheInfo per decoder layer (``size``: bytes of K and V for one cache id)."""
        return list(self._infos)

    # ------------------------------------------------------------------ inference
    def _input(self, inputs: Any) -> tuple[np.ndarray, int]:
        arrs = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
        if len(arrs) != 1:
            raise ValueError(f"The number of inputs is invalid (expected 1, got {len(arrs)}).")
        x = np.asarray(arrs[0], dtype=np.float32)
        h = self._cfg.hidden_size
        ok = (x.ndim == 3 and x.shape[0] == 1) or (x.ndim == 4 and x.shape[:2] == (1, 1))
        if not ok or x.shape[-1] != h or x.shape[-2] < 1:
            raise ValueError("Input shape is invalid.")
        return x.reshape(-1, h), x.ndim

    def _check_item(self, length: int, cache_size: int) -> None:
        if length > self.W:
            raise fail("Model_ShapeMismatched", f"Sequence length of inputs[0] exceeds maximum value ({length} > {self.W})", "model.cc:412")
        if self._infos and cache_size + length > self.T:
            raise fail("Model_CacheOverflow", f"Sum of sequence length and cache size exceeds max cache size ({cache_size + length} > {self.T})", "model.cc:418")

    def _items(self, n_tokens: int, cache_size: int, params: Sequence[BatchParam] | None) -> list[tuple[int, int, int]]:
        """Validated ``(cache_id, cache_size, length)`` per item."""
        if params is None:
            if not _is_int(cache_size) or cache_size < 0:
                raise ValueError(f"cache_size {cache_size!r} must be an integer >= 0")
            self._check_item(n_tokens, int(cache_size))
            return [(0, int(cache_size), n_tokens)]
        params = list(params)
        if len(params) > self.K:
            raise fail("Model_InvalidBatchParam", f"Batch size exceeds maximum value ({len(params)} > {self.K})", "model.cc:436")
        seen: set[int] = set()
        for p in params:
            for name in ("sequence_length", "cache_size", "cache_id"):
                v = getattr(p, name)
                if not _is_int(v) or v < 0:
                    raise ValueError(f"BatchParam.{name} {v!r} must be an integer >= 0 ({p!r})")
            if p.cache_id >= self.K:
                raise fail("Model_InvalidBatchParam", f"Cache Id exceeds maximum value ({p.cache_id} > {self.K - 1})", "model.cc:441")
            if p.cache_id in seen:
                raise fail("Model_InvalidBatchParam", f"Duplicated `cache_id` is detected (`cache_id` = {p.cache_id}). "
                           "Please ensure that no duplicate `cache_id` exist across batches.", "model.cc:445")
            seen.add(p.cache_id)
        total = sum(int(p.sequence_length) for p in params)
        if total != n_tokens:
            raise fail("Model_InvalidBatchParam", f"Sequence Length is mismatched between input and `BatchParam` (expected: {n_tokens}, actual: {total})", "model.cc:450")
        for p in params:
            if p.sequence_length < 1:
                raise fail("Model_InvalidBatchParam", f"Sequence length of a batch item must be positive ({p!r})", "model.cc:453")
            self._check_item(int(p.sequence_length), int(p.cache_size))
        return [(int(p.cache_id), int(p.cache_size), int(p.sequence_length)) for p in params]

    def _cache(self, cache_id: int) -> KVCache:
        if cache_id not in self._caches:
            c = (self._decoder or self._part or self._e3).new_cache(self.T)  # type: ignore[union-attr]
            for k, v in zip(c.keys, c.values):
                k.fill(np.nan)
                v.fill(np.nan)
            self._caches[cache_id] = c
        return self._caches[cache_id]

    def infer(self, inputs: Any, outputs: list[np.ndarray] | None = None, cache_size: int = 0,
              params: Sequence[BatchParam] | None = None) -> list[np.ndarray] | None:
        """Run the model on one float32 input of shape ``(1, S, hidden)`` or ``(1, 1, S, hidden)``
        (EAGLE-3 MXQs: their list of inputs, :meth:`_infer_eagle3`).

        Without ``params``: the S tokens go to cache id 0 at ``cache_size``. With ``params``
        (``cache_size`` ignored): item i takes the next ``params[i].sequence_length`` tokens.

        Returns:
            ``outputs=None``: ``[logits]`` float32, rows = one per item (last-logit artifacts) or one
            per token (full-logits artifacts), shape ``(1, rows, vocab)`` (``(1, 1, rows, vocab)``
            for a rank-4 input). With ``outputs``: written into ``outputs[0]``, returns None.

        Raises:
            QbRuntimeError: ``Model_NotLaunched``; ``Model_ShapeMismatched`` (an item longer than
                W); ``Model_CacheOverflow`` (cache_size + length > T); ``Model_InvalidBatchParam``;
                the injected ``infer_fail_*`` fault.
            ValueError: ``"Input shape is invalid."``, a negative cache_size, an output buffer of
                the wrong size.
        """
        acc = self._launched()
        if self._audio is not None:
            results = self._infer_audio(acc, inputs, cache_size, params)
        elif self._vision is not None:
            results = self._infer_vision(acc, inputs, cache_size, params)
        elif self._vlm_text is not None:
            results = self._infer_vlm_text(acc, inputs, cache_size, params)
        elif self._e3 is not None:
            results = self._infer_eagle3(acc, inputs, cache_size, params)
        else:
            x, rank = self._input(inputs)
            wall = time.perf_counter()
            rows = self._compute(x, cache_size, params)
            self._account_infer(acc, x.shape[0], wall)
            results = _with_rank(rows, rank)
        if outputs is None:
            return results
        if len(outputs) != len(results):
            raise ValueError(f"The number of outputs is invalid (expected {len(results)}, got {len(outputs)}).")
        for out, result in zip(outputs, results):
            if out.size != result.size:
                raise ValueError(f"Output shape is invalid: buffer of {out.size} elements, result {result.shape}.")
        for out, result in zip(outputs, results):
            out.reshape(-1)[:] = result.reshape(-1)
        return None

    def _infer_eagle3(self, acc: Accelerator, inputs: Any, cache_size: int,
                      params: Sequence[BatchParam] | None) -> list[np.ndarray]:
        """``infer`` of an EAGLE-3 MXQ (:mod:`npusim.mxq.eagle3_kinds`): all inputs ``[1, 1, T, C]``
        (or ``[1, T, C]``), one item on cache id 0 at ``cache_size``. Checks run before any KV is written.

        Raises:
            ValueError: the wrong number of inputs; ``Eagle3InputError`` (a ValueError) for a shape
                (name, expected and got) or a mask row that sees nothing; a negative cache_size.
            QbRuntimeError: ``Model_InvalidBatchParam`` (params given: the MXQ takes one item);
                ``Model_ShapeMismatched`` (T > W); ``Model_CacheOverflow`` (cache_size + T > max cache size);
                the injected ``infer_fail_*`` fault.
        """
        part = self._e3
        assert part is not None
        names = EAGLE3_INPUTS[self._kind]
        arrs = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
        if len(arrs) != len(names):
            raise ValueError(f"The number of inputs is invalid (expected {len(names)}, got {len(arrs)}).")
        if params is not None:
            raise fail("Model_InvalidBatchParam", f"This MXQ ({self._kind}) has max batch size 1 and takes no BatchParam.",
                       "model.cc:436")
        xs = [np.asarray(a, dtype=np.float32) for a in arrs]
        rank = xs[0].ndim
        for i, (name, x) in enumerate(zip(names, xs)):
            if not ((x.ndim == 4 and x.shape[:2] == (1, 1)) or (x.ndim == 3 and x.shape[0] == 1)) or x.ndim != rank \
                    or x.shape[-2] < 1:
                raise Eagle3InputError(f"Input shape is invalid: inputs[{i}] ({name}) must be [1, 1, T, C] with T >= 1 "
                                       f"like inputs[0], got {list(x.shape)}.")
        rows = [x.reshape(x.shape[-2], x.shape[-1]) for x in xs]
        if not _is_int(cache_size) or cache_size < 0:
            raise ValueError(f"cache_size {cache_size!r} must be an integer >= 0")
        cs, t = int(cache_size), rows[0].shape[0]
        self._check_item(t, cs)
        part.check(rows, cs)
        _raise_injected_fault()
        wall = time.perf_counter()
        cache = None
        if self._infos:
            cache = self._cache(0)
            cache.length = cs  # rewind/skip: the next write lands at cache_size
        with np.errstate(invalid="ignore", over="ignore"):
            named = part.run(rows, cache)
        machine.note_infer_ok()
        self._account_infer(acc, t, wall)
        return _with_rank([named[n].astype(np.float32) for n in self._outputs], rank)

    def _infer_audio(self, acc: Accelerator, inputs: Any, cache_size: int,
                     params: Sequence[BatchParam] | None) -> list[np.ndarray]:
        """``infer`` of an audio-encoder MXQ (:mod:`npusim.mxq.asr_kinds`): one mel window
        ``[1, 1, num_mel_bins, 100]`` (or ``[1, num_mel_bins, 100]``) in, ``[1, output_dim, 1, 13]``
        (``[output_dim, 1, 13]``) out. ``cache_size`` is checked (an int >= 0) and ignored: no KV.
        Paced as 13 tokens (the window's audio tokens) of kind ``audio_encoder``.

        Raises:
            ValueError: the wrong number of inputs; ``AudioInputError`` (a ValueError, qbruntime's
                ``Input shape is invalid.``) for any other shape; a negative cache_size.
            QbRuntimeError: ``Model_InvalidBatchParam`` (params given: the MXQ takes one window);
                the injected ``infer_fail_*`` fault.
        """
        part = self._audio
        assert part is not None
        arrs = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
        mel, rank = part.check(arrs)
        self._check_encoder_call(cache_size, params)
        wall = time.perf_counter()
        with np.errstate(invalid="ignore", over="ignore"):
            out = part.run(mel, rank)
        machine.note_infer_ok()
        self._account_infer(acc, part.tokens, wall)
        return [out]

    def _check_encoder_call(self, cache_size: int, params: Sequence[BatchParam] | None) -> None:
        """The checks of an encoder MXQ's ``infer`` (no KV, batch 1), then the injected fault.

        Raises:
            QbRuntimeError: ``Model_InvalidBatchParam`` (params given); the injected ``infer_fail_*`` fault.
            ValueError: ``cache_size`` not an integer >= 0.
        """
        if params is not None:
            raise fail("Model_InvalidBatchParam", f"This MXQ ({self._kind}) has max batch size 1 and takes no "
                       "BatchParam.", "model.cc:436")
        if not _is_int(cache_size) or cache_size < 0:
            raise ValueError(f"cache_size {cache_size!r} must be an integer >= 0")
        _raise_injected_fault()

    def _infer_vision(self, acc: Accelerator, inputs: Any, cache_size: int,
                      params: Sequence[BatchParam] | None) -> list[np.ndarray]:
        """``infer`` of a Qwen2-VL / Qwen3-VL vision MXQ (:mod:`npusim.mxq.vlm_kinds`): the layout's
        inputs in, ``(1, N/m², H)`` per output (``(B, N/m², H)`` for ``B`` stacked items) out, in the
        MXQ's output order. ``cache_size`` is checked (an int >= 0) and ignored: no KV. Paced as N
        patches (per item) of the vision kind.

        Raises:
            ValueError: the wrong number of inputs; ``VlmInputError`` (a ValueError starting with
                qbruntime's ``Input shape is invalid.``) for a shape outside the layout, or a
                dynamic patch count outside ``[m², max_width]``; a negative cache_size.
            QbRuntimeError: ``Model_InvalidBatchParam`` (params given: the MXQ takes no BatchParam);
                the injected ``infer_fail_*`` fault.
        """
        part = self._vision
        assert part is not None
        arrs = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
        xs, batch = part.check(arrs)
        self._check_encoder_call(cache_size, params)
        wall = time.perf_counter()
        with np.errstate(invalid="ignore", over="ignore"):
            outs = part.run(xs, batch)
        machine.note_infer_ok()
        self._account_infer(acc, part.patches_per_item(xs) * xs[0].shape[0], wall)
        return outs

    def _infer_vlm_text(self, acc: Accelerator, inputs: Any, cache_size: int,
                        params: Sequence[BatchParam] | None) -> list[np.ndarray]:
        """``infer`` of a VLM text decoder (``vlm_text_layout``, :mod:`npusim.mxq.vlm_kinds`): each
        item's rows are computed by ``Decoder.forward_rope`` on its cache id (RoPE from the host's
        packed rows, or from the cache position on all three M-RoPE rows for a static layout;
        DeepStack rows added after layers 0..L-1). Every check runs before any KV is written.

        Returns:
            ``[logits]``: one row per item (``output_logits`` "last") or per token ("all"), rank of
            ``inputs_embeds`` (``(1, 1, rows, vocab)`` or ``(1, rows, vocab)``).

        Raises:
            ValueError: the wrong number of inputs; ``VlmInputError`` (a ValueError, ``Input shape
                is invalid.``) naming the input; a negative cache_size.
            QbRuntimeError: as :meth:`infer` (``Model_ShapeMismatched``, ``Model_CacheOverflow``,
                ``Model_InvalidBatchParam``, the injected fault).
        """
        part = self._vlm_text
        assert part is not None
        arrs = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
        xs, rank = part.check(arrs)
        total = xs[0].shape[0]
        items = self._items(total, cache_size, params)
        _raise_injected_fault()
        wall = time.perf_counter()
        rows, pos = [], 0
        with np.errstate(invalid="ignore", over="ignore"):
            for cid, cs, n in items:
                c = self._cache(cid)
                c.length = cs  # rewind/skip: the next write lands at cache_size
                logits = part.run_item(xs, pos, pos + n, c)
                rows.append(logits if self._all_logits else logits[-1:])
                pos += n
        machine.note_infer_ok()
        self._account_infer(acc, total, wall)
        return _with_rank([np.concatenate(rows).astype(np.float32)], rank)

    def _compute(self, x: np.ndarray, cache_size: int, params: Sequence[BatchParam] | None) -> list[np.ndarray]:
        """Check, then run the MXQ on the ``[S, hidden]`` tokens ``x``: one float32 ``[rows, C]`` per output.

        Raises: as :meth:`infer` (nothing is written when a check fails).
        """
        items = self._items(x.shape[0], cache_size, params)
        if self._kind == "lm_head" and x.shape[0] != 1:
            raise fail("Model_ShapeMismatched", f"Sequence length of inputs[0] must be 1 for this MXQ (got {x.shape[0]})", "model.cc:412")
        _raise_injected_fault()
        caches, xs, pos = [], [], 0
        for cid, cs, n in items:
            if self._infos:
                c = self._cache(cid)
                c.length = cs  # rewind/skip: the next write lands at cache_size
                caches.append(c)
            xs.append(x[pos : pos + n])
            pos += n
        with np.errstate(invalid="ignore", over="ignore"):
            if self._decoder is not None:
                logits = self._decoder._forward(xs, caches)
                out = [np.concatenate(logits if self._all_logits else [lg[-1:] for lg in logits])]
            else:
                out = self._part_forward(x, caches)
        machine.note_infer_ok()
        return [o.astype(np.float32) for o in out]

    def _part_forward(self, x: np.ndarray, caches: list[KVCache]) -> list[np.ndarray]:
        part = self._part
        assert part is not None
        if self._kind == "moe_expert":
            return [part.expert_mlp(x)]
        if self._kind == "lm_head":
            return [part.head(x)]
        residual, expert_in, gate = part.shared(x, caches[0])
        named = {"residual": residual, "expert_in": expert_in, "gate": gate}
        return [named[n][-1:] if self._last_only else named[n] for n in self._outputs]

    # ------------------------------------------------------------------ NPU data
    def _io(self, side: str, idx: Any) -> float:
        """The dequantisation multiplier of input/output ``idx``. Raises: ValueError: no such index."""
        scales = self._in_scales if side == "input" else self._out_scales
        if not _is_int(idx) or not 0 <= idx < len(scales):
            raise ValueError(f"{side} index {idx!r} is out of range: the model has {len(scales)} {side}(s)")
        return 1.0 / scales[idx] if side == "input" else scales[idx]

    def _acquire(self, side: str, shape: Sequence[int], idx: int, upload: bool, dtype: Any) -> NPUData:
        acc = self._launched()
        if self._cfg is None or self._vlm_text is not None:
            raise fail("NotImplemented", f"acquire_{side}_npu_data is not simulated for {self._kind} MXQs (the "
                       "Qwen3-ASR and Qwen2/3-VL paths call infer).", "model.cc:720")
        scale = self._io(side, idx)
        dims = [int(d) for d in shape]
        channels = self._cfg.hidden_size if side == "input" else self._channels(self._outputs[idx])
        if len(dims) not in (3, 4) or any(d < 1 for d in dims) or dims[-1] != channels:
            raise ValueError(f"acquire_{side}_npu_data: shape {list(shape)!r} must be [1, T, {channels}] "
                             f"(or [1, 1, T, {channels}]) with T >= 1 for {side} {idx}")
        if dtype is not None and dtype != DataType.Float32:
            raise fail("NotImplemented", f"acquire_{side}_npu_data: dtype {dtype!r} is not simulated "
                       "(npusim.mxq keeps the user-facing Float32 type only)", "model.cc:720")
        return NPUData._acquire(tuple(dims), scale, acc if upload else None)

    def acquire_input_npu_data(self, shape: list[int], idx: int = 0, upload: bool = False, dtype: Any = None) -> NPUData:
        """A zero :class:`NPUData` of ``shape`` for input ``idx``: on this model's card when
        ``upload``, else on the host. Its scale is this input's (``npu_data`` module docstring).

        Raises:
            QbRuntimeError: ``Model_NotLaunched``; ``NotImplemented`` for a dtype other than Float32.
            ValueError: no input ``idx``, or a shape that is not ``[1, T, hidden]`` (``[1, 1, T, hidden]``).
        """
        return self._acquire("input", shape, idx, upload, dtype)

    def acquire_output_npu_data(self, shape: list[int], idx: int = 0, upload: bool = False, dtype: Any = None) -> NPUData:
        """As :meth:`acquire_input_npu_data`, for output ``idx`` (its channels, its scale)."""
        return self._acquire("output", shape, idx, upload, dtype)

    def infer_npu_data(self, inputs: list[NPUData], outputs: list[NPUData] | None = None,
                       cache_size: int = 0) -> list[NPUData] | None:
        """Run the model on NPUData: all on this model's card, or all on the host (never mixed).

        On the card, the input's raw values are read with this model's input scale and the
        outputs are written raw with this model's output scales, whatever model acquired the
        buffers (``npu_data`` module docstring). On the host, values are real. An MoE expert MXQ
        returns after a random wait of up to ``expert_finish_jitter_us`` (``machine``).

        Returns:
            None when ``outputs`` are given (filled in place); else new NPUData, one per output,
            where the inputs reside.

        Raises:
            QbRuntimeError: as :meth:`infer`; ``InternalError`` for a mixed set of residencies or
                card data on another card than the model's.
            TypeError: an element is not an NPUData.
            ValueError: as :meth:`infer`; the wrong number of inputs or outputs; an output
                buffer whose shape is not the result's (both named).
        """
        acc = self._launched()
        if self._e3 is not None or self._audio is not None or self._vision is not None or self._vlm_text is not None:
            raise fail("NotImplemented", f"infer_npu_data is not simulated for {self._kind} MXQs (the EAGLE-3, "
                       "Qwen3-ASR and Qwen2/3-VL paths call infer).", "model.cc:720")
        ins = list(inputs)
        outs = None if outputs is None else list(outputs)
        if len(ins) != len(self._in_scales):
            raise ValueError(f"The number of inputs is invalid (expected {len(self._in_scales)}, got {len(ins)}).")
        if outs is not None and len(outs) != len(self._outputs):
            raise ValueError(f"The number of outputs is invalid (expected {len(self._outputs)}, got {len(outs)}).")
        every = ins + (outs or [])
        for d in every:
            if not isinstance(d, NPUData):
                raise TypeError(f"infer_npu_data takes NPUData, got {type(d).__name__}")
        on_npu = {d.on_npu for d in every}
        if len(on_npu) > 1:
            raise fail("InternalError", "infer_npu_data: the inputs and outputs must all reside on the NPU or all "
                       "on the host (got a mixed set)", "model.cc:760")
        npu = on_npu.pop()
        dev = acc.get_dev_no()
        if npu and any(d.dev_no != dev for d in every):
            where = sorted({d.dev_no for d in every})
            raise fail("InternalError", f"infer_npu_data: NPUData on device(s) {where} given to a model launched "
                       f"on device {dev}", "model.cc:765")
        raw = ins[0]._values
        real = raw * np.float32(self._io("input", 0)) if npu else raw
        x, rank = self._input(real)
        wall = time.perf_counter()
        rows = self._compute(x, cache_size, None)
        results = _with_rank(rows, rank)
        if outs is not None:
            for i, (out, r) in enumerate(zip(outs, results)):
                if out.shape != r.shape:
                    raise ValueError(f"Output shape is invalid: outputs[{i}] has shape {out.shape}, the result {r.shape}.")
        else:
            outs = [NPUData._acquire(r.shape, self._out_scales[i], acc if npu else None) for i, r in enumerate(results)]
        for out, r, s in zip(outs, results, self._out_scales):
            out._put(r / np.float32(s) if npu else r)
        self._account_infer(acc, x.shape[0], wall)
        jitter = machine.settings().expert_finish_jitter_us if self._kind == "moe_expert" else 0
        if jitter > 0:
            time.sleep(random.uniform(0.0, jitter) / 1e6)
        return None if outputs is not None else outs

    infer_hwc = infer
    infer_chw = infer

    def _account_infer(self, acc: Accelerator, n_tokens: int, wall: float) -> None:
        s = machine.settings()
        run = s.infer_run_us(self._kind, n_tokens)
        t0, t1 = acc._device.advance(2 * s.io_fixed_us + run, wall)
        pid, tid, io = acc.get_dev_no(), self._id, s.io_fixed_us
        tracing.span("infer", t0, t1, pid, tid)
        tracing.span("lock core", t0, t0, pid, tid)
        tracing.span("copy to npu", t0, t0 + io, pid, tid)
        tracing.span("run npu", t0 + io, t0 + io + run, pid, tid)
        tracing.span("copy from npu", t0 + io + run, t1, pid, tid)

    # ------------------------------------------------------------------ KV memory
    def _check_cache_id(self, cache_id: int, what: str) -> int:
        if not _is_int(cache_id) or cache_id < 0 or cache_id >= self.K:
            raise fail("Model_InvalidBatchParam", f"Failed to {what} cache memory - `cache_id` ({cache_id}) exceeds maximum batch size ({self.K})", "model.cc:610")
        return int(cache_id)

    def dump_cache_memory(self, cache_id: int = 0) -> list[bytes]:
        """One blob per CacheInfo: the layer's keys then values, float32 ``[kv_heads, T, head_dim]`` C order.

        Raises:
            QbRuntimeError: ``Model_NotLaunched``; ``Model_InvalidBatchParam`` (cache_id >= K).
        """
        acc = self._launched()
        cid = self._check_cache_id(cache_id, "dump")
        wall = time.perf_counter()
        blobs: list[bytes] = []
        if self._infos:  # an MXQ without KV (eagle3_fc, audio_encoder) dumps nothing
            c = self._cache(cid)
            blobs = [k.tobytes() + v.tobytes() for k, v in zip(c.keys, c.values)]
        s = machine.settings()
        t0, t1 = acc._device.advance(s.io_fixed_us + s.dump_us_per_kib * sum(map(len, blobs)) / 1024, wall)
        tracing.span("read device", t0, t1, acc.get_dev_no(), self._id)
        return blobs

    def load_cache_memory(self, bufs: Sequence[bytes], cache_id: int = 0) -> None:
        """Overwrite cache id ``cache_id`` with blobs from :meth:`dump_cache_memory` (exact copy).

        Raises:
            QbRuntimeError: ``Model_NotLaunched``; ``Model_InvalidBatchParam`` (cache_id >= K);
                ``Model_NumCacheMismatched`` (wrong number of blobs) or
                ``Model_BufferSizeMismatched`` (a wrong blob size); nothing is written.
        """
        acc = self._launched()
        cid = self._check_cache_id(cache_id, "load")
        bufs = list(bufs)
        if len(bufs) != len(self._infos):
            raise fail("Model_NumCacheMismatched", f"Failed to load cache memory - The number of cache is mismatched (expected: {len(self._infos)}, actual: {len(bufs)})", "model.cc:640")
        for info, b in zip(self._infos, bufs):
            if len(b) != info.size:
                raise fail("Model_BufferSizeMismatched", f"Failed to load cache memory - {info.name}: Wrong buffer size (expected: {info.size}, actual: {len(b)})", "model.cc:645")
        wall = time.perf_counter()
        c = self._cache(cid) if self._infos else None
        for k, v, b in zip(c.keys if c else [], c.values if c else [], bufs):
            arr = np.frombuffer(bytes(b), dtype=np.float32)
            k.reshape(-1)[:] = arr[: k.size]
            v.reshape(-1)[:] = arr[k.size :]
        s = machine.settings()
        t0, t1 = acc._device.advance(s.io_fixed_us + s.load_us_per_kib * sum(map(len, bufs)) / 1024, wall)
        tracing.span("copy to npu", t0, t1, acc.get_dev_no(), self._id)

    def _info(self, key: str, value: str) -> int:
        for i, info in enumerate(self._infos):
            if getattr(info, key) == value:
                return i
        label = "name" if key == "name" else "layer hash"
        raise fail("Model_CacheNotFound", f"Failed to find KV-cache whose {label} is `{value}`", "model.cc:660")

    def _dump_one(self, key: str, value: str, cache_id: int) -> bytes:
        self._launched()
        i = self._info(key, value)
        return self.dump_cache_memory(cache_id)[i]

    def _load_one(self, buf: bytes, key: str, value: str, cache_id: int) -> None:
        self._launched()
        i = self._info(key, value)
        bufs = self.dump_cache_memory(cache_id)
        bufs[i] = buf
        self.load_cache_memory(bufs, cache_id)

    def dump_cache_memory_by_name(self, name: str, cache_id: int = 0) -> bytes:
        return self._dump_one("name", name, cache_id)

    def dump_cache_memory_by_layer_hash(self, layer_hash: str, cache_id: int = 0) -> bytes:
        return self._dump_one("layer_hash", layer_hash, cache_id)

    def load_cache_memory_by_name(self, buf: bytes, name: str, cache_id: int = 0) -> None:
        self._load_one(buf, "name", name, cache_id)

    def load_cache_memory_by_layer_hash(self, buf: bytes, layer_hash: str, cache_id: int = 0) -> None:
        self._load_one(buf, "layer_hash", layer_hash, cache_id)

    def dump_cache_memory_to(self, cache_dir: str | os.PathLike, cache_id: int = 0) -> None:
        """Write ``cache_<layer_hash>.bin`` per CacheInfo into ``cache_dir`` (created if missing)."""
        blobs = self.dump_cache_memory(cache_id)
        d = Path(cache_dir)
        d.mkdir(parents=True, exist_ok=True)
        for info, b in zip(self._infos, blobs):
            (d / f"cache_{info.layer_hash}.bin").write_bytes(b)

    def load_cache_memory_from(self, cache_dir: str | os.PathLike, cache_id: int = 0) -> None:
        """Load the files :meth:`dump_cache_memory_to` wrote.

        Raises:
            QbRuntimeError: ``Model_FailedToOpenCacheFile`` (a file is missing) or
                ``Model_BufferSizeMismatched`` (a file has the wrong size).
        """
        self._launched()
        bufs = []
        for info in self._infos:
            p = Path(cache_dir) / f"cache_{info.layer_hash}.bin"
            if not p.is_file():
                raise fail("Model_FailedToOpenCacheFile", f"Failed to load cache memory - {info.name}: file '{p}' not found", "model.cc:690")
            bufs.append(p.read_bytes())
        self.load_cache_memory(bufs, cache_id)

    def _not_implemented(self, name: str) -> None:
        raise fail("NotImplemented", f"{name} is not implemented by the npusim.mxq simulator (its artifacts have no FixedTailCache, async or pinned-memory paths).", "model.cc:700")

    def reset_fixed_tail_cache_memory(self, cache_id: int = 0) -> None:
        """Raises: QbRuntimeError ``NotImplemented``."""
        self._not_implemented("reset_fixed_tail_cache_memory")

    def move_cache_tail(self, num_head: int, num_tail: int, cache_size: int) -> int:
        """Raises: QbRuntimeError ``NotImplemented``."""
        self._not_implemented("move_cache_tail")
        return 0

    def filter_cache_tail(self, cache_size: int, tail_size: int, mask: Sequence[bool]) -> int:
        """Raises: QbRuntimeError ``NotImplemented``."""
        self._not_implemented("filter_cache_tail")
        return 0

    def infer_async(self, *args: Any, **kwargs: Any) -> None:
        """Raises: QbRuntimeError ``NotImplemented`` (CNN-only in qbruntime)."""
        self._not_implemented("infer_async")

    def infer_to_float(self, *args: Any, **kwargs: Any) -> None:
        """Raises: QbRuntimeError ``NotImplemented`` (int8 inputs)."""
        self._not_implemented("infer_to_float")


def _raise_injected_fault() -> None:
    """Count this infer against ``NPUSIM_MXQ``'s ``infer_fail_*`` and raise when it is to fail.

    Raises:
        QbRuntimeError: the injected status (``infer_fail_status``), naming the fault settings.
    """
    status = machine.infer_fault()
    if status is not None:
        s = machine.settings()
        raise fail(status, f"Injected fault: infer failed (infer_fail_after={s.infer_fail_after}, "
                   f"infer_fail_times={s.infer_fail_times}).", "model.cc:500")


def _with_rank(rows: list[np.ndarray], rank: int) -> list[np.ndarray]:
    """Each ``[rows, C]`` output as ``(1, rows, C)``, or ``(1, 1, rows, C)`` for a rank-4 input."""
    return [r.reshape((1, 1) + r.shape if rank == 4 else (1,) + r.shape) for r in rows]


def _num_inputs(kind: str, header: dict[str, Any] | None = None) -> int:
    """How many inputs an MXQ of ``kind`` takes (1 but for the EAGLE-3 kinds and the VLM layouts
    of ``header``)."""
    vlm = vlm_num_inputs(kind, header or {})
    if vlm is not None:
        return vlm
    return len({**EAGLE3_INPUTS, **ASR_INPUTS}.get(kind, ("x",)))


def _check_header(h: dict[str, Any]) -> dict[str, Any]:
    """Raises: MxqFormatError for header values outside their rules."""
    for key in ("max_batch_size", "max_cache_size", "max_width"):
        if not _is_int(h[key]) or h[key] < 1:
            raise MxqFormatError(f"MXQ header {key}={h[key]!r} must be an integer >= 1.")
    if h["output_logits"] not in ("last", "all"):
        raise MxqFormatError(f"MXQ header output_logits={h['output_logits']!r} must be 'last' or 'all'.")
    modes = h["core_modes"]
    if not isinstance(modes, list) or not modes or any(m not in CORE_MODE_NAMES for m in modes):
        raise MxqFormatError(f"MXQ header core_modes={modes!r} must be a non-empty list of {sorted(CORE_MODE_NAMES)}.")
    if not isinstance(h["llm_config"], dict):
        raise MxqFormatError("MXQ header llm_config must be a JSON object.")
    kind = h.get("kind", "decoder")
    if kind not in MXQ_KINDS:
        raise MxqFormatError(f"MXQ header kind={kind!r} must be one of {', '.join(MXQ_KINDS)}.")
    try:
        check_vlm_header(h, kind)
    except VlmHeaderError as exc:
        raise MxqFormatError(str(exc)) from None
    outputs = h.get("outputs", list(KIND_OUTPUTS[kind]))
    if not isinstance(outputs, list) or sorted(outputs) != sorted(KIND_OUTPUTS[kind]):
        raise MxqFormatError(f"MXQ header outputs={outputs!r} must be an ordering of {list(KIND_OUTPUTS[kind])} for kind {kind!r}.")
    for key, n in (("input_scales", _num_inputs(kind, h)), ("output_scales", len(outputs))):
        v = h.get(key, [1.0] * n)
        if (not isinstance(v, list) or len(v) != n
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 for x in v)):
            raise MxqFormatError(f"MXQ header {key}={v!r} must be a list of {n} positive numbers.")
    if not isinstance(h.get("last_only", False), bool) or (h.get("last_only", False) and kind != "moe_shared"):
        raise MxqFormatError(f"MXQ header last_only={h.get('last_only')!r} must be a boolean, true only for kind 'moe_shared'.")
    taps = h.get("eagle3_taps")
    if (kind == "eagle3_base") != (taps is not None):
        raise MxqFormatError(f"MXQ header eagle3_taps={taps!r}: required for kind 'eagle3_base' and only for it.")
    if kind != "decoder" and h["max_batch_size"] != 1:
        raise MxqFormatError(f"MXQ header max_batch_size={h['max_batch_size']!r} must be 1 for kind {kind!r}.")
    return h


def load(path: str | os.PathLike, model_config: ModelConfig | None = None) -> Model:
    """As the real ``qbruntime.load``: an ``Accelerator()``, ``Model(path, model_config)``,
    and the model launched on it.

    Raises:
        QbRuntimeError: whatever ``Accelerator()``, ``Model`` or ``launch`` raise.
    """
    from .accelerator import Accelerator

    acc = Accelerator()
    model = Model(path, model_config)
    model.launch(acc)
    return model


def get_model_summary(mxq_path: str | os.PathLike) -> str:
    """A human-readable summary of an ``.mxq`` (shapes, K, T, W, core modes, layers).

    Raises:
        QbRuntimeError: ``Model_FailedToLoadMXQ`` as for :class:`Model`.
    """
    m = Model(mxq_path, _summary_only=True)  # a summary reads the file, whatever its core modes
    c = m._cfg
    if m._vision is not None:
        v = m._vision
        what = (f"  kind: {m._kind}, layout: {v.layout}, grid: {list(v.grid) if v.grid else 'dynamic'}, "
                f"vision hidden: {v.vision_hidden}, out hidden: {v.out_hidden}")
    elif c is None:
        a = m._header["llm_config"]
        what = (f"  kind: {m._kind}, mel bins: {a.get('num_mel_bins')}, layers: {a.get('encoder_layers')}, "
                f"d_model: {a.get('d_model')}, output_dim: {a.get('output_dim')}")
    else:
        what = (f"  model_type: {c.model_type}, layers: {c.num_hidden_layers}, hidden: {c.hidden_size}, "
                f"vocab: {c.vocab_size}")
    return "\n".join([
        f"MXQ: {mxq_path}",
        what,
        f"  input shape: {m.get_model_input_shape()}, output shape: {m.get_model_output_shape()}",
        f"  max_batch_size (K): {m.K}, max_cache_size (T): {m.T}, max_width (W): {m.W}",
        f"  core modes: {', '.join(m._header['core_modes'])}, output logits: {m._header['output_logits']}, target: {m._header['target_device']}",
        f"  cache infos: {len(m._infos)} x {m._infos[0].size if m._infos else 0} bytes",
    ])
