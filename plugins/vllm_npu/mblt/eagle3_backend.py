"""A Mobilint EAGLE-3 release on the runtime API: its files (:class:`Eagle3Release`) and its three
MXQs (:class:`Eagle3Backend`).

A release (``docs/mblt-eagle3-release.md``) ships a *base* MXQ (the target model: inputs
embeddings, mask, RoPE rows; outputs three hidden taps and every row's logits; KV on cache id
0), an *fc* MXQ (the taps ``[T, 3H]`` projected to the draft width ``Hd``; no KV) and a *draft*
MXQ (one block: inputs draft embeddings of target ids, hidden, mask, RoPE rows; outputs hidden
and draft-vocabulary logits; KV on cache id 0), plus host weights in ``model.safetensors``: both
embedding tables and the draft's ``d2t`` map. Every MXQ tensor is float32 and rank 4
``[1, 1, T, C]``.

:class:`Eagle3Backend` embeds on the host, cuts each call into chunks of at most the MXQ's
``max_width`` and ``npu_prefill_chunk_size`` tokens, and checks the KV capacity before every
infer (``cache_size + T <= max_cache_size``), raising :class:`Eagle3CapacityError` naming both
numbers where the runtime would fail. It does not know the round: :mod:`vllm_npu.mblt.eagle3_round`
drives it. One sequence at a time holds the base and draft KV; :attr:`Eagle3Backend.owner` says
which.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_npu.mblt.errors import MbltBackendError
from vllm_npu.mblt.placement import MbltTargetError, parse_core_target
from vllm_npu.mblt.settings import MbltConfigError

__all__ = ["BATCH_REFUSAL", "EAGLE3_MODEL_TYPES", "Eagle3Backend", "Eagle3CapacityError", "Eagle3Release",
           "Eagle3ReleaseError", "is_eagle3_release", "loader_layout"]

logger = logging.getLogger("vllm.vllm_npu.mblt")

EAGLE3_MODEL_TYPES: tuple[str, ...] = ("mobilint-llama-eagle3", "mobilint-qwen2-eagle3", "mobilint-qwen3-eagle3")
ROLES: tuple[str, ...] = ("base", "draft", "fc")
BATCH_REFUSAL = "EAGLE-3 models serve one sequence per base MXQ, but max_batch_size={n} was configured."
DEFAULT_CHUNK = 128
DEFAULT_TREE = {"num_assistant_tokens": 64, "eagle3_tree_depth": 5, "eagle3_tree_top_k": 8}
BASE_EMBED = "eagle3_base_model.embed_tokens.weight"
DRAFT_EMBED = "eagle3_draft_model.embed_tokens.weight"
D2T = "eagle3_draft_model.d2t"


def is_eagle3_release(artifact: Mapping[str, object]) -> bool:
    """Whether ``config.json`` (as a mapping) is a Mobilint EAGLE-3 release."""
    return artifact.get("model_type") in EAGLE3_MODEL_TYPES


class Eagle3ReleaseError(MbltBackendError):
    """The release's files or config break a rule of the layout (the message names the key or
    file and the rule)."""


class Eagle3CapacityError(MbltBackendError):
    """An infer would write KV past the MXQ's capacity.

    Attributes:
        role: ``"base"`` or ``"draft"``.
        end: ``cache_size + T`` of the refused infer (tokens).
        capacity: the MXQ's ``max_cache_size`` (tokens).
    """

    def __init__(self, role: str, cache_size: int, tokens: int, capacity: int) -> None:
        self.role, self.end, self.capacity = role, cache_size + tokens, capacity
        super().__init__(
            f"EAGLE-3 {role} MXQ: an infer of {tokens} tokens at cache_size={cache_size} needs KV up to "
            f"{cache_size + tokens} tokens, above its capacity max_cache_size={capacity}")


def _theta(cfg: Mapping[str, Any], default: float | None) -> float:
    """``rope_theta`` of a config dict: the flat key (transformers 4) or inside
    ``rope_parameters`` / ``rope_scaling`` (transformers 5).

    Raises:
        Eagle3ReleaseError: none found and no default.
    """
    for src in (cfg, cfg.get("rope_parameters"), cfg.get("rope_scaling")):
        if isinstance(src, Mapping) and src.get("rope_theta") is not None:
            return float(src["rope_theta"])
    if default is None:
        raise Eagle3ReleaseError("config.json has no rope_theta (flat, or in rope_parameters / rope_scaling)")
    return float(default)


def _head_dim(cfg: Mapping[str, Any], what: str) -> int:
    hd = cfg.get("head_dim")
    if hd is None:
        try:
            hd = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
        except (KeyError, TypeError, ValueError):
            raise Eagle3ReleaseError(f"{what}: no head_dim, and no hidden_size / num_attention_heads") from None
    return int(hd)


def _positive_int(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise Eagle3ReleaseError(f"{name}={value!r} must be an int >= {minimum}")
    return value


@dataclass(frozen=True)
class RolePlacement:
    """Where one role's MXQ runs: device ``dev`` and its single-core-mode cores ``(cluster, core)``."""

    dev: int
    cores: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Eagle3Release:
    """What the host needs of an EAGLE-3 release directory.

    Attributes:
        root: the release directory.
        hidden_size, vocab_size, head_dim, rope_theta: the base's ``H``, ``V``, head dim and theta.
        draft_hidden_size, draft_vocab_size, draft_head_dim, draft_rope_theta: the draft's ``Hd``,
            ``Dv``, head dim and theta (theta defaults to 10000).
        num_assistant_tokens: tree size, root included (>= 2).
        depth, top_k: the tree's levels and fan-out.
        chunk: tokens per base / draft infer chunk (``npu_prefill_chunk_size``).
        paths: role -> MXQ path.
        placement: role -> :class:`RolePlacement`.
        max_batch_size: ``base_max_batch_size`` (or the unprefixed key), None when absent.
    """

    root: Path
    hidden_size: int
    vocab_size: int
    head_dim: int
    rope_theta: float
    draft_hidden_size: int
    draft_vocab_size: int
    draft_head_dim: int
    draft_rope_theta: float
    num_assistant_tokens: int
    depth: int
    top_k: int
    chunk: int
    paths: Mapping[str, Path]
    placement: Mapping[str, RolePlacement]
    max_batch_size: int | None

    @classmethod
    def read(cls, model_dir: str | os.PathLike, artifact: Mapping[str, Any],
             extra: Mapping[str, Any] | None = None) -> Eagle3Release:
        """From ``config.json`` (``artifact``), ``generation_config.json`` and the loader extra
        config ``extra`` (which wins over config.json for the role layout keys).

        Tree shape: ``num_assistant_tokens`` from generation_config.json (else 64); depth and
        top_k from generation_config.json, else config.json, else 5 and 8. Per-role layout keys
        are ``<role>_<key>``; an unprefixed key applies to every role that lacks the prefixed one in
        the same source (the loader extra config's keys, prefixed or not, win over config.json's).

        Raises:
            Eagle3ReleaseError: a missing ``draft_config`` or MXQ file, ``draft_vocab_size`` above
                the target vocabulary, ``num_assistant_tokens`` < 2, depth or top_k < 1, a chunk
                size that is not a positive int, an unreadable generation_config.json.
            MbltConfigError: a role's ``core_mode`` other than ``single``, or bad ``dev_no`` /
                ``target_cores``.
        """
        root = Path(model_dir)
        extra = dict(extra or {})
        draft = artifact.get("draft_config")
        if hasattr(draft, "to_dict"):
            draft = draft.to_dict()
        if not isinstance(draft, Mapping):
            raise Eagle3ReleaseError(f"{root}/config.json: draft_config={draft!r} must be a LlamaConfig dict")
        vocab = _positive_int(artifact.get("vocab_size"), "vocab_size")
        dv = _positive_int(draft.get("draft_vocab_size", draft.get("vocab_size", vocab)), "draft_config.draft_vocab_size")
        if dv > vocab:
            raise Eagle3ReleaseError(f"draft_config.draft_vocab_size={dv} exceeds the target vocab_size={vocab}")
        gen_path = root / "generation_config.json"
        gen: dict[str, Any] = {}
        if gen_path.is_file():
            try:
                gen = json.loads(gen_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise Eagle3ReleaseError(f"{gen_path}: unreadable ({exc})") from None

        def tree_key(key: str, from_config: bool) -> int:
            value = gen.get(key)
            if value is None and from_config:
                value = artifact.get(key)
            return DEFAULT_TREE[key] if value is None else value  # type: ignore[return-value]

        nat = tree_key("num_assistant_tokens", False)
        if isinstance(nat, bool) or not isinstance(nat, int) or nat < 2:
            raise Eagle3ReleaseError(f"EAGLE-3 num_assistant_tokens must be >= 2 (the root token plus at least one "
                                     f"draft token), got {nat!r}.")
        depth = _positive_int(tree_key("eagle3_tree_depth", True), "eagle3_tree_depth")
        top_k = _positive_int(tree_key("eagle3_tree_top_k", True), "eagle3_tree_top_k")
        if top_k > dv:
            raise Eagle3ReleaseError(f"eagle3_tree_top_k={top_k} exceeds the draft vocabulary ({dv} tokens)")
        chunk_raw = artifact.get("npu_prefill_chunk_size", DEFAULT_CHUNK)
        if isinstance(chunk_raw, Mapping):
            chunk_raw = chunk_raw.get("single", chunk_raw.get("default", chunk_raw.get("DEFAULT", DEFAULT_CHUNK)))
        chunk = _positive_int(chunk_raw, "npu_prefill_chunk_size")

        def role_key(role: str, key: str, default: object = None) -> object:
            for src in (extra, artifact):  # the loader extra config wins over the release
                if f"{role}_{key}" in src:
                    return src[f"{role}_{key}"]
                if key in src and key != "mxq_path":
                    return src[key]
            return default

        paths: dict[str, Path] = {}
        placement: dict[str, RolePlacement] = {}
        for role in ROLES:
            rel = role_key(role, "mxq_path", f"mxq/{role}.mxq")
            path = root / str(rel)
            if not path.is_file():
                raise Eagle3ReleaseError(f"{root}: {role}_mxq_path={rel!r} names no file")
            paths[role] = path
            placement[role] = _role_placement(role, role_key)
        mbs = role_key("base", "max_batch_size")
        if mbs is not None and (isinstance(mbs, bool) or not isinstance(mbs, int)):
            raise Eagle3ReleaseError(f"base_max_batch_size={mbs!r} must be an int")
        return cls(root=root, hidden_size=_positive_int(artifact.get("hidden_size"), "hidden_size"),
                   vocab_size=vocab, head_dim=_head_dim(artifact, "config.json"), rope_theta=_theta(artifact, None),
                   draft_hidden_size=_positive_int(draft.get("hidden_size"), "draft_config.hidden_size"),
                   draft_vocab_size=dv, draft_head_dim=_head_dim(draft, "draft_config"),
                   draft_rope_theta=_theta(draft, 10000.0), num_assistant_tokens=nat, depth=depth, top_k=top_k,
                   chunk=chunk, paths=paths, placement=placement, max_batch_size=mbs)

    def tree_candidates(self) -> int:
        """Candidate nodes one tree expansion yields: ``k + (depth - 1) * k * k``."""
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    def draft_headroom(self) -> int:
        """KV positions the draft's tree levels write past the committed draft KV: ``(depth - 1) * top_k``."""
        return (self.depth - 1) * self.top_k


def loader_layout(overrides: Any) -> dict[str, object]:
    """The loader extra config's layout keys as :meth:`Eagle3Release.read` takes them: the
    role-prefixed keys verbatim, and the unprefixed ``dev_no`` (one device), ``target_cores``,
    ``target_clusters`` and ``core_mode`` (which then apply to every role without its own key)."""
    extra: dict[str, object] = dict(overrides.extra)
    if overrides.dev_no is not None:
        extra["dev_no"] = overrides.dev_no[0] if len(overrides.dev_no) == 1 else list(overrides.dev_no)
    for key in ("target_cores", "target_clusters"):
        if getattr(overrides, key) is not None:
            extra[key] = list(getattr(overrides, key))
    if overrides.core_mode is not None:
        extra["core_mode"] = overrides.core_mode
    return extra


def _role_placement(role: str, role_key: Any) -> RolePlacement:
    """``<role>_dev_no`` (int, default 0), ``<role>_target_cores`` (``"d:c:k"`` list on that
    device; default core 0:0) with ``<role>_core_mode`` single.

    Raises:
        MbltConfigError: another core mode; a dev_no that is not an int >= 0; target cores that do
            not parse or name another device.
    """
    if role_key(role, "target_clusters") is not None:
        raise MbltConfigError(f"{role}_target_clusters={role_key(role, 'target_clusters')!r}: EAGLE-3 roles run in "
                              f"single core mode, placed with {role}_target_cores ('d:c:k' cores)")
    mode = role_key(role, "core_mode", "single")
    if mode != "single":
        raise MbltConfigError(f"{role}_core_mode={mode!r}: the plugin serves EAGLE-3 releases in 'single' core "
                              "mode only (as the releases ship)")
    dev = role_key(role, "dev_no", 0)
    if isinstance(dev, list) and len(dev) == 1:
        dev = dev[0]
    if isinstance(dev, bool) or not isinstance(dev, int) or dev < 0:
        raise MbltConfigError(f"{role}_dev_no={dev!r} must be one int >= 0 (one MXQ per role)")
    raw = role_key(role, "target_cores")
    if raw is None:
        return RolePlacement(dev, ((0, 0),))
    if isinstance(raw, str):
        raw = [raw]
    try:
        parsed = [parse_core_target(t) for t in raw]  # type: ignore[union-attr]
    except (MbltTargetError, TypeError) as exc:
        raise MbltConfigError(f"{role}_target_cores={raw!r}: {exc}") from None
    if not parsed or {d for d, _, _ in parsed} != {dev}:
        raise MbltConfigError(f"{role}_target_cores={raw!r} must be non-empty 'd:c:k' cores on {role}_dev_no={dev}")
    return RolePlacement(dev, tuple((c, k) for _, c, k in parsed))


def load_host_weights(root: Path, release: Eagle3Release) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(base embeddings [V, H], draft embeddings [V, Hd], d2t [Dv] or None)`` from
    ``model.safetensors`` (``d2t`` is None when the draft vocabulary is the target's).

    Raises:
        Eagle3ReleaseError: the file or a tensor is missing, or a shape disagrees with config.json.
    """
    from safetensors.numpy import load_file

    path = root / "model.safetensors"
    if not path.is_file():
        raise Eagle3ReleaseError(f"{path}: missing (the host embeddings and d2t of the release)")
    t = load_file(str(path))
    want = {BASE_EMBED: (release.vocab_size, release.hidden_size),
            DRAFT_EMBED: (release.vocab_size, release.draft_hidden_size)}
    if release.draft_vocab_size != release.vocab_size:
        want[D2T] = (release.draft_vocab_size,)
    for name, shape in want.items():
        if name not in t:
            raise Eagle3ReleaseError(f"{path}: no tensor {name!r}")
        if tuple(t[name].shape) != shape:
            raise Eagle3ReleaseError(f"{path}: {name} has shape {tuple(t[name].shape)}, config.json implies {shape}")
    d2t = np.asarray(t[D2T], dtype=np.int64) if D2T in want else None
    if d2t is not None:
        ids = np.arange(d2t.shape[0]) + d2t
        if ids.min() < 0 or ids.max() >= release.vocab_size:
            raise Eagle3ReleaseError(f"{path}: {D2T} maps draft ids outside the target vocabulary [0, {release.vocab_size})")
    return (np.ascontiguousarray(t[BASE_EMBED], dtype=np.float32),
            np.ascontiguousarray(t[DRAFT_EMBED], dtype=np.float32), d2t)


def _rank4(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32)[None, None])


def _rows(out: Any) -> np.ndarray:
    """An MXQ output ``[1, 1, T, C]`` (or ``[1, T, C]``) as ``[T, C]`` float32."""
    a = np.asarray(out, dtype=np.float32)
    return a.reshape(a.shape[-2], a.shape[-1])


class Eagle3Backend:
    """The three launched MXQs of a release and the host weights; build with :meth:`create`.

    Attributes:
        release: the :class:`Eagle3Release`.
        base_capacity, draft_capacity: KV tokens of the base and draft MXQs (``max_cache_size``).
        base_width, draft_width, fc_width: tokens per infer (``max_width``).
        owner: the sequence whose KV the base and draft MXQs hold (None: nobody's).
        infers: MXQ calls so far, per role.
    """

    def __init__(self, release: Eagle3Release, models: Mapping[str, Any], weights: tuple[np.ndarray, np.ndarray,
                 np.ndarray | None]) -> None:
        """Internal: use :meth:`create`."""
        self.release = release
        self.models = dict(models)
        self.base_embed, self.draft_embed, self.d2t = weights
        info = {r: m.get_input_buffer_info()[0] for r, m in self.models.items()}
        self.base_capacity = int(info["base"].max_cache_size)
        self.draft_capacity = int(info["draft"].max_cache_size)
        self.base_width = int(info["base"].max_width)
        self.draft_width = int(info["draft"].max_width)
        self.fc_width = int(info["fc"].max_width)
        self.owner: object | None = None
        self.infers = {r: 0 for r in ROLES}
        self._disposed = False

    @classmethod
    def create(cls, runtime: Any, release: Eagle3Release, device_name: str = "aries") -> Eagle3Backend:
        """Load the host weights, then create and launch the base, draft and fc MXQs where the
        release places them.

        Raises:
            Eagle3ReleaseError: as :func:`load_host_weights`.
            MbltTargetError: a ``ModelConfig`` setter refused a role's cores.
            QbRuntimeError: the runtime's error, unchanged (every model created so far disposed).
        """
        weights = load_host_weights(release.root, release)
        models: dict[str, Any] = {}
        accs: dict[int, Any] = {}
        try:
            for role in ROLES:
                where = release.placement[role]
                mc = runtime.ModelConfig()
                ids = [runtime.CoreId(getattr(runtime.Cluster, f"Cluster{c}"), getattr(runtime.Core, f"Core{k}"))
                       for c, k in where.cores]
                if mc.set_single_core_mode(None, ids) is False:
                    raise MbltTargetError(f"qbruntime refused {role} cores {list(where.cores)} on device {where.dev}")
                if where.dev not in accs:
                    accs[where.dev] = runtime.Accelerator(device_name, where.dev)
                models[role] = runtime.Model(str(release.paths[role]), mc)
                models[role].launch(accs[where.dev])
        except BaseException:
            for m in models.values():
                try:
                    m.dispose()
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass
            raise
        backend = cls(release, models, weights)
        backend._accelerators = accs
        logger.info(
            "MBLT EAGLE-3 release: base on device %d, draft on device %d, fc on device %d; KV capacity base %d / draft %d "
            "tokens; widths base %d, draft %d, fc %d; chunk %d; tree %d tokens (depth %d, top_k %d)",
            release.placement["base"].dev, release.placement["draft"].dev, release.placement["fc"].dev,
            backend.base_capacity, backend.draft_capacity, backend.base_width, backend.draft_width, backend.fc_width,
            release.chunk, release.num_assistant_tokens, release.depth, release.top_k)
        return backend

    # ---------------------------------------------------------------- shapes
    @property
    def vocab_size(self) -> int:
        return self.release.vocab_size

    def _chunk(self, role: str) -> int:
        width = self.base_width if role == "base" else self.draft_width
        return max(1, min(self.release.chunk, width))

    def _check(self, role: str, cache_size: int, tokens: int) -> None:
        if self._disposed:
            raise MbltBackendError("the EAGLE-3 backend was disposed")
        cap = self.base_capacity if role == "base" else self.draft_capacity
        if cache_size + tokens > cap:
            raise Eagle3CapacityError(role, cache_size, tokens, cap)

    # ---------------------------------------------------------------- MXQ calls
    def base(self, ids: np.ndarray, mask: np.ndarray, rope: np.ndarray, cache_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The base on target ids ``[T]`` at ``cache_size`` with ``mask`` ``[T, cache_size + T]``
        and RoPE rows ``[T, P]``: ``(taps [T, 3H], logits [T, V])``. Writes KV at ``[cache_size,
        cache_size + T)``.

        Raises:
            Eagle3CapacityError: ``cache_size + T`` above the base capacity (checked per chunk).
            QbRuntimeError: the runtime's error, unchanged.
        """
        x = self.base_embed[np.asarray(ids, dtype=np.int64)]
        *taps, logits = self._infer_chunks("base", [x], mask, rope, cache_size, "3 hidden taps, logits", 4)
        return np.concatenate(taps, axis=-1), logits

    def fc(self, taps: np.ndarray) -> np.ndarray:
        """The fc projection of base taps ``[T, 3H]`` to ``[T, Hd]`` (rows independent, so it runs
        in pieces of ``max_width``); taps already ``Hd`` wide pass unchanged (transformers-mblt calls
        fc only when the widths differ).

        Raises:
            QbRuntimeError: the runtime's error, unchanged.
        """
        if taps.shape[-1] == self.release.draft_hidden_size:
            return taps
        if self._disposed:
            raise MbltBackendError("the EAGLE-3 backend was disposed")
        out = []
        for s in range(0, taps.shape[0], max(1, self.fc_width)):
            res = self.models["fc"].infer([_rank4(taps[s:s + self.fc_width])])
            self.infers["fc"] += 1
            out.append(_rows(res[0]))
        return np.concatenate(out)

    def draft(self, ids: np.ndarray, hidden: np.ndarray, mask: np.ndarray, rope: np.ndarray,
              cache_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The draft on target ids ``[T]`` (embedded with the draft table) and hidden ``[T, Hd]``:
        ``(hidden [T, Hd], draft logits [T, Dv])``. Writes KV at ``[cache_size, cache_size + T)``.

        Raises:
            Eagle3CapacityError: ``cache_size + T`` above the draft capacity (checked per chunk).
            QbRuntimeError: the runtime's error, unchanged.
        """
        x = self.draft_embed[np.asarray(ids, dtype=np.int64)]
        out, logits = self._infer_chunks("draft", [x, hidden], mask, rope, cache_size, "hidden, logits", 2)
        return out, logits

    def _infer_chunks(self, role: str, rows: list[np.ndarray], mask: np.ndarray, rope: np.ndarray, cache_size: int,
                      outputs: str, n_outputs: int) -> list[np.ndarray]:
        """Run ``role``'s MXQ over ``rows`` (per-token inputs ``[T, C]``, then the mask and RoPE rows)
        in chunks at ``cache_size``; returns each output's rows ``[T, C]``, the chunks joined.

        Raises:
            Eagle3CapacityError: a chunk past the role's capacity.
            MbltBackendError: the MXQ returned other than ``n_outputs`` outputs (``outputs`` names them).
        """
        got: list[list[np.ndarray]] = [[] for _ in range(n_outputs)]
        step, total = self._chunk(role), rows[0].shape[0]
        for s in range(0, total, step):
            e = min(s + step, total)
            self._check(role, cache_size + s, e - s)
            out = self.models[role].infer(
                [*(_rank4(r[s:e]) for r in rows), _rank4(mask[s:e, : cache_size + e]), _rank4(rope[s:e])],
                None, cache_size + s)
            self.infers[role] += 1
            if len(out) != n_outputs:
                raise MbltBackendError(f"the EAGLE-3 {role} MXQ returned {len(out)} outputs; it has {n_outputs} "
                                       f"({outputs})")
            for acc, o in zip(got, out):
                acc.append(_rows(o))
        return [np.concatenate(parts) for parts in got]

    # ---------------------------------------------------------------- teardown
    def dispose(self) -> None:
        """Dispose the three MXQs; later calls do nothing.

        Raises:
            Exception: the first ``dispose()`` failure, after every model was tried.
        """
        if self._disposed:
            return
        self._disposed = True
        first: Exception | None = None
        for m in self.models.values():
            try:
                m.dispose()
            except Exception as exc:  # noqa: BLE001
                first = first or exc
        if first is not None:
            raise first
