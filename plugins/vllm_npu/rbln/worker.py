"""The RBLN vLLM worker of the ``optimum`` (``transformers``) model path.

The model is the vendor's own optimum-rbln class (``RBLNLlamaForCausalLM``...), which reaches
the device only through ``rebel`` (imported by name: the real rebel-compiler on ``rbln-hw``,
``npusim.rbln`` through the alias on ``rbln-sim``). vLLM's engine calls, in order:
``init_device``, ``load_model`` (compile into the compile cache, or load a compiled
directory), ``get_kv_cache_spec`` / ``determine_available_memory`` (the compiled KV block
count, +1 for vLLM's null block), ``initialize_from_config``, ``compile_or_warm_up_model``,
then ``execute_model`` once per step through the step engine (:mod:`vllm_npu.step_engine`),
which returns the step's ``ModelRunnerOutput`` with host sampling done
(:mod:`vllm_npu.host_sampling`), or None when a structured-output request samples in the step:
vLLM then calls ``sample_tokens`` with the grammar bitmask (:mod:`vllm_npu.step_output`).

A step's device work comes from :class:`vllm_npu.rbln.sequences.SequenceTable`: prefills one at a
time through ``model.prefill_decoder`` (chunked by optimum-rbln), then one padded decode
through ``model.decoders[bucket]``. A device call that fails with a runtime error is retried once
(a retry rewrites the same KV positions), then the step fails with :class:`RblnDeviceError`
(:data:`DEVICE_RETRY`; any other error propagates as itself).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_npu._worker import NpuWorker
from vllm_npu.device_retry import DeviceRetry
from vllm_npu.host_sampling import HostSampler
from vllm_npu.rbln import compile_plan as cp
from vllm_npu.rbln.runtime import load_rebel, model_class
from vllm_npu.rbln.sequences import DevicePlan, Seq, SequenceTable
from vllm_npu.step_engine import Request, StepEngine, StepPlan, StepResult, new_request_fields
from vllm_npu.step_output import StepOutputs

logger = logging.getLogger("vllm.vllm_npu.rbln")

#: ``additional_config`` key the platform hands the worker its plan under.
PLAN_KEY = "npu_harness_rbln_plan"


class RblnWorkerError(RuntimeError):
    """The worker cannot serve as configured (the message names the values)."""


class RblnDeviceError(RblnWorkerError):
    """A device call failed again after the one retry (the runtime's error is chained)."""


#: RBLN's device errors: rebel's C++ core raises its runtime failures as ``RuntimeError``; a
#: ``ValueError`` (inputs that are not the compiled shapes) or the plugin's own errors are bugs,
#: never retried (:mod:`vllm_npu.device_retry`).
DEVICE_RETRY = DeviceRetry("RBLN", (RuntimeError,), RblnDeviceError,
                           never=(NotImplementedError, RecursionError, RblnWorkerError))


class RblnStepWorker(NpuWorker):
    """What both RBLN workers share: the device runner of the step engine
    (:class:`vllm_npu.step_engine.StepEngine`) over the
    :class:`~vllm_npu.rbln.sequences.SequenceTable`: a step's rows become the table's device
    plan, each path runs it (:meth:`_run`), and the logits come back in the step's order for
    host sampling (:mod:`vllm_npu.host_sampling`).

    Subclasses set ``self.table``, ``self.sampler`` (then :meth:`_start_engine`) and
    ``self.stats`` (with ``steps``) and implement :meth:`_run`.
    """

    npu_name = "RBLN"
    table: SequenceTable | None = None
    sampler: HostSampler | None = None

    def _start_engine(self) -> None:
        """The step engine over this worker, host sampling with ``self.sampler``."""
        self.engine = StepEngine(self, StepOutputs(self.sampler), vocab_size=int(self.model_config.get_vocab_size()))

    def _forget_requests(self) -> None:
        """Forget every request (the worker shuts down)."""
        if self.table is not None:
            self.table.seqs.clear()
        if self.engine is not None:
            self.engine.clear()

    def _count_retry(self) -> None:
        """Count one device-call retry (``stats["retries"]``)."""
        self.stats["retries"] += 1

    def _run(self, plan: DevicePlan) -> np.ndarray:
        """Run ``plan`` on the device; return the logits of :meth:`DevicePlan.sampled`, in order."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the device runner

    def admit(self, new: Any) -> Seq:
        """A new request's sequence; its prompt embeddings (:mod:`vllm_npu.prompt_embeds`), keyed
        by content for the prefix bookkeeping.

        Raises:
            RblnWorkerError: embeddings for a model that takes token ids only (the platform
                refuses them first).
            vllm_npu.prompt_embeds.PromptEmbedsError: embeddings that are not ``[tokens, hidden]``.
        """
        from vllm_npu.prompt_embeds import prompt_embeds_of

        assert self.table is not None
        seq = Seq(**new_request_fields(new))
        if getattr(new, "prompt_embeds", None) is not None:
            if not self.plan["prompt_embeds"]:
                raise RblnWorkerError(f"req_id={seq.req_id}: prompt_embeds for a model that takes token ids only")
            seq.embeds = prompt_embeds_of(seq, new, int(self.model_config.get_hidden_size()),
                                          int(self.model_config.get_vocab_size()))
            seq.key_prompt_ids = seq.embeds.key_ids(seq.prompt_ids)
        return self.table.admit(seq)

    def finish(self, req: Request) -> None:
        assert self.table is not None
        self.table.finish(req.req_id)

    def preempt(self, req: Request) -> None:
        assert self.table is not None
        self.table.preempt(req.req_id)

    def resume(self, req: Request) -> None:
        assert self.table is not None
        self.table.resumed(req)  # type: ignore[arg-type]

    def run_step(self, plan: StepPlan) -> StepResult:
        """The table's device plan of the step (prefills one at a time, one padded decode),
        run; the logits reordered to the step's sampling rows."""
        table = self.table
        assert table is not None
        self.stats["steps"] += 1
        device = table.plan(plan.num_scheduled)
        logits = self._run(device)
        table.done(device)
        seqs = device.sampled()
        if not seqs:
            return StepResult()
        row = {s.req_id: i for i, s in enumerate(seqs)}
        return StepResult(logits=logits[[row[r.req.req_id] for r in plan.sampling]])


class RblnOptimumWorker(RblnStepWorker):
    """vLLM worker running optimum-rbln compiled decoders (see the module docstring)."""

    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False) -> None:
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.plan = self.platform_plan(vllm_config, PLAN_KEY, RblnWorkerError, "RBLN")
        self.model: Any = None
        self.spec: cp.CompiledModelSpec | None = None
        self.table: SequenceTable | None = None
        self.sampler: HostSampler | None = None
        self._seen_layouts: set[tuple[int, int]] = set()
        self._logged_chunked = False
        self.stats = {"steps": 0, "prefills": 0, "decodes": 0, "retries": 0, "padded_rows": 0,
                      "prefix_reused_tokens": 0, "prompt_logprob_microsteps": 0}

    # ------------------------------------------------------------------ lifecycle

    def init_device(self) -> None:
        from vllm.utils.torch_utils import set_torch_threads_for_runtime

        self.device = torch.device("cpu")
        set_torch_threads_for_runtime()

    def load_model(self, *, load_dummy_weights: bool = False) -> None:  # noqa: ARG002
        """Load the compiled directory, or compile into the compile cache first.

        Raises:
            RblnWorkerError: no rebel / optimum-rbln; the compiled model does not match the plan.
            whatever optimum-rbln raises for the compile (its own messages).
        """
        rebel = load_rebel()
        compiled = self.plan["compiled_dir"]
        cls = model_class(self.plan["model_class"])
        t0 = time.perf_counter()
        if self.plan.get("compile"):
            logger.info("RBLN compile: %s -> %s with rbln_config %s (rebel %s)", self.plan["source"],
                        compiled, self.plan["rbln_config"], getattr(rebel, "__version__", "?"))
            tmp = Path(compiled + ".partial")
            tmp.mkdir(parents=True, exist_ok=True)
            self.model = cls.from_pretrained(self.plan["source"], export=True, model_save_dir=str(tmp),
                                             rbln_config=dict(self.plan["rbln_config"]))
            if Path(compiled).exists():  # another process finished first: keep the finished one
                logger.info("RBLN compile cache: %s appeared meanwhile; keeping it", compiled)
            else:
                tmp.rename(compiled)
            logger.info("RBLN compile: done in %.2f s (cold start)", time.perf_counter() - t0)
        else:
            self.model = cls.from_pretrained(compiled, rbln_config=dict(self.plan.get("runtime_config") or {}))
            logger.info("RBLN load: compiled model %s in %.2f s, no compile (warm start)", compiled,
                        time.perf_counter() - t0)
        self.spec = cp.CompiledModelSpec.from_dir(compiled)
        blocks = self.spec.kvcache_num_blocks or self.spec.batch_size * (self.spec.max_seq_len // self.spec.block_size)
        prefix = self.plan.get("prefix")
        self.vllm_block = int(prefix["sub_block_size"]) if prefix else self.spec.block_size
        if prefix:
            need = int(self.scheduler_config.max_num_seqs) * (self.spec.max_seq_len // self.spec.block_size)
            if blocks < need:
                raise RblnWorkerError(
                    f"prefix caching gives each sequence its own device KV blocks: {need} are needed "
                    f"for max_num_seqs {self.scheduler_config.max_num_seqs} at max_seq_len "
                    f"{self.spec.max_seq_len}, the compiled model has {blocks}; pass "
                    "--no-enable-prefix-caching or a smaller --max-num-seqs")
        self.table = SequenceTable(blocks, self.spec.block_size, self.spec.max_seq_len, self.spec.decoder_batch_sizes,
                                   prefix_chunk=self.spec.prefill_chunk_size if prefix else None)
        self.sampler = HostSampler(int(self.model_config.get_vocab_size()), log=logger, vllm_config=self.vllm_config)
        self._start_engine()
        logger.info("RBLN model %s: %d KV blocks of %d tokens, max_seq_len %d, prefill chunk %d, "
                    "decoders %s, attention %s", self.spec.model_class, blocks, self.spec.block_size,
                    self.spec.max_seq_len, self.spec.prefill_chunk_size, list(self.spec.decoder_batch_sizes),
                    self.spec.attn_impl)

    def _num_blocks(self) -> int:
        assert self.table is not None and self.spec is not None
        # + vLLM's null block 0; with prefix caching vLLM counts sub-blocks
        return self.table.num_device_blocks * (self.spec.block_size // self.vllm_block) + 1

    def get_kv_cache_spec(self) -> dict[str, Any]:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        assert self.spec is not None
        # The KV lives in the compiled runtime; vLLM only does the block accounting.
        return {"rbln": MLAAttentionSpec(block_size=self.vllm_block, num_kv_heads=1, head_size=1,
                                         dtype=torch.int8)}

    def determine_available_memory(self) -> int:
        return self._num_blocks() * self.get_kv_cache_spec()["rbln"].page_size_bytes

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:  # noqa: ARG002
        if num_gpu_blocks != self._num_blocks():
            raise RblnWorkerError(f"KV blocks mismatch: the compiled model has {self._num_blocks() - 1} "
                                  f"(+1 null), vLLM planned {num_gpu_blocks}")

    def get_cache_block_size_bytes(self) -> int:
        return self.vllm_block

    def check_health(self) -> None:
        if self.model is None:
            raise RblnWorkerError("the RBLN model is not loaded")

    def shutdown(self) -> None:
        self.model = None
        self._forget_requests()

    # ------------------------------------------------------------------ the step

    def _device_call(self, what: str, fn):
        """``fn()`` under :data:`DEVICE_RETRY` (see the module docstring)."""
        return DEVICE_RETRY.call(what, fn, on_retry=self._count_retry)

    def _run(self, plan: DevicePlan) -> np.ndarray:
        """Run ``plan``; return the last-position logits of :meth:`DevicePlan.sampled`, in order."""
        rows: list[np.ndarray] = []
        for p in plan.prefills:
            plp = p.seq.prompt_logprobs
            if plp is not None and plp.needs_logits_at(0):
                rows.append(self._scored_prefill(p))
                continue
            if p.copies or p.start:
                runtime = self.model.model[0]
                for src, dst, slots in p.copies:
                    runtime._copy_kv_cache(src, dst, slots)
                logger.info("RBLN prefix cache: req %s reuses %d of %d tokens (%d block(s) copied)",
                            p.seq.req_id, p.start, len(p.ids), len(p.copies))
                self.stats["prefix_reused_tokens"] += p.start
            pos = torch.arange(p.start, len(p.ids), dtype=torch.int32).unsqueeze(0)
            tbl = torch.tensor(p.table, dtype=torch.int16)
            feed = self._prefill_inputs(p)
            out = self._device_call(f"prefill of {p.seq.req_id} ({len(p.ids)} tokens)",
                                    lambda: self.model.prefill_decoder(**feed, cache_position=pos,
                                                                       block_tables=tbl).logits)
            rows.append(out.reshape(-1, out.shape[-1])[-1].float().numpy())
            self.stats["prefills"] += 1
            chunks = -(-(len(p.ids) - p.start) // self.spec.prefill_chunk_size)
            if chunks > 1 and not self._logged_chunked:
                self._logged_chunked = True
                logger.info("RBLN prefill: %d tokens in %d chunks of %d", len(p.ids), chunks,
                            self.spec.prefill_chunk_size)
        d = plan.decode
        if d is not None:
            ids = torch.tensor(d.ids, dtype=torch.int64).unsqueeze(1)
            pos = torch.tensor(d.positions, dtype=torch.int32).unsqueeze(1)
            tbl = torch.tensor(d.tables, dtype=torch.int16)
            decoder = self.model.decoders[d.batch]
            out = self._device_call(f"decode of {len(d.seqs)} rows (batch {d.batch})",
                                    lambda: decoder(input_ids=ids, cache_position=pos, block_tables=tbl).logits)
            out = out.reshape(d.batch, -1)[: len(d.seqs)].float().numpy()
            rows.extend(out)
            self.stats["decodes"] += 1
            self.stats["padded_rows"] += d.batch - len(d.seqs)
            if (len(d.seqs), d.batch) not in self._seen_layouts:
                self._seen_layouts.add((len(d.seqs), d.batch))
                logger.info("RBLN decode: %d rows on the batch-%d decoder (%d padding rows)",
                            len(d.seqs), d.batch, d.batch - len(d.seqs))
        return np.stack(rows) if rows else np.zeros((0, 1), np.float32)

    def _prefill_inputs(self, p) -> dict[str, torch.Tensor]:
        """``input_ids`` of the prefill's tokens, or, for a prompt with embeddings, its
        ``inputs_embeds``: the tokens' embeddings (optimum-rbln's host ``embed_tokens``) with the
        request's rows at their positions."""
        seq = p.seq
        if seq.embeds is None:
            return {"input_ids": torch.tensor([p.ids[p.start:]], dtype=torch.int64)}
        n = len(p.ids) - p.start
        with torch.no_grad():
            x = self.model.embed_tokens(torch.tensor([seq.token_ids(p.start, len(p.ids))], dtype=torch.int64)).clone()
        offsets, rows = seq.embeds.window(p.start, n)
        x[0, torch.as_tensor(offsets, dtype=torch.int64)] = torch.from_numpy(rows).to(x.dtype)
        return {"inputs_embeds": x}

    def _scored_prefill(self, p) -> np.ndarray:
        """A prompt whose positions are all scored (prompt logprobs, :mod:`vllm_npu.prompt_logprobs`):
        the compiled prefill returns the last position's logits only, so its first token is
        prefilled and each later one fed through the smallest compiled decoder (every row of
        it the same token at the same slot: the padding rows rewrite that slot with the same
        KV). Every position from 0 is recomputed, so a prefix the table reused is rewritten
        with the same values. Returns the last position's logits.
        """
        plp = p.seq.prompt_logprobs
        table = torch.tensor(p.table, dtype=torch.int16)
        first = torch.tensor([[p.ids[0]]], dtype=torch.int64)
        out = self._device_call(f"prefill of {p.seq.req_id} (1 token, prompt logprobs)",
                                lambda: self.model.prefill_decoder(input_ids=first, cache_position=torch.zeros((1, 1), dtype=torch.int32),
                                                                   block_tables=table).logits)
        row = out.reshape(-1, out.shape[-1])[-1].float().numpy()
        plp.record(0, row)
        batch = min(self.spec.decoder_batch_sizes)
        decoder = self.model.decoders[batch]
        tables = table.unsqueeze(0).expand(batch, -1).contiguous()
        for pos in range(1, len(p.ids)):
            ids = torch.full((batch, 1), int(p.ids[pos]), dtype=torch.int64)
            cache = torch.full((batch, 1), pos, dtype=torch.int32)
            out = self._device_call(f"decode of {p.seq.req_id} at {pos} (prompt logprobs)",
                                    lambda: decoder(input_ids=ids, cache_position=cache, block_tables=tables).logits)
            row = out.reshape(batch, -1)[0].float().numpy()
            plp.record(pos, row)
        self.stats["prefills"] += 1
        self.stats["prompt_logprob_microsteps"] += len(p.ids)
        logger.info("RBLN prompt logprobs: req %s scored %d positions (1 prefill token, %d decoder steps of batch %d)",
                    p.seq.req_id, plp.num_rows, len(p.ids) - 1, batch)
        return row
