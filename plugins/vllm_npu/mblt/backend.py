"""MXQ model instances on Mobilint cards, and one step's rows dispatched to them concurrently.

:class:`MbltBackend` owns ``len(models)`` ``Model`` instances of one MXQ, each holding
``k_per_model`` KV slots (``cache_id``). vLLM's slot ``s`` is ``divmod(s, K) = (model_idx,
cache_id)``. The backend talks to the runtime module it is given (``qbruntime`` or
``npusim.mxq``, see :mod:`vllm_npu.mblt.runtime`) and calls only the qbruntime API on it.

Creation (reference §4): resolve targets (:mod:`vllm_npu.mblt.placement`); one
``Accelerator(device_name, d)`` per device; slot 0 on ``dev_no[0]``; K probed from slot 0's
cache infos; ``n_models = max(1, ceil(max_batch_size / K))``; instance ``i`` on
``dev_no[i % len(dev_no)]``, each constructed and launched in turn. Any ``QbRuntimeError``
disposes every instance created so far; BadAlloc becomes :class:`MobilintBackendAllocError`, any
other error is re-raised unchanged after one ``[Mobilint] ...`` line on stderr.

Dispatch: rows grouped per instance, one blocking ``infer`` per instance, instances in parallel
on a persistent thread pool (threads ``mblt-slot_*``), outputs split back in caller order.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from vllm_npu.mblt.dispatch import (
    OutputLayout,
    Row,
    group_rows,
    output_rows,
    split_rows,
    stack_embeds,
    stack_extras,
)
from vllm_npu.mblt.errors import BackendCapacityError, MbltBackendError, MobilintBackendAllocError
from vllm_npu.mblt.placement import (
    CORE_MODES,
    MbltTargetError,
    Placement,
    make_slot_config,
    resolve_targets,
    slot_devices,
)

__all__ = [
    "kv_capacity",
    "BackendCapacityError",
    "BackendLayout",
    "MbltBackend",
    "MbltBackendError",
    "MbltTargetError",
    "MobilintBackendAllocError",
    "Row",
    "probe_k_per_model",
    "probe_output_layout",
]

logger = logging.getLogger("vllm.vllm_npu.mblt")


def kv_capacity(runtime: Any, mxq_path: str) -> int:
    """The MXQ's KV capacity in tokens per cache id (``max_cache_size`` of its first input
    buffer), read from an instance that is constructed, never launched, then disposed.

    Raises:
        QbRuntimeError: the runtime cannot load the MXQ (its error, unchanged).
    """
    model = runtime.Model(mxq_path)
    try:
        return int(model.get_input_buffer_info()[0].max_cache_size)
    finally:
        model.dispose()


@dataclass(frozen=True)
class BackendLayout:
    """Where and how many MXQ instances to load.

    Attributes:
        dev_no: device numbers, distinct, non-empty; instances go round-robin over them.
        core_mode: ``auto | single | multi | global4 | global8``.
        target_cores: canonical ``"d:c:k"`` cores (single mode only); None = every core.
        target_clusters: canonical ``"d:c"`` clusters (other modes); None = every cluster.
        max_batch_size: aggregate rows the backend must hold (>= 1), over all instances.
        device_name: qbruntime device name (``aries``, ``aries-rb``, ``regulus-ra``...).

    Raises:
        ValueError: empty/duplicated/negative dev_no, unknown core_mode, max_batch_size < 1.
    """

    dev_no: tuple[int, ...] = (0,)
    core_mode: str = "auto"
    target_cores: tuple[str, ...] | None = None
    target_clusters: tuple[str, ...] | None = None
    max_batch_size: int = 1
    device_name: str = "aries"

    def __post_init__(self) -> None:
        for name in ("dev_no", "target_cores", "target_clusters"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        dev_no = self.dev_no
        if (not dev_no or len(set(dev_no)) != len(dev_no)
                or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in dev_no)):
            raise ValueError(f"dev_no must be distinct non-negative ints, got {list(dev_no)!r}")
        if self.core_mode not in CORE_MODES:
            raise ValueError(
                f"core_mode={self.core_mode!r} is not one of {', '.join(CORE_MODES)}"
            )
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {self.max_batch_size!r}")


def probe_k_per_model(model: Any) -> int:
    """KV slots per instance: the max ``num_batches`` over ``model.get_cache_infos()``; 1 when
    there are no cache infos or the model/infos lack the attribute.

    Raises:
        QbRuntimeError: propagated from the runtime.
    """
    try:
        infos = model.get_cache_infos()
        return max(1, max((int(info.num_batches) for info in infos), default=1))
    except AttributeError:
        return 1


def probe_output_layout(output_shape: Sequence[int], in_max_width: int, out_max_width: int,
                        k_per_model: int, max_batch_size: int) -> OutputLayout | None:
    """Which rows an MXQ returns, from its shapes (reference §7 "Logits kind").

    Non-batch (K == 1), output ``(1, X, vocab)``: ``X == 1`` -> ``"last"``; ``X == -1`` or
    ``X > 1`` -> ``"all"``. Batch (K > 1): ``out.max_width == in.max_width >
    max(max_batch_size, K)`` -> ``"all"``; ``out.max_width < in.max_width`` -> ``"last"``;
    otherwise None (decided by the first output whose row count tells).
    """
    if k_per_model <= 1:
        x = output_shape[-2] if len(output_shape) >= 2 else 1
        return "last" if x == 1 else "all"
    if out_max_width == in_max_width > max(max_batch_size, k_per_model):
        return "all"
    if out_max_width < in_max_width:
        return "last"
    return None


def _is_badalloc(exc: BaseException) -> bool:
    return "badalloc" in "".join(str(exc).split()).lower()


class MbltBackend:
    """Launched MXQ instances and concurrent dispatch to them; build with :meth:`create`.

    Attributes:
        runtime: the qbruntime-API module.
        models: the launched ``Model`` instances (slot ``i`` = ``models[i]``).
        model_dev_no: device number of each instance.
        k_per_model: KV slots (``cache_id`` values) per instance.
        layout: the :class:`BackendLayout` it was created from.
    """

    def __init__(self, runtime: Any, models: list[Any], model_dev_no: list[int],
                 k_per_model: int, layout: BackendLayout, accelerators: dict[int, Any]) -> None:
        """Internal: use :meth:`create`. Reads the MXQ's shapes from ``models[0]``."""
        self.runtime = runtime
        self.models = models
        self.model_dev_no = model_dev_no
        self.k_per_model = k_per_model
        self.layout = layout
        self.accelerators = accelerators
        first = models[0]
        in_info = first.get_input_buffer_info()[0]
        out_info = first.get_output_buffer_info()[0]
        out_shape = tuple(first.get_model_output_shape()[0])
        self.hidden_size: int = int(tuple(first.get_model_input_shape()[0])[-1])
        self.vocab_size: int = int(out_shape[-1])
        self.max_width: int = int(in_info.max_width)
        self.max_cache_size: int = int(in_info.max_cache_size)
        try:
            self.kv_nbytes_per_cache: int = sum(int(i.size) for i in first.get_cache_infos())
        except AttributeError:
            self.kv_nbytes_per_cache = 0
        self._layout: OutputLayout | None = probe_output_layout(
            out_shape, self.max_width, int(out_info.max_width), k_per_model, layout.max_batch_size)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._disposed = False
        #: rank of the embeddings input: 4 ``(1, 1, T, H)``; a Qwen3-VL text MXQ takes 3 ``(1, T, H)``
        self.embeds_rank = 4

    # ---------------------------------------------------------------- creation
    @classmethod
    def create(cls, runtime: Any, mxq_path: str, layout: BackendLayout) -> MbltBackend:
        """Create, probe and launch the instances ``layout`` asks for.

        Args:
            runtime: module with the qbruntime API (``qbruntime`` or ``npusim.mxq``).
            mxq_path: path of the ``.mxq`` file, passed to ``Model`` as given.
            layout: devices, core mode, targets and aggregate ``max_batch_size``.

        Raises:
            MbltTargetError: targets do not resolve (before any runtime call), or a
                ModelConfig setter refused the selection.
            MobilintBackendAllocError: BadAlloc from the runtime (all instances disposed).
            QbRuntimeError: any other runtime error, unchanged (all instances disposed).
            BackendCapacityError: ``len(models) * K < max_batch_size`` (all disposed).
        """
        placement = resolve_targets(layout.dev_no, layout.core_mode, layout.target_cores,
                                    layout.target_clusters, layout.device_name)
        dev_no = list(layout.dev_no)
        models: list[Any] = []
        model_dev: list[int] = []
        launched = 0
        phase, slot, dev = "create", 0, dev_no[0]
        k: int | None = None
        n_models: int | None = None
        accs: dict[int, Any] = {}
        try:
            for d in dev_no:
                dev = d
                accs[d] = runtime.Accelerator(layout.device_name, d)
            dev = dev_no[0]
            models.append(runtime.Model(mxq_path, cls._slot_config(runtime, placement, 0, 1)))
            model_dev.append(dev)
            phase = "probe_k_per_model"
            k = probe_k_per_model(models[0])
            n_models = max(1, math.ceil(layout.max_batch_size / k))
            devs = slot_devices(dev_no, n_models)
            n_on_dev0 = devs.count(dev_no[0])
            if layout.core_mode == "single" and n_on_dev0 > 1:
                # Slot 0 was built as if alone on its device; it shares it: one core of its own.
                phase = "create"
                models.pop().dispose()
                model_dev.pop()
                models.append(runtime.Model(
                    mxq_path, cls._slot_config(runtime, placement, 0, n_on_dev0)))
                model_dev.append(dev)
            for slot in range(n_models):
                dev = devs[slot]
                if slot > 0:
                    phase = "create"
                    index_on_dev = devs[:slot].count(dev)
                    mc = make_slot_config(runtime, placement, dev, index_on_dev, devs.count(dev))
                    models.append(runtime.Model(mxq_path, mc))
                    model_dev.append(dev)
                phase = "launch"
                models[slot].launch(accs[dev])
                launched += 1
        except runtime.QbRuntimeError as exc:
            cls._dispose_models(models)
            if _is_badalloc(exc):
                raise MobilintBackendAllocError(
                    phase=phase, slot=slot, dev=dev, succeeded_so_far=launched, n_total=n_models,
                    max_batch_size=layout.max_batch_size, k_per_model=k, original=exc,
                ) from exc
            print(f"[Mobilint] NPU backend create failed at slot {slot} (phase={phase}, "
                  f"dev={dev}, succeeded_so_far={launched}, n_total={n_models}); re-raising "
                  "qbruntime error unchanged.", file=sys.stderr, flush=True)
            raise
        except BaseException:
            cls._dispose_models(models)
            raise
        backend = cls(runtime, models, model_dev, k, layout, accs)
        if backend.capacity < layout.max_batch_size:
            backend.dispose()
            raise BackendCapacityError(backend.capacity, layout.max_batch_size)
        return backend

    @staticmethod
    def _slot_config(runtime: Any, placement: Placement, index_on_dev: int, n_on_dev: int) -> Any:
        return make_slot_config(runtime, placement, placement.devices[0], index_on_dev, n_on_dev)

    @staticmethod
    def _dispose_models(models: Sequence[Any]) -> BaseException | None:
        """Dispose every model; log failures and return the first one (never raises)."""
        first: BaseException | None = None
        for i, model in enumerate(models):
            try:
                model.dispose()
            except Exception as exc:  # noqa: BLE001 - teardown must reach every model
                logger.warning("Disposing Mobilint model slot %d failed: %s", i, exc)
                first = first or exc
        return first

    # ---------------------------------------------------------------- metadata
    @property
    def capacity(self) -> int:
        """Rows the backend holds: ``len(models) * k_per_model``."""
        return len(self.models) * self.k_per_model

    @property
    def output_layout(self) -> Literal["last", "all", "unknown"]:
        """``"last"`` (one logits row per item) or ``"all"`` (one per token); ``"unknown"``
        while neither the shapes nor an output's row count has decided it."""
        return self._layout or "unknown"

    def slot_of(self, vllm_slot: int) -> tuple[int, int]:
        """vLLM slot ``s`` -> ``(model_idx, cache_id) = divmod(s, k_per_model)``.

        Raises:
            MbltBackendError: ``s`` outside ``[0, capacity)``.
        """
        if not isinstance(vllm_slot, (int, np.integer)) or not 0 <= vllm_slot < self.capacity:
            raise MbltBackendError(
                "Mobilint cache slot exceeds the loaded multi-card capacity: "
                f"cache_id={vllm_slot!r}, models={len(self.models)}, k_per_model={self.k_per_model}"
            )
        model_idx, cache_id = divmod(int(vllm_slot), self.k_per_model)
        return model_idx, cache_id

    def _check_slot(self, model_idx: int, cache_id: int) -> Any:
        if self._disposed:
            raise MbltBackendError("the Mobilint backend was disposed")
        if not 0 <= model_idx < len(self.models) or not 0 <= cache_id < self.k_per_model:
            raise MbltBackendError(
                f"slot (model_idx={model_idx}, cache_id={cache_id}) is outside the loaded "
                f"backend: models={len(self.models)}, k_per_model={self.k_per_model}"
            )
        return self.models[model_idx]

    # ---------------------------------------------------------------- dispatch
    def infer_rows(self, rows: Sequence[Row]) -> list[np.ndarray]:
        """Run one step: each instance's rows in one blocking ``infer``, instances in parallel.

        Returns:
            Per row, in caller order: ``[vocab]`` float logits of its last token (``"last"``
            layout) or ``[T_i, vocab]`` for every token (``"all"``).

        Raises:
            MbltBackendError: disposed backend; a row outside the loaded slots; two rows on one
                slot; two rows on a K == 1 instance; hidden-size mismatch; an output row count
                that is neither the item count nor the token count.
            QbRuntimeError (or whatever an ``infer`` raised): the first failing instance's
                exception, unchanged, after every instance has finished.
        """
        if not rows:
            return []
        groups = group_rows(rows)
        for model_idx, positions in groups.items():
            if self.k_per_model == 1 and len(positions) > 1:
                raise MbltBackendError(
                    f"{len(positions)} rows on model_idx={model_idx}, whose MXQ is not "
                    "batch-compiled (k_per_model=1): one row per instance per call"
                )
            seen: set[int] = set()
            for pos in positions:
                row = rows[pos]
                self._check_slot(row.model_idx, row.cache_id)
                if row.cache_id in seen:
                    raise MbltBackendError(
                        f"two rows target the same slot (model_idx={model_idx}, "
                        f"cache_id={row.cache_id}) in one step"
                    )
                seen.add(row.cache_id)
        jobs = [(idx, [rows[p] for p in pos]) for idx, pos in groups.items()]
        if len(jobs) == 1:
            results = [self._infer_model(*jobs[0])]
        else:
            pool = self._executor()
            futures = [pool.submit(self._infer_model, idx, group) for idx, group in jobs]
            wait(futures)
            for fut in futures:
                if fut.exception() is not None:
                    raise fut.exception()  # type: ignore[misc]
            results = [fut.result() for fut in futures]
        out: list[np.ndarray | None] = [None] * len(rows)
        for (_, positions), logits in zip(groups.items(), results):
            for pos, item in zip(positions, logits):
                out[pos] = item
        return out  # type: ignore[return-value]

    def _infer_model(self, model_idx: int, group: list[Row]) -> list[np.ndarray]:
        model = self.models[model_idx]
        x = stack_embeds(group, self.hidden_size)
        if self.embeds_rank == 3:
            x = x.reshape(1, x.shape[2], x.shape[3])
        inputs = [x, *stack_extras(group)]
        if self.k_per_model > 1:
            params = [self.runtime.BatchParam(r.n_tokens, int(r.cache_size), int(r.cache_id))
                      for r in group]
            outputs = model.infer(inputs, None, 0, params)
        else:
            outputs = model.infer(inputs, None, int(group[0].cache_size))
        lengths = [r.n_tokens for r in group]
        with self._lock:
            layout = self._layout
        flat, layout = output_rows(outputs, self.vocab_size, lengths, layout)
        if layout is not None:
            with self._lock:
                self._layout = self._layout or layout
        return split_rows(flat, lengths, layout)

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=len(self.models),
                                                thread_name_prefix="mblt-slot")
            return self._pool

    # ---------------------------------------------------------------- KV host copies
    def dump(self, model_idx: int, cache_id: int) -> list[bytes]:
        """``dump_cache_memory(cache_id)`` of one slot: one blob per CacheInfo.

        Raises:
            MbltBackendError: disposed backend or slot outside the loaded backend.
        """
        return list(self._check_slot(model_idx, cache_id).dump_cache_memory(cache_id))

    def load(self, model_idx: int, cache_id: int, blobs: Sequence[bytes]) -> None:
        """``load_cache_memory(blobs, cache_id)`` into one slot.

        Raises:
            MbltBackendError: disposed backend or slot outside the loaded backend.
            QbRuntimeError: wrong blob count or sizes (the runtime's check).
        """
        self._check_slot(model_idx, cache_id).load_cache_memory(list(blobs), cache_id)

    # ---------------------------------------------------------------- teardown
    def dispose(self) -> None:
        """Dispose every instance and shut the thread pool down; later calls do nothing.

        Raises:
            Exception: the first ``dispose()`` failure, after every instance was tried.
        """
        with self._lock:
            if self._disposed:
                return
            self._disposed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        first = self._dispose_models(self.models)
        if first is not None:
            raise first
