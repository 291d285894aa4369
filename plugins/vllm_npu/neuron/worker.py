"""The Neuron vLLM worker: one NEFF per bucket, compiled at warm-up, executed per step.

The device is reached only through the runtime seam (:mod:`vllm_npu.neuron.runtime`:
``npusim.neff`` on ``neuron-sim``, ``nrtpy`` on ``neuron-hw``). vLLM's engine calls, in order:

1. ``init_device`` / ``load_model``: the runtime, the device (Trn2/Trn3, HBM per logical core),
   the model's resident bytes (its weight files), the ``model_load_*`` metrics;
2. ``get_kv_cache_spec`` / ``determine_available_memory``: one full-attention KV spec per
   layer at the model's KV dtype (``fp8`` halves it), and the KV budget of
   :func:`vllm_npu.neuron.memory.compute_kv_budget` against the core's HBM; vLLM turns it into
   ``available // page_bytes`` blocks (or ``--num-gpu-blocks-override``);
3. ``initialize_from_config``: the device-resident KV tensor of that many blocks;
4. ``compile_or_warm_up_model``: one NEFF per compile target of the plan, from
   ``NEURON_COMPILED_ARTIFACTS``, the compile cache, or compiled now
   (:mod:`vllm_npu.neuron.compile_cache`), each loaded with the vendor's warm-up log lines;
5. ``execute_model`` once per step. The scheduler (:mod:`vllm_npu.neuron.scheduler`) hands
   either one prefill (padded to ``num_scheduled_tokens_padded``: one segment of a long
   prompt, or a whole prompt) or a decode of every running request, which the worker pads
   to the smallest decode batch bucket (and context-length bucket). A step that mixes the two
   is the vendor's ``RuntimeError``. A shape with no NEFF is the ``fail_on_recompile`` error.

Sampling is on the device (the NEFF's ``tokens`` output, from the host's uniforms) unless
``on_device_sampling_config`` is null, when vLLM's sampler runs on the host
(:mod:`vllm_npu.host_sampling`). A NEFF execution that fails with an NRT error is retried once (it
rewrites the same KV slots); a second failure is :class:`NeuronDeviceError` and the engine stops
(:class:`vllm_npu.device_retry.DeviceRetry`; any other error propagates as itself).
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_npu._worker import NpuWorker
from vllm_npu.device_retry import DeviceRetry
from vllm_npu.neuron import compile_cache as cc
from vllm_npu.neuron.errors import NeuronDeviceError, NeuronWorkerError
from vllm_npu.neuron.runtime import compiler_of, load_runtime
from vllm_npu.step_engine import Request, RunnerHooks, StepEngine, StepPlan, StepResult

logger = logging.getLogger("vllm.vllm_npu.neuron")

#: ``additional_config`` key the platform hands the plan to the worker and scheduler under.
PLAN_KEY = "npu_harness_neuron_plan"
MIXED_BATCH_ERROR = ("Neuron constraint violated: Mixed prefill ({p}) and decode ({d}) in the same batch. "
                     "This indicates a bug in the scheduling logic.")
#: How often (decode steps) the async-flow counters are logged.
ASYNC_LOG_EVERY = 64


def recompile_error(name: str, tensor: str, expected: int, actual: int) -> RuntimeError:
    """The ``fail_on_recompile`` error of a shape no NEFF was compiled for (reference §10.5)."""
    return RuntimeError(
        "Detected recompile when torch.compile stance is 'fail_on_recompile'. filename: "
        f"'vllm_npu/neuron/worker.py', function name: '{name}', line number: 0\n"
        "    triggered by the following guard failure(s):\n"
        f"    - 0/0: tensor '{tensor}' size mismatch at index 0. expected {expected}, actual {actual}")


def _process_age_s() -> float:
    """Seconds since this (engine) process started, from ``/proc`` (the time since the worker
    was built where ``/proc`` is absent)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED_AT


_IMPORTED_AT = time.perf_counter()


def device_retry(runtime: Any) -> DeviceRetry:
    """Neuron's retry policy: the runtime's NRT status errors (``NrtError``: ``NRT_FAILURE``...)
    are device errors; ``NrtpyError``, a misuse of the binding (a wrong shape or dtype), is a bug
    and propagates as itself (:mod:`vllm_npu.device_retry`)."""
    return DeviceRetry("Neuron", (runtime.NrtError,), NeuronDeviceError)


class NeuronWorker(RunnerHooks, NpuWorker):
    """vLLM worker executing NEFFs through the Neuron runtime seam (module docstring); the
    device runner of its own :class:`~vllm_npu.step_engine.StepEngine` (plain request records)."""

    npu_name = "Neuron"

    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False) -> None:
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.plan = self.platform_plan(vllm_config, PLAN_KEY, NeuronWorkerError, "Neuron")
        self.target = self.plan["target"]
        self.nrt: Any = None
        self.device_info: Any = None
        self.neffs: dict[str, Any] = {}
        self.kv: Any = None
        # its output builder is set with CPU sampling
        self._vocab = int(self.model_config.get_vocab_size())
        #: request id -> its prompt embeddings (vllm_npu.prompt_embeds.PromptEmbeds)
        self._embeds: dict[str, Any] = {}
        self.engine = StepEngine(self, vocab_size=self._vocab)
        self.sampler: Any = None
        self.metrics: Any = None
        self._rng = np.random.default_rng(int(vllm_config.model_config.seed or 0))
        self._prev_ids: list[str] | None = None
        self.stats = {"steps": 0, "prefills": 0, "decodes": 0, "retries": 0, "padded_rows": 0,
                      "padded_tokens": 0, "async_steps": 0, "sync_fallback_steps": 0, "prompt_logprob_microsteps": 0}

    # ------------------------------------------------------------------ lifecycle

    def init_device(self) -> None:
        from vllm.utils.torch_utils import set_torch_threads_for_runtime

        from vllm_npu.host_threads import limit_host_blas_threads

        self.device = torch.device("cpu")
        set_torch_threads_for_runtime()
        # the simulated NEFFs compute in numpy: an OpenBLAS pool at the core count spin-waits
        # between calls and steals the cores the step needs (see vllm_npu.host_threads)
        limited = limit_host_blas_threads(1)
        if limited:
            logger.info("Neuron worker: host OpenBLAS set to 1 thread (%s)", ", ".join(map(os.path.basename, limited)))
        self.nrt = load_runtime(self.target)
        self.retry = device_retry(self.nrt)
        self.device_info = self.nrt.device_info()

    def load_model(self, *, load_dummy_weights: bool = False) -> None:  # noqa: ARG002
        """The model's resident bytes and the load metrics (the weights go to the device with
        each NEFF)."""
        from vllm_npu.neuron.metrics import NeuronMetrics

        self.metrics = NeuronMetrics(self.plan["model_name"], rank_id=int(self.local_rank))
        self.metrics.precreate(self.plan["prefill_names"], self.plan["decode_names"])
        from vllm_npu.host_sampling import HostSampler

        self.sampler = HostSampler(self._vocab, log=logger, vllm_config=self.vllm_config)
        if self.plan["on_device_sampling"]:  # the host sampler only computes the tokens' logprobs
            self.engine.logprobs_sampler = self.sampler
        else:
            from vllm_npu.step_output import StepOutputs

            self.engine.outputs = StepOutputs(self.sampler)
        logger.info("Neuron model %s: %d weight bytes on %s (%d logical cores, %.1f GiB HBM each), "
                    "%s sampling, Model Runner %s", self.plan["model_name"], self.plan["model_weight_bytes"],
                    self.device_info.target, self.device_info.logical_cores,
                    self.device_info.hbm_bytes_per_logical_core / 2**30,
                    "on-device" if self.plan["on_device_sampling"] else "CPU",
                    "V2" if self.plan["runner"]["use_v2"] else "V1")
        if self.plan["runner"]["use_v2"]:
            logger.info("Using the standalone V2 Neuron model runner.")

    def get_kv_cache_spec(self) -> dict[str, Any]:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        g = self.plan["geometry"]
        dtype = torch.float8_e4m3fn if self.plan["kv_dtype"] == "fp8_e4m3" else self.model_config.dtype
        spec = FullAttentionSpec(block_size=int(self.plan["block_size"]), num_kv_heads=int(g["num_kv_heads"]),
                                 head_size=int(g["head_dim"]), dtype=dtype)
        return {f"model.layers.{i}.self_attn": spec for i in range(int(g["num_layers"]))}

    def determine_available_memory(self) -> int:
        """The KV budget in bytes (:func:`vllm_npu.neuron.memory.compute_kv_budget`).

        Raises:
            RuntimeError: the budget is below ``VLLM_NEURON_MIN_KV_BUDGET_GIB`` (the vendor's text).
        """
        from vllm_npu.neuron import memory

        budget = memory.compute_kv_budget(
            logical_core_hbm_bytes=int(self.device_info.hbm_bytes_per_logical_core),
            model_weight_bytes=int(self.plan["model_weight_bytes"]),
            gpu_memory_utilization=float(self.cache_config.gpu_memory_utilization), env=os.environ)
        logger.info("Neuron KV budget: %.3f GiB (%s)", budget.available_bytes / 2**30, budget.mode)
        return int(budget.available_bytes)

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        """Allocate the device-resident KV tensor of ``kv_cache_config.num_blocks`` blocks."""
        self.kv_cache_config = kv_cache_config
        self.num_blocks = int(kv_cache_config.num_blocks)
        shape = self.nrt.kv_cache_shape(self.plan["model_dir"], self.num_blocks, int(self.plan["block_size"]))
        self.kv = self.nrt.NrtpyTensor.from_numpy(np.zeros(shape, np.float32), name="kv_cache", core_id=0)
        logger.info("Neuron KV cache: %d blocks of %d tokens (%s), shape %s", self.num_blocks,
                    self.plan["block_size"], self.plan["kv_dtype"], tuple(shape))

    def get_cache_block_size_bytes(self) -> int:
        return next(iter(self.get_kv_cache_spec().values())).page_size_bytes

    def compile_or_warm_up_model(self):
        """Every NEFF of the plan: loaded from ``NEURON_COMPILED_ARTIFACTS`` or the compile
        cache, else compiled now (module docstring, step 4).

        Raises:
            vllm_npu.neuron.compile_cache.WarmupCompileDisabledError: a miss with compiling off.
            NotImplementedError: a miss on ``neuron-hw`` (issue 11).
            whatever the compiler raises (``NCC_EOOM001`` ...).
        """
        from vllm import envs
        from vllm.v1.worker.worker_base import CompilationTimes

        t0 = time.perf_counter()
        targets = self.plan["compile_targets"]
        fields = [self._spec_fields(t) for t in targets]
        names = list(self.plan["compile_target_names"])
        fingerprint = cc.model_fingerprint(self.plan["model_dir"])
        platform_target = self.device_info.target
        keys = [cc.cache_key(f, model_fingerprint=fingerprint, platform_target=platform_target,
                             compiler_version=self.nrt.COMPILER_VERSION) for f in fields]
        cfg_hash = cc.config_hash(keys)
        cache = cc.CompileCache.from_env(envs.VLLM_CACHE_ROOT)
        art_dir = os.environ.get("NEURON_COMPILED_ARTIFACTS", "").strip()
        artifacts = cc.CompiledArtifacts(Path(art_dir)) if art_dir else None
        from_artifacts = artifacts.load(cfg_hash) if artifacts else None
        n_prefill = sum(1 for t in targets if t["kind"] == "prefill")
        logger.info("Warming up model for %s num_batched_tokens_buckets: %s", n_prefill,
                    self.plan["num_batched_tokens_buckets"])
        paths: dict[str, Path] = {}
        compiled = cached = 0
        simulated_s = 0.0
        for i, (t, f, name, key) in enumerate(zip(targets, fields, names, keys), 1):
            if t["kind"] == "prefill":
                logger.info("[%s/%s] Warming up for prefill: bucket_size=%s, kv_segment_size=%s", i, len(targets),
                            t["tokens"], t["kv_segment"] or None)
            else:
                logger.info("[%s/%s] Warming up decode (batch=%s, seq=%s)", i, len(targets), t["batch"], t["context"])
            if from_artifacts is not None:
                paths[name] = from_artifacts[name]
                continue
            hit = cache.lookup(key)
            if hit is not None:
                paths[name] = hit
                cached += 1
                continue
            cache.require_compile(key)
            compile_neff = compiler_of(self.target, self.nrt)
            out = Path(envs.VLLM_CACHE_ROOT) / "neuron" / "work" / f"{key}-{os.getpid()}.neff"
            out.parent.mkdir(parents=True, exist_ok=True)
            report = compile_neff(self.nrt.NeffSpec(**f), self.plan["model_dir"], str(out), target=platform_target)
            simulated_s += float(report.simulated_seconds)
            self.metrics.compiled(name, float(report.simulated_seconds))
            paths[name] = cache.store(key, out, {"name": name, "spec": f, "target": platform_target,
                                                 "compiler": self.nrt.COMPILER_VERSION})
            if paths[name] != out:
                out.unlink(missing_ok=True)
            compiled += 1
        if artifacts is not None and from_artifacts is None:
            artifacts.save(cfg_hash, paths, targets)
        t_load = time.perf_counter()
        for name, path in paths.items():  # loading a NEFF puts the model's weights on the core
            self.neffs[name] = self.nrt.NrtpyModel.load_from_neff(str(path), name=name, core_id=0)
        self.metrics.model_loaded(time.perf_counter() - t_load, int(self.plan["model_weight_bytes"]))
        source = ("NEURON_COMPILED_ARTIFACTS" if from_artifacts is not None else
                  f"compile cache ({cached} hit(s), {compiled} compiled)")
        logger.info("Model warmup completed: %s num_batched_tokens_buckets, %s num_seqs_buckets", n_prefill,
                    len(self.plan["num_seqs_buckets"]))
        logger.info("Neuron NEFFs: %d loaded from %s; simulated compile time %.2f s; warm-up took %.2f s",
                    len(paths), source, simulated_s, time.perf_counter() - t0)
        self.metrics.startup(_process_age_s())
        return CompilationTimes(language_model=simulated_s, encoder=0.0)

    def _spec_fields(self, t: dict[str, Any]) -> dict[str, Any]:
        p = self.plan
        common = {"max_model_len": int(p["max_model_len"]), "block_size": int(p["block_size"]),
                  "num_blocks": int(self.num_blocks), "kv_dtype": p["kv_dtype"],
                  "on_device_sampling": bool(p["on_device_sampling"]),
                  "logit_mask": bool(p["on_device_sampling"]),  # structured outputs' bitmask on device
                  "max_top_k": int(p["max_top_k"]), "deterministic": bool(p["deterministic"])}
        if t["kind"] == "prefill":
            return {"kind": "prefill", "tokens": int(t["tokens"]), "batch": 1, "kv_segment": int(t["kv_segment"] or 0),
                    "context": int(p["max_model_len"]), "prompt_embeds": bool(p["prompt_embeds"]), **common}
        return {"kind": "decode", "tokens": 1, "batch": int(t["batch"]), "kv_segment": 0,
                "context": int(t["context"]), **common}

    def check_health(self) -> None:
        if not self.neffs:
            raise NeuronWorkerError("no NEFF is loaded")

    def shutdown(self) -> None:
        self.neffs.clear()
        self.engine.clear()
        if self.nrt is not None:
            try:
                self.nrt.reset()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass

    # ------------------------------------------------------------------ the step

    def admit(self, new: Any) -> Request:
        """A new request's record; its prompt embeddings (``--enable-prompt-embeds``) go to the
        prefill NEFF's ``inputs_embeds`` (:mod:`vllm_npu.prompt_embeds`).

        Raises:
            vllm_npu.prompt_embeds.PromptEmbedsError: embeddings that are not ``[tokens, hidden]``.
        """
        from vllm_npu.prompt_embeds import prompt_embeds_of
        from vllm_npu.step_engine import new_request_fields

        req = Request(**new_request_fields(new))
        embeds = prompt_embeds_of(req, new, int(self.model_config.get_hidden_size()), self._vocab)
        if embeds is not None:
            self._embeds[req.req_id] = embeds
        return req

    def finish(self, req: Request) -> None:
        self._embeds.pop(req.req_id, None)

    def run_step(self, plan: StepPlan) -> StepResult:
        """One prefill (a segment of a prompt, or a whole one) or one decode of every row
        (module docstring, step 5); the NEFF's logits, and its tokens with on-device sampling.

        Raises:
            RuntimeError: a step mixing prefill and decode (the vendor's text), a shape with no
                NEFF (``fail_on_recompile``).
            NeuronDeviceError: a NEFF execution failed twice.
        """
        rows = plan.rows
        prefill = [r for r in rows if r.num_tokens > 1 or r.end < r.req.num_tokens]
        if prefill and len(rows) > 1:
            raise RuntimeError(MIXED_BATCH_ERROR.format(p=len(prefill), d=len(rows) - len(prefill)))
        masks = plan.token_masks  # the grammar bitmask of the sampling rows (on-device sampling)
        if prefill:
            r = prefill[0]
            plp = r.req.prompt_logprobs
            mask = masks[0] if masks is not None and r.samples else None
            if plp is not None and plp.needs_logits_at(r.start):
                logits, tokens = self._scored_prefill(r.req, r.start, r.end, mask)
            else:
                logits, tokens = self._prefill(r.req, r.start, r.num_tokens, plan.scheduler_output, mask=mask)
            if not r.samples:
                return StepResult()
        else:
            self._async_flow(plan.order)
            logits, tokens = self._decode([r.req for r in rows], masks)
        if not self.plan["on_device_sampling"]:
            return StepResult(logits=logits)
        return StepResult(logits=logits, tokens=[[int(t)] for t in tokens])

    # ------------------------------------------------------------------ device calls

    def _neff(self, name: str, tensor: str, want: int, largest: int) -> Any:
        neff = self.neffs.get(name)
        if neff is None:
            raise recompile_error(name, tensor, largest, want)
        return neff

    def _count_retry(self) -> None:
        """Count one NEFF execution retried (``stats["retries"]``)."""
        self.stats["retries"] += 1

    def _run(self, name: str, label: str, what: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Execute NEFF ``name`` once, retried once on an NRT error (module docstring);
        ``label`` is the ``neff_execution_count`` bucket name."""
        neff = self.neffs[name]
        feed = {k: self.nrt.NrtpyTensor.from_numpy(v, name=k) for k, v in inputs.items()}
        feed["kv_cache"] = self.kv

        def call():
            out = neff(inputs=feed)
            return {k: v.numpy() for k, v in out.items()}

        out = self.retry.call(what, call, on_retry=self._count_retry)
        self.metrics.neff_executed(label)
        return out

    def _sampling_inputs(self, rows: list[Request], n: int, masks: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The on-device sampler's inputs for ``rows`` padded to ``n``: parameters, uniforms and
        the ``logit_mask`` (``masks[i]``, the grammar's allowed tokens of row ``i``; every token
        where None, and on padding rows)."""
        from vllm_npu.neuron.sampling import on_device_row

        params = np.zeros((n, 3), np.float32)
        rand = np.zeros((n,), np.float32)
        for i, s in enumerate(rows):
            p = s.params
            params[i] = on_device_row(p.temperature, p.top_k, p.top_p, max_top_k=int(self.plan["max_top_k"]))
            if s.generator is not None:
                rand[i] = float(torch.rand(1, generator=s.generator).item())
            else:
                rand[i] = float(self._rng.random())
        logit_mask = np.ones((n, self._vocab), np.int32)
        if masks is not None:
            logit_mask[:len(masks)] = masks
        return {"sampling_params": params, "rand": rand, "logit_mask": logit_mask}

    def _slots(self, seq: Request, start: int, n: int) -> np.ndarray:
        bs = int(self.plan["block_size"])
        pos = np.arange(start, start + n)
        blocks = np.asarray(seq.blocks, np.int64)
        if len(pos) and pos[-1] // bs >= len(blocks):
            raise NeuronWorkerError(f"request {seq.req_id}: position {int(pos[-1])} has no KV block "
                                    f"({len(blocks)} blocks of {bs})")
        return (blocks[pos // bs] * bs + pos % bs).astype(np.int32)

    def _scored_prefill(self, seq: Request, start: int, end: int, mask: np.ndarray | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
        """Prefill ``seq``'s tokens ``[start, end)`` one token per NEFF call (each returns the
        logits after its token: the NEFFs give ``last_token_index``'s only), filling the
        request's prompt-logprob rows (:mod:`vllm_npu.prompt_logprobs`); the last call's
        logits and tokens. Only the last call draws the on-device sampler's uniform and takes
        the grammar's ``mask``."""
        assert seq.prompt_logprobs is not None
        logits = tokens = None
        for p in range(start, end):
            last = p == end - 1
            logits, tokens = self._prefill(seq, p, 1, None, sample=last, mask=mask if last else None)
            seq.prompt_logprobs.record(p, logits)
        self.stats["prompt_logprob_microsteps"] += end - start
        return logits, tokens

    def _prefill(self, seq: Request, start: int, n: int, so, *, sample: bool = True,
                 mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Prefill ``n`` of ``seq``'s tokens from ``start`` on the bucket's NEFF (the scheduler's
        padded count from ``so``, else the smallest bucket that holds ``n``); ``sample`` False
        draws no uniform for the on-device sampler (its token is not used); ``mask``: the
        grammar's allowed tokens (on-device sampling)."""
        padded_map = getattr(so, "num_scheduled_tokens_padded", None) or {}
        from vllm_npu.neuron.buckets import get_bucket_for_count, target_name

        buckets = self.plan["num_batched_tokens_buckets"]
        t = int(padded_map.get(seq.req_id) or get_bucket_for_count(n, buckets))
        name = target_name({"kind": "prefill", "tokens": t, "kv_segment": int(self.plan["kv_segment"] or 0)})
        self._neff(name, "input_ids", n, int(buckets[-1]))
        if n > t:
            raise recompile_error(name, "input_ids", t, n)
        ids = np.zeros(t, np.int32)
        ids[:n] = seq.all_ids[start:start + n]
        pos = np.full(t, start + n - 1, np.int32)
        pos[:n] = np.arange(start, start + n)
        slots = np.full(t, -1, np.int32)
        slots[:n] = self._slots(seq, start, n)
        max_blocks = math.ceil(int(self.plan["max_model_len"]) / int(self.plan["block_size"]))
        table = np.full(max_blocks, -1, np.int32)
        table[:len(seq.blocks)] = seq.blocks[:max_blocks]
        inputs = {"input_ids": ids, "position_ids": pos, "slot_mapping": slots, "block_table": table,
                  "last_token_index": np.array([n - 1], np.int32)}
        if self.plan["prompt_embeds"]:
            inputs.update(self._embeds_inputs(seq, start, n, t))
        if self.plan["on_device_sampling"]:
            # without ``sample``, the one row is padding: neutral parameters, no uniform drawn
            inputs.update(self._sampling_inputs([seq] if sample else [], 1, None if mask is None else mask[None]))
        out = self._run(name, name, f"prefill of {seq.req_id} ({n} tokens on {name})", inputs)
        self.stats["prefills"] += 1
        self.stats["padded_tokens"] += t - n
        return out["logits"].reshape(1, -1), out.get("tokens", np.zeros(1, np.int32)).reshape(-1)

    def _embeds_inputs(self, seq: Request, start: int, n: int, t: int) -> dict[str, np.ndarray]:
        """The prefill NEFF's ``inputs_embeds`` / ``embeds_mask`` for ``seq``'s tokens
        ``[start, start + n)`` padded to ``t`` (mask 0: the token's own embedding)."""
        hidden = int(self.model_config.get_hidden_size())
        rows = np.zeros((t, hidden), np.float32)
        mask = np.zeros(t, np.int32)
        pe = self._embeds.get(seq.req_id)
        if pe is not None:
            offsets, values = pe.window(start, n)
            rows[offsets] = values
            mask[offsets] = 1
        return {"inputs_embeds": rows, "embeds_mask": mask}

    def _decode(self, seqs: list[Request], masks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        from vllm_npu.neuron.buckets import decode_context_bucket, get_bucket_for_count, target_name

        n = len(seqs)
        b = int(get_bucket_for_count(n, self.plan["num_seqs_buckets"]))
        max_len = int(self.plan["max_model_len"])
        ctx_buckets = self.plan["decode_context_length_buckets"]
        need = max(s.num_computed + 1 for s in seqs)
        ctx = int(decode_context_bucket(need, ctx_buckets, max_len)) if ctx_buckets else max_len
        name = target_name({"kind": "decode", "batch": b, "context": ctx}, max_len)
        self._neff(name, "input_ids", n, int(self.plan["num_seqs_buckets"][-1]))
        if n > b:
            raise recompile_error(name, "input_ids", b, n)
        bs = int(self.plan["block_size"])
        width = math.ceil(ctx / bs)
        ids = np.zeros(b, np.int32)
        pos = np.zeros(b, np.int32)
        slots = np.full(b, -1, np.int32)
        table = np.full((b, width), -1, np.int32)
        for i, s in enumerate(seqs):
            ids[i] = s.all_ids[s.num_computed]
            pos[i] = s.num_computed
            slots[i] = self._slots(s, s.num_computed, 1)[0]
            k = min(len(s.blocks), width)
            table[i, :k] = s.blocks[:k]
        inputs = {"input_ids": ids, "position_ids": pos, "slot_mapping": slots, "block_table": table}
        if self.plan["on_device_sampling"]:
            inputs.update(self._sampling_inputs(seqs, b, masks))
        # the NEFF-count label names the real request count (reference §2.5)
        out = self._run(name, f"decode_b{n}", f"decode of {n} rows on {name}", inputs)
        self.stats["decodes"] += 1
        self.stats["padded_rows"] += b - n
        return out["logits"][:n], out.get("tokens", np.zeros(b, np.int32))[:n]

    def _async_flow(self, order: list[str]) -> None:
        """Count the decode steps the async flow would overlap and those it would break
        (the seed: MRv1 breaks when the batch composition or order changes; MRv2 only waits
        when new requests join)."""
        if not self.plan["async_scheduling"]:
            return
        prev, self._prev_ids = self._prev_ids, list(order)
        if prev is None:
            return
        v2 = self.plan["runner"]["use_v2"]
        joined = set(order) - set(prev)
        if v2:
            broken = "new requests joined" if joined else None
        elif frozenset(order) != frozenset(prev):
            broken = "batch composition changed"
            logger.debug("Breaking async flow: prev_req_ids=%s, curr_req_ids=%s.", prev, order)
        elif order != prev:
            broken = "batch reordered"
        else:
            broken = None
        self.stats["sync_fallback_steps" if broken else "async_steps"] += 1
        total = self.stats["async_steps"] + self.stats["sync_fallback_steps"]
        if total % ASYNC_LOG_EVERY == 0:
            logger.info("Neuron async flow (Model Runner %s): %d async steps, %d sync fallbacks",
                        "V2" if v2 else "V1", self.stats["async_steps"], self.stats["sync_fallback_steps"])
