"""The RBLN vLLM worker of the ``vllm`` model path: vLLM's own model code compiled for the NPU.

The model is vLLM's own implementation of the architecture (``vllm.model_executor.models``),
loaded by vLLM's model loader; its attention layers run on the device's paged attention
operators (:mod:`vllm_npu.rbln.attention`). Its forward is compiled as vllm-rbln compiles it:
``torch.compile(forward, backend=rebel.core.torch_compile.rbln_backend, dynamic=False,
fullgraph=True, options=...)`` (``rebel`` imported by name: the real rebel-compiler on
``rbln-hw``, ``npusim.rbln`` through the alias on ``rbln-sim``). So every device call has a
static shape:

* **warm-up** (``compile_or_warm_up_model``, ``VLLM_RBLN_ENABLE_WARM_UP``, default on)
  compiles the prefill graph at one chunk of ``max_num_batched_tokens`` tokens and one decode
  graph per decode batch bucket;
* **a step** (:class:`vllm_npu.rbln.sequences.SequenceTable` plans it, as on the optimum
  path): each prefill runs alone, chunk by chunk, each chunk zero-padded to the chunk size;
  then one decode call for every request at its next token, padded to the smallest bucket
  that fits (padding rows write vLLM's null block 0);
* **the compile cache** (:mod:`vllm_npu.rbln.graph_cache`, ``rebel.core.mega_cache``): the
  bundle of this configuration is loaded before warm-up and written after it;
* **a new shape after warm-up** is a recompile. Compiles are counted (``stats["compiles"]``,
  ``stats["recompiles"]``, logged); with ``VLLM_RBLN_COMPILE_STRICT_MODE`` (default on) a
  recompile after warm-up is an error (:class:`RblnRecompileError`) instead.

The logits are computed on the host (``model.compute_logits`` of the last position of each
row) and sampled by :mod:`vllm_npu.host_sampling`. A device call that fails is retried once,
then the step fails with :class:`vllm_npu.rbln.worker.RblnDeviceError`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from vllm_npu.device_retry import DeviceRetry
from vllm_npu.host_sampling import HostSampler
from vllm_npu.rbln.attention import RblnAttentionMetadata
from vllm_npu.rbln.runtime import load_rebel
from vllm_npu.rbln.sequences import DevicePlan, SequenceTable
from vllm_npu.rbln.worker import DEVICE_RETRY, PLAN_KEY, RblnDeviceError, RblnStepWorker, RblnWorkerError
from vllm_npu.settings import RBLN_ENV_WORDS, env_switch

logger = logging.getLogger("vllm.vllm_npu.rbln")

__all__ = ["RblnVllmWorker", "RblnRecompileError", "strict_mode"]


class RblnRecompileError(RblnWorkerError):
    """A graph shape that warm-up did not compile, under ``VLLM_RBLN_COMPILE_STRICT_MODE``."""


def strict_mode(environ: Any = None) -> bool:
    """``VLLM_RBLN_COMPILE_STRICT_MODE`` (default on; ``1``/``true`` on, ``0``/``false`` off:
    the words vllm-rbln reads the same way, :data:`vllm_npu.settings.RBLN_ENV_WORDS`).

    Raises:
        SettingError: any other value (vllm-rbln would read ``yes`` or ``on`` as off).
    """
    return env_switch("VLLM_RBLN_COMPILE_STRICT_MODE", default=True, environ=environ, words=RBLN_ENV_WORDS)


def _warm_up_enabled() -> bool:
    """``VLLM_RBLN_ENABLE_WARM_UP`` (default on; the words of :func:`strict_mode`).

    Raises:
        SettingError: any other value.
    """
    return env_switch("VLLM_RBLN_ENABLE_WARM_UP", default=True, words=RBLN_ENV_WORDS)


#: The vllm path's retry: RBLN's device errors (:data:`vllm_npu.rbln.worker.DEVICE_RETRY`), read
#: through torch.compile's wrapping (the innermost cause), and never a recompile refusal.
VLLM_PATH_RETRY = DeviceRetry("RBLN", DEVICE_RETRY.device_errors, RblnDeviceError,
                              never=DEVICE_RETRY.never, cause_of=lambda exc: _root(exc))


class RblnVllmWorker(RblnStepWorker):
    """vLLM worker running vLLM's own model code compiled with ``rbln_backend`` (see the
    module docstring)."""

    def __init__(self, vllm_config, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False) -> None:
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.plan = self.platform_plan(vllm_config, PLAN_KEY, RblnWorkerError, "RBLN")
        self.model: Any = None
        self.compiled: Any = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.table: SequenceTable | None = None
        self.sampler: HostSampler | None = None
        self.strict = strict_mode()
        self.warm_up = _warm_up_enabled()  # both read (and refused if malformed) at start-up
        self.warmed = False
        self._shape = ("?", 0)
        self.shapes: set[tuple[str, int]] = set()
        self._seen_layouts: set[tuple[int, int]] = set()
        self.stats = {"steps": 0, "prefills": 0, "prefill_chunks": 0, "decodes": 0, "retries": 0,
                      "padded_rows": 0, "compiles": 0, "recompiles": 0, "prefix_reused_tokens": 0}

    # ------------------------------------------------------------------ lifecycle

    def init_device(self) -> None:
        from vllm.utils.torch_utils import set_torch_threads_for_runtime
        from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

        self.device = torch.device("cpu")
        set_torch_threads_for_runtime()
        init_worker_distributed_environment(self.vllm_config, self.rank, self.distributed_init_method,
                                            self.local_rank, "gloo")

    def load_model(self, *, load_dummy_weights: bool = False) -> None:  # noqa: ARG002
        """Load vLLM's model for the architecture and wrap its forward in ``torch.compile``
        with ``rebel``'s backend (graphs are compiled at warm-up).

        Raises:
            RblnWorkerError: no ``rebel``, or one without ``core.torch_compile.rbln_backend``.
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model

        rebel = load_rebel()
        try:
            from importlib import import_module

            backend = import_module(rebel.__name__ + ".core.torch_compile").rbln_backend
        except (ImportError, AttributeError) as exc:
            raise RblnWorkerError(f"rebel {getattr(rebel, '__version__', '?')} has no "
                                  f"core.torch_compile.rbln_backend ({exc})") from exc
        t0 = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            self.model = get_model(vllm_config=self.vllm_config)
        self.model.eval()
        plan = self.plan
        mode = ["strict"] if self.strict else []
        options = {"npu": plan["npu"], "num_devices": int(plan.get("num_devices", 1)), "mode": mode,
                   "use_static_output": True, "use_direct_dispatch": True}
        from vllm import envs

        self.rebel = rebel
        self.bundle = None
        if not envs.VLLM_DISABLE_COMPILE_CACHE:
            from vllm_npu.rbln import graph_cache

            sig = graph_cache.signature(self.vllm_config.compute_hash(), plan, getattr(rebel, "__version__", "0.0"))
            self.bundle = graph_cache.bundle_path(envs.VLLM_CACHE_ROOT, str(self.model_config.model), sig,
                                                  self.local_rank)
            options.update(cache_dir=graph_cache.cache_root(envs.VLLM_CACHE_ROOT), mega_cache_only=True)

        def counting_backend(graph, example_inputs, **kwargs):
            if self.warmed:
                what = f"{self._shape[0]} of {self._shape[1]} tokens"
                if self.strict:
                    raise RblnRecompileError(
                        f"RBLN: a {what} needs a graph warm-up did not compile (compiled: "
                        f"{sorted(self.shapes)}); VLLM_RBLN_COMPILE_STRICT_MODE forbids recompiles "
                        "after warm-up (set it to 0 to allow them)")
                self.stats["recompiles"] += 1
                logger.warning("RBLN recompile #%d after warm-up: %s (static shapes: every new "
                               "shape is a compile)", self.stats["recompiles"], what)
            self.stats["compiles"] += 1
            return backend(graph, example_inputs, **kwargs)

        import torch._dynamo

        # one graph per bucket: Dynamo must not give up recompiling before the buckets end
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   len(plan["decode_buckets"]) + 8)
        model = self.model

        def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids=input_ids, positions=positions)

        self.compiled = torch.compile(forward, backend=counting_backend, dynamic=False, fullgraph=True,
                                      options=options)
        self.sampler = HostSampler(int(self.model_config.get_vocab_size()), log=logger, vllm_config=self.vllm_config)
        self._start_engine()
        logger.info("RBLN vllm model path: %s loaded in %.2f s on %s; prefill chunk %d, decode buckets "
                    "%s, KV blocks %d of %d tokens, strict mode %s", type(self.model).__name__,
                    time.perf_counter() - t0, plan["npu"], plan["chunk"], plan["decode_buckets"],
                    plan["num_blocks"], plan["block_size"], self.strict)

    def _layers(self) -> dict[str, Any]:
        from vllm_npu.rbln.attention import RblnAttentionImpl

        ctx = self.vllm_config.compilation_config.static_forward_context
        return {name: layer for name, layer in ctx.items() if isinstance(getattr(layer, "impl", None), RblnAttentionImpl)}

    def get_kv_cache_spec(self) -> dict[str, Any]:
        return {name: layer.get_kv_cache_spec(self.vllm_config) for name, layer in self._layers().items()}

    def determine_available_memory(self) -> int:
        specs = self.get_kv_cache_spec()
        return int(self.plan["num_blocks"]) * sum(s.page_size_bytes for s in specs.values())

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:  # noqa: ARG002
        if num_gpu_blocks != int(self.plan["num_blocks"]):
            raise RblnWorkerError(f"KV blocks mismatch: the plan has {self.plan['num_blocks']}, vLLM "
                                  f"planned {num_gpu_blocks}")

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        """Allocate each layer's paged KV cache and bind it to the layer."""
        super().initialize_from_config(kv_cache_config)
        n = int(kv_cache_config.num_blocks)
        for name, layer in self._layers().items():
            spec = layer.get_kv_cache_spec(self.vllm_config)
            cache = torch.zeros((2, n, spec.num_kv_heads, 1, spec.block_size, spec.head_size), dtype=spec.dtype)
            layer.kv_cache = cache
            self.kv_caches[name] = cache
        plan = self.plan
        self.table = SequenceTable(n - 1, int(plan["block_size"]), int(plan["max_seq_len"]), plan["decode_buckets"],
                                   shared_blocks=bool(plan.get("prefix_caching")))
        logger.info("RBLN KV cache: %d layers x %d blocks x %d tokens (%d MiB on the host)", len(self.kv_caches),
                    n, plan["block_size"], sum(c.numel() * c.element_size() for c in self.kv_caches.values()) >> 20)

    def compile_or_warm_up_model(self):
        """Compile the prefill graph and one decode graph per bucket (unless
        ``VLLM_RBLN_ENABLE_WARM_UP`` is off: then each shape compiles at first use)."""
        from vllm.v1.worker.worker_base import CompilationTimes

        from vllm import envs

        from vllm_npu.rbln import graph_cache

        t0 = time.perf_counter()
        if self.bundle is not None:
            graph_cache.load(self.rebel, envs.VLLM_CACHE_ROOT, self.bundle)
        if self.warm_up:
            self._call("prefill", np.zeros(int(self.plan["chunk"]), np.int64), 0, [])
            for b in self.plan["decode_buckets"]:
                self._call("decode", np.zeros(b, np.int64), np.zeros(b, np.int64), [[] for _ in range(b)])
            self.warmed = True
            if self.bundle is not None:
                graph_cache.save(self.rebel, envs.VLLM_CACHE_ROOT, self.bundle)
        took = time.perf_counter() - t0
        logger.info("RBLN warm-up: %d graphs compiled in %.2f s (prefill x%d tokens, decode buckets %s)",
                    self.stats["compiles"], took, self.plan["chunk"], self.plan["decode_buckets"])
        return CompilationTimes(language_model=took, encoder=0.0)

    def check_health(self) -> None:
        if self.model is None:
            raise RblnWorkerError("the RBLN model is not loaded")

    def shutdown(self) -> None:
        self.compiled = None
        self.model = None
        self._forget_requests()

    # ------------------------------------------------------------------ device calls

    def _tables(self, blocks_per_row: list[list[int]]) -> torch.Tensor:
        width = int(self.plan["max_seq_len"]) // int(self.plan["block_size"])
        out = torch.zeros((len(blocks_per_row), width), dtype=torch.int32)
        for i, blocks in enumerate(blocks_per_row):
            if blocks:
                out[i, :len(blocks)] = torch.tensor(blocks[:width], dtype=torch.int32)
        return out

    def _call(self, phase: str, ids: np.ndarray, start: Any, blocks: list) -> torch.Tensor:
        """One device call: ``phase`` ``prefill`` (``ids`` one chunk from position ``start``,
        ``blocks`` the sequence's vLLM blocks) or ``decode`` (``ids`` one token per row at
        ``start[i]``, ``blocks[i]`` each row's). Returns the hidden states ``[N, H]``."""
        from vllm.forward_context import set_forward_context

        n = len(ids)
        self._shape = (phase, n)
        if phase == "prefill":
            pos = torch.arange(int(start), int(start) + n, dtype=torch.int64)
            seq = torch.tensor([[int(start)]], dtype=torch.int32)
            table = self._tables([blocks])[0]
        else:
            pos = torch.as_tensor(np.asarray(start, np.int64))
            seq = pos.to(torch.int32).reshape(n, 1)
            table = self._tables(blocks)
        md = RblnAttentionMetadata(phase, seq, table, int(self.plan["block_size"]))
        ids_t = torch.as_tensor(np.asarray(ids, np.int64))
        names = list(self.kv_caches) or list(self._layers())
        before = self.stats["compiles"]

        def run():
            with set_forward_context({name: md for name in names}, self.vllm_config, num_tokens=n, slot_mapping={}):
                return self.compiled(ids_t, pos)

        try:
            out = VLLM_PATH_RETRY.call(f"{phase} of {n} tokens", run, on_retry=self._count_retry,
                                       may_retry=lambda: self.warmed and self.stats["compiles"] == before)
        except Exception as exc:
            cause = _root(exc)
            if isinstance(cause, RblnRecompileError) and cause is not exc:
                raise cause from exc  # torch.compile wrapped the strict-mode refusal: name it
            raise
        self.shapes.add((phase, n))
        return out

    # ------------------------------------------------------------------ the step

    def _logits(self, hidden: torch.Tensor) -> np.ndarray:
        return self.model.compute_logits(hidden).float().numpy()

    def _run(self, plan: DevicePlan) -> np.ndarray:
        """Run ``plan``; return the last-position logits of :meth:`DevicePlan.sampled`, in order."""
        chunk = int(self.plan["chunk"])
        rows: list[np.ndarray] = []
        for p in plan.prefills:
            ids = np.asarray(p.ids, np.int64)
            last = None
            if p.start:
                self.stats["prefix_reused_tokens"] += p.start
                logger.info("RBLN prefix cache: req %s reuses %d of %d tokens (vLLM's shared blocks)",
                            p.seq.req_id, p.start, len(ids))
            plp = p.seq.prompt_logprobs  # prompt logprobs: the LM head of every row of each chunk
            for s in range(p.start, len(ids), chunk):
                piece = ids[s:s + chunk]
                padded = np.zeros(chunk, np.int64)
                padded[:len(piece)] = piece
                hidden = self._call("prefill", padded, s, p.seq.blocks)
                last = hidden[len(piece) - 1: len(piece)]
                if plp is not None and plp.needs_logits_at(s):
                    plp.record(s, self._logits(hidden[:len(piece)]))
                self.stats["prefill_chunks"] += 1
            rows.append(self._logits(last)[0])
            self.stats["prefills"] += 1
            chunks = -(-(len(ids) - p.start) // chunk)
            if chunks > 1:
                logger.info("RBLN prefill: %d tokens in %d chunks of %d", len(ids) - p.start, chunks, chunk)
        d = plan.decode
        if d is not None:
            live = len(d.seqs)
            ids = np.zeros(d.batch, np.int64)
            pos = np.zeros(d.batch, np.int64)
            ids[:live] = d.ids[:live]
            pos[:live] = d.positions[:live]
            blocks = [s.blocks for s in d.seqs] + [[] for _ in range(d.batch - live)]
            hidden = self._call("decode", ids, pos, blocks)
            rows.extend(self._logits(hidden[:live]))
            self.stats["decodes"] += 1
            self.stats["padded_rows"] += d.batch - live
            if (live, d.batch) not in self._seen_layouts:
                self._seen_layouts.add((live, d.batch))
                logger.info("RBLN decode: %d rows on the batch-%d graph (%d padding rows)", live, d.batch,
                            d.batch - live)
        return np.stack(rows) if rows else np.zeros((0, 1), np.float32)


def _root(exc: BaseException) -> BaseException:
    """The innermost cause of ``exc`` (torch.compile wraps a backend's error)."""
    seen = set()
    while (exc.__cause__ or exc.__context__) is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return exc
