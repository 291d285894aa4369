"""``rebel.core.torch_compile.rbln_backend``: the torch.compile backend of the ``vllm`` model path.

vllm-rbln compiles vLLM's own model code with
``torch.compile(model, backend=rbln_backend, dynamic=False, fullgraph=True, options={...})``.
TorchDynamo traces the model to an FX graph once per input signature and hands it here with
example inputs; the backend turns it into a *static program* for the NPU and returns the
callable Dynamo runs from then on. On the simulator:

* **static shapes only.** Every example input must have concrete sizes (a ``SymInt``, i.e.
  ``dynamic=True`` or a dimension Dynamo marked dynamic, is an :class:`RBLNCompileError` naming
  the input). The returned :class:`CompiledGraph` accepts exactly those shapes and dtypes and
  nothing else (:class:`RBLNInputError` naming the input, what it got and what was compiled),
  as a compiled RBLN program does. A new shape is therefore a new compile: Dynamo's guards
  send it back here, and every compile is recorded (:func:`compiled_graphs`).
* **the device.** The graph is compiled for ``options["npu"]`` or the present device 0; with
  no NPU present a compile that is to run (``mode`` without ``"compile_only"``) fails with the
  real stack's ``Device 0 is not a valid NPU device...``. ``"compile_only"`` returns a program
  whose calls fail naming the mode. Each call of a program counts as a device call, so the
  ``$NPUSIM_RBLN`` fault (``after_calls``/``times``) strikes it as it strikes a
  :class:`rebel.Runtime` call.
* **execution** is the traced graph itself on the host: the ``torch.ops.rbln_custom_ops``
  operators in it (the paged attention of vllm-rbln's attention backend) are the simulator's
  (:mod:`npusim.rbln.ops`), so KV caches passed in as tensors are updated in place.

With ``cache_dir`` a program whose signature the mega cache holds (:mod:`.mega_cache`) is a
hit, recorded ``from_cache``; every other compile is added to it.

Options are the ones vllm-rbln passes (``../shared/reference/rbln.md`` §5.2); a name outside
them is an error naming it, since a typo there would otherwise compile something else than
asked. ``mode`` takes ``"strict"`` and ``"compile_only"``; ``strict`` is recorded with the
compile (the plugin, which knows when its warm-up ended, refuses recompiles after it).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import parts
from ..errors import RBLNCompileError, RBLNDeviceError, RBLNInputError

__all__ = ["rbln_backend", "CompiledGraph", "CompileRecord", "compiled_graphs", "OPTIONS", "MODES"]

#: The option names vllm-rbln 0.12.0 passes (reference §5.2), plus ``npu``.
OPTIONS = frozenset({
    "compile_context", "num_devices", "model_trace_method", "process_group_dict", "guard_filter_fn",
    "_runtime_holder", "mode", "use_global_ctx", "global_device_id", "use_static_output", "dtype",
    "cache_dir", "mega_cache_only", "use_direct_dispatch", "npu", "tensor_parallel_size",
})
MODES = frozenset({"strict", "compile_only"})

_lock = threading.Lock()
_records: list["CompileRecord"] = []


@dataclass(frozen=True)
class CompileRecord:
    """One compile of :func:`rbln_backend`.

    Attributes:
        npu: the device name compiled for (``RBLN-CR13``), None for a compile-only host.
        inputs: ``(shape, dtype name)`` per graph input, in order (non-tensor inputs: ``()``,
            their type name).
        modes: the ``mode`` entries.
        signature: a digest of the graph's code, inputs, NPU and compiler (equal graphs
            compile alike; the mega cache's key).
        from_cache: the program came from the mega cache (``cache_dir``), not a compile.
    """

    npu: str | None
    inputs: tuple[tuple[tuple[int, ...], str], ...]
    modes: tuple[str, ...]
    signature: str
    from_cache: bool = False


def compiled_graphs() -> tuple[CompileRecord, ...]:
    """Every compile of this process so far, in order (a simulator-only query)."""
    with _lock:
        return tuple(_records)


def _input_spec(i: int, x: Any) -> tuple[tuple[int, ...], str]:
    if isinstance(x, torch.Tensor):
        dims = []
        for d, size in enumerate(x.shape):
            if not isinstance(size, int):
                raise RBLNCompileError(
                    f"rbln_backend: graph input {i} has a dynamic dimension {d} ({size}); the RBLN "
                    "compiler takes static shapes only: compile with torch.compile(dynamic=False)")
            dims.append(int(size))
        return tuple(dims), str(x.dtype).removeprefix("torch.")
    if isinstance(x, torch.SymInt):
        raise RBLNCompileError(f"rbln_backend: graph input {i} is a symbolic int ({x}); the RBLN "
                               "compiler takes static shapes only: compile with torch.compile(dynamic=False)")
    return (), type(x).__name__


class CompiledGraph:
    """The program :func:`rbln_backend` returns: the graph, callable with its compiled inputs only."""

    def __init__(self, graph: torch.fx.GraphModule, record: CompileRecord, device: int) -> None:
        self._graph = graph
        self.record = record
        self._device = device

    def _check(self, args: Sequence[Any]) -> None:
        want = self.record.inputs
        if len(args) != len(want):
            raise RBLNInputError(f"compiled graph takes {len(want)} inputs, got {len(args)}")
        for i, (x, (shape, dtype)) in enumerate(zip(args, want)):
            if isinstance(x, torch.Tensor):
                got = (tuple(x.shape), str(x.dtype).removeprefix("torch."))
                if got != (shape, dtype):
                    raise RBLNInputError(
                        f"compiled graph input {i}: got {list(got[0])} {got[1]}, compiled for "
                        f"{list(shape)} {dtype} (a static program takes its compiled shapes only)")

    def __call__(self, *args: Any) -> Any:
        """Run the program on ``args`` (the graph's inputs, in order).

        Raises:
            RBLNInputError: an input's shape or dtype differs from the compiled one.
            RBLNDeviceError: the program was compiled with ``mode=["compile_only"]``.
            RBLNRuntimeFault: an injected fault struck this call.
        """
        if "compile_only" in self.record.modes:
            raise RBLNDeviceError("this graph was compiled with mode 'compile_only': it has no runtime")
        from ..runtime import count_call

        count_call(self._device)
        self._check(args)
        return self._graph(*args)


def _options(options: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    opts = dict(options or {})
    if not isinstance(options, (Mapping, type(None))):
        raise TypeError(f"rbln_backend: options must be a mapping, got {type(options).__name__}")
    opts.update(kwargs)
    unknown = sorted(set(opts) - OPTIONS)
    if unknown:
        raise RBLNCompileError(f"rbln_backend: unknown options {unknown}; known: {sorted(OPTIONS)}")
    mode = opts.get("mode") or []
    if isinstance(mode, str):
        mode = [mode]
    bad = sorted(set(mode) - MODES)
    if bad:
        raise RBLNCompileError(f"rbln_backend: mode {bad} is not one of {sorted(MODES)}")
    opts["mode"] = tuple(mode)
    return opts


def rbln_backend(graph: torch.fx.GraphModule, example_inputs: Sequence[Any], options: Any = None,
                 **kwargs: Any) -> Callable[..., Any]:
    """Compile ``graph`` for the NPU (the torch.compile backend; see the module docstring).

    Args:
        graph: the FX graph TorchDynamo traced.
        example_inputs: one example per graph input (their shapes are the program's).
        options: ``torch.compile(options=...)``; keyword arguments are merged into it.

    Returns:
        A :class:`CompiledGraph`.

    Raises:
        RBLNCompileError: an unknown option or mode, or a dynamic shape.
        RBLNDeviceError: no NPU is present for a compile that is to run, or ``npu`` names no
            known part.
    """
    opts = _options(options, kwargs)
    settings = parts.settings()
    npu = opts.get("npu")
    if npu is not None:
        parts.part_for(str(npu))  # RBLNDeviceError for a name no part matches
    if "compile_only" not in opts["mode"]:
        part = settings.part(0)
        if part is None:
            from ..runtime import invalid_device_message

            raise RBLNDeviceError(invalid_device_message(0))
        npu = npu or part.name
    inputs = tuple(_input_spec(i, x) for i, x in enumerate(example_inputs))
    from ..compiler import COMPILER
    from . import mega_cache

    npu = None if npu is None else str(npu)
    digest = hashlib.sha256("\n".join([graph.code, repr(inputs), str(npu), COMPILER]).encode()).hexdigest()[:16]
    cache_dir = opts.get("cache_dir")
    hit = cache_dir is not None and mega_cache.lookup(cache_dir, digest) is not None
    if cache_dir is not None and not hit:
        mega_cache.add(cache_dir, digest, {"npu": npu, "inputs": [[list(s), d] for s, d in inputs]})
    record = CompileRecord(npu=npu, inputs=inputs, modes=opts["mode"], signature=digest, from_cache=hit)
    with _lock:
        _records.append(record)
    return CompiledGraph(graph, record, device=0)
