"""A Mobilint Mixture-of-Experts release (Qwen3-MoE) on the runtime API: :class:`MoeBackend`.

A release (``docs/mblt-moe-release.md``) ships one *shared* MXQ per decoder layer (attention and
that layer's KV; outputs ``residual``, ``expert_in`` and the router ``gate``), one MXQ per
(layer, expert), and one ``lm_head`` MXQ; the host embeds, routes (softmax, top-k, renormalised
with ``norm_topk_prob``) and adds the weighted expert outputs to the residual. The MXQs come from
per-layer packs listed by a ``mobilint-moe-mxqpack`` v1 index, or from ``str.format`` templates.

:class:`MoeBackend` has the surface :class:`~vllm_npu.mblt.backend.MbltBackend` gives the worker
(``infer_rows``, ``dump``/``load``, ``slot_of``, shapes), with one slot: MoE releases serve one
sequence at a time (``max_batch_size`` 1). Its KV is every shared MXQ's, so a dump (a
prefix-cache snapshot) holds one blob per layer and ``kv_nbytes_per_cache`` counts them all. It
emits the last position's logits only (the release's last layer emits only the last token's
hidden state), so prompt logprobs take the worker's 1-token microstep path.

Placement (:class:`MoePlacement`), from the release's ``config.json`` and the loader extra
config's ``shared_``/``expert_``/``lm_head_`` prefixed ``target_cores`` and
``num_expert_workers``: ``shared[L]`` on the ``L % n``-th shared device, expert ``e`` of every
layer on the ``e % m``-th expert device with that device's expert cores, the lm_head on its one
device. Experts of one layer run in parallel, on ``num_expert_workers`` threads.

Expert sum order (``expert_sum_order`` in the loader extra config): ``"finish"`` (default, the
board's behaviour: each expert's weighted output is added to the residual as it finishes, so
float32 rounding, and rarely a greedy token, can differ run to run) or ``"expert"`` (ascending
expert id, then added to the residual: the golden reference's order, deterministic).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from vllm_npu.mblt.backend import MbltBackend
from vllm_npu.mblt.dispatch import Row
from vllm_npu.mblt.errors import MbltBackendError, MobilintBackendAllocError
from vllm_npu.mblt.placement import MbltTargetError, parse_core_target
from vllm_npu.mblt.settings import MbltConfigError

__all__ = ["MOE_MODEL_TYPE", "SUM_ORDERS", "MoeBackend", "MoePlacement", "MoeRelease", "MoeReleaseError",
           "is_moe_release"]

logger = logging.getLogger("vllm.vllm_npu.mblt")

MOE_MODEL_TYPE = "mobilint-qwen3_moe"
ROLES: tuple[str, ...] = ("shared", "expert", "lm_head")
SUM_ORDERS: tuple[str, ...] = ("finish", "expert")
#: transformers-mblt's role cores when config.json names none.
DEFAULT_CORES: dict[str, tuple[str, ...]] = {
    "shared": ("0:0:0",), "expert": tuple(f"0:{c}:{k}" for c in range(2) for k in range(4)), "lm_head": ("0:0:0",),
}
DEFAULT_EXPERT_WORKERS = 24
PACK_FORMAT, PACK_VERSION = "mobilint-moe-mxqpack", 1
SHARED_ROLES: tuple[str, ...] = ("residual", "expert_in", "gate")
#: A shared output's scale times the expert input scale is within this of 1 for ``expert_in``.
SCALE_TOLERANCE = 1e-3
#: Token counts whose buffers each model keeps (transformers-mblt keeps 2 chunk sizes).
KEPT_TOKEN_COUNTS = 2
BATCH_REFUSAL = "Mixture-of-Experts models support only non-batch serving, but max_batch_size={n} was configured."


def is_moe_release(artifact: Mapping[str, object]) -> bool:
    """Whether ``config.json`` (as a mapping) is a Mobilint Mixture-of-Experts release."""
    return artifact.get("model_type") == MOE_MODEL_TYPE


def num_experts(artifact: Mapping[str, object]) -> int:
    """Experts per layer: ``num_experts`` of config.json, which transformers 5 keeps as
    ``num_local_experts`` in a parsed ``Qwen3MoeConfig``.

    Raises:
        MoeReleaseError: neither key holds an int >= 1.
    """
    n = artifact.get("num_experts", artifact.get("num_local_experts"))
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise MoeReleaseError(f"config num_experts={n!r} must be an int >= 1")
    return n


class MoeReleaseError(MbltBackendError):
    """The release's files break a rule of the layout (the message names the file and the rule)."""


# ------------------------------------------------------------------------------------ placement
@dataclass(frozen=True)
class MoePlacement:
    """Where each role's MXQs run, and how the host combines experts.

    Attributes:
        cores: role -> canonical ``"d:c:k"`` cores, in the order given.
        num_expert_workers: threads running experts (>= 1).
        sum_order: :data:`SUM_ORDERS`.
    """

    cores: Mapping[str, tuple[str, ...]]
    num_expert_workers: int = DEFAULT_EXPERT_WORKERS
    sum_order: str = "finish"

    @classmethod
    def resolve(cls, artifact: Mapping[str, object], extra: Mapping[str, object]) -> MoePlacement:
        """From ``config.json`` and the loader extra config (which wins), key by key.

        Raises:
            MbltConfigError: a role's cores that are not a non-empty list of ``"d:c:k"``; a
                ``<role>_core_mode`` other than ``single``; ``<role>_dev_no`` or
                ``<role>_target_clusters`` (not used: MoE roles place on cores); an lm_head on more
                than one device; ``num_expert_workers`` not an int >= 1; an unknown
                ``expert_sum_order``. The message names the key, the value and the rule.
        """
        cores: dict[str, tuple[str, ...]] = {}
        for role in ROLES:
            for unused in ("dev_no", "target_clusters"):
                if f"{role}_{unused}" in extra:
                    raise MbltConfigError(
                        f"{role}_{unused}={extra[f'{role}_{unused}']!r}: Mixture-of-Experts roles are placed on "
                        f"cores only; give {role}_target_cores as 'd:c:k' strings")
            mode = extra.get(f"{role}_core_mode", artifact.get(f"{role}_core_mode", "single"))
            if mode != "single":
                raise MbltConfigError(f"{role}_core_mode={mode!r}: Mixture-of-Experts releases support only 'single'")
            key = f"{role}_target_cores"
            raw = extra.get(key, artifact.get(key, list(DEFAULT_CORES[role])))
            if not isinstance(raw, (list, tuple)) or not raw:
                raise MbltConfigError(f"{key}={raw!r} must be a non-empty list of 'd:c:k' cores")
            try:
                parsed = [parse_core_target(t) for t in raw]
            except MbltTargetError as exc:
                raise MbltConfigError(f"{key}={list(raw)!r}: {exc}") from None
            if any(c > 1 or k > 3 for _, c, k in parsed) or len(set(parsed)) != len(parsed):
                raise MbltConfigError(f"{key}={list(raw)!r}: cores must be distinct, cluster 0-1 and core 0-3")
            cores[role] = tuple(f"{d}:{c}:{k}" for d, c, k in parsed)
        lm_devices = {int(t.split(":")[0]) for t in cores["lm_head"]}
        if len(lm_devices) != 1:
            raise MbltConfigError(f"lm_head_target_cores={list(cores['lm_head'])!r} must cover exactly one device, "
                                  f"got devices {sorted(lm_devices)}")
        workers = extra.get("num_expert_workers", artifact.get("num_expert_workers", DEFAULT_EXPERT_WORKERS))
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise MbltConfigError(f"num_expert_workers={workers!r} must be an int >= 1")
        order = extra.get("expert_sum_order", "finish")
        if order not in SUM_ORDERS:
            raise MbltConfigError(f"expert_sum_order={order!r} must be one of {', '.join(SUM_ORDERS)}")
        return cls(cores=cores, num_expert_workers=workers, sum_order=str(order))

    def devices(self, role: str) -> list[int]:
        """The role's devices, in order of first appearance."""
        out: list[int] = []
        for t in self.cores[role]:
            d = int(t.split(":")[0])
            if d not in out:
                out.append(d)
        return out

    def cores_on(self, role: str, dev: int) -> list[tuple[int, int]]:
        """``(cluster, core)`` of the role's cores on device ``dev``."""
        return [(c, k) for d, c, k in (parse_core_target(t) for t in self.cores[role]) if d == dev]


# ------------------------------------------------------------------------------------ files
class MoeRelease:
    """The MXQ files of a release directory (packed or templated).

    Raises (construction):
        MoeReleaseError: no pack index and no templates; an index that is not format
            ``mobilint-moe-mxqpack`` version 1, whose rows are not one per layer of
            ``1 + num_experts`` sizes, or whose pack files are missing or of another size; a
            missing MXQ file. The message names the path and the rule.
    """

    def __init__(self, model_dir: str | os.PathLike, artifact: Mapping[str, object]) -> None:
        self.root = Path(model_dir)
        self.num_layers = int(artifact["num_hidden_layers"])  # type: ignore[arg-type]
        self.num_experts = num_experts(artifact)
        self.lm_head_path = self.root / str(artifact.get("lm_head_mxq_path") or "")
        if not artifact.get("lm_head_mxq_path") or not self.lm_head_path.is_file():
            raise MoeReleaseError(f"{self.root}: lm_head_mxq_path={artifact.get('lm_head_mxq_path')!r} names no file")
        self._index: dict[str, Any] | None = None
        index = artifact.get("moe_mxq_pack_index")
        if index:
            self._load_index(self.root / str(index))
            return
        self._templates = (artifact.get("shared_mxq_path"), artifact.get("expert_mxq_path"))
        if not all(isinstance(t, str) and t for t in self._templates):
            raise MoeReleaseError(f"{self.root}: a Mixture-of-Experts release needs moe_mxq_pack_index, or both "
                                  f"shared_mxq_path and expert_mxq_path templates (got {self._templates!r})")
        for layer in range(self.num_layers):
            for i in range(1 + self.num_experts):
                if not self._file(layer, i).is_file():
                    raise MoeReleaseError(f"{self.root}: missing MXQ {self._file(layer, i)}")

    def _load_index(self, path: Path) -> None:
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise MoeReleaseError(f"{path}: cannot read the MoE pack index ({exc})") from None
        if not isinstance(index, dict) or (index.get("format"), index.get("version")) != (PACK_FORMAT, PACK_VERSION):
            got = (index.get("format"), index.get("version")) if isinstance(index, dict) else index
            raise MoeReleaseError(f"{path} is not a {PACK_FORMAT} v{PACK_VERSION} index (format, version = {got!r})")
        a, pack, sizes = index.get("alignment"), index.get("pack"), index.get("sizes")
        if isinstance(a, bool) or not isinstance(a, int) or a < 1 or a & (a - 1):
            raise MoeReleaseError(f"{path}: alignment={a!r} must be a positive power of two")
        if not isinstance(pack, str) or "{layer}" not in pack or not pack.endswith(".mxqpack"):
            raise MoeReleaseError(f"{path}: pack={pack!r} must contain '{{layer}}' and end with '.mxqpack'")
        if (not isinstance(sizes, list) or len(sizes) != self.num_layers
                or any(not isinstance(r, list) or len(r) != 1 + self.num_experts for r in sizes)):
            raise MoeReleaseError(f"{path}: sizes must hold {self.num_layers} rows of {1 + self.num_experts} sizes "
                                  "(the shared MXQ, then every expert)")
        for layer, row in enumerate(sizes):
            file = path.parent / pack.format(layer=layer)
            want = sum(-(-s // a) * a for s in row[:-1]) + row[-1]
            if not file.is_file():
                raise MoeReleaseError(f"{path}: missing pack {file}")
            if file.stat().st_size != want:
                raise MoeReleaseError(f"{file} is {file.stat().st_size} bytes but its index describes {want} bytes")
        self._index = {"dir": path.parent, "alignment": a, "pack": pack, "sizes": sizes}

    def _file(self, layer: int, member: int) -> Path:
        shared, expert = self._templates
        rel = shared.format(layer=layer) if member == 0 else expert.format(layer=layer, expert=member - 1)  # type: ignore[union-attr]
        return self.root / rel

    @contextmanager
    def member(self, layer: int, member: int) -> Iterator[str]:
        """A path holding member ``member`` of layer ``layer`` (0: the shared MXQ, ``1 + e``: expert
        ``e``) for as long as the context lasts: the file itself, or the bytes cut from the
        layer's pack into a temporary file (removed afterwards)."""
        if self._index is None:
            yield str(self._file(layer, member))
            return
        ix = self._index
        sizes, a = ix["sizes"][layer], ix["alignment"]
        start = sum(-(-s // a) * a for s in sizes[:member])
        with open(ix["dir"] / ix["pack"].format(layer=layer), "rb") as f:
            f.seek(start)
            data = f.read(sizes[member])
        kind = "shared" if member == 0 else f"expert_{member - 1}"
        fd, tmp = tempfile.mkstemp(prefix=f"mblt-moe-{os.getpid()}-", suffix=f"-block_{layer}_{kind}.mxq")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            yield tmp
        finally:
            os.unlink(tmp)

    def shared_kv_capacity(self, runtime: Any) -> int:
        """The KV capacity (tokens) of layer 0's shared MXQ, read from a Model never launched.

        Raises:
            QbRuntimeError: the runtime cannot load it (its error, unchanged).
        """
        with self.member(0, 0) as path:
            model = runtime.Model(path)
            try:
                return int(model.get_input_buffer_info()[0].max_cache_size)
            finally:
                model.dispose()


# ------------------------------------------------------------------------------------ backend
@dataclass
class _Layer:
    shared: Any
    experts: list[Any]
    residual: int
    expert_in: int
    gate: int
    #: the shared MXQ emits only the last token's row (a release's final layer may)
    last_only: bool = False


@dataclass
class _Io:
    """A model's NPU data for one token count: the input on the host and on the card, the outputs
    on the card and on the host."""

    host_in: Any
    npu_in: Any
    npu_out: list[Any]
    host_out: list[Any]


class _IoCache:
    """Per model, the :class:`_Io` of its :data:`KEPT_TOKEN_COUNTS` most recently used token counts,
    acquired once and reused by later steps (a decode step always finds its one-token buffers),
    as transformers-mblt keeps its shared MXQs' buffers per chunk size. Thread-safe: experts of one
    layer run on several threads, each on its own model."""

    def __init__(self, hidden: int) -> None:
        self._hidden = hidden
        self._by_model: dict[int, OrderedDict[int, _Io]] = {}
        self._lock = threading.Lock()

    def get(self, model: Any, n: int, out_shapes: Sequence[tuple[int, int]]) -> _Io:
        """``model``'s buffers for ``n`` input tokens and outputs ``[1, rows, C]`` per ``out_shapes``."""
        with self._lock:
            kept = self._by_model.setdefault(id(model), OrderedDict())
            io = kept.get(n)
            if io is not None:
                kept.move_to_end(n)
                return io
        shape = [1, n, self._hidden]
        outs = [[1, rows, c] for rows, c in out_shapes]
        io = _Io(model.acquire_input_npu_data(shape, 0, False), model.acquire_input_npu_data(shape, 0, True),
                 [model.acquire_output_npu_data(o, i, True) for i, o in enumerate(outs)],
                 [model.acquire_output_npu_data(o, i, False) for i, o in enumerate(outs)])
        with self._lock:
            kept[n] = io
            while len(kept) > KEPT_TOKEN_COUNTS:
                kept.popitem(last=False)
        return io

    def clear(self) -> None:
        """Drop every buffer."""
        with self._lock:
            self._by_model.clear()


class MoeBackend:
    """A release's MXQs launched as placed, run one sequence at a time (module docstring).

    Attributes (the :class:`~vllm_npu.mblt.backend.MbltBackend` surface the worker reads):
        models, model_dev_no: every launched MXQ and its device; k_per_model 1; capacity 1;
        hidden_size, vocab_size; max_width (tokens per call); max_cache_size (the smallest shared
        KV capacity); kv_nbytes_per_cache (every shared MXQ's CacheInfo bytes); output_layout "last".
    """

    k_per_model = 1
    capacity = 1
    output_layout: Literal["last"] = "last"

    def __init__(self, runtime: Any, layers: list[_Layer], lm_head: Any, models: list[Any], model_dev_no: list[int],
                 accelerators: dict[int, Any], placement: MoePlacement, artifact: Mapping[str, object]) -> None:
        """Internal: use :meth:`create`."""
        self.runtime, self.layers, self.lm_head = runtime, layers, lm_head
        self.models, self.model_dev_no, self.accelerators, self.placement = models, model_dev_no, accelerators, placement
        first = layers[0].shared
        self.hidden_size = int(tuple(first.get_model_input_shape()[0])[-1])
        self.vocab_size = int(tuple(lm_head.get_model_output_shape()[0])[-1])
        self.num_experts = num_experts(artifact)
        self.top_k = int(artifact["num_experts_per_tok"])  # type: ignore[arg-type]
        self.norm_topk_prob = bool(artifact.get("norm_topk_prob", False))
        self.max_cache_size = min(int(layer.shared.get_input_buffer_info()[0].max_cache_size) for layer in layers)
        self.max_width = min(int(m.get_input_buffer_info()[0].max_width) for m in (first, layers[0].experts[0]))
        self.kv_nbytes_per_cache = sum(int(i.size) for layer in layers for i in layer.shared.get_cache_infos())
        self._pool = ThreadPoolExecutor(max_workers=placement.num_expert_workers, thread_name_prefix="mblt-expert")
        self._ios = _IoCache(self.hidden_size)
        self._head_io: tuple[Any, Any] | None = (lm_head.acquire_input_npu_data([1, 1, self.hidden_size], 0, False),
                                                 lm_head.acquire_output_npu_data([1, 1, self.vocab_size], 0, False))
        self._lock = threading.Lock()
        self._disposed = False

    # ---------------------------------------------------------------- creation
    @classmethod
    def create(cls, runtime: Any, model_dir: str | os.PathLike, artifact: Mapping[str, object],
               placement: MoePlacement, device_name: str = "aries") -> MoeBackend:
        """Load and launch every MXQ of the release as ``placement`` says: per layer the shared
        MXQ then its experts, the lm_head last; then resolve each shared MXQ's output roles.

        Raises:
            MoeReleaseError: as :class:`MoeRelease`; a shared MXQ whose outputs' roles cannot be
                told (``moe_shared_output_order`` malformed, or no single gate / expert_in output
                by shape and scale).
            MbltConfigError: more expert devices than experts.
            MobilintBackendAllocError: BadAlloc from the runtime (everything disposed).
            QbRuntimeError: any other runtime error, unchanged (everything disposed).
        """
        release = MoeRelease(model_dir, artifact)
        n_layers, n_experts = release.num_layers, release.num_experts
        shared_devs, expert_devs = placement.devices("shared"), placement.devices("expert")
        lm_dev = placement.devices("lm_head")[0]
        if len(expert_devs) > n_experts:
            raise MbltConfigError(f"expert_target_cores cover {len(expert_devs)} devices but the release has only "
                                  f"{n_experts} experts per layer")
        models: list[Any] = []
        devs: list[int] = []
        accs: dict[int, Any] = {}

        def config(role: str, dev: int) -> Any:
            mc = runtime.ModelConfig()
            ids = [runtime.CoreId(getattr(runtime.Cluster, f"Cluster{c}"), getattr(runtime.Core, f"Core{k}"))
                   for c, k in placement.cores_on(role, dev)]
            mc.set_single_core_mode(None, ids)
            return mc

        def launch(path: str, role: str, dev: int) -> Any:
            if dev not in accs:
                accs[dev] = runtime.Accelerator(device_name, dev)
            model = runtime.Model(path, config(role, dev))
            models.append(model)
            devs.append(dev)
            model.launch(accs[dev])
            return model

        layers: list[_Layer] = []
        try:
            for layer in range(n_layers):
                with release.member(layer, 0) as path:
                    shared = launch(path, "shared", shared_devs[layer % len(shared_devs)])
                experts = []
                for e in range(n_experts):
                    with release.member(layer, 1 + e) as path:
                        experts.append(launch(path, "expert", expert_devs[e % len(expert_devs)]))
                last_only = int(tuple(shared.get_model_output_shape()[0])[-2]) == 1
                if last_only and layer != n_layers - 1:
                    raise MoeReleaseError(f"shared MXQ of layer {layer} emits only the last token, but layer "
                                          f"{layer + 1} needs every token: only the final layer may be last-only")
                layers.append(_Layer(shared, experts, *_output_roles(layer, shared, experts[0], artifact, n_experts),
                                     last_only=last_only))
            lm_head = launch(str(release.lm_head_path), "lm_head", lm_dev)
        except BaseException as exc:
            MbltBackend._dispose_models(models)
            if isinstance(exc, runtime.QbRuntimeError) and "badalloc" in str(exc).replace(" ", "").lower():
                raise MobilintBackendAllocError(phase="launch", slot=len(models) - 1, dev=devs[-1] if devs else 0,
                                                succeeded_so_far=max(0, len(models) - 1),
                                                n_total=n_layers * (1 + n_experts) + 1, max_batch_size=1,
                                                k_per_model=1, original=exc) from exc
            raise
        logger.info(
            "MBLT MoE release: %d shared MXQs round-robin on device(s) %s, %d x %d experts on device(s) %s, lm_head on device %d; "
            "%d expert workers, expert outputs summed in %s order",
            n_layers, shared_devs, n_layers, n_experts, expert_devs, lm_dev, placement.num_expert_workers,
            placement.sum_order)
        return cls(runtime, layers, lm_head, models, devs, accs, placement, artifact)

    # ---------------------------------------------------------------- slots
    def slot_of(self, vllm_slot: int) -> tuple[int, int]:
        """Raises: MbltBackendError: any slot but 0 (one sequence at a time)."""
        if vllm_slot != 0:
            raise MbltBackendError(f"Mixture-of-Experts releases hold one sequence: slot {vllm_slot!r} does not exist")
        return 0, 0

    def _check(self, model_idx: int, cache_id: int) -> None:
        if self._disposed:
            raise MbltBackendError("the Mobilint backend was disposed")
        if (model_idx, cache_id) != (0, 0):
            raise MbltBackendError(f"slot (model_idx={model_idx}, cache_id={cache_id}) is outside the MoE backend's "
                                   "one slot (0, 0)")

    # ---------------------------------------------------------------- compute
    def infer_rows(self, rows: Sequence[Row]) -> list[np.ndarray]:
        """Run one step of the one sequence: ``[vocab]`` logits of its last token.

        Raises:
            MbltBackendError: disposed; more than one row; a row outside slot (0, 0); a row wider
                than ``max_width`` or of another hidden size.
            QbRuntimeError: whatever an MXQ raised, unchanged.
        """
        if not rows:
            return []
        if len(rows) > 1:
            raise MbltBackendError(f"{len(rows)} rows in one step: a Mixture-of-Experts release runs one sequence")
        row = rows[0]
        self._check(row.model_idx, row.cache_id)
        x = np.asarray(row.embeds, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.hidden_size or not 1 <= x.shape[0] <= self.max_width:
            raise MbltBackendError(f"row of shape {x.shape}: expected [T, {self.hidden_size}] with 1 <= T <= "
                                   f"{self.max_width}")
        h = x
        for layer in self.layers:
            residual, expert_in, gate = self._shared(layer, h, int(row.cache_size))
            h = self._experts(layer, residual, expert_in, gate)
        return [self._head(h[-1:])]

    def _shared(self, layer: _Layer, h: np.ndarray, cache_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The shared MXQ on ``h``; ``(residual, expert_in, gate)`` on the host, one row per token
        (one row, the last token's, on a last-only layer)."""
        rows = 1 if layer.last_only else h.shape[0]
        channels = {layer.residual: self.hidden_size, layer.expert_in: self.hidden_size, layer.gate: self.num_experts}
        out = self._run(layer.shared, h, [(rows, channels[i]) for i in range(3)], cache_size)
        return out[layer.residual], out[layer.expert_in], out[layer.gate]

    def _run(self, model: Any, x: np.ndarray, out_shapes: Sequence[tuple[int, int]], cache_size: int = 0) -> list[np.ndarray]:
        """``model`` on the host rows ``x`` ``[n, hidden]`` through NPU data on its card (uploaded,
        run, read back; the buffers of :class:`_IoCache`): each output ``[rows, C]`` on the host."""
        io = self._ios.get(model, x.shape[0], out_shapes)
        io.host_in[:] = x[None]
        io.npu_in.copy_from(io.host_in)
        model.infer_npu_data([io.npu_in], io.npu_out, cache_size)
        for host, npu in zip(io.host_out, io.npu_out):
            host.copy_from(npu)
        return [np.array(host[0], dtype=np.float32) for host in io.host_out]

    def _route(self, gate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top-k experts per token (by falling probability, lowest id first on a tie) and their
        weights: softmax over the router logits in float64, renormalised with ``norm_topk_prob``,
        rounded to float32 (the golden reference's rule)."""
        g = gate.astype(np.float64)
        p = np.exp(g - g.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        top = np.argsort(-p, axis=-1, kind="stable")[:, : self.top_k]
        w = np.take_along_axis(p, top, axis=-1)
        if self.norm_topk_prob:
            w = w / w.sum(axis=-1, keepdims=True)
        return top, w.astype(np.float32)

    def _expert(self, model: Any, x: np.ndarray) -> np.ndarray:
        """One expert on its routed rows ``x`` ``[n, hidden]`` (unweighted), on the host."""
        return self._run(model, x, [(x.shape[0], self.hidden_size)])[0]

    def _experts(self, layer: _Layer, residual: np.ndarray, expert_in: np.ndarray, gate: np.ndarray) -> np.ndarray:
        """The next layer's input: ``residual`` plus the routed experts' weighted outputs."""
        top, weights = self._route(gate)
        jobs = {}
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)
            jobs[self._pool.submit(self._expert, layer.experts[int(e)], expert_in[rows])] = (int(e), rows, slot)
        if self.placement.sum_order == "finish":
            h = np.array(residual, dtype=np.float32)
            for fut in as_completed(jobs):
                _, rows, slot = jobs[fut]
                h[rows] += fut.result() * weights[rows, slot, None]
            return h
        out = np.zeros_like(residual, dtype=np.float32)
        for fut in sorted(jobs, key=lambda f: jobs[f][0]):
            _, rows, slot = jobs[fut]
            y = fut.result().astype(np.float64) * weights[rows, slot, None].astype(np.float64)
            out[rows] = (out[rows].astype(np.float64) + y.astype(np.float32)).astype(np.float32)
        return (residual.astype(np.float64) + out).astype(np.float32)

    def _head(self, h: np.ndarray) -> np.ndarray:
        """The lm_head on the host-resident ``[1, hidden]`` row ``h`` (as transformers-mblt calls it)."""
        x, y = self._head_io
        x[:] = h[None]
        self.lm_head.infer_npu_data([x], [y])
        return np.array(y[0, 0], dtype=np.float32)

    # ---------------------------------------------------------------- KV host copies
    def dump(self, model_idx: int, cache_id: int) -> list[bytes]:
        """Every shared MXQ's KV of the one sequence: the blobs of layer 0, then layer 1, ...

        Raises:
            MbltBackendError: disposed, or a slot other than (0, 0).
        """
        self._check(model_idx, cache_id)
        return [b for layer in self.layers for b in layer.shared.dump_cache_memory(0)]

    def load(self, model_idx: int, cache_id: int, blobs: Sequence[bytes]) -> None:
        """Restore what :meth:`dump` returned, layer by layer.

        Raises:
            MbltBackendError: disposed; a slot other than (0, 0); a blob count that is not one per
                shared CacheInfo (nothing is loaded).
            QbRuntimeError: a blob of the wrong size (the runtime's check).
        """
        self._check(model_idx, cache_id)
        counts = [len(layer.shared.get_cache_infos()) for layer in self.layers]
        blobs = list(blobs)
        if len(blobs) != sum(counts):
            raise MbltBackendError(f"{len(blobs)} KV blobs for a release whose shared MXQs hold {sum(counts)}")
        pos = 0
        for layer, n in zip(self.layers, counts):
            layer.shared.load_cache_memory(blobs[pos : pos + n], 0)
            pos += n

    # ---------------------------------------------------------------- teardown
    def dispose(self) -> None:
        """Stop the expert threads and dispose every MXQ; later calls do nothing.

        Raises:
            Exception: the first ``dispose()`` failure, after every model was tried.
        """
        with self._lock:
            if self._disposed:
                return
            self._disposed = True
        self._pool.shutdown(wait=True)
        self._ios.clear()  # NPU data goes before the models and accelerators holding it
        self._head_io = None
        first = MbltBackend._dispose_models(self.models)
        if first is not None:
            raise first


def _output_roles(layer: int, shared: Any, expert: Any, artifact: Mapping[str, object],
                  n_experts: int) -> tuple[int, int, int]:
    """``(residual, expert_in, gate)`` output indices of a shared MXQ: from
    ``moe_shared_output_order`` (``"default"`` or the layer's own entry) when config.json has it,
    else the gate by its ``num_experts`` channels and ``expert_in`` as the one output whose scale
    times the expert input scale is 1 (within :data:`SCALE_TOLERANCE`), as the release's are.

    Raises:
        MoeReleaseError: not 3 outputs; a malformed order; no single output fits a role.
    """
    shapes = [tuple(s) for s in shared.get_model_output_shape()]
    if len(shapes) != 3:
        raise MoeReleaseError(f"shared MXQ of layer {layer} has {len(shapes)} outputs; a shared MXQ has 3 "
                              "(residual, expert_in, gate)")
    order = artifact.get("moe_shared_output_order")
    if order is not None:
        entry = order.get(str(layer), order.get("default")) if isinstance(order, Mapping) else None
        if entry is not None:
            if not isinstance(entry, list) or sorted(entry) != sorted(SHARED_ROLES):
                raise MoeReleaseError(f"moe_shared_output_order for layer {layer} is {entry!r}; it must be a "
                                      f"permutation of {list(SHARED_ROLES)}")
            idx = {role: entry.index(role) for role in SHARED_ROLES}
            if shapes[idx["gate"]][-1] != n_experts:
                raise MoeReleaseError(f"shared MXQ of layer {layer}: output {idx['gate']} has {shapes[idx['gate']][-1]} "
                                      f"channels but the router gate has num_experts={n_experts}")
            return idx["residual"], idx["expert_in"], idx["gate"]
    gates = [i for i, s in enumerate(shapes) if s[-1] == n_experts]
    if len(gates) != 1:
        raise MoeReleaseError(f"shared MXQ of layer {layer}: cannot tell the router gate from output shapes {shapes}; "
                              "set moe_shared_output_order in config.json")
    out_scales = shared.get_output_scale()
    in_scale = expert.get_input_scale()[0]
    matches = [i for i, s in enumerate(out_scales) if i != gates[0] and s.is_uniform and in_scale.is_uniform
               and abs(float(s.scale) * float(in_scale.scale) - 1.0) <= SCALE_TOLERANCE]
    if len(matches) != 1:
        raise MoeReleaseError(f"shared MXQ of layer {layer}: cannot tell expert_in from the quantisation scales "
                              f"({[s.scale for s in out_scales]} against expert input {in_scale.scale}); "
                              "set moe_shared_output_order in config.json")
    residual = ({0, 1, 2} - {gates[0], matches[0]}).pop()
    return residual, matches[0], gates[0]
