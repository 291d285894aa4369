"""FAKE qbruntime for the mblt adapter's unit tests: not a simulator, not the real API.

:func:`make_fake_runtime` returns a fresh module object holding just the qbruntime names the
adapter calls, bound to a :class:`FakeState` that records every call and injects failures.
Logits are a deterministic function of the inputs so that merge order is checkable: the logits
of an input token whose embedding is ``e`` are ``e.mean() + 0.001 * arange(vocab)``
(see :func:`token_logits`).
"""

from __future__ import annotations

import enum
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


class QbRuntimeError(RuntimeError):
    """Same role as qbruntime.QbRuntimeError."""


class Cluster(enum.IntEnum):
    Cluster0 = 0x10000
    Cluster1 = 0x20000


class Core(enum.IntEnum):
    Core0 = 1
    Core1 = 2
    Core2 = 3
    Core3 = 4


@dataclass(frozen=True, order=True)
class CoreId:
    cluster: Cluster
    core: Core


@dataclass(frozen=True)
class BatchParam:
    sequence_length: int = 0
    cache_size: int = 0
    cache_id: int = 0


@dataclass(frozen=True)
class CacheInfo:
    name: str
    size: int
    num_batches: int
    cache_type: str = "CacheType.Default"
    layer_hash: str = ""


@dataclass(frozen=True)
class BufferInfo:
    max_width: int
    max_cache_size: int


def token_logits(embed_row: np.ndarray, vocab: int) -> np.ndarray:
    """The fake's logits for one input token."""
    return np.float32(np.mean(embed_row)) + np.float32(0.001) * np.arange(vocab, dtype=np.float32)


@dataclass
class FakeState:
    """Knobs and call records of one fake runtime.

    ``fail`` maps ``(phase, creation_ordinal)`` -> exception, phase in
    ``"create" | "launch" | "probe" | "infer"``; the ordinal counts ``Model`` constructions.
    ``out_width``: the compiled output ``X`` of ``(1, X, vocab)`` (1 = last-token logits, -1 =
    every token). ``wrong_rows``: infer returns this many rows instead. ``barrier``: every
    infer waits on it (proves concurrency).
    """

    k: int = 1
    hidden: int = 8
    vocab: int = 16
    n_layers: int = 2
    layer_bytes: int = 64
    max_width: int = 128
    out_max_width: int | None = None
    max_cache_size: int = 1024
    out_width: int = 1
    no_cache_infos: bool = False
    wrong_rows: int | None = None
    fail: dict[tuple[str, int], BaseException] = field(default_factory=dict)
    barrier: threading.Barrier | None = None
    trace_start_result: bool = True
    trace_writes_file: bool = True
    accelerators: list[tuple[str, int]] = field(default_factory=list)
    models: list[FakeModel] = field(default_factory=list)
    infer_calls: list[dict[str, Any]] = field(default_factory=list)
    trace_calls: list[tuple[str, str | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Accelerator:
    _state: FakeState

    def __init__(self, device_name: str = "auto", dev_no: int = 0) -> None:
        self.device_name, self.dev_no = device_name, dev_no
        self._state.accelerators.append((device_name, dev_no))


class ModelConfig:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def _record(self, name: str, *args: Any) -> bool:
        self.calls.append((name, args))
        return True

    def set_auto_core_mode(self) -> bool:
        return self._record("set_auto_core_mode")

    def set_single_core_mode(self, num_cores: Any = None, core_ids: Any = None) -> bool:
        return self._record("set_single_core_mode", num_cores, list(core_ids or []))

    def set_multi_core_mode(self, clusters: Any) -> bool:
        return self._record("set_multi_core_mode", list(clusters))

    def set_global4_core_mode(self, clusters: Any) -> bool:
        return self._record("set_global4_core_mode", list(clusters))

    def set_global8_core_mode(self) -> bool:
        return self._record("set_global8_core_mode")


class FakeModel:
    _state: FakeState

    def __init__(self, path: str, model_config: ModelConfig | None = None) -> None:
        st = self._state
        self.ordinal = len(st.models)
        self.path, self.config = path, model_config
        self.acc: Accelerator | None = None
        self.disposed = False
        self.launched = False
        self.kv: dict[int, list[bytes]] = {}
        st.models.append(self)
        self._maybe_fail("create")

    def _maybe_fail(self, phase: str) -> None:
        exc = self._state.fail.get((phase, self.ordinal))
        if exc is not None:
            raise exc

    # lifecycle
    def launch(self, acc: Accelerator) -> None:
        self._maybe_fail("launch")
        self.acc, self.launched = acc, True

    def dispose(self) -> None:
        self.acc, self.disposed = None, True

    # metadata
    def get_cache_infos(self) -> list[CacheInfo]:
        self._maybe_fail("probe")
        st = self._state
        if st.no_cache_infos:
            return []
        return [CacheInfo(f"layer{i}", st.layer_bytes, st.k) for i in range(st.n_layers)]

    def get_model_input_shape(self) -> list[tuple[int, ...]]:
        return [(1, -1, self._state.hidden)]

    def get_model_output_shape(self) -> list[tuple[int, ...]]:
        return [(1, self._state.out_width, self._state.vocab)]

    def get_input_buffer_info(self) -> list[BufferInfo]:
        return [BufferInfo(self._state.max_width, self._state.max_cache_size)]

    def get_output_buffer_info(self) -> list[BufferInfo]:
        st = self._state
        width = st.out_max_width if st.out_max_width is not None else (
            st.k if st.out_width == 1 else st.max_width)
        return [BufferInfo(width, st.max_cache_size)]

    # inference
    def infer(self, inputs: list[np.ndarray], outputs: Any = None, cache_size: int = 0,
              params: list[BatchParam] | None = None) -> list[np.ndarray]:
        st = self._state
        if self.acc is None:
            raise QbRuntimeError("Model_NotLaunched occurred.")
        (x,) = inputs
        with st.lock:
            st.infer_calls.append(dict(model=self.ordinal, shape=x.shape, dtype=x.dtype,
                                       cache_size=cache_size, params=params,
                                       thread=threading.current_thread().name))
        if st.barrier is not None:
            st.barrier.wait()
        self._maybe_fail("infer")
        tokens = x.reshape(-1, x.shape[-1])
        if params is None:
            lengths = [tokens.shape[0]]
        else:
            lengths = [p.sequence_length for p in params]
            if sum(lengths) != tokens.shape[0]:
                raise QbRuntimeError("Model_InvalidBatchParam occurred.")
        per_token = np.stack([token_logits(t, st.vocab) for t in tokens])
        if st.out_width == 1:
            ends = np.cumsum(lengths) - 1
            rows = per_token[ends]
        else:
            rows = per_token
        if st.wrong_rows is not None:
            rows = np.resize(rows, (st.wrong_rows, st.vocab))
        return [rows.reshape(1, rows.shape[0], st.vocab)]

    # KV host copies
    def dump_cache_memory(self, cache_id: int = 0) -> list[bytes]:
        st = self._state
        return self.kv.get(cache_id, [bytes(st.layer_bytes)] * st.n_layers)

    def load_cache_memory(self, bufs: list[bytes], cache_id: int = 0) -> None:
        self.kv[cache_id] = list(bufs)


def make_fake_runtime(**knobs: Any) -> types.ModuleType:
    """A fresh fake ``qbruntime`` module; ``knobs`` set :class:`FakeState` fields. The state is
    the module attribute ``state``."""
    state = FakeState(**knobs)
    mod = types.ModuleType("fake_qbruntime_instance")
    mod.state = state
    mod.QbRuntimeError = QbRuntimeError
    mod.Cluster, mod.Core, mod.CoreId, mod.BatchParam = Cluster, Core, CoreId, BatchParam
    mod.ModelConfig = ModelConfig
    mod.Accelerator = type("Accelerator", (Accelerator,), {"_state": state})
    mod.Model = type("Model", (FakeModel,), {"_state": state})

    def start_tracing_events(path: str) -> bool:
        state.trace_calls.append(("start", path))
        mod._trace_path = path
        return state.trace_start_result

    def stop_tracing_events() -> None:
        state.trace_calls.append(("stop", None))
        if state.trace_writes_file:
            Path(mod._trace_path).write_text("[\n\n]")

    mod.start_tracing_events = start_tracing_events
    mod.stop_tracing_events = stop_tracing_events
    return mod
