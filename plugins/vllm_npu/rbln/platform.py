"""The RBLN vLLM platform: model-path choice, ``--rbln-*`` options, the compile cache and the
scheduler plan, then the worker of the path (:class:`vllm_npu.rbln.worker.RblnOptimumWorker`,
or :class:`vllm_npu.rbln.vllm_worker.RblnVllmWorker` for the ``vllm`` path).

Activated by the ``vllm.platform_plugins`` entry point ``rbln`` when ``NPU_HARNESS_TARGET`` is
``rbln-sim`` or ``rbln-hw``. What every NPU platform shares (vLLM's CPU kernels chosen for this
CPU, the worker hook, eager and synchronous steps) is in :class:`vllm_npu._platform.NpuPlatform`.
:meth:`RblnPlatform.configure`:

1. resolves the model path (:mod:`vllm_npu.rbln.model_impl`: ``auto`` takes ``optimum`` for a
   compiled directory or an architecture optimum-rbln implements) and refuses the ``vllm``
   path on ATOM (:func:`~vllm_npu.rbln.model_impl.reject_disabled`);
2. resolves the path's ``--rbln-*`` options (:mod:`vllm_npu.rbln.options`), rejecting the
   other path's;
3. finds the compiled model: the model directory itself, else the compile-cache entry of this
   configuration (``$VLLM_CACHE_ROOT/compiled_models/<name>_<key>``), else plans a compile
   into that entry (the worker runs it);
4. sizes the scheduler from the compiled model (:mod:`vllm_npu.rbln.compile_plan`) and hands
   the worker its plan in ``additional_config``.

On the ``vllm`` path, steps 2-4 are :meth:`RblnPlatform._configure_vllm_path` instead (its
rules: :mod:`vllm_npu.rbln.vllm_path`), and the platform answers vLLM's attention layers with
:class:`vllm_npu.rbln.attention.RblnAttentionBackend` as one opaque operator per layer.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, ClassVar

from vllm_npu.vllm_version import require_supported_vllm

require_supported_vllm("rbln")  # before any vLLM import: another vLLM is refused by name

from vllm_npu._platform import NpuPlatform, refuse_unsampled

logger = logging.getLogger("vllm.vllm_npu.rbln")

WORKER_CLS = "vllm_npu.rbln.worker.RblnOptimumWorker"
#: The worker of the ``vllm`` model path (vLLM's own model code compiled with ``rbln_backend``).
VLLM_WORKER_CLS = "vllm_npu.rbln.vllm_worker.RblnVllmWorker"


def _refuse_unbuilt(arch: str, category: str | None) -> None:
    """The optimum path here serves decoder-only generation models.

    Raises:
        NotImplementedError: Whisper (encoder-decoder; the seed's ``audio`` extra and
            ``/v1/audio/transcriptions``), multimodal and pooling architectures, naming the
            issue.
    """
    if category in (None, "decoder-only"):
        return
    what = {"encoder-decoder": "Whisper speech recognition (encoder-decoder, the `audio` extra)",
            "multimodal": "multimodal models", "pooling": "pooling (embedding/reranker) models"}[category]
    raise NotImplementedError(f"{arch}: {what} on the RBLN optimum path are not built yet (issue 16); "
                              "decoder-only generation models are")


class RblnConfigError(ValueError):
    """The vLLM settings cannot run on this RBLN configuration (names the value and rule)."""


def _versions(rebel: Any) -> tuple[str, str]:
    import importlib.metadata as md

    compiler = getattr(rebel, "SIMULATOR", None) or f"rebel-compiler {getattr(rebel, '__version__', '?')}"
    try:
        optimum = md.version("optimum-rbln")
    except md.PackageNotFoundError:
        optimum = "absent"
    return compiler, optimum


class RblnPlatform(NpuPlatform):
    """Out-of-tree platform for Rebellions NPUs (see the module docstring)."""

    worker_cls = WORKER_CLS
    npu_name = "rbln"
    device_control_env_var: str = "RBLN_VISIBLE_DEVICES"
    #: The worker takes ``prompt_embeds`` (set by :meth:`configure`: the optimum path compiled
    #: with ``use_inputs_embeds`` under ``--enable-prompt-embeds``).
    _prompt_embeds: ClassVar[bool] = False

    @classmethod
    def pre_register_and_update(cls, parser: Any = None) -> None:
        """Add the ``--rbln-*`` flags (group ``RBLNConfig``) to ``vllm serve``'s parser."""
        super().pre_register_and_update(parser)
        if parser is None:
            return
        from vllm_npu.rbln import options

        options.add_cli_args(parser)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        from vllm_npu.rbln.runtime import load_rebel

        load_rebel().manual_seed(seed)

    @classmethod
    def configure(cls, vllm_config: Any) -> None:
        """Steps 1-4 of the module docstring.

        Raises:
            vllm_npu.rbln.model_impl.ModelImplError / ModelPathDisabledError: a bad or
                disabled ``--model-impl`` (the reference's messages).
            vllm_npu.rbln.options.RBLNConfigError: foreign or bad ``--rbln-*`` options.
            vllm_npu.rbln.compile_plan.CompilePlanError: settings the compiled model or the
                compile cannot take.
            RblnConfigError: tensor parallelism, speculative decoding or pipeline parallelism.
            vllm_npu.rbln.vllm_path.VllmPathError: settings the ``vllm`` model path cannot run.
        """
        from vllm_npu.rbln import compile_plan as cp
        from vllm_npu.rbln import device, engine_args, model_impl, options
        from vllm_npu.rbln.runtime import load_rebel
        from vllm_npu.rbln.worker import PLAN_KEY

        mc, sched, cache = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.cache_config
        flag, user_tokens = engine_args.captured()
        extra = vllm_config.additional_config
        if isinstance(extra, dict) and isinstance(extra.get(PLAN_KEY), dict):
            # Configured already (the API server's config, passed on to the engine process):
            # the plan and the settings it made stand; configuring again would read them back
            # as the user's (the KV block becomes the prefix-cache sub-block).
            if extra[PLAN_KEY].get("impl") == "vllm":
                vllm_config.parallel_config.worker_cls = VLLM_WORKER_CLS
            cls._prompt_embeds = bool(extra[PLAN_KEY].get("prompt_embeds"))
            return
        extra = dict(extra) if isinstance(extra, dict) else extra
        res = model_impl.resolve_model_impl(flag, extra, os.environ, mc.model)
        logger.info("RBLN model path: %s (%s)", res.impl, res.log)
        rebel = load_rebel()
        try:
            name = device.device_name(rebel)
        except device.NpuNameUnavailableError:
            name = None
        model_impl.reject_disabled(res, name)
        if res.impl == "vllm":
            cls._prompt_embeds = False  # vLLM's model code on the vllm path takes token ids only
            cls._configure_vllm_path(vllm_config, extra, name)
            return
        opts, _warnings = options.resolve(options.OptimumRBLNConfig, extra)
        par = vllm_config.parallel_config
        if par.tensor_parallel_size > 1:
            raise RblnConfigError(
                "Cannot set tensor_parallel_size on the optimum model path. Use "
                "--rbln-num-devices-per-local-rank to compile the model with RSD, or set "
                "--model-impl vllm.")
        if par.pipeline_parallel_size > 1:
            raise RblnConfigError("pipeline_parallel_size must be 1 on the optimum model path")
        if vllm_config.speculative_config is not None:
            raise RblnConfigError("speculative decoding is not supported on the optimum model path")
        if getattr(vllm_config, "kv_transfer_config", None) is not None:
            raise NotImplementedError(
                "KV cache offloading and disaggregated prefill/decode (vllm-rbln's kv_connectors "
                "extra: nixl-rbln, lmcache-rbln) are not built in the RBLN plugin (issue 16)")

        user_block = cache.block_size if cache.user_specified_block_size else None
        compiled = mc.model if model_impl.is_compiled_dir(mc.model) else None
        # --enable-prompt-embeds: optimum-rbln compiles the graphs to take inputs_embeds (its
        # use_inputs_embeds; token ids are then embedded on the host by its embed_tokens)
        embeds = bool(getattr(mc, "enable_prompt_embeds", False))
        overrides = dict(opts.optimum_overrides or {})
        if embeds:
            if overrides.get("use_inputs_embeds", True) is not True:
                raise RblnConfigError(
                    f"--enable-prompt-embeds needs the model compiled with use_inputs_embeds, but the rbln_config "
                    f"override sets use_inputs_embeds={overrides['use_inputs_embeds']!r}")
            overrides["use_inputs_embeds"] = True
        compile_cfg = None
        if compiled is None:
            if name is None:
                raise device.NpuNameUnavailableError(
                    "Could not determine the RBLN NPU name (rebel.get_npu_name(0) returned None). "
                    "On a host without an NPU mounted (e.g., a CPU-only compile worker running with "
                    "VLLM_RBLN_COMPILE_ONLY=1), set RBLN_FORCE_NPU_NAME to the target NPU (e.g., "
                    "RBLN-CA25) so compilation can target it.")
            compiler, optimum = _versions(rebel)
            key = options.cache_key(
                model_name=str(mc.model), batch_size=int(sched.max_num_seqs), block_size=user_block,
                max_model_len=int(mc.max_model_len), num_devices=opts.num_devices_per_local_rank,
                dtype=mc.dtype, max_num_batched_tokens=user_tokens,
                memory_budget=float(cache.gpu_memory_utilization), optimum_overrides=overrides,
                compiler_version=compiler, optimum_rbln_version=optimum)
            from vllm import envs

            cached = options.cached_model_path(envs.VLLM_CACHE_ROOT, key)
            if model_impl.is_compiled_dir(cached):
                logger.info("Found cached compiled model at %s", cached)
                compiled = cached
            else:
                compile_cfg = cp.rbln_config_for(
                    max_num_seqs=int(sched.max_num_seqs), max_model_len=int(mc.max_model_len),
                    block_size=user_block, num_devices=opts.num_devices_per_local_rank,
                    prefill_chunk_size=device.prefill_chunk_size(name), npu=name,
                    overrides=overrides)
                logger.info("RBLN compile cache: no entry at %s; the worker compiles it (key %s)",
                            cached, dict(key.factors))
        if compiled is not None:
            spec = cp.CompiledModelSpec.from_dir(compiled)
            if embeds and not spec.use_inputs_embeds:
                raise RblnConfigError(
                    f"--enable-prompt-embeds: the compiled model {compiled} takes token ids only (compiled "
                    "without use_inputs_embeds); compile it with use_inputs_embeds, or serve without "
                    "--enable-prompt-embeds")
            splan = cp.scheduler_plan(spec, user_max_num_batched_tokens=user_tokens,
                                      user_block_size=user_block)
            model_class = spec.model_class
            if int(mc.max_model_len) > spec.max_seq_len:
                raise cp.CompilePlanError(
                    f"--max-model-len {mc.max_model_len} exceeds the compiled max_seq_len {spec.max_seq_len} "
                    f"of {compiled}; pass --max-model-len {spec.max_seq_len} or lower")
            max_num_seqs, block, chunk = splan.max_num_seqs, splan.block_size, splan.max_num_batched_tokens
            cache.num_gpu_blocks_override = splan.num_gpu_blocks
        else:
            from vllm_npu.rbln import architectures

            archs = list(getattr(mc.hf_config, "architectures", None) or [])
            arch = architectures.require_supported(archs)
            model_class = architectures.optimum_class_for(arch)
            _refuse_unbuilt(arch, architectures.optimum_category(arch))
            max_num_seqs, block, chunk = int(sched.max_num_seqs), int(user_block), int(compile_cfg["prefill_chunk_size"])
            cached_target = cached
        if user_tokens is not None and compiled is None and user_tokens != chunk:
            raise cp.CompilePlanError(
                f"--max-num-batched-tokens {user_tokens} must equal the prefill chunk {chunk} of "
                f"{name} (one prefill chunk per step on the optimum path)")
        prefix = None
        if cache.enable_prefix_caching:
            sub = opts.sub_block_size or chunk
            if block % sub or sub % chunk and not (name and device.is_cr13(name)):
                raise RblnConfigError(
                    f"sub_block_size {sub} must divide the KV block {block} and be a multiple of the "
                    f"prefill chunk {chunk}: a sub_block_size below max_num_batched_tokens needs the "
                    f"multi-block store that only REBEL CR13 carries; this is {name}")
            prefix = {"sub_block_size": sub}
            cache.block_size = sub
            if compiled is not None:
                cache.num_gpu_blocks_override = (splan.num_gpu_blocks - 1) * (block // sub) + 1
            logger.info("RBLN prefix caching: hits of %d tokens, device KV blocks of %d; reused "
                        "prefixes are copied with the runtime's KV block copy", sub, block)
        else:
            cache.block_size = block
        sched.max_num_seqs = max_num_seqs
        sched.enable_chunked_prefill = True
        sched.max_num_batched_tokens = max(chunk, max_num_seqs)
        sched.long_prefill_token_threshold = chunk
        if getattr(sched, "max_num_scheduled_tokens", None) is not None:
            sched.max_num_scheduled_tokens = min(sched.max_num_scheduled_tokens, sched.max_num_batched_tokens)
        plan = {
            "model_class": model_class,
            "compile": compiled is None,
            "source": str(mc.model),
            "compiled_dir": str(compiled if compiled is not None else cached_target),
            "rbln_config": compile_cfg or {},
            "runtime_config": {k: v for k, v in (opts.optimum_overrides or {}).items() if k == "device"},
            "npu": name,
            "attn_block_size": block,
            "prefix": prefix,
            "prompt_embeds": embeds,
        }
        cls._prompt_embeds = embeds
        resolved = {k: v for k, v in vars(opts).items() if v is not None}
        vllm_config.additional_config = {**resolved, PLAN_KEY: plan}
        logger.info("RBLN platform: %s on %s, model %s (%s), max_num_seqs %d, block_size %d, "
                    "prefill chunk %d", res.impl, name, plan["compiled_dir"], model_class, max_num_seqs,
                    block, chunk)

    @classmethod
    def _configure_vllm_path(cls, vllm_config: Any, extra: Any, name: str | None) -> None:
        """The ``vllm`` model path: vLLM's own model code, compiled with ``rbln_backend`` by
        :class:`vllm_npu.rbln.vllm_worker.RblnVllmWorker` (rules: :mod:`vllm_npu.rbln.vllm_path`).

        Raises:
            vllm_npu.rbln.options.RBLNConfigError: foreign or bad ``--rbln-*`` options.
            vllm_npu.rbln.vllm_path.VllmPathError: LoRA, chunked prefill off, parallelism or
                speculative decoding, bad buckets, a KV cache that does not fit the part.
            vllm_npu.rbln.device.NpuNameUnavailableError: no NPU name to compile for.
        """
        import math

        import torch

        from vllm_npu.rbln import device, engine_args, options, vllm_path
        from vllm_npu.rbln.worker import PLAN_KEY

        mc, sched, cache = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.cache_config
        opts, _warnings = options.resolve(options.RBLNConfig, extra)
        if name is None:
            raise device.NpuNameUnavailableError(
                "Could not determine the RBLN NPU name (rebel.get_npu_name(0) returned None). Set "
                "RBLN_FORCE_NPU_NAME to the target NPU (e.g., RBLN-CR13) so compilation can target it.")
        from vllm_npu.rbln import model_impl

        if model_impl.is_compiled_dir(mc.model):
            raise vllm_path.VllmPathError(
                f"--model-impl vllm cannot serve {mc.model}: it holds a compiled optimum-rbln artifact "
                "(rbln_config.json), which only the optimum model path loads; pass the Hugging Face "
                "checkpoint, or --model-impl optimum")
        if vllm_config.lora_config is not None:
            raise vllm_path.VllmPathError(vllm_path.LORA)
        if sched.enable_chunked_prefill is False:
            raise vllm_path.VllmPathError(vllm_path.CHUNKED_PREFILL_OFF)
        par = vllm_config.parallel_config
        for what, size in (("tensor_parallel_size", par.tensor_parallel_size),
                           ("pipeline_parallel_size", par.pipeline_parallel_size)):
            if size > 1:
                raise vllm_path.VllmPathError(
                    f"{what} {size}: the RBLN plugin's vllm model path runs one NPU per engine "
                    "(several devices per rank are not built)")
        if vllm_config.speculative_config is not None:
            raise vllm_path.VllmPathError("speculative decoding is not built on the RBLN vllm model path")
        if getattr(vllm_config, "kv_transfer_config", None) is not None:
            raise NotImplementedError(
                "KV cache offloading and disaggregated prefill/decode (vllm-rbln's kv_connectors "
                "extra: nixl-rbln, lmcache-rbln) are not built in the RBLN plugin (issue 16)")
        if opts.enforce_model_fp32 or mc.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            mc.dtype = torch.float32
        _flag, user_tokens = engine_args.captured()
        chunk = int(user_tokens) if user_tokens else device.prefill_chunk_size(name)
        user_block = int(cache.block_size) if cache.user_specified_block_size else None
        prefix = bool(cache.enable_prefix_caching)
        if prefix:
            # vLLM's own prefix caching: a hit is whole blocks, so the KV block is the
            # prefix-cache sub-block (sub_block_size, default the prefill chunk).
            sub = opts.sub_block_size or user_block or chunk
            if user_block is not None and opts.sub_block_size and user_block != opts.sub_block_size:
                raise vllm_path.VllmPathError(
                    f"--rbln-sub-block-size {opts.sub_block_size} must equal --block-size {user_block} on "
                    "the vllm model path (a prefix-cache hit is whole KV blocks there)")
            if sub < chunk and not device.is_cr13(name):
                raise vllm_path.VllmPathError(
                    f"sub_block_size {sub} is below max_num_batched_tokens {chunk}: a sub_block_size below "
                    f"max_num_batched_tokens needs the multi-block store that only REBEL CR13 carries; this "
                    f"is {name}")
            block = sub
        else:
            block = user_block or min(int(mc.max_model_len), 1024)
        max_num_seqs = int(sched.max_num_seqs)
        buckets = vllm_path.decode_buckets(
            max_num_seqs, opts.decode_batch_bucket_strategy, opts.decode_batch_bucket_min,
            opts.decode_batch_bucket_step, opts.decode_batch_bucket_limit, opts.decode_batch_bucket_manual_buckets)
        hf = mc.hf_text_config
        heads = int(hf.num_attention_heads)
        head_size = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
        weights = sum(p.stat().st_size for p in Path(mc.model).glob("*.safetensors")) if Path(mc.model).is_dir() else 0
        kv = vllm_path.kv_plan(
            npu=name, max_num_seqs=max_num_seqs, max_model_len=int(mc.max_model_len), block_size=block,
            num_layers=int(hf.num_hidden_layers), num_kv_heads=int(getattr(hf, "num_key_value_heads", heads)),
            head_size=head_size, dtype_bytes=torch.tensor([], dtype=mc.dtype).element_size(),
            weight_bytes=weights, memory_utilization=float(cache.gpu_memory_utilization),
            override=cache.num_gpu_blocks_override)
        if prefix:
            logger.info("RBLN prefix caching (vllm model path): hits of whole %d-token KV blocks, read in "
                        "place from vLLM's shared blocks", block)
        cache.block_size = block
        cache.num_gpu_blocks_override = kv.num_blocks
        sched.enable_chunked_prefill = True
        sched.max_num_batched_tokens = max(chunk, max_num_seqs)
        sched.long_prefill_token_threshold = chunk
        if getattr(sched, "max_num_scheduled_tokens", None) is not None:
            sched.max_num_scheduled_tokens = min(sched.max_num_scheduled_tokens, sched.max_num_batched_tokens)
        vllm_config.parallel_config.worker_cls = VLLM_WORKER_CLS
        plan = {
            "impl": "vllm", "npu": name, "chunk": chunk, "decode_buckets": buckets, "block_size": block,
            "max_num_seqs": max_num_seqs,
            "max_seq_len": math.ceil(int(mc.max_model_len) / block) * block, "num_blocks": kv.num_blocks,
            "num_devices": opts.num_devices_per_local_rank, "prefix_caching": prefix,
        }
        resolved = {k: v for k, v in vars(opts).items() if v is not None}
        vllm_config.additional_config = {**resolved, PLAN_KEY: plan}
        logger.info("RBLN platform: vllm model path on %s, model %s, max_num_seqs %d, block_size %d, "
                    "prefill chunk %d, decode buckets %s, %d KV blocks (%d bytes each)", name, mc.model,
                    max_num_seqs, block, chunk, buckets, kv.num_blocks, kv.block_bytes)

    @classmethod
    def get_attn_backend_cls(cls, selected_backend: Any, attn_selector_config: Any, num_heads: Any = None) -> str:
        """The RBLN attention backend (:mod:`vllm_npu.rbln.attention`), for vLLM's own model
        code on the ``vllm`` model path (the optimum path builds no attention layers).

        Raises:
            NotImplementedError: MLA or sparse attention (their RBLN kernels are not built).
        """
        from vllm_npu.rbln import attention

        for what in ("use_mla", "use_sparse"):
            if getattr(attn_selector_config, what, False):
                raise NotImplementedError(
                    f"{what.removeprefix('use_').upper()} attention on the RBLN vllm model path is not built "
                    "(issue 16): the RBLN attention backend runs standard decoder attention")

        attention.register()
        return attention.BACKEND_PATH

    @classmethod
    def opaque_attention_op(cls) -> bool:
        """Attention is one opaque operator per layer in the graph the compiler sees."""
        return True

    @classmethod
    def validate_request(cls, processed_inputs: Any, params: Any) -> None:
        """Refuse what the optimum worker would otherwise ignore (vLLM answers HTTP 400).

        Raises:
            RblnRequestError: what :func:`vllm_npu._platform.refuse_unsampled` refuses (pooling
                requests, prompt embeddings, ``prompt_logprob_token_ids``, a thinking budget;
                each named).
        """
        from vllm_npu.rbln.errors import RblnRequestError

        # prompt embeddings: served when the model is compiled to take inputs_embeds
        # (--enable-prompt-embeds on the optimum path), refused by name otherwise
        refuse_unsampled(processed_inputs, params, worker="RBLN optimum worker", error=RblnRequestError,
                         serves_prompt_embeds=bool(getattr(cls, "_prompt_embeds", False)))

    @classmethod
    def log_warnings(cls) -> None:
        logger.info("RBLN platform active (NPU_HARNESS_TARGET=%s)", os.environ.get("NPU_HARNESS_TARGET", ""))
