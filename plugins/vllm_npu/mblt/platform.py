"""The MBLT vLLM platform: scheduler defaults from the MXQ artifact, and the MBLT worker.

Activated by the ``vllm.platform_plugins`` entry point ``mblt`` when ``NPU_HARNESS_TARGET``
is ``mblt-sim`` or ``mblt-hw``. The model runs inside the MXQ through the runtime API, so
the platform is an out-of-tree CPU-hosted one (:class:`vllm_npu._platform.NpuPlatform`: vLLM's
CPU kernels chosen for this CPU, no attention backend, no torch.compile, no CUDA graphs)
whose job is configuration:

- worker class :class:`vllm_npu.mblt.worker.MbltWorker`;
- block size 128 and prefix caching on unless the user set them;
- ``max_model_len`` clamped to the MXQ's KV capacity when the user gave none;
- ``max_num_seqs`` from the artifact's ``max_batch_size`` and chunked prefill from its
  ``npu_prefill_chunk_size`` (:func:`vllm_npu.mblt.settings.plan_scheduler`);
- requests the worker cannot honour are refused in :meth:`MbltPlatform.validate_request`
  (vLLM answers them with HTTP 400);
- an EAGLE-3 release (:func:`_eagle3_rules`): one sequence (``max_batch_size`` above 1 refused,
  ``max_num_seqs`` 1), prefix caching off, ``max_model_len`` within
  :func:`eagle3_max_model_len`, requests sampling with temperature, top_k and top_p only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from vllm_npu.vllm_version import require_supported_vllm

require_supported_vllm("mblt")  # before any vLLM import: another vLLM is refused by name

from vllm.exceptions import VLLMValidationError

from vllm_npu import audio_uploads
from vllm_npu._platform import NpuPlatform, refuse_unsampled

logger = logging.getLogger("vllm.vllm_npu.mblt")

WORKER_CLS = "vllm_npu.mblt.worker.MbltWorker"
TRACE_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"


class MbltRequestError(VLLMValidationError, ValueError):
    """A request asks for something the MBLT worker does not do (answered with HTTP 400).

    vLLM 0.32's ``AsyncLLM.generate`` re-raises only ``VLLMClientError`` subclasses as they
    are; any other exception from ``validate_request`` (a plain ``ValueError`` included)
    becomes an ``EngineGenerateError`` and an HTTP 500 with an empty message.
    """


def artifact_config(vllm_config: Any) -> dict[str, Any]:
    """The artifact's ``config.json`` as vLLM parsed it (``--hf-overrides`` applied): the one
    source the platform's scheduler plan and the worker's layout both read."""
    hf = vllm_config.model_config.hf_config
    return hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))


def _fit_max_model_len(vllm_config: Any, artifact: dict[str, Any], overrides: Any, explicit: bool) -> None:
    """Fit vLLM's ``max_model_len`` to what the MXQs hold: the MXQ's KV capacity; for a
    Mixture-of-Experts release that of its shared MXQs (read from layer 0's); for an EAGLE-3
    release :func:`eagle3_max_model_len` of its base and draft MXQs.

    Without ``--max-model-len`` (``explicit`` False) the value vLLM took from the artifact's declared
    ``max_position_embeddings`` is clamped to it, with a log line, as vllm-mblt does for its
    releases whose config declares more than their MXQs hold. An explicit value above the KV
    capacity of an MXQ or MoE release is refused here, in the API server, with the worker's own
    message, so that ``vllm serve`` stops before it starts an engine (an EAGLE-3 limit is left to
    the worker, whose message names both MXQs' capacities). Nothing changes when the capacity
    cannot be read here (no target selected, no ``mxq_path``, a runtime error): the worker then
    reports the cause.

    Raises:
        vllm_npu.mblt.settings.MbltConfigError: an explicit ``max_model_len`` above the KV capacity.
    """
    from vllm_npu.mblt import eagle3_backend, moe_backend, settings
    from vllm_npu.mblt.backend import kv_capacity
    from vllm_npu.mblt.runtime import load_runtime
    from vllm_npu.targets import selected_target

    model_config = vllm_config.model_config
    target = selected_target()
    if target not in ("mblt-sim", "mblt-hw"):
        return
    if eagle3_backend.is_eagle3_release(artifact):
        if explicit:
            return
        source, what = "release", "the EAGLE-3 base and draft MXQs"

        def read(runtime: Any) -> tuple[int, str]:
            return _eagle3_capacity(runtime, model_config.model, artifact, overrides)
    elif moe_backend.is_moe_release(artifact):
        source, what = "release", "its Mixture-of-Experts shared MXQs"

        def read(runtime: Any) -> tuple[int, str]:
            capacity = moe_backend.MoeRelease(model_config.model, artifact).shared_kv_capacity(runtime)
            return capacity, f"the KV capacity of {what}"
        refused_what = "the Mixture-of-Experts release's shared MXQs"  # the worker's words
    else:
        path = settings.mxq_path_of(model_config.model, artifact, overrides)
        if path is None or not os.path.isfile(path):
            return
        source, what = "artifact", path

        def read(runtime: Any) -> tuple[int, str]:
            return kv_capacity(runtime, path), f"the KV capacity of {path}"
        refused_what = f"the MXQ {path}"
    try:
        capacity, reason = read(load_runtime(target))
    except Exception as exc:  # noqa: BLE001 - the worker loads the MXQs again and raises its error
        logger.debug("MBLT platform: KV capacity of %s not read here (%s)", what, exc)
        return
    if explicit:
        if model_config.max_model_len > capacity:
            raise settings.MbltConfigError(
                f"max_model_len={model_config.max_model_len} exceeds the KV capacity of {refused_what} "
                f"({capacity} tokens per cache id). Pass --max-model-len {capacity} or lower.")
        return
    if model_config.max_model_len > capacity:
        logger.warning(
            "MBLT platform: max_model_len clamped from %d (the %s's config) to %d, %s; pass "
            "--max-model-len to choose a value up to it",
            model_config.max_model_len, source, capacity, reason,
        )
        model_config.max_model_len = capacity


def eagle3_max_model_len(base_capacity: int, draft_capacity: int, depth: int, top_k: int) -> int:
    """The largest ``max_model_len`` an EAGLE-3 release serves: ``min(base_capacity,
    draft_capacity - (depth - 1) * top_k + 2)`` tokens.

    Why (``vllm_npu.mblt.eagle3_round``): with ``L`` = tokens known (prompt and outputs, the next
    root included) a round feeds the base the previous round's accepted tokens again and the tree
    at ``cache_size = L - 1 - a``, so it writes up to ``L + N``, and the tree's ``N`` nodes are capped
    by the budget left (``N <= max_model_len - L``): the base never writes past ``max_model_len``.
    The draft's tree levels write ``(depth - 1) * top_k`` positions past its committed ``L - 1``
    tokens whatever ``N`` is, and a tree is grown only while ``L <= max_model_len - 1``: the draft
    writes up to ``max_model_len - 2 + (depth - 1) * top_k``. (transformers-mblt grows a tree
    even when the budget is spent; the plugin does not, which changes no token.)
    """
    return max(1, min(int(base_capacity), int(draft_capacity) - (int(depth) - 1) * int(top_k) + 2))


def _eagle3_capacity(runtime: Any, model_dir: str, artifact: dict[str, Any], overrides: Any) -> tuple[int, str]:
    """``(largest max_model_len, why)`` of an EAGLE-3 release, reading the base and draft MXQs' KV
    capacities from never-launched Models of ``runtime``.

    Raises:
        Exception: the release or the runtime cannot be read (the caller decides).
    """
    from vllm_npu.mblt.backend import kv_capacity
    from vllm_npu.mblt.eagle3_backend import Eagle3Release, loader_layout

    release = Eagle3Release.read(model_dir, artifact, loader_layout(overrides))
    base = kv_capacity(runtime, str(release.paths["base"]))
    draft = kv_capacity(runtime, str(release.paths["draft"]))
    limit = eagle3_max_model_len(base, draft, release.depth, release.top_k)
    return limit, (f"from the EAGLE-3 base MXQ's KV capacity ({base}) and the draft MXQ's ({draft}) less its tree "
                   f"levels' headroom ((depth {release.depth} - 1) x top_k {release.top_k} - 2)")


def _eagle3_rules(artifact: dict[str, Any], overrides: Any) -> None:
    """An EAGLE-3 release: one sequence per base MXQ (its ``max_model_len`` is clamped as any
    artifact's: :func:`_fit_max_model_len`).

    Raises:
        vllm_npu.mblt.settings.MbltConfigError: ``max_batch_size`` above 1 (from the loader extra
            config, config.json's ``base_max_batch_size`` / ``max_batch_size`` /
            ``npu_max_batch_size``).
    """
    from vllm_npu.mblt import eagle3_backend, settings

    n = settings.resolve_max_batch_size(overrides, artifact)
    base_n = overrides.extra.get("base_max_batch_size", artifact.get("base_max_batch_size"))
    for value in (n, base_n):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value > 1):
            raise settings.MbltConfigError(eagle3_backend.BATCH_REFUSAL.format(n=value))


#: Prompt embeddings on a release whose prompt positions are also an encoder's (images, audio).
PROMPT_EMBEDS_MM_REFUSAL = ("prompt_embeds are served for text (and MoE) releases; this release places its "
                            "vision or audio encoder's embeddings in the prompt, so send token ids")
EAGLE3_PREFIX_CACHE_OFF = "Disabling prefix caching for EAGLE-3: every request feeds its whole prompt."
EAGLE3_REQUEST_REFUSAL = "EAGLE-3 models sample with temperature, top_k and top_p only; unsupported here: {names}."
EAGLE3_PROMPT_REFUSAL = "EAGLE-3 models take token prompts only, without prompt embeddings or multimodal data."


def _eagle3_refusals(params: Any) -> list[str]:
    """The sampling parameters of ``params`` an EAGLE-3 round cannot honour, in vllm-mblt's order."""
    checks = (
        ("logprobs", params.logprobs is not None),
        ("prompt_logprobs", params.prompt_logprobs is not None),
        ("presence_penalty", bool(params.presence_penalty)),
        ("frequency_penalty", bool(params.frequency_penalty)),
        ("repetition_penalty", params.repetition_penalty != 1.0),
        ("min_p", bool(params.min_p and params.min_p > 0)),
        ("min_tokens", bool(params.min_tokens and params.min_tokens > 0)),
        ("seed", params.seed is not None),
        ("logit_bias", bool(params.logit_bias)),
        ("allowed_token_ids", bool(params.allowed_token_ids)),
        ("bad_words", bool(params.bad_words)),
        ("logits_processors", bool(getattr(params, "logits_processors", None))),
        ("structured_outputs", params.structured_outputs is not None),
        ("n", (params.n or 1) > 1),
    )
    return [name for name, refused in checks if refused]


ASR_PREFIX_CACHE_OFF = ("Disabling prefix caching for Qwen3-ASR: vLLM drops the audio features of a prompt span its "
                       "prefix cache covers, so every request encodes its audio and feeds its whole prompt.")
ASR_CLAMP_LOG = ("MBLT platform: Clamping max_model_len from %d to %d for Qwen3-ASR: a request whose audio runs "
                  "past token %d can stall the NPU (the artifact declares more)")


def _asr_rules(vllm_config: Any) -> None:
    """A Qwen3-ASR release (vllm-mblt's rules): ``max_model_len`` at most
    :data:`vllm_npu.mblt.asr.ASR_MAX_MODEL_LEN` (logged when clamped, the user's value included;
    longer prompts then get vLLM's HTTP 400), vLLM's multimodal processor cache off (the worker
    needs every request's features), and one audio clip per prompt.

    Raises:
        vllm_npu.mblt.settings.MbltConfigError: ``--limit-mm-per-prompt`` allows more than one
            audio clip, or any other modality.
    """
    from vllm.config.multimodal import AudioDummyOptions

    from vllm_npu.mblt import settings
    from vllm_npu.mblt.asr import ASR_MAX_MODEL_LEN

    model_config = vllm_config.model_config
    if model_config.max_model_len > ASR_MAX_MODEL_LEN:
        logger.warning(ASR_CLAMP_LOG, model_config.max_model_len, ASR_MAX_MODEL_LEN, ASR_MAX_MODEL_LEN)
        model_config.max_model_len = ASR_MAX_MODEL_LEN
    mm = model_config.multimodal_config
    if mm is None:
        return
    if mm.mm_processor_cache_gb:
        logger.info("MBLT platform: multimodal processor cache off for Qwen3-ASR (was %s GiB)",
                    mm.mm_processor_cache_gb)
        mm.mm_processor_cache_gb = 0
    for modality, opts in mm.limit_per_prompt.items():
        if modality != "audio" or opts.count > 1:
            raise settings.MbltConfigError(
                f"--limit-mm-per-prompt {modality}={opts.count}: Mobilint Qwen3-ASR takes one audio clip per "
                "request (and no other modality)")
    mm.limit_per_prompt["audio"] = AudioDummyOptions(count=1)


VLM_STATIC_LIMIT_REFUSAL = ("--limit-mm-per-prompt {modality}={count}: a {kind} Mobilint {family} release takes "
                            "exactly one image and no video per request (image=1, video=0); a dynamic-vision Qwen3-VL "
                            "release takes several images and videos")


def _vlm_dynamic(model_dir: str, artifact: dict[str, Any], overrides: Any) -> bool:
    """Whether a VLM release's vision is dynamic: read off its vision MXQ's input count (a
    never-launched ``Model`` of the selected runtime, as the worker decides), else the config's
    flag (``is_dynamic`` / ``dynamic_vision``) when the MXQ cannot be read here."""
    from vllm_npu.mblt import vlm
    from vllm_npu.mblt.runtime import load_runtime
    from vllm_npu.targets import selected_target

    family = vlm.vlm_family(artifact)
    try:
        vision_mxq, _text = vlm.VlmRelease.mxq_paths(model_dir, artifact, overrides.extra)
        shapes = vlm.probe_input_shapes(load_runtime(selected_target() or ""), vision_mxq)
        return vlm.vision_layout(str(family), shapes, artifact.get("vision_config") or {}).dynamic
    except Exception as exc:  # noqa: BLE001 - the worker reads the MXQs again and raises its error
        logger.debug("MBLT platform: vision MXQ not read here (%s); using the config's dynamic flag", exc)
    flag = artifact.get("is_dynamic", artifact.get("dynamic_vision")) if family == "qwen3_vl" \
        else artifact.get("dynamic_vision", (artifact.get("vision_config") or {}).get("dynamic_vision"))
    return bool(flag)


def _vlm_rules(vllm_config: Any, artifact: dict[str, Any], overrides: Any) -> bool:
    """A Mobilint Qwen2-VL / Qwen3-VL release (:mod:`vllm_npu.mblt.vlm`): no unprefixed
    ``mxq_path``; a Qwen2-VL release (static or dynamic vision) and a static-vision Qwen3-VL one take one
    image and no video per prompt (``--limit-mm-per-prompt`` image 1, video 0; a larger explicit
    limit stops start-up naming it). Prefix caching stays on: it covers the LM KV only (the worker
    encodes every request's images again).

    Returns:
        Whether requests may carry several images and videos (a dynamic Qwen3-VL).

    Raises:
        vllm_npu.mblt.settings.MbltConfigError: an unprefixed ``mxq_path``, or a limit above the
            static release's.
    """
    from vllm.config.multimodal import ImageDummyOptions, VideoDummyOptions

    from vllm_npu.mblt import settings, vlm

    settings.refuse_vlm_mxq_path(overrides)
    model_config = vllm_config.model_config
    dynamic = _vlm_dynamic(model_config.model, artifact, overrides)
    family = vlm.vlm_family(artifact)
    mm = model_config.multimodal_config
    multi_item = dynamic and family == "qwen3_vl"  # Qwen2-VL: one image, dynamic or not (the seed, vllm-mblt)
    if mm is not None and not multi_item:
        name = "Qwen2-VL" if family == "qwen2_vl" else "Qwen3-VL"
        allowed = {"image": 1, "video": 0}
        for modality, opts in mm.limit_per_prompt.items():
            if opts.count > allowed.get(modality, 0):
                raise settings.MbltConfigError(VLM_STATIC_LIMIT_REFUSAL.format(
                    modality=modality, count=opts.count, family=name,
                    kind="dynamic-vision" if dynamic else "static-vision"))
        image = mm.limit_per_prompt.get("image")
        mm.limit_per_prompt["image"] = image if image is not None and image.count == 1 else ImageDummyOptions(count=1)
        mm.limit_per_prompt["video"] = VideoDummyOptions(count=0)
    logger.info("MBLT platform: Mobilint %s release, %s vision%s", family, "dynamic" if dynamic else "static",
                "" if multi_item else " (one image per request, no video)")
    return multi_item


def _moe_rules(artifact: dict[str, Any], overrides: Any) -> None:
    """A Mixture-of-Experts release: one sequence at a time, placement by role (its
    ``max_model_len`` is clamped as any artifact's: :func:`_fit_max_model_len`).

    Raises:
        vllm_npu.mblt.settings.MbltConfigError: ``max_batch_size`` above 1 (from the loader extra
            config or config.json), or a bad role placement key (:class:`MoePlacement`).
    """
    from vllm_npu.mblt import moe_backend, settings

    n = settings.resolve_max_batch_size(overrides, artifact)
    if n is not None and n > 1:
        raise settings.MbltConfigError(moe_backend.BATCH_REFUSAL.format(n=n))
    unprefixed = {k: v for k, v in (("dev_no", overrides.dev_no), ("target_cores", overrides.target_cores),
                                     ("target_clusters", overrides.target_clusters), ("core_mode", overrides.core_mode),
                                     ("mxq_path", overrides.extra.get("mxq_path"))) if v is not None}
    if unprefixed:
        logger.warning("MBLT MoE: unprefixed layout keys %s are not used for Mixture-of-Experts releases; place the "
                       "roles with the shared_, expert_ and lm_head_ prefixed keys (e.g. lm_head_target_cores) and "
                       "num_expert_workers", sorted(unprefixed))
    moe_backend.MoePlacement.resolve(artifact, overrides.extra)


class MbltPlatform(NpuPlatform):
    """Out-of-tree platform for Mobilint NPUs (see the module docstring); what every NPU
    platform shares (kernel loading, worker hook, eager and synchronous) is in
    :class:`vllm_npu._platform.NpuPlatform`."""

    worker_cls = WORKER_CLS
    npu_name = "mblt"
    middlewares = (*NpuPlatform.middlewares, audio_uploads.MIDDLEWARE)

    @classmethod
    def configure(cls, vllm_config: Any) -> None:
        """Size the scheduler and the cache from the artifact.

        Raises:
            vllm_npu.mblt.settings.MbltConfigError: a bad ``--model-loader-extra-config``
                or artifact value (the message names it and the rule); engine-level
                ``--logits-processors`` (the host sampler would ignore them).
        """
        from vllm_npu.mblt import engine_args, settings

        sched = vllm_config.scheduler_config
        cache = vllm_config.cache_config
        procs = getattr(vllm_config.model_config, "logits_processors", None)
        if procs:
            names = ", ".join(p if isinstance(p, str) else f"{p.__module__}.{p.__qualname__}" for p in procs)
            raise settings.MbltConfigError(
                f"--logits-processors {names}: the MBLT worker samples the MXQ's logits with vLLM's "
                "Sampler on the host and runs no engine-level logits processors; they would be "
                "ignored silently. Start without --logits-processors."
            )
        overrides = settings.parse_loader_extra_config(vllm_config.load_config.model_loader_extra_config)
        # the user's own values (None when not given), not vLLM's defaults
        user = engine_args.captured() or {"max_num_seqs": sched.max_num_seqs,
                                          "max_num_batched_tokens": sched.max_num_batched_tokens,
                                          "max_model_len": vllm_config.model_config.max_model_len}
        artifact = artifact_config(vllm_config)
        from vllm_npu.mblt.eagle3_backend import is_eagle3_release
        from vllm_npu.mblt.moe_backend import is_moe_release

        eagle3 = is_eagle3_release(artifact)
        cls._serving_eagle3 = eagle3
        if is_moe_release(artifact):
            _moe_rules(artifact, overrides)
        if eagle3:
            _eagle3_rules(artifact, overrides)
        from vllm_npu.mblt.asr import is_asr_release

        asr = is_asr_release(artifact)
        cls._serving_asr = asr
        if asr:
            _asr_rules(vllm_config)
        from vllm_npu.mblt.vlm import is_vlm_release, vlm_family

        plan_artifact, plan_overrides = artifact, overrides
        cls._serving_vlm = None
        if is_vlm_release(artifact):
            multi_item = _vlm_rules(vllm_config, artifact, overrides)
            cls._serving_vlm = (str(vlm_family(artifact)), multi_item)
            # the scheduler serves the text MXQ: its max_batch_size, core mode and prefill chunk
            plan_artifact, plan_overrides = settings.vlm_role_view(artifact, overrides, "text")
        _fit_max_model_len(vllm_config, artifact, overrides, explicit=user["max_model_len"] is not None)
        plan = settings.plan_scheduler(
            plan_artifact,
            plan_overrides,
            user_max_num_seqs=user["max_num_seqs"],
            user_max_num_batched_tokens=user["max_num_batched_tokens"],
            user_block_size=cache.block_size if cache.user_specified_block_size else None,
            user_enable_prefix_caching=cache.enable_prefix_caching,
        )
        if eagle3:
            if plan.max_num_seqs > 1:
                logger.warning("MBLT platform: max_num_seqs clamped from %d to 1: EAGLE-3 models serve one sequence "
                               "per base MXQ", plan.max_num_seqs)
            if plan.enable_prefix_caching:
                logger.info(EAGLE3_PREFIX_CACHE_OFF)
            plan = dataclasses.replace(plan, max_num_seqs=1, max_num_batched_tokens=plan.max_num_batched_tokens
                                       // max(1, plan.max_num_seqs), enable_prefix_caching=False)
        if asr and plan.enable_prefix_caching:
            logger.info(ASR_PREFIX_CACHE_OFF)
            plan = dataclasses.replace(plan, enable_prefix_caching=False)
        cache.block_size = plan.block_size
        cache.enable_prefix_caching = plan.enable_prefix_caching
        sched.enable_chunked_prefill = True
        sched.max_num_seqs = plan.max_num_seqs
        sched.max_num_batched_tokens = plan.max_num_batched_tokens
        sched.long_prefill_token_threshold = plan.long_prefill_token_threshold
        if getattr(sched, "max_num_scheduled_tokens", None) is not None:
            sched.max_num_scheduled_tokens = min(sched.max_num_scheduled_tokens, plan.max_num_batched_tokens)
        logger.info(
            "MBLT platform: worker %s, block_size %d, max_num_seqs %d, max_num_batched_tokens %d, "
            "long_prefill_token_threshold %d, prefix caching %s",
            WORKER_CLS, plan.block_size, plan.max_num_seqs, plan.max_num_batched_tokens,
            plan.long_prefill_token_threshold, "on" if plan.enable_prefix_caching else "off",
        )

    @classmethod
    def pre_register_and_update(cls, parser: Any = None) -> None:
        """Install :attr:`middlewares` (the base's, plus :data:`vllm_npu.audio_uploads.MIDDLEWARE`:
        a bad audio upload gets 400 before vLLM decodes it), and turn ``VLLM_TORCH_PROFILER_DIR``
        into vLLM's profiler config for this server.

        vLLM 0.32 registers ``/start_profile`` and ``/stop_profile`` only when
        ``--profiler-config`` names a profiler; with ``VLLM_TORCH_PROFILER_DIR`` set (the
        MBLT switch) and no ``--profiler-config`` given, the default becomes the torch
        profiler writing into that directory: vLLM's front-end trace lands there, and the
        worker's ``profile`` hook records the qbruntime NPU trace beside it.
        """
        super().pre_register_and_update(parser)
        trace_dir = os.environ.get(TRACE_DIR_ENV, "")
        if parser is None or not trace_dir:
            return
        from vllm.config import ProfilerConfig

        parser.set_defaults(profiler_config=ProfilerConfig(profiler="torch", torch_profiler_dir=trace_dir))

    #: Whether this process configured an EAGLE-3 release (the fallback of :meth:`_eagle3_engine`).
    _serving_eagle3 = False
    #: ``(family, several images and videos per request)`` of the VLM release this process configured, else None.
    _serving_vlm: tuple[str, bool] | None = None
    _serving_asr = False
    #: The image position of each session of a static VLM release (:meth:`_validate_vlm`).
    _vlm_sessions: Any = None

    @classmethod
    def _eagle3_engine(cls) -> bool:
        """Whether the engine validating a request serves an EAGLE-3 release: the caller's
        ``model_config`` (vLLM's ``InputProcessor``), else what :meth:`configure` saw."""
        import sys

        from vllm_npu.mblt.eagle3_backend import EAGLE3_MODEL_TYPES

        frame = sys._getframe(2)
        for _ in range(3):
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            model_config = getattr(owner, "model_config", None)
            hf = getattr(model_config, "hf_config", None)
            if hf is not None:
                return getattr(hf, "model_type", None) in EAGLE3_MODEL_TYPES
            frame = frame.f_back
        return cls._serving_eagle3

    @classmethod
    def validate_request(cls, processed_inputs: Any, params: Any) -> None:
        """Refuse what the MBLT worker would otherwise ignore (vLLM answers HTTP 400).

        On an EAGLE-3 release only temperature, top_k and top_p sample (with ``max_tokens``,
        ``stop``, stop ids, ``ignore_eos`` and ``n`` 1): every other parameter vllm-mblt refuses is
        refused, named, and so are prompt embeddings and multimodal data.

        Raises:
            MbltRequestError: pooling requests, ``prompt_logprob_token_ids`` or
                ``thinking_token_budget`` (each named), prompt embeddings for a VLM or ASR
                release (:data:`PROMPT_EMBEDS_MM_REFUSAL`). Prompt logprobs
                (:mod:`vllm_npu.prompt_logprobs`) and prompt embeddings of a text or MoE
                release (the MXQ takes embeddings from the host) are served.
        """
        if cls._eagle3_engine():
            cls._validate_eagle3(processed_inputs, params)
            return
        if isinstance(processed_inputs, dict) and processed_inputs.get("prompt_embeds") is not None:
            if cls._serving_vlm is not None or cls._serving_asr:
                raise MbltRequestError(PROMPT_EMBEDS_MM_REFUSAL, parameter="prompt_embeds")
        refuse_unsampled(processed_inputs, params, worker="MBLT worker", error=MbltRequestError,
                         serves_prompt_embeds=True)
        if cls._serving_vlm is not None:
            cls._validate_vlm(processed_inputs, params)

    @classmethod
    def _validate_vlm(cls, processed_inputs: Any, params: Any) -> None:
        """A VLM release's per-request rules, answered with HTTP 400 (the worker checks the same
        again): static vision takes exactly one image and no video, and a session keeps its image at
        one token position (:class:`vllm_npu.mblt.vlm.SessionImagePositions`: the session is the
        client's ``vllm_xargs.session_id``); dynamic Qwen3-VL takes images and videos, each encoder
        call at most :data:`vllm_npu.mblt.vlm.MAX_VISION_PATCHES` pre-merge patches.

        Raises:
            MbltRequestError: the seed's text of the broken rule (``parameter`` ``multi_modal_data``).
        """
        from vllm_npu.mblt import vlm

        if not isinstance(processed_inputs, dict) or cls._serving_vlm is None:
            return
        placeholders = processed_inputs.get("mm_placeholders") or {}
        modalities = [m for m, ranges in placeholders.items() for _ in (ranges or ())]
        _family, multi_item = cls._serving_vlm
        try:
            vlm.check_request_rules(modalities, dynamic=multi_item)
            if multi_item:
                for modality, items in (processed_inputs.get("mm_kwargs") or {}).items():
                    key = "video_grid_thw" if modality == "video" else "image_grid_thw"
                    for item in items or ():
                        if item is not None and key in item:
                            vlm.check_vision_patches(modality, vlm._np(item[key]).reshape(-1, 3).tolist())
            elif modalities:
                if cls._vlm_sessions is None:
                    cls._vlm_sessions = vlm.SessionImagePositions()
                cls._vlm_sessions.check(vlm.session_id_of(params), vlm.image_signature(placeholders["image"][0]))
        except vlm.VlmRuleError as exc:
            raise MbltRequestError(str(exc), parameter="multi_modal_data") from None

    @staticmethod
    def _validate_eagle3(processed_inputs: Any, params: Any) -> None:
        """Raises: MbltRequestError: as :meth:`validate_request` says for EAGLE-3 (``parameter`` is
        the first refused one)."""
        from vllm.sampling_params import SamplingParams

        if not isinstance(params, SamplingParams):
            raise MbltRequestError("EAGLE-3 models serve text generation only (no pooling requests)")
        if isinstance(processed_inputs, dict) and (
                processed_inputs.get("type") in ("embeds", "multimodal")
                or processed_inputs.get("prompt_embeds") is not None or processed_inputs.get("mm_kwargs")):
            raise MbltRequestError(EAGLE3_PROMPT_REFUSAL, parameter="prompt_embeds"
                                   if processed_inputs.get("type") == "embeds"
                                   or processed_inputs.get("prompt_embeds") is not None else "multi_modal_data")
        refused = _eagle3_refusals(params)
        if refused:
            raise MbltRequestError(EAGLE3_REQUEST_REFUSAL.format(names=", ".join(refused)), parameter=refused[0])

    @classmethod
    def log_warnings(cls) -> None:
        target = os.environ.get("NPU_HARNESS_TARGET", "")
        logger.info("MBLT platform active (NPU_HARNESS_TARGET=%s)", target)
