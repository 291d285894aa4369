"""The simulated Neuron runtime, ``nrtpy``-style: device tensors, loaded NEFFs, execution.

* :class:`NrtpyTensor` is a device tensor: :meth:`NrtpyTensor.from_numpy` copies the array to
  the "device" (and counts its bytes against the logical core's HBM until the tensor is garbage
  collected or the runtime is :func:`reset`); :meth:`NrtpyTensor.numpy` returns the live device
  array, so a KV pool updated in place by a NEFF is visible through it.
* :class:`NrtpyModel` is a loaded NEFF: the file is checked (format, model digest, target), the
  model's weights are counted once per (logical core, model) and the golden
  :class:`~npusim.llm.Decoder` is loaded once per model per process.
* A call checks the input names, shapes (``fail_on_recompile`` text on a mismatch) and dtypes,
  applies an injected fault (``$NPUSIM_NEFF`` ``fault``), then gathers every real row's KV from
  the pool through its block table, runs all real rows in one ``Decoder.step_batch``, scatters
  the new keys/values to ``slot_mapping`` (fp8: clamped and rounded to e4m3) and samples on
  device when the NEFF does.
"""

from __future__ import annotations

import itertools
import json
import os
import weakref
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..llm import Decoder
from . import config, neff_file
from .compiler import NeffSpec, io_info, model_digest
from .errors import NeffFileError, NeffRecompileError, NeffTargetError, NrtError, NrtpyError, nrt_message
from .platform import device_info, get_nc_count, get_platform_target, visible_cores
from .sampling import sample

__all__ = [
    "NrtpyTensor",
    "NrtpyModel",
    "configure",
    "reset",
    "get_vnc_memory_stats",
    "execution_counts",
    "quantize_fp8_e4m3",
]


# ---------------------------------------------------------------- process state

class _State:
    """Device state of this process (replaced by :func:`reset`)."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.weights: dict[tuple[int, str], list[int]] = {}  # (core, model key) -> [bytes, refs]
        self.tensors: dict[int, dict[int, int]] = {}  # core -> tensor id -> bytes
        self.calls = 0  # NEFF executions attempted (fault numbering)
        self.counts: Counter[str] = Counter()


_state = _State(0)
_ids = itertools.count(1)
_decoders: dict[tuple[str, str], Decoder] = {}


def _used(core: int) -> int:
    w = sum(b for (c, _), (b, _refs) in _state.weights.items() if c == core)
    return w + sum(_state.tensors.get(core, {}).values())


def _check_core(core_id: Any, what: str) -> int:
    if isinstance(core_id, bool) or not isinstance(core_id, (int, np.integer)):
        raise NrtpyError(f"{what}: core_id must be an integer, got {core_id!r}")
    n = get_nc_count()
    if not 0 <= core_id < n:
        raise NrtError(nrt_message("NRT_LOAD_NOT_ENOUGH_NC",
                                   f"{what}: logical core {core_id} is not available ({n} visible cores)"))
    return int(core_id)


def _allocate(core: int, nbytes: int, what: str) -> None:
    hbm = device_info().hbm_bytes_per_logical_core
    used = _used(core)
    if used + nbytes > hbm:
        raise NrtError(nrt_message(
            "NRT_RESOURCE", f"Failed to allocate tensor {what} of {nbytes} bytes on logical core {core}: "
            f"{used} bytes used, {hbm - used} bytes free of {hbm}"))


def _release_tensor(generation: int, core: int, key: int) -> None:
    if generation == _state.generation:
        _state.tensors.get(core, {}).pop(key, None)


def _release_weights(generation: int, key: tuple[int, str]) -> None:
    if generation != _state.generation or key not in _state.weights:
        return
    entry = _state.weights[key]
    entry[1] -= 1
    if entry[1] <= 0:
        del _state.weights[key]


def configure(visible_cores: str | int | Iterable[int] | None = None) -> None:
    """Set ``$NEURON_RT_VISIBLE_CORES`` (``None``: unset, all cores visible).

    Args:
        visible_cores: ``"0-3"``/``"0,2"``, one core, or a list of cores (a contiguous list is
            written as a range).

    Raises:
        NrtpyError: a value of another type.
        NeffConfigError / NrtError: the cores are malformed or not on the instance (the
            variable is restored).
    """
    old = os.environ.get("NEURON_RT_VISIBLE_CORES")
    if visible_cores is None:
        os.environ.pop("NEURON_RT_VISIBLE_CORES", None)
        return
    if isinstance(visible_cores, str):
        value = visible_cores
    elif isinstance(visible_cores, (int, np.integer)) and not isinstance(visible_cores, bool):
        value = str(int(visible_cores))
    else:
        try:
            cores = [int(c) for c in visible_cores]
        except TypeError as exc:
            raise NrtpyError(f"visible_cores must be a string, an int or a list of ints, got {visible_cores!r}") from exc
        if not cores:
            raise NrtpyError("visible_cores is an empty list")
        if cores == list(range(cores[0], cores[0] + len(cores))):
            value = f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
        else:
            value = ",".join(map(str, cores))
    os.environ["NEURON_RT_VISIBLE_CORES"] = value
    try:
        _visible()
    except Exception:
        if old is None:
            os.environ.pop("NEURON_RT_VISIBLE_CORES", None)
        else:
            os.environ["NEURON_RT_VISIBLE_CORES"] = old
        raise


def _visible() -> list[int]:
    return visible_cores()


def reset() -> None:
    """Unload every model and forget every device allocation; execution counts and fault
    numbering restart. Models loaded before raise ``NrtError`` when called."""
    global _state
    _state = _State(_state.generation + 1)


def get_vnc_memory_stats(core_id: int = 0) -> tuple[int, int]:
    """``(bytes_used, bytes_free)`` of logical core ``core_id`` (models and tensors of this process).

    Raises:
        NrtError: the core is not visible.
    """
    core = _check_core(core_id, "get_vnc_memory_stats")
    used = _used(core)
    return used, device_info().hbm_bytes_per_logical_core - used


def execution_counts() -> dict[str, int]:
    """Program name -> successful executions since the process started (or the last :func:`reset`)."""
    return dict(_state.counts)


def quantize_fp8_e4m3(x: np.ndarray, max_value: float) -> np.ndarray:
    """``x`` clamped to ``±max_value`` and rounded to e4m3 (3 mantissa bits, min normal 2^-6,
    subnormal step 2^-9, ties to even), scale 1.0; same dtype as ``x``."""
    a = np.clip(np.asarray(x, np.float64), -max_value, max_value)
    _, e = np.frexp(a)
    exp = np.maximum(e.astype(np.int64) - 1, -6)
    step = np.ldexp(1.0, exp - 3)
    return (np.round(a / step) * step).astype(np.asarray(x).dtype)


# ---------------------------------------------------------------- tensors

class NrtpyTensor:
    """A tensor in the HBM of one logical core.

    Attributes:
        name: optional label.
        core_id: the logical core holding it.
    """

    def __init__(self, *_: Any, **__: Any) -> None:
        raise NrtpyError("create device tensors with NrtpyTensor.from_numpy(array, name=None, core_id=0)")

    @classmethod
    def from_numpy(cls, array: np.ndarray, name: str | None = None, core_id: int = 0) -> NrtpyTensor:
        """Copy ``array`` to logical core ``core_id`` (its bytes count against the core's HBM).

        Raises:
            NrtpyError: not a numeric array, or a bad ``core_id`` type.
            NrtError: ``NRT_RESOURCE(4)`` when the core's HBM is full; the core is not visible.
        """
        a = np.array(array, copy=True, order="C")
        if a.dtype.kind not in "biuf":
            raise NrtpyError(f"NrtpyTensor.from_numpy: unsupported dtype {a.dtype}")
        core = _check_core(core_id, "NrtpyTensor.from_numpy")
        what = repr(name) if name is not None else f"of shape {a.shape}"
        _allocate(core, a.nbytes, what)
        t = object.__new__(cls)
        t._array, t.name, t.core_id = a, name, core
        key = next(_ids)
        _state.tensors.setdefault(core, {})[key] = a.nbytes
        weakref.finalize(t, _release_tensor, _state.generation, core, key)
        return t

    @property
    def shape(self) -> tuple[int, ...]:
        return self._array.shape

    @property
    def dtype(self) -> np.dtype:
        return self._array.dtype

    def numpy(self) -> np.ndarray:
        """The live device array (not a copy: in-place updates by a NEFF show through it)."""
        return self._array

    def write_from_numpy(self, array: np.ndarray) -> None:
        """Overwrite the tensor's contents.

        Raises:
            NrtpyError: another shape, or a dtype that cannot be cast safely.
        """
        a = np.asarray(array)
        if a.shape != self._array.shape:
            raise NrtpyError(f"write_from_numpy: shape {a.shape} differs from the tensor's {self._array.shape}")
        if not np.can_cast(a.dtype, self._array.dtype, casting="same_kind"):
            raise NrtpyError(f"write_from_numpy: dtype {a.dtype} cannot be written to a {self._array.dtype} tensor")
        self._array[...] = a

    def __repr__(self) -> str:
        return f"NrtpyTensor(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, core_id={self.core_id})"


# ---------------------------------------------------------------- models

def _decoder(model_dir: str, digest: str) -> Decoder:
    key = (model_dir, digest)
    if key not in _decoders:
        _decoders[key] = Decoder.from_pretrained(model_dir)
    return _decoders[key]


def _invalid(msg: str) -> NrtError:
    return NrtError(nrt_message("NRT_INVALID", msg))


class _Row:
    """One real sequence of a call: its new tokens, the position of the first, slots and blocks."""

    __slots__ = ("index", "ids", "start", "slots", "table", "embeds", "embeds_mask")

    def __init__(self, index: int, ids: np.ndarray, start: int, slots: np.ndarray, table: np.ndarray,
                 embeds: np.ndarray | None = None, embeds_mask: np.ndarray | None = None) -> None:
        self.index, self.ids, self.start, self.slots, self.table = index, ids, start, slots, table
        #: prompt embeddings: ``[len(ids), hidden]`` rows, used where ``embeds_mask`` is 1
        self.embeds, self.embeds_mask = embeds, embeds_mask


class NrtpyModel:
    """A NEFF loaded on one logical core.

    Attributes:
        name: the model's label (default: the program name).
        path: the NEFF path as given.
        spec: the :class:`~npusim.neff.compiler.NeffSpec` it was compiled from.
        target: the target it was compiled for.
        core_id, cc_enabled, rank_id, world_size: as passed to :meth:`load_from_neff`.
        input_tensors_info / output_tensors_info: ``[{"name", "shape", "dtype"}, ...]`` in call order.
    """

    def __init__(self, *_: Any, **__: Any) -> None:
        raise NrtpyError("load NEFFs with NrtpyModel.load_from_neff(neff_path, ...)")

    @classmethod
    def load_from_neff(cls, neff_path: str | os.PathLike, name: str | None = None, core_id: int = 0,
                       cc_enabled: bool = False, rank_id: int = 0, world_size: int = 1) -> NrtpyModel:
        """Load a NEFF file written by :func:`~npusim.neff.compiler.compile_neff`.

        Raises:
            NeffFileError: the file is unreadable/corrupt/another version, its header is not a
                valid program, or the model changed since compile (digest mismatch or missing).
            NeffTargetError: the NEFF was compiled for another target than the device's (both named).
            NrtpyError: bad ``rank_id``/``world_size``/``core_id`` types.
            NrtError: the core is not visible; ``NRT_RESOURCE(4)`` if the weights do not fit.
        """
        path = os.fspath(neff_path)
        header = neff_file.read(path)
        where = f"NEFF file {path!r}"
        try:
            spec = NeffSpec.from_dict(header["spec"])
        except (TypeError, ValueError) as exc:
            raise NeffFileError(f"{where}: header field 'spec' is not a valid NeffSpec ({exc})") from exc
        if header["name"] != spec.name:
            raise NeffFileError(f"{where}: header name {header['name']!r} does not match its spec ({spec.name!r})")
        device = get_platform_target()
        if header["target"] != device:
            raise NeffTargetError(f"{where} was compiled for target {header['target']!r} but the device is "
                                  f"{device!r}; recompile it for {device!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise NrtpyError(f"world_size must be an integer >= 1, got {world_size!r}")
        if isinstance(rank_id, bool) or not isinstance(rank_id, int) or not 0 <= rank_id < world_size:
            raise NrtpyError(f"rank_id must be an integer in [0, {world_size}), got {rank_id!r}")
        core = _check_core(core_id, "NrtpyModel.load_from_neff")
        mdir = header["model_dir"]
        try:
            digest, _ = model_digest(mdir)
        except OSError as exc:
            raise NeffFileError(f"{where}: model directory {mdir!r} cannot be read ({exc})") from exc
        if digest != header["model_digest"]:
            raise NeffFileError(f"{where}: model changed since compile (the files of {mdir!r} no longer "
                                f"match the digest recorded in the NEFF); recompile it")
        decoder = _decoder(mdir, digest)
        ins, outs = io_info(spec, decoder.config)
        if ins != header["inputs"] or outs != header["outputs"]:
            raise NeffFileError(f"{where}: the recorded inputs/outputs do not match the program's")
        wkey = (core, f"{mdir}#{digest}")
        if wkey in _state.weights:
            _state.weights[wkey][1] += 1
        else:
            _allocate(core, header["weight_bytes"], f"'weights of {mdir}'")
            _state.weights[wkey] = [header["weight_bytes"], 1]
        m = object.__new__(cls)
        m.name = name if name is not None else spec.name
        m.path, m.spec, m.target, m.header = path, spec, header["target"], header
        m.core_id, m.cc_enabled, m.rank_id, m.world_size = core, bool(cc_enabled), rank_id, world_size
        m.input_tensors_info = [dict(i) for i in ins]
        m.output_tensors_info = [dict(o) for o in outs]
        m._decoder, m._generation, m._loaded = decoder, _state.generation, True
        m._finalizer = weakref.finalize(m, _release_weights, _state.generation, wkey)
        return m

    def unload(self) -> None:
        """Release the model (its weights leave HBM once no NEFF of the model is loaded on the core)."""
        self._loaded = False
        self._finalizer()

    def __repr__(self) -> str:
        return f"NrtpyModel(name={self.name!r}, spec={self.spec.name!r}, target={self.target!r}, core_id={self.core_id})"

    # ------------------------------------------------------------ call

    def __call__(self, inputs: Mapping[str, NrtpyTensor], outputs: Mapping[str, NrtpyTensor] | None = None,
                 save_trace: bool = False, ntff_name: str | None = None) -> dict[str, NrtpyTensor]:
        """Execute the NEFF.

        Args:
            inputs: input name -> :class:`NrtpyTensor` (exactly :attr:`input_tensors_info`).
            outputs: optional preallocated outputs (name -> tensor) to write into.
            save_trace: write a JSON execution trace to ``ntff_name`` (default ``<neff>.ntff``).

        Returns:
            Output name -> tensor (``logits``, and ``tokens`` with on-device sampling). The
            ``kv_cache`` input is updated in place and not returned.

        Raises:
            NrtpyError: ``inputs``/``outputs`` are not mappings of NrtpyTensor.
            NeffRecompileError: an input's shape differs from the compiled one (torch's text).
            NrtError: unloaded model; missing/unexpected input names, a wrong dtype, a tensor on
                another core (``NRT_INVALID``); inconsistent positions/slots/block tables, a decode
                row at or past the context bucket (names row, position and bucket), bad token ids;
                an injected fault (``NRT_FAILURE(1)``); a padding self-check failure.
        """
        if not self._loaded or self._generation != _state.generation:
            raise _invalid(f"model {self.name!r} is not loaded (unloaded or reset)")
        arrays = self._check_inputs(inputs)
        out_tensors = self._check_outputs(outputs)
        _state.calls += 1
        call = _state.calls
        fault = config.settings().fault
        if fault is not None and fault.strikes(call):
            raise NrtError(nrt_message("NRT_FAILURE", f"Failed to execute model {self.name!r} (execution {call} "
                                                      f"of this process; fault injected by ${config.ENV_VAR})"))
        logits, tokens = self._execute(arrays)
        _state.counts[self.spec.name] += 1
        results = {"logits": logits} if tokens is None else {"logits": logits, "tokens": tokens}
        ret: dict[str, NrtpyTensor] = {}
        for name, value in results.items():
            t = out_tensors.get(name)
            if t is None:
                t = NrtpyTensor.from_numpy(value, name=name, core_id=self.core_id)
            else:
                t._array[...] = value
            ret[name] = t
        if save_trace:
            trace = Path(ntff_name) if ntff_name else Path(self.path + ".ntff")
            trace.write_text(json.dumps({"model": self.name, "program": self.spec.name, "execution": call,
                                         "target": self.target, "core_id": self.core_id}) + "\n")
        return ret

    def _check_inputs(self, inputs: Mapping[str, NrtpyTensor]) -> dict[str, np.ndarray]:
        if not isinstance(inputs, Mapping):
            raise NrtpyError(f"inputs must be a dict of name -> NrtpyTensor, got {type(inputs).__name__}")
        expected = [i["name"] for i in self.input_tensors_info]
        missing = [n for n in expected if n not in inputs]
        extra = sorted(str(n) for n in inputs if n not in expected)
        if missing or extra:
            raise _invalid(f"model {self.name!r} ({self.spec.name}): missing inputs {missing}, unexpected "
                           f"inputs {extra}; expected {expected}")
        for n in expected:
            if not isinstance(inputs[n], NrtpyTensor):
                raise NrtpyError(f"input {n!r} must be an NrtpyTensor, got {type(inputs[n]).__name__}")
        for info in self.input_tensors_info:
            got, want = inputs[info["name"]].shape, tuple(info["shape"])
            if got != want:
                if len(got) != len(want):
                    reason = f"tensor {info['name']!r} rank mismatch. expected {len(want)}, actual {len(got)}"
                else:
                    i = next(k for k in range(len(want)) if got[k] != want[k])
                    reason = f"tensor {info['name']!r} size mismatch at index {i}. expected {want[i]}, actual {got[i]}"
                raise NeffRecompileError(
                    f"Detected recompile when torch.compile stance is 'fail_on_recompile'. filename: "
                    f"'{self.path}', function name: '{self.spec.name}', line number: 0\n"
                    f"    triggered by the following guard failure(s):\n    - 0/0: {reason}")
        arrays = {}
        for info in self.input_tensors_info:
            t = inputs[info["name"]]
            if t.dtype != np.dtype(info["dtype"]):
                raise _invalid(f"model {self.name!r}: input {info['name']!r} has dtype {t.dtype}, expected {info['dtype']}")
            if t.core_id != self.core_id:
                raise _invalid(f"model {self.name!r} on logical core {self.core_id}: input {info['name']!r} "
                               f"is on logical core {t.core_id}")
            arrays[info["name"]] = t._array
        return arrays

    def _check_outputs(self, outputs: Mapping[str, NrtpyTensor] | None) -> dict[str, NrtpyTensor]:
        if outputs is None:
            return {}
        if not isinstance(outputs, Mapping):
            raise NrtpyError(f"outputs must be a dict of name -> NrtpyTensor, got {type(outputs).__name__}")
        infos = {o["name"]: o for o in self.output_tensors_info}
        for n, t in outputs.items():
            if n not in infos:
                raise _invalid(f"model {self.name!r}: unexpected output {n!r}; outputs are {list(infos)}")
            if not isinstance(t, NrtpyTensor):
                raise NrtpyError(f"output {n!r} must be an NrtpyTensor, got {type(t).__name__}")
            if t.shape != tuple(infos[n]["shape"]) or t.dtype != np.dtype(infos[n]["dtype"]):
                raise _invalid(f"model {self.name!r}: output {n!r} is {t.dtype}{list(t.shape)}, expected "
                               f"{infos[n]['dtype']}{infos[n]['shape']}")
        return dict(outputs)

    # ------------------------------------------------------------ compute

    def _rows(self, a: dict[str, np.ndarray]) -> tuple[list[_Row], int]:
        """The real rows of a call, validated; and the number of rows of the output."""
        spec, vocab = self.spec, self._decoder.config.vocab_size
        bs, nb = spec.block_size, spec.num_blocks
        ids, pos, slots, table = a["input_ids"], a["position_ids"], a["slot_mapping"], a["block_table"]
        rows: list[_Row] = []
        if spec.kind == "prefill":
            real = slots != -1
            n = int(real.sum())
            if n == 0:
                raise _invalid(f"{spec.name}: no real token (every slot_mapping entry is -1)")
            if not real[:n].all():
                raise _invalid(f"{spec.name}: real tokens must be a prefix (slot_mapping -1 only after them), "
                               f"got {slots.tolist()}")
            p0 = int(pos[0])
            if p0 < 0 or not np.array_equal(pos[:n], p0 + np.arange(n)):
                raise _invalid(f"{spec.name}: position_ids of the real tokens must be consecutive from "
                               f"position_ids[0] >= 0, got {pos[:n].tolist()}")
            if p0 + n > spec.max_model_len:
                raise _invalid(f"{spec.name}: positions {p0}..{p0 + n - 1} exceed max_model_len {spec.max_model_len}")
            last = int(a["last_token_index"][0])
            if not 0 <= last < n:
                raise _invalid(f"{spec.name}: last_token_index {last} is not one of the {n} real tokens")
            embeds = mask = None
            if spec.prompt_embeds:
                embeds, mask = a["inputs_embeds"][:n], a["embeds_mask"][:n]
                if ((mask != 0) & (mask != 1)).any():
                    raise _invalid(f"{spec.name}: embeds_mask values must be 0 or 1")
                if not np.isfinite(embeds[mask == 1]).all():
                    raise _invalid(f"{spec.name}: inputs_embeds of the masked positions must be finite")
            rows.append(_Row(0, ids[:n], p0, slots[:n], table, embeds, mask))
        else:
            s = spec.context
            for r in np.flatnonzero(slots != -1):
                p = int(pos[r])
                if not 0 <= p < s:
                    raise _invalid(f"{spec.name}: row {r} has position {p}, outside the context bucket of "
                                   f"S={s} tokens (needs 0 <= position < {s}); use a larger context bucket")
                rows.append(_Row(int(r), ids[r : r + 1], p, slots[r : r + 1], table[r]))
        seen: set[int] = set()
        for row in rows:
            where = f"{spec.name} row {row.index}"
            end = row.start + len(row.ids)
            bad = (row.ids < 0) | (row.ids >= vocab)
            if bad.any():
                raise _invalid(f"{where}: token id {int(row.ids[np.argmax(bad)])} is outside [0, {vocab})")
            needed = row.table[: -(-end // bs)]
            if ((needed < 0) | (needed >= nb)).any():
                raise _invalid(f"{where}: block_table entries for positions 0..{end - 1} must be blocks in "
                               f"[0, {nb}), got {needed.tolist()}")
            p = np.arange(row.start, end)
            want = row.table[p // bs].astype(np.int64) * bs + p % bs
            if not np.array_equal(row.slots.astype(np.int64), want):
                raise _invalid(f"{where}: slot_mapping {row.slots.tolist()} does not match the block table "
                               f"(positions {row.start}..{end - 1} map to slots {want.tolist()})")
            dup = seen.intersection(want.tolist())
            if dup:
                raise _invalid(f"{spec.name}: KV slots {sorted(dup)} are written by two rows")
            seen.update(want.tolist())
        return rows, spec.rows

    def _run(self, pool: np.ndarray, rows: list[_Row]) -> list[np.ndarray]:
        """Gather, one ``step_batch`` over the real rows, scatter; returns each row's logits."""
        spec, dec = self.spec, self._decoder
        bs = spec.block_size
        caches = []
        for row in rows:
            cache = dec.new_cache(row.start + len(row.ids))
            if row.start:
                p = np.arange(row.start)
                blocks, offs = row.table[p // bs], p % bs
                for layer in range(cache.num_layers):
                    cache.keys[layer][:, : row.start] = pool[layer, 0, blocks, offs].transpose(1, 0, 2)
                    cache.values[layer][:, : row.start] = pool[layer, 1, blocks, offs].transpose(1, 0, 2)
                cache.advance(row.start)
            caches.append(cache)
        if any(row.embeds_mask is not None and row.embeds_mask.any() for row in rows):
            xs = []
            for row in rows:
                x = dec.embed(row.ids.astype(np.int64))
                if row.embeds_mask is not None:
                    use = row.embeds_mask == 1
                    x[use] = row.embeds[use]
                xs.append(x)
            logits = dec.step_batch_embeddings(list(zip(xs, caches)))
        else:
            logits = dec.step_batch([(row.ids.astype(np.int64), c) for row, c in zip(rows, caches)])
        fp8 = device_info(self.target).fp8_e4m3_max if spec.kv_dtype == "fp8_e4m3" else None
        for row, cache in zip(rows, caches):
            s = row.slots.astype(np.int64)
            blocks, offs = s // bs, s % bs
            a, b = row.start, row.start + len(row.ids)
            for layer in range(cache.num_layers):
                for kv, src in ((0, cache.keys[layer]), (1, cache.values[layer])):
                    new = src[:, a:b].transpose(1, 0, 2)
                    pool[layer, kv, blocks, offs] = new if fp8 is None else quantize_fp8_e4m3(new, fp8)
        return logits

    def _execute(self, a: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        spec = self.spec
        pool = a["kv_cache"]
        rows, n_out = self._rows(a)
        check = config.settings().check_padding
        before = pool.copy() if check else None
        per_row = self._run(pool, rows)
        vocab = self._decoder.config.vocab_size
        logits = np.zeros((n_out, vocab), np.float32)
        if spec.kind == "prefill":
            logits[0] = per_row[0][int(a["last_token_index"][0])]
        else:
            for row, lg in zip(rows, per_row):
                logits[row.index] = lg[0]
        if check:
            self._check_padding(before, pool, rows, per_row)
        tokens = None
        if spec.on_device_sampling:
            params, rand = a["sampling_params"], a["rand"]
            real = [row.index for row in rows]
            if not np.isfinite(params[real]).all():
                raise _invalid(f"{spec.name}: sampling_params of real rows must be finite, got {params[real].tolist()}")
            r = rand[real]
            if not spec.deterministic and (~((r >= 0) & (r < 1))).any():
                raise _invalid(f"{spec.name}: rand of real rows must be uniforms in [0, 1), got {r.tolist()}")
            tokens = np.zeros(n_out, np.int32)
            masked = logits
            if spec.logit_mask:
                mask = a["logit_mask"][real]
                if ((mask != 0) & (mask != 1)).any():
                    raise _invalid(f"{spec.name}: logit_mask values must be 0 or 1")
                empty = [i for i, m in zip(real, mask) if not m.any()]
                if empty:
                    raise _invalid(f"{spec.name}: logit_mask of rows {empty} allows no token")
                masked = logits.copy()
                masked[real] = np.where(mask == 1, logits[real], -np.inf)
            if real:
                tokens[real] = sample(masked[real], params[real], rand[real], max_top_k=spec.max_top_k,
                                      deterministic=spec.deterministic)
        return logits, tokens

    def _check_padding(self, before: np.ndarray, after: np.ndarray, rows: list[_Row], per_row: list[np.ndarray]) -> None:
        """``check_padding``: only real slots changed, and the real rows alone give the same logits."""
        bs = self.spec.block_size
        changed = np.flatnonzero(np.any(before != after, axis=(0, 1, 4, 5)).reshape(-1))
        allowed = {int(s) for row in rows for s in row.slots}
        stray = sorted(set(changed.tolist()) - allowed)
        if stray:
            raise _invalid(f"{self.spec.name}: padding wrote KV slots {stray} (block, offset = "
                           f"{[(s // bs, s % bs) for s in stray]})")
        again = self._run(before.copy(), rows)
        for row, x, y in zip(rows, per_row, again):
            if not np.array_equal(x, y):
                raise _invalid(f"{self.spec.name}: row {row.index}: logits with padding differ from the real rows alone "
                               f"(max |diff| {float(np.max(np.abs(x - y))):.3e})")
