"""The MBLT vLLM worker: runs each scheduled step on MXQ slots through the runtime API.

vLLM's engine calls, in order: ``init_device``, ``load_model``, ``get_kv_cache_spec``,
``determine_available_memory``, ``initialize_from_config``, ``compile_or_warm_up_model``,
then ``execute_model`` once per step. It returns the step's ``ModelRunnerOutput``, sampling
included, or None when a structured-output request samples in the step: vLLM then calls
``sample_tokens`` with the grammar bitmask (:mod:`vllm_npu.step_output`).

The KV lives on the device, per slot ``(model_idx, cache_id)``; vLLM's block manager only
does the accounting (a one-byte-per-token ``MLAAttentionSpec``), sized for
``max(max_batch_size, max_num_seqs) + 1`` sequences of ``max_model_len`` tokens.

Per step:
1. finished requests release their slot and become prefix snapshots (no dump);
2. new requests get a slot (batch models: the lowest free vLLM slot ``s`` →
   ``divmod(s, K)``; non-batch models: everyone shares ``(0, 0)``) and, when vLLM's prefix
   cache says tokens are already computed, their KV comes from the best snapshot if the
   cost model expects the load to beat recomputing, else it is recomputed;
3. each request's cache is bound to its slot (saving the previous holder to host), its
   tokens ``[cache_len, scheduled_end)`` run in pieces of at most ``max_width``, rows of
   different slots in one dispatch;
4. requests whose prompt is complete sample on the host (:mod:`vllm_npu.host_sampling`).

A Qwen3-ASR release (:mod:`vllm_npu.mblt.asr`) adds its audio-encoder MXQ: a new request's audio
features are encoded once, when it arrives, and the embeddings are written over its
``<|audio_pad|>`` placeholders' rows whenever those positions are fed to the decoder MXQ. For the
KV bookkeeping (what a slot or a prefix snapshot holds) each audio position counts as a token of
its own, derived from the clip's hash, so a snapshot is reused only for the same audio, never for
another clip of the same length.

A Qwen2-VL / Qwen3-VL release (:mod:`vllm_npu.mblt.vlm`) adds its vision MXQ the same way: each
image or video of a new request is encoded once when the request arrives (never cached across
requests: the prefix cache covers the LM KV only), its rows written over the placeholders'
embedding rows (``is_embed``), its positions keyed by the item's hash for the KV bookkeeping. The
text MXQ's further inputs are built per piece: Qwen3-VL's dense DeepStack rows (zeros outside the
images, and for generated tokens), and, for a RoPE-input text MXQ, the packed M-RoPE rows of the
piece's positions (the prompt's from :func:`vllm_npu.mblt.vlm_positions.rope_index`, computed here
from the prompt ids and the items' grids because vLLM 0.32's scheduler output carries no M-RoPE
positions: its GPU runner computes them itself with the model class; generated token ``i`` at
``i + delta`` on all rows). A static text MXQ takes no positions: it rotates by the cache position.
An item vLLM's prefix cache covers may arrive without its pixels; its KV must then come from a
prefix snapshot, which is loaded whatever the cost model says.

Prompt logprobs (``prompt_logprobs``, and ``echo`` with logprobs) are scored as the prompt is
computed (:mod:`vllm_npu.prompt_logprobs`): one infer per chunk on an MXQ that emits every
position's logits, else the seed's 1-token microstep path for that request (the others in its
dispatch keep their chunk width). vLLM never gives such a request a prefix-cache hit, so it is
never started from a snapshot; when it finishes, its KV becomes a snapshot like any other.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_npu._worker import NpuWorker
from vllm_npu.device_retry import DeviceRetry
from vllm_npu.host_sampling import num_logprobs
from vllm_npu.mblt import prefix_cache as pc
from vllm_npu.mblt import settings
from vllm_npu.mblt.asr import AsrEncoder, AsrRelease, feature_rows, is_asr_release
from vllm_npu.mblt.backend import BackendLayout, MbltBackend, Row
from vllm_npu.mblt.eagle3_backend import Eagle3Backend, Eagle3Release, is_eagle3_release, loader_layout
from vllm_npu.mblt.moe_backend import BATCH_REFUSAL, MoeBackend, MoePlacement, is_moe_release
from vllm_npu.host_threads import limit_host_blas_threads
from vllm_npu.mblt.platform import artifact_config
from vllm_npu.mblt.runtime import load_runtime
from vllm_npu.mblt.vlm import is_vlm_release
from vllm_npu.mblt.sampling import PENALTIES_ENV, HostSampler, penalties_enabled
from vllm_npu.mblt.slots import MbltCacheStateError, RequestKV, SlotTable
from vllm_npu.targets import selected_target
from vllm_npu.prompt_embeds import content_key_ids, prompt_embeds_of
from vllm_npu.step_engine import Request, StepEngine, StepPlan, StepResult, new_request_fields
from vllm_npu.step_output import StepOutputs

logger = logging.getLogger("vllm.vllm_npu.mblt")

EMBED_TENSOR = "model.embed_tokens.weight"
#: Logged once per worker when a last-logit MXQ serves prompt logprobs (the seed's wording).
MICROSTEP_WARNING = (
    "Prompt logprobs on last-logit MBLT/MXQ outputs use a slower 1-token microstep path. "
    "Compile the MXQ to emit every position's logits to score a prompt chunk in one infer."
)
SHORT_CACHE_WARNING = (
    "MBLT request cache holds fewer tokens than the scheduler expects for req_id=%s "
    "(cache_id=%s, live_tokens=%s, expected=%d). Recomputing the rest of the prefix. occurrences=%d"
)


class MbltWorkerError(RuntimeError):
    """The worker cannot serve as configured (the message names the values)."""


class NoFreeSlotError(MbltWorkerError):
    """Every accelerator cache slot is taken."""


class MbltDeviceError(MbltWorkerError):
    """An infer failed again after the one retry (the runtime's error is chained)."""


@dataclass(eq=False)
class _Req(Request):
    """A request (:class:`vllm_npu.step_engine.Request`) with its MXQ cache and encoder inputs."""

    #: the request's KV cache on its slot (set when the worker admits it)
    kv: RequestKV = None  # type: ignore[assignment]
    vslot: int | None = None
    #: audio / vision: prompt positions of the encoder's embeddings, and the embeddings ``[n, hidden]``
    mm_pos: np.ndarray | None = None
    mm_rows: np.ndarray | None = None
    #: Qwen3-VL: the DeepStack rows ``[L, n, hidden]`` of ``mm_pos``
    mm_deep: np.ndarray | None = None
    #: VLM with a RoPE-input text MXQ: the prompt's M-RoPE positions ``[3, T]`` and decode delta
    mrope: np.ndarray | None = None
    mrope_delta: int = 0
    #: VLM: the prompt prefix whose images vLLM's prefix cache covered and sent without pixels
    #: (its KV must come from a snapshot)
    covered_until: int = 0
    #: the prompt's ids for KV bookkeeping: audio positions hold negative clip-derived ids
    key_prompt_ids: list[int] | None = None

    @property
    def all_ids(self) -> list[int]:
        """The ids the KV bookkeeping compares (a slot's and a snapshot's ``token_ids``)."""
        return (self.key_prompt_ids or self.prompt_ids) + self.output_ids


def _load_embeddings(model_dir: str, name: str = EMBED_TENSOR, what: str = "the host-side embedding") -> np.ndarray:
    """The float32 host tensor ``name`` (the token embedding unless named otherwise) from the
    release's ``model.safetensors`` or ``embedding.safetensors``, read alone from the file.

    Raises:
        MbltWorkerError: neither file holds it (the files named, and ``what`` is missing).
    """
    from safetensors import safe_open

    d = Path(model_dir)
    searched = ("model.safetensors", "embedding.safetensors")
    for fname in searched:
        if (d / fname).is_file():
            with safe_open(str(d / fname), framework="numpy") as fh:
                if name in fh.keys():
                    return np.ascontiguousarray(fh.get_tensor(name), dtype=np.float32)
    found = [n for n in searched if (d / n).is_file()]
    raise MbltWorkerError(
        f"no {name!r} in {' or '.join(f'{d}/{n}' for n in searched)} "
        f"({'present: ' + ', '.join(found) if found else 'neither file exists'}): {what} is missing"
    )


def _core_mode_mismatch(runtime: Any, mxq_path: str, core_mode: str) -> str:
    """The start-up error for ``Model_MXQAndModelConfigNotMatch``, naming the core mode asked
    for and the MXQ's compiled modes (from ``get_model_summary``'s ``core modes:`` line)."""
    import re

    try:
        summary = str(runtime.get_model_summary(mxq_path))
    except Exception as exc:  # noqa: BLE001 - the summary only adds detail
        summary = f"(get_model_summary failed: {exc})"
    line = re.search(r"core modes?:([^\n]*)", summary, re.IGNORECASE)
    names = [w for w in re.findall(r"[a-z0-9]+", line.group(1).lower())
             if w in settings.CORE_MODES] if line else []
    modes = ", ".join(names) if names else f"unknown (summary: {summary[:300]!r})"
    hint = (" (core_mode auto asks qbruntime to pick, which it refuses when the MXQ holds several modes)"
            if core_mode == "auto" else "")
    return (f"The MXQ {mxq_path} does not run in core_mode={core_mode}{hint}: qbruntime answered "
            f"Model_MXQAndModelConfigNotMatch. Its compiled core modes: {modes}. Pass "
            "--model-loader-extra-config '{\"core_mode\": \"<one of them>\"}'.")


def device_retry(runtime: Any) -> DeviceRetry:
    """MBLT's retry policy: the qbruntime-API module's ``QbRuntimeError`` is the device error
    (:mod:`vllm_npu.device_retry`); anything else is a bug and propagates as itself."""
    return DeviceRetry("MBLT", (runtime.QbRuntimeError,), MbltDeviceError)


class MbltWorker(NpuWorker):
    """vLLM worker for Mobilint MXQ artifacts (see the module docstring)."""

    npu_name = "MBLT"

    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False) -> None:
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.max_model_len = int(self.model_config.max_model_len)
        self.block_size = int(self.cache_config.block_size)
        self.enable_prefix_caching = bool(self.cache_config.enable_prefix_caching)
        self.overrides = settings.parse_loader_extra_config(self.load_config.model_loader_extra_config)
        self.artifact = artifact_config(vllm_config)
        self.core_mode = settings.resolve_core_mode(self.overrides, self.artifact)
        #: the text MXQ's layout keys: a VLM release's ``text_*`` view (:func:`settings.vlm_role_view`)
        self.layout_artifact, self.layout_overrides = self.artifact, self.overrides
        if is_vlm_release(self.artifact):
            settings.refuse_vlm_mxq_path(self.overrides)
            self.layout_artifact, self.layout_overrides = settings.vlm_role_view(self.artifact, self.overrides, "text")
            self.core_mode = settings.resolve_core_mode(self.layout_overrides, self.layout_artifact)
        self.max_batch_size = settings.resolve_max_batch_size(self.layout_overrides, self.layout_artifact) or 1
        self.pc_settings = pc.prefix_cache_settings(os.environ, self.overrides.prefix_cache)
        self.cost_model = pc.PrefixCacheCostModel(self.pc_settings)
        self.backend: MbltBackend | None = None
        #: an EAGLE-3 release's runner (:mod:`vllm_npu.mblt.eagle3_serving`); None otherwise
        self.eagle3 = None
        #: a Qwen3-ASR release's audio encoder; None otherwise
        self.audio: AsrEncoder | None = None
        #: a VLM release's layout and vision encoder (:mod:`vllm_npu.mblt.vlm`); None otherwise
        self.vlm = None
        self.vision = None
        self.engine = StepEngine(self)  # host sampling once the model is loaded; EAGLE-3's runner replaces it
        self.free_vslots: list[int] = list(range(self.max_batch_size))
        self.snapshots: pc.SnapshotIndex[RequestKV] = pc.SnapshotIndex(pc.MAX_FINISHED_SNAPSHOTS)
        self.table: SlotTable | None = None
        self.sampler: HostSampler | None = None
        self.tracer = None
        self.short_cache_warnings = 0
        self.kv_cache_config = None
        self.stats = {"prefix_loads": 0, "prefix_recomputes": 0, "steps": 0, "infer_retries": 0,
                      "prompt_logprob_microsteps": 0}
        self._microstep_warned = False

    # ------------------------------------------------------------------ lifecycle

    def init_device(self) -> None:
        from vllm.utils.torch_utils import set_torch_threads_for_runtime

        self.device = torch.device("cpu")
        # Host sampling runs small torch ops every step: one intra-op thread, as vLLM's own
        # workers do, so idle OpenMP threads do not spin against the runtime's compute.
        set_torch_threads_for_runtime()
        limited = limit_host_blas_threads(1)
        if limited:
            logger.info("MBLT worker: host OpenBLAS set to 1 thread (%s)", ", ".join(map(os.path.basename, limited)))
        logger.info("MBLT worker rank %d: host device cpu, MXQ runtime target %s", self.rank, selected_target())

    def load_model(self, *, load_dummy_weights: bool = False) -> None:  # noqa: ARG002
        """Create the MXQ model instances and check them against the scheduler.

        Raises:
            vllm_npu.mblt.settings.MbltConfigError: ``max_model_len`` exceeds the loaded
                artifact's KV capacity (both numbers named), or a bad layout value.
            vllm_npu.mblt.backend.MbltBackendError: the runtime could not create the
                instances (its error chained).
        """
        target = selected_target()
        if target not in ("mblt-sim", "mblt-hw"):
            raise MbltWorkerError(
                f"NPU_HARNESS_TARGET={target or ''!r}: the MBLT worker runs on mblt-sim (npusim.mxq) or "
                "mblt-hw (qbruntime); set NPU_HARNESS_TARGET to one of them"
            )
        runtime = load_runtime(target)
        model_dir = self.model_config.model
        if is_eagle3_release(self.artifact):
            self._load_eagle3(runtime, model_dir)
            return
        if is_moe_release(self.artifact):
            if self.max_batch_size > 1:
                raise settings.MbltConfigError(BATCH_REFUSAL.format(n=self.max_batch_size))
            placement = MoePlacement.resolve(self.artifact, self.overrides.extra)
            device = self._device_name("shared_target_device")
            self._finish_load(MoeBackend.create(runtime, model_dir, self.artifact, placement, device), runtime,
                              "the Mixture-of-Experts release's shared MXQs")
            return
        dev_no = self.layout_overrides.dev_no
        if dev_no is None:
            dev_no = settings.parse_dev_no(self.layout_artifact.get("dev_no", 0), source=f"{model_dir}/config.json")
        target_cores = self.layout_overrides.target_cores
        core_mode = self.core_mode or "auto"
        if is_asr_release(self.artifact):
            release = AsrRelease.resolve(model_dir, self.artifact, self.overrides.extra, dev_no[0])
            self.audio = AsrEncoder.create(runtime, release, self._device_name("target_device"))
            logger.info("MBLT Qwen3-ASR: audio encoder %s on device %d (%s), %d mel bins -> width %d",
                        release.encoder_mxq, release.encoder_dev_no, release.encoder_core_mode,
                        self.audio.mel_bins, self.audio.hidden_size)
            core_mode = self.overrides.core_mode or release.decoder_core_mode or core_mode
            target_cores = target_cores or release.decoder_target_cores
        if is_vlm_release(self.artifact):
            self._load_vision(runtime, model_dir)
        mxq_path = settings.mxq_path_of(model_dir, self.artifact, self.overrides)
        if mxq_path is None:
            raise MbltWorkerError(f"{model_dir}/config.json names no mxq_path")
        if core_mode == "auto" and target_cores:
            core_mode = "single"  # explicit cores place single-core instances
        layout = BackendLayout(
            dev_no=tuple(dev_no),
            core_mode=core_mode,
            target_cores=target_cores,
            target_clusters=self.layout_overrides.target_clusters,
            max_batch_size=self.max_batch_size,
            device_name=str(self.layout_artifact.get("target_device", "aries")).split("-")[0] or "aries",
        )
        try:
            backend = MbltBackend.create(runtime, mxq_path, layout)
        except Exception as exc:
            self._drop_audio()
            if "MXQAndModelConfigNotMatch" in str(exc):
                raise settings.MbltConfigError(_core_mode_mismatch(runtime, mxq_path, core_mode)) from exc
            raise
        self._finish_load(backend, runtime, f"the loaded MXQ {mxq_path}")

    def _load_vision(self, runtime: Any, model_dir: str) -> None:
        """A VLM release: read both MXQs' layouts (:class:`vllm_npu.mblt.vlm.VlmRelease`), refuse the
        unsupported ones, and launch the vision MXQ with its ``vision_*`` layout keys.

        Raises:
            vllm_npu.mblt.settings.MbltConfigError: a batched Qwen3-VL text MXQ without a RoPE input
                (split-static included), a batched RoPE-input Qwen2-VL one, a bad ``vision_*`` key.
            vllm_npu.mblt.vlm.VlmLayoutError: MXQs matching no layout of the family, or disagreeing.
        """
        from vllm_npu.mblt.vlm import POS_EMBED_TENSOR, VisionEncoder, VlmRelease, probe_input_shapes

        vision_mxq, text_mxq = VlmRelease.mxq_paths(model_dir, self.artifact, self.overrides.extra)
        release = VlmRelease.resolve(model_dir, self.artifact, self.overrides.extra,
                                     probe_input_shapes(runtime, vision_mxq), probe_input_shapes(runtime, text_mxq),
                                     text_max_batch_size=self.max_batch_size)
        vart, vov = settings.vlm_role_view(self.artifact, self.overrides, "vision")
        dev = vov.dev_no or settings.parse_dev_no(vart.get("dev_no", 0), source=f"{model_dir}/config.json vision")
        pos_embed = None
        if release.family == "qwen3_vl" and release.dynamic:
            pos_embed = _load_embeddings(model_dir, POS_EMBED_TENSOR, "the dynamic Qwen3-VL vision position embedding")
        device = str(vart.get("target_device") or self.artifact.get("target_device", "aries")).split("-")[0] or "aries"
        self.vision = VisionEncoder.create(
            runtime, release, dev_no=dev[0], core_mode=settings.resolve_core_mode(vov, vart) or "single",
            target_cores=vov.target_cores, target_clusters=vov.target_clusters, device_name=device,
            pos_embed=pos_embed)
        self.vlm = release
        logger.info("MBLT %s: vision MXQ %s (%s, %d input(s)) on device %d; text MXQ %s (inputs %s)",
                    release.family, release.vision_mxq, release.vision.kind, len(release.vision.input_shapes),
                    dev[0], release.text_mxq, ", ".join(release.text.inputs))

    def _load_eagle3(self, runtime: Any, model_dir: str) -> None:
        """An EAGLE-3 release: its three MXQs and the round runner (:mod:`vllm_npu.mblt.eagle3_serving`),
        which serves every step; no slot table, snapshots or host sampler.

        Raises:
            vllm_npu.mblt.settings.MbltConfigError: ``max_batch_size`` above 1, or ``max_model_len``
                above what the base and draft KV capacities serve
                (:func:`vllm_npu.mblt.platform.eagle3_max_model_len`; both numbers named).
            vllm_npu.mblt.eagle3_backend.Eagle3ReleaseError: the release breaks its layout.
        """
        from vllm_npu.mblt.eagle3_backend import BATCH_REFUSAL as EAGLE3_BATCH_REFUSAL
        from vllm_npu.mblt.eagle3_serving import Eagle3Runner
        from vllm_npu.mblt.platform import eagle3_max_model_len

        release = Eagle3Release.read(model_dir, self.artifact, loader_layout(self.overrides))
        n = max(self.max_batch_size, release.max_batch_size or 1)
        if n > 1:
            raise settings.MbltConfigError(EAGLE3_BATCH_REFUSAL.format(n=n))
        backend = Eagle3Backend.create(runtime, release, self._device_name("base_target_device"))
        limit = eagle3_max_model_len(backend.base_capacity, backend.draft_capacity, release.depth, release.top_k)
        if self.max_model_len > limit:
            backend.dispose()
            raise settings.MbltConfigError(
                f"max_model_len={self.max_model_len} exceeds what the EAGLE-3 release serves: {limit} tokens (the base "
                f"MXQ holds {backend.base_capacity} tokens of KV; the draft MXQ {backend.draft_capacity}, of which its "
                f"tree levels need (depth {release.depth} - 1) x top_k {release.top_k} - 2 past the sequence). "
                f"Pass --max-model-len {limit} or lower.")
        self.runtime = runtime
        self.eagle3 = Eagle3Runner(backend, self.max_model_len)
        self.engine = StepEngine(self.eagle3)

    def _device_name(self, key: str) -> str:
        """The qbruntime device family config.json's ``key`` names (``aries-rb`` -> ``aries``; default ``aries``)."""
        return str(self.artifact.get(key, "aries")).split("-")[0] or "aries"

    def _finish_load(self, backend: MbltBackend | MoeBackend, runtime: Any, what: str) -> None:
        """Check ``backend`` against the scheduler, load the embeddings and set up the slot table,
        sampler and snapshot cap (``what`` names the MXQs in messages). Disposes the backend
        when a check fails.

        Raises:
            vllm_npu.mblt.settings.MbltConfigError: ``max_model_len`` above the KV capacity.
            MbltWorkerError: the embedding width differs from the MXQ input width.
        """
        model_dir = self.model_config.model
        try:
            if self.max_model_len > backend.max_cache_size:
                raise settings.MbltConfigError(
                    f"max_model_len={self.max_model_len} exceeds the KV capacity of {what} "
                    f"({backend.max_cache_size} tokens per cache id). "
                    f"Pass --max-model-len {backend.max_cache_size} or lower."
                )
            if self.vlm is not None:
                from vllm_npu.mblt.vlm import TEXT_EMBED_TENSOR

                self.embeddings = _load_embeddings(model_dir, TEXT_EMBED_TENSOR)
                backend.embeds_rank = self.vlm.text.embeds_rank
            else:
                self.embeddings = _load_embeddings(model_dir)
            if self.embeddings.shape[1] != backend.hidden_size:
                raise MbltWorkerError(
                    f"embedding width {self.embeddings.shape[1]} does not match the MXQ input width "
                    f"{backend.hidden_size}"
                )
            if self.audio is not None and self.audio.hidden_size != backend.hidden_size:
                raise MbltWorkerError(f"the audio encoder's output width {self.audio.hidden_size} does not match "
                                      f"the decoder MXQ's input width {backend.hidden_size}")
        except Exception:
            backend.dispose()
            self._drop_audio()
            raise
        self.backend = backend
        self.runtime = runtime
        self.table = SlotTable(backend.dump, backend.load, self.cost_model.observe_dump,
                               self.cost_model.observe_load, self._on_displaced)
        self.sampler = HostSampler(backend.vocab_size, enable_penalties=penalties_enabled(), switch=PENALTIES_ENV,
                                   log=logger, vllm_config=self.vllm_config)
        self.engine.outputs = StepOutputs(self.sampler)
        self.engine.vocab_size = backend.vocab_size
        cap = pc.finished_snapshot_cap(self.pc_settings.max_host_mib, backend.kv_nbytes_per_cache)
        self.snapshots.set_cap(cap)
        logger.info(pc.snapshot_cap_log_line(cap, backend.kv_nbytes_per_cache, self.pc_settings.max_host_mib))
        logger.info(
            "MBLT backend: %d MXQ instance(s) on device(s) %s, K=%d cache ids each, max_width %d, "
            "KV capacity %d tokens, logits %s",
            len(backend.models), backend.model_dev_no, backend.k_per_model, backend.max_width,
            backend.max_cache_size, backend.output_layout,
        )
        if self.enable_prefix_caching and self.pc_settings.calibrate:
            self._calibrate()

    def _calibrate(self) -> None:
        """Measure one-cache-id prefill time at 1, 2, 4, 8 KV blocks (3 runs, first dropped)."""
        assert self.backend is not None
        slot = self.backend.slot_of(1 if self.max_batch_size > 1 else 0)
        try:
            for blocks in pc.CALIBRATION_BLOCKS:
                tokens = self.block_size * blocks
                if tokens > min(self.max_model_len, 1024, self.backend.max_cache_size):
                    break
                runs = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    self._run_tokens_cacheless(slot, tokens)
                    runs.append((time.perf_counter() - t0) * 1e3)
                self.cost_model.observe_prefill(tokens, statistics.median(runs[1:]))
        except Exception as exc:  # noqa: BLE001 - calibration is best effort, as in vllm-mblt
            logger.debug("Skipping Mobilint prefix-cache prefill calibration: %s", exc)
        finally:
            assert self.table is not None
            self.table.clear()

    def _run_tokens_cacheless(self, slot: tuple[int, int], tokens: int) -> None:
        assert self.backend is not None
        x = np.zeros((tokens, self.backend.hidden_size), np.float32)
        width = self.backend.max_width
        for start in range(0, tokens, width):
            piece = x[start:start + width]
            self.backend.infer_rows([Row(slot[0], slot[1], piece, start, self._text_extras(None, start, len(piece)))])

    def get_kv_cache_spec(self) -> dict[str, Any]:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        return {"mblt": MLAAttentionSpec(block_size=self.block_size, num_kv_heads=1, head_size=1,
                                         dtype=torch.int8)}

    def _num_blocks(self) -> int:
        """Blocks for every sequence the scheduler may run, plus one (vllm-mblt's
        ``max_batch_size + 1``; a model without ``max_batch_size`` runs up to ``max_num_seqs``
        requests on its one shared slot)."""
        seqs = max(self.max_batch_size, int(self.scheduler_config.max_num_seqs))
        return (seqs + 1) * math.ceil(self.max_model_len / self.block_size)

    def determine_available_memory(self) -> int:
        spec = self.get_kv_cache_spec()["mblt"]
        return self._num_blocks() * spec.page_size_bytes

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:  # noqa: ARG002
        if num_gpu_blocks != self._num_blocks():
            raise MbltWorkerError(f"GPU Blocks mismatch: expected {self._num_blocks()}, got {num_gpu_blocks}")

    def check_health(self) -> None:
        if self.backend is None and self.eagle3 is None:
            raise MbltWorkerError("MBLT Accelerator/Model is not initialized.")

    def get_cache_block_size_bytes(self) -> int:
        return self.block_size

    def profile(self, is_start: bool = True, profile_prefix: str | None = None) -> None:  # noqa: ARG002
        """Start/stop a qbruntime NPU event trace (``VLLM_TORCH_PROFILER_DIR``).

        Raises:
            vllm_npu.mblt.tracing.MbltTraceError: the runtime refused to start, or the log
                was not written.
            MbltWorkerError: tracing is not enabled (no ``VLLM_TORCH_PROFILER_DIR``).
        """
        from vllm_npu.mblt.tracing import MbltTracer

        trace_dir = os.environ.get("VLLM_TORCH_PROFILER_DIR", "")
        if not trace_dir:
            raise MbltWorkerError("MBLT NPU tracing is not enabled: set VLLM_TORCH_PROFILER_DIR before starting the server")
        if self.tracer is None:
            self.tracer = MbltTracer(self.runtime, trace_dir, self.rank)
        if is_start:
            self.tracer.start()
        else:
            self.tracer.stop()

    def shutdown(self) -> None:
        if self.tracer is not None:
            self.tracer.shutdown()
        if self.backend is not None:
            self.backend.dispose()
            self.backend = None
        if self.eagle3 is not None:
            self.eagle3.shutdown()
            self.eagle3.backend.dispose()
            self.eagle3 = None
        self._drop_audio()
        if self.table is not None:
            self.table.clear()
        self.engine.clear()

    @property
    def reqs(self) -> dict[str, Request]:
        """The step engine's request table."""
        return self.engine.reqs

    def _drop_audio(self) -> None:
        """Dispose a Qwen3-ASR release's audio encoder or a VLM release's vision encoder, if one was created."""
        if self.audio is not None:
            self.audio.dispose()
            self.audio = None
        if self.vision is not None:
            self.vision.dispose()
            self.vision = None

    def get_supported_tasks(self) -> tuple[str, ...]:
        """``generate``; a Qwen3-ASR release also ``transcription`` (vLLM then serves
        ``/v1/audio/transcriptions`` and ``/v1/audio/translations``)."""
        return ("generate", "transcription") if is_asr_release(self.artifact) else ("generate",)

    # ------------------------------------------------------------------ requests and slots

    def _assign_vslot(self, req_id: str) -> int | None:
        if self.max_batch_size <= 1:
            return None
        if not self.free_vslots:
            raise NoFreeSlotError(
                f"No free accelerator cache slots remain for batch execution. req_id={req_id}, "
                f"max_batch_size={self.max_batch_size}"
            )
        return self.free_vslots.pop(0)

    def _release_vslot(self, st: _Req) -> None:
        if st.vslot is not None:
            self.free_vslots.append(st.vslot)
            self.free_vslots.sort()
            st.vslot = None

    def _slot_for(self, vslot: int | None) -> tuple[int, int]:
        assert self.backend is not None
        return (0, 0) if vslot is None else self.backend.slot_of(vslot)

    def finish(self, st: _Req) -> None:
        """A finished request: its slot is free and its KV becomes a prefix snapshot."""
        req_id = st.req_id
        self._release_vslot(st)
        assert self.table is not None
        displaced = self.snapshots.pop_displaced(req_id)  # superseded by the finished cache
        if displaced is not None:
            self.table.release(displaced)
        if self.enable_prefix_caching and st.kv.length:
            self._add_snapshot(req_id, st.kv)
        else:
            self.table.release(st.kv)

    def _on_displaced(self, kv: RequestKV) -> None:
        """Non-batch models: a running request that loses the shared slot to another is also
        kept as a prefix snapshot (its host copy, shared, not copied), so a later request
        can start from its prefix. Only caches holding at least one full block count. One
        per request (a newer one replaces the older), outside the finished-snapshot LRU."""
        if self.max_batch_size > 1 or not self.enable_prefix_caching or kv.length < self.block_size:
            return
        owner = next((st for st in self.reqs.values() if st.kv is kv), None)
        if owner is None or kv.host is None:
            return
        snap = RequestKV(kv.slot, list(kv.token_ids[: kv.host_len]), kv.host, kv.host_len,
                         owner=f"snapshot {pc.displaced_key(owner.req_id)}")
        old = self.snapshots.add_displaced(owner.req_id, snap.token_ids, snap)
        if old is not None:
            assert self.table is not None
            self.table.release(old)

    def _add_snapshot(self, key: str, kv: RequestKV) -> None:
        """Index ``kv`` as a prefix snapshot; snapshots evicted by the LRU cap lose their slot."""
        assert self.table is not None
        for _key, old in self.snapshots.add(key, list(kv.token_ids), kv):
            self.table.release(old)

    def preempt(self, st: _Req) -> None:
        """A preempted request: its KV is saved to host and its slot freed."""
        assert self.table is not None
        self.table.save(st.kv)
        self.table.release(st.kv)
        self._release_vslot(st)

    def admit(self, new) -> _Req:
        """A new request: a slot, and its prompt embeddings or encoder inputs."""
        params = new.sampling_params
        vslot = self._assign_vslot(new.req_id)
        embeds = getattr(new, "prompt_embeds", None)
        st = _Req(**new_request_fields(new), kv=RequestKV(self._slot_for(vslot), owner=f"req_id={new.req_id}"),
                  vslot=vslot)
        if embeds is not None:
            self._add_prompt_embeds(st, new)
        elif self.vlm is not None:
            self._add_vision(st, new.mm_features or [], new.num_computed_tokens)
        elif new.mm_features:
            self._add_audio(st, new.mm_features)
        assert self.backend is not None
        k = num_logprobs(params, self.backend.vocab_size, "prompt_logprobs")
        if k is not None:  # the step engine gives it the rows to fill (vllm_npu.prompt_logprobs)
            path = "one infer per chunk (full-sequence logits)" if self.backend.output_layout == "all" \
                else "1-token microsteps (last-position logits)"
            logger.info("MBLT prompt logprobs for req_id=%s (%d positions, top %d): %s",
                        new.req_id, max(len(st.prompt_ids) - 1, 0), k, path)
            if self.backend.output_layout != "all" and not self._microstep_warned:
                self._microstep_warned = True
                logger.warning(MICROSTEP_WARNING)
        return st

    def _add_prompt_embeds(self, st: _Req, new: Any) -> None:
        """A request with ``prompt_embeds`` (``--enable-prompt-embeds``,
        :func:`vllm_npu.prompt_embeds.prompt_embeds_of`): the MXQ takes embeddings from the host,
        so they replace the token embeddings at their positions. Their positions get
        content-derived ids for the KV bookkeeping (a prefix snapshot is reused only for the same
        embeddings).

        Raises:
            MbltWorkerError: a VLM or ASR release (the platform refuses these first).
            vllm_npu.prompt_embeds.PromptEmbedsError: embeddings whose width is not the model's
                hidden size, or a length that is not the prompt's.
        """
        assert self.backend is not None
        if self.vlm is not None or self.audio is not None:
            raise MbltWorkerError(f"req_id={st.req_id}: prompt_embeds on a release that places encoder embeddings")
        pe = prompt_embeds_of(st, new, self.backend.hidden_size, self.backend.vocab_size)
        assert pe is not None
        st.mm_pos, st.mm_rows = pe.positions, pe.rows
        st.key_prompt_ids = pe.key_ids(st.prompt_ids)

    def _add_audio(self, st: _Req, mm_features: list) -> None:
        """Encode a new request's audio clips (:func:`vllm_npu.mblt.asr.feature_rows`) and give
        their positions clip-derived ids for the KV bookkeeping.

        Raises:
            MbltWorkerError: multimodal data for a release without an audio encoder.
            vllm_npu.mblt.asr.AsrInputError: features the encoder cannot take.
        """
        if self.audio is None:
            raise MbltWorkerError(f"req_id={st.req_id}: multimodal data for a release that takes none")
        items = feature_rows(mm_features, self.audio)
        st.mm_pos = np.concatenate([pos for _clip, pos, _rows in items])
        st.mm_rows = np.concatenate([rows for _clip, _pos, rows in items], axis=0)
        keys = list(st.prompt_ids)
        for clip, pos, _rows in items:
            for p, k in zip(pos.tolist(), content_key_ids(clip, pos.size)):
                keys[p] = k
        st.key_prompt_ids = keys

    def _add_vision(self, st: _Req, mm_features: list, computed: int) -> None:
        """A VLM request: encode its images/videos once (:func:`vllm_npu.mblt.vlm.feature_items`, the
        release's rules first), key their positions by the items' hashes for the KV bookkeeping (two
        different images never share KV), and, for a RoPE-input text MXQ, compute the prompt's M-RoPE
        positions. A text-only request gets linear positions.

        Raises:
            vllm_npu.mblt.vlm.VlmRuleError: a rule of the release broken (the seed's text; the front
                end refuses the same with HTTP 400 first).
            vllm_npu.mblt.vlm.VlmInputError: features the vision MXQ cannot take.
            MbltWorkerError: an item vLLM sent without its grid while its positions are needed.
        """
        from vllm_npu.mblt.vlm import feature_items
        from vllm_npu.mblt.vlm_positions import rope_index

        assert self.vlm is not None and self.vision is not None
        rel = self.vlm
        items = feature_items(mm_features, self.vision, computed_tokens=computed)
        if not items:
            return
        encoded = [it for it in items if it.rows is not None]
        logger.info("MBLT vision: req_id=%s encoded %d item(s); %d covered by prefix-cached KV", st.req_id,
                    len(encoded), len(items) - len(encoded))
        if encoded:
            st.mm_pos = np.concatenate([it.positions for it in encoded])
            st.mm_rows = np.concatenate([it.rows for it in encoded], axis=0)
            if rel.text.deepstack is not None:
                st.mm_deep = np.concatenate([it.deepstack for it in encoded], axis=1)
        st.covered_until = max((it.end for it in items if it.rows is None), default=0)
        keys = list(st.prompt_ids)
        for it in items:
            for p, k in zip(it.positions.tolist(), content_key_ids(it.identifier, it.positions.size)):
                keys[p] = k
        st.key_prompt_ids = keys
        if rel.text.has_rope:
            if any(it.grid is None for it in items):
                raise MbltWorkerError(f"req_id={st.req_id}: vLLM sent an item without its grid; the M-RoPE positions "
                                      "of a RoPE-input text MXQ need every item's grid")
            image_ids = {rel.image_token_id, rel.video_token_id}
            if None in image_ids:
                raise MbltWorkerError(f"{rel.model_dir}/config.json names no image_token_id / video_token_id")
            st.mrope, st.mrope_delta = rope_index(
                st.prompt_ids, image_grid_thw=[it.grid for it in items if it.modality == "image"],
                video_grid_thw=[it.grid for it in items if it.modality == "video"],
                image_token_id=int(rel.image_token_id), video_token_id=int(rel.video_token_id),
                spatial_merge_size=rel.merge_size, family=rel.family)

    def _positions(self, st: _Req | None, start: int, n: int) -> np.ndarray:
        """M-RoPE positions ``[3, n]`` of ``st``'s tokens ``[start, start + n)``: the prompt's, then
        ``index + delta`` (linear when the request has no images, or ``st`` is None)."""
        from vllm_npu.mblt.vlm_positions import decode_positions

        if st is None or st.mrope is None:
            return decode_positions(start, n, 0)
        t = st.mrope.shape[1]
        head = st.mrope[:, start:min(start + n, t)]
        tail_start = max(start, t)
        tail = decode_positions(tail_start, max(0, start + n - tail_start), st.mrope_delta)
        return np.concatenate([head, tail], axis=1)

    def _text_extras(self, st: _Req | None, start: int, n: int) -> tuple[np.ndarray, ...]:
        """A VLM text MXQ's inputs after the embeddings for ``st``'s tokens ``[start, start + n)``
        (:func:`vllm_npu.mblt.vlm.text_extras`); ``()`` for any other release."""
        if self.vlm is None:
            return ()
        from vllm_npu.mblt.vlm import deepstack_window, text_extras

        assert self.backend is not None
        rel = self.vlm
        rope = rel.rope_rows(self._positions(st, start, n)) if rel.text.has_rope else None
        deep = None
        if rel.text.deepstack is not None:
            deep = deepstack_window(st.mm_pos if st is not None else None, st.mm_deep if st is not None else None,
                                    start, n, layers=rel.deepstack_layers or 3, hidden=self.backend.hidden_size)
        return text_extras(rel, rope=rope, deepstack=deep)

    def _embeds(self, st: _Req, start: int, piece: list[int]) -> np.ndarray:
        """Input embeddings of ``st``'s ``piece`` (its ``all_ids`` from position ``start``): the
        token embeddings, with the audio / vision embeddings at their positions."""
        if st.mm_pos is None:
            if st.key_prompt_ids is None:
                return self.embeddings[piece]
            return self.embeddings[st.token_ids(start, start + len(piece))]  # images covered by a snapshot
        n = len(piece)
        x = self.embeddings[st.token_ids(start, start + n)]  # a copy: fancy indexing
        sel = (st.mm_pos >= start) & (st.mm_pos < start + n)
        x[st.mm_pos[sel] - start] = st.mm_rows[sel]
        return x

    def resume(self, st: _Req) -> None:
        """A resumed request gets a slot again (its KV was saved to host at preemption)."""
        if self.max_batch_size > 1 and st.vslot is None:
            st.vslot = self._assign_vslot(st.req_id)
            new_slot = self._slot_for(st.vslot)
            if new_slot != st.kv.slot:
                assert self.table is not None
                self.table.release(st.kv)
                st.kv.slot = new_slot

    def _restore_prefix(self, st: _Req, target: int) -> None:
        """Give ``st`` KV for ``[0, target)`` where possible; the rest is recomputed."""
        assert self.table is not None
        ids = st.all_ids
        kv = st.kv
        common = 0
        for a, b in zip(kv.token_ids, ids[:target]):
            if a != b:
                break
            common += 1
        if common < kv.length:
            kv.truncate(common)
        if kv.length >= target:
            kv.truncate(target)
            return
        if kv.length > 0:
            self.short_cache_warnings += 1
            logger.warning(SHORT_CACHE_WARNING, st.req_id, kv.slot[1], kv.length, target, self.short_cache_warnings)
            return
        if not self.enable_prefix_caching:
            return
        match = self.snapshots.best_match(ids[:target], target)
        if match is None:
            self.stats["prefix_recomputes"] += 1
            return
        key, snap, matched = match
        ok, reason = self.cost_model.should_load(matched, kv.slot[1])
        if st.covered_until and matched >= st.covered_until:
            ok, reason = True, "its images arrived without pixels: vLLM's prefix cache covers them"
        if not ok:
            self.stats["prefix_recomputes"] += 1
            logger.info("MBLT prefix snapshot %s: recompute %d tokens for req_id=%s (%s)", key, matched, st.req_id, reason)
            return
        self.snapshots.touch(key)
        self.table.save(snap)
        kv.token_ids = list(snap.token_ids[:matched])
        if self.table.holder(kv.slot) is snap:  # resident on this slot: take it over in place
            self.table.owner[kv.slot] = kv
            kv.host, kv.host_len = None, 0
        else:  # elsewhere or saved: the first bind loads the snapshot's host copy
            kv.host, kv.host_len = snap.host, matched
            self.table.bind(kv)
        self.stats["prefix_loads"] += 1
        logger.info("MBLT prefix snapshot %s: load %d tokens for req_id=%s (%s)", key, matched, st.req_id, reason)

    # ------------------------------------------------------------------ the step

    def run_step(self, plan: StepPlan) -> StepResult:
        """Restore each row's cache (its own, or a prefix snapshot), run its tokens (scoring the
        prompt positions of a request that asked for prompt logprobs), and return the sampling
        rows' last-position logits.

        Raises:
            MbltWorkerError: images vLLM's prefix cache covered whose KV no snapshot holds.
            MbltDeviceError: an infer failed twice.
        """
        self.stats["steps"] += 1
        work: list[tuple[_Req, int]] = []
        for row in plan.rows:
            st = row.req
            self._restore_prefix(st, st.num_computed)
            if st.covered_until > st.kv.length:
                raise MbltWorkerError(
                    f"req_id={st.req_id}: vLLM's prefix cache covered its images up to token {st.covered_until} and "
                    f"sent them without pixels, but no prefix snapshot holds that KV (the worker has {st.kv.length} "
                    "tokens): raise prefix_cache_max_host_mib, or serve this release with --no-enable-prefix-caching")
            work.append((st, row.end))
        logits = self._run(work)
        rows = [logits[i] for i, row in enumerate(plan.rows) if row.samples]
        return StepResult(logits=np.stack(rows) if rows else None)

    def _infer(self, rows: list[Row]) -> list[np.ndarray]:
        """One dispatch; a ``QbRuntimeError`` is retried once (every row rewrites the same KV
        positions, so the retry is exact), then raised as :class:`MbltDeviceError`
        (:class:`vllm_npu.device_retry.DeviceRetry`; any other error propagates as itself)."""
        assert self.backend is not None
        return device_retry(self.runtime).call("infer", lambda: self.backend.infer_rows(rows), on_retry=self._count_infer_retry,
                          where=f" on slots {[(r.model_idx, r.cache_id) for r in rows]}")

    def _count_infer_retry(self) -> None:
        self.stats["infer_retries"] += 1

    def _run(self, work: list[tuple[_Req, int]]) -> list[np.ndarray | None]:
        """Compute each request's tokens ``[cache_len, end)``; return its last-token logits.

        Batch models bind every request's cache and run them together; non-batch models share
        one slot, so each request is bound and run on its own in turn.
        """
        assert self.backend is not None and self.table is not None
        out: list[np.ndarray | None] = [None] * len(work)
        pending = []
        for i, (st, end) in enumerate(work):
            start = st.kv.length
            if start >= end:
                raise MbltCacheStateError(
                    f"req_id={st.req_id}: nothing to compute (cache holds {start} tokens, step ends at {end})"
                )
            pending.append([i, st, st.all_ids[:end], start])
        groups = [pending] if self.max_batch_size > 1 else [[item] for item in pending]
        for group in groups:
            for _i, st, _ids, _start in group:
                self.table.bind(st.kv)
            self._run_rounds(group, out)
        return [o if o is None or o.ndim == 1 else o[-1] for o in out]

    def _piece_width(self, st: _Req, start: int) -> int:
        """Tokens of ``st`` to feed from ``start`` in one round: ``max_width``, or 1 while a
        last-logit MXQ scores its prompt (the microstep path)."""
        assert self.backend is not None
        plp = st.prompt_logprobs
        if plp is not None and plp.needs_logits_at(start) and self.backend.output_layout != "all":
            return 1
        return self.backend.max_width

    def _run_rounds(self, pending: list[list], out: list[np.ndarray | None]) -> None:
        """Feed each ``[index, request, ids, start]`` its next piece (:meth:`_piece_width`)
        per round, every bound request in one dispatch, until all reach the end of their ids.
        A request asking for prompt logprobs scores each piece's positions as they come."""
        while pending:
            pieces = [ids[start:start + self._piece_width(st, start)] for _i, st, ids, start in pending]
            rows = [Row(*st.kv.slot, self._embeds(st, start, piece), start, self._text_extras(st, start, len(piece)))
                    for (_i, st, _ids, start), piece in zip(pending, pieces)]
            for item, piece, r in zip(pending, pieces, self._infer(rows)):
                i, st, _ids, start = item
                st.kv.note_write(start, piece)
                out[i] = r
                item[3] = start + len(piece)
                if st.prompt_logprobs is not None and st.prompt_logprobs.needs_logits_at(start):
                    if len(piece) > 1 and r.ndim == 1:
                        raise MbltWorkerError(
                            f"req_id={st.req_id}: the MXQ returned one logits row for {len(piece)} "
                            "tokens; prompt logprobs need the microstep path on last-logit outputs"
                        )
                    if len(piece) == 1:
                        self.stats["prompt_logprob_microsteps"] += 1
                    st.prompt_logprobs.record(start, r)
            pending = [item for item in pending if item[3] < len(item[2])]
