"""``rebel.compile_from_torch`` and ``rebel.RBLNCompiledModel``.

A compile turns a ``torch.nn.Module`` into a static program with ``torch.export`` (strict
shapes: every input has exactly the shape and dtype of its ``input_info`` entry, and any
data-dependent control flow fails the compile as it fails the real compiler's tracer). The
program keeps calls to ``torch.ops.rbln_custom_ops`` as opaque operators. It is held in memory
and written by :meth:`RBLNCompiledModel.save` as a ``.rbln`` file (:mod:`npusim.rbln.rblnfile`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from . import memory, parts, rblnfile
from .compile_context import CompileContext
from .errors import RBLNCompileError, RBLNDeviceError, RBLNFileError

__all__ = ["COMPILER", "RBLNCompiledModel", "compile", "compile_from_torch", "DTYPES"]

COMPILER = "npusim.rbln 0.12.0"

#: dtype names of ``input_info`` -> torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _check_input_info(input_info: Any) -> list[tuple[str, list[int], str]]:
    out: list[tuple[str, list[int], str]] = []
    if not isinstance(input_info, (list, tuple)) or not input_info:
        raise ValueError(f"input_info must be a non-empty list of (name, shape, dtype), got {input_info!r}")
    seen: set[str] = set()
    for entry in input_info:
        try:
            name, shape, dtype = entry
        except (TypeError, ValueError):
            raise ValueError(f"input_info entry {entry!r} is not (name, shape, dtype)") from None
        if not isinstance(name, str) or not name or name in seen:
            raise ValueError(f"input_info: name {name!r} is empty, not a string or repeated")
        if not isinstance(shape, (list, tuple)) or any(
                not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise ValueError(f"input_info {name!r}: shape {shape!r} must be a list of ints >= 0 (static)")
        dname = dtype if isinstance(dtype, str) else _dtype_name(dtype) if isinstance(dtype, torch.dtype) else None
        if dname not in DTYPES:
            raise ValueError(f"input_info {name!r}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
        seen.add(name)
        out.append((name, [int(d) for d in shape], dname))
    return out


def _normal_tensors(model: torch.nn.Module) -> None:
    """Turn inference-mode parameters and buffers of ``model`` into normal tensors (same values).

    optimum-rbln builds parts of its wrappers under ``torch.inference_mode()``; ``torch.export``
    cannot trace inference tensors as parameters.
    """
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.is_inference():
                mod._parameters[name] = torch.nn.Parameter(p.clone(), requires_grad=False)
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is not None and b.is_inference():
                mod._buffers[name] = b.clone()


def _shape_spec(model: torch.nn.Module, dynamic: list[Any]) -> tuple[Any, ...]:
    """``dynamic`` (one entry per positional input) in the structure of ``model.forward``'s
    signature: a ``*args`` parameter takes its inputs as one tuple."""
    import inspect

    fixed = 0
    for p in inspect.signature(model.forward).parameters.values():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return (*dynamic[:fixed], tuple(dynamic[fixed:]))
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            fixed += 1
    return tuple(dynamic)


def compile(model: Any = None, *, input_info: Any = None, npu: str | None = None,
            num_devices: int = 1, dtype: str | None = None, **kwargs: Any) -> "RBLNCompiledModel":
    """The generic compile entry point. Only its signature is read by optimum-rbln and
    vllm-rbln (``num_devices``, ``dtype``); the simulator compiles torch modules only.

    Raises:
        NotImplementedError: always; use :func:`compile_from_torch`.
    """
    raise NotImplementedError(
        "npusim.rbln compiles torch modules only: use rebel.compile_from_torch (issue 16)")


def compile_from_torch(model: torch.nn.Module, input_info: Sequence[tuple[str, Sequence[int], str]],
                       npu: str | None = None, num_devices: int | None = None,
                       example_inputs: Sequence[torch.Tensor] | None = None,
                       compile_context: CompileContext | None = None,
                       tensor_parallel_size: int | None = None, **kwargs: Any) -> "RBLNCompiledModel":
    """Compile ``model`` called with the inputs of ``input_info`` into a static program.

    Args:
        model: the module; ``model(*inputs)`` in ``input_info`` order.
        input_info: ``[(name, shape, dtype_name), ...]``, static-address buffers included.
        npu: the target SKU; None = device 0's.
        num_devices: devices (RSD) the program spans (``tensor_parallel_size`` is the old name).
        example_inputs: tensors of those shapes (meta tensors allowed); None = zeros.
        compile_context: the model's context; None = a context of its own.

    Raises:
        ValueError: a malformed ``input_info``, an example that does not match it, bad
            ``num_devices``.
        RBLNDeviceError: ``npu`` is not an RBLN SKU, or is None with no NPU present.
        RBLNCompileError: ``torch.export`` cannot capture the module (chained).
    """
    info = _check_input_info(input_info)
    n = num_devices if num_devices is not None else tensor_parallel_size if tensor_parallel_size is not None else 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"num_devices must be an int >= 1, got {n!r}")
    if npu is None:
        from . import get_npu_name

        npu = get_npu_name(0)
        if npu is None:
            raise RBLNDeviceError("no NPU is present to compile for: pass npu= (e.g. 'RBLN-CA25')")
    part = parts.part_for(npu)
    ctx = compile_context if compile_context is not None else CompileContext()
    if example_inputs is not None and len(example_inputs) != len(info):
        raise ValueError(f"example_inputs has {len(example_inputs)} tensors, input_info names {len(info)}")
    args: list[torch.Tensor] = []
    dynamic: list[dict[int, Any] | None] = []
    with torch.inference_mode(False), torch.no_grad():
        for i, (name, shape, dname) in enumerate(info):
            ex = None if example_inputs is None else example_inputs[i]
            if ex is not None and (list(ex.shape) != shape or ex.dtype != DTYPES[dname]):
                raise ValueError(f"example input {name!r} is {list(ex.shape)} {_dtype_name(ex.dtype)}, "
                                 f"input_info says {shape} {dname}")
            if name in ctx.static:
                # Static buffers may grow after the compile (exp_multiply_buffer_size): their
                # first dimension is traced as a symbol (from an example of 2, since torch.export
                # specializes sizes 0 and 1).
                args.append(torch.zeros([max(2, shape[0]), *shape[1:]], dtype=DTYPES[dname]))
                dynamic.append({0: torch.export.Dim(f"blocks_{i}", min=1)})
                continue
            dynamic.append(None)
            if ex is None or ex.is_meta or ex.is_inference():
                args.append(torch.zeros(shape, dtype=DTYPES[dname]) if ex is None or ex.is_meta
                            else ex.clone())
            else:
                args.append(ex)
        _normal_tensors(model)
        try:
            program = torch.export.export(model, tuple(args), dynamic_shapes=_shape_spec(model, dynamic), strict=False)
        except Exception as exc:  # the tracer's own errors are many and unrelated classes
            raise RBLNCompileError(f"cannot compile {type(model).__name__} to a static graph: {exc}") from exc
    outs = [n.meta["val"] for n in program.graph.output_node().args[0]]
    weights = 0
    if not (ctx.use_weight_sharing and ctx.programs):
        weights = sum(t.numel() * t.element_size() for t in program.state_dict.values())
        weights += sum(t.numel() * t.element_size() for t in program.constants.values()
                       if isinstance(t, torch.Tensor))
    ctx.programs += 1
    act = 4 * max((o.numel() * o.element_size() for o in outs), default=0)
    header = rblnfile.Header(
        compiler=COMPILER, npu=part.name, num_devices=n, input_info=[tuple(e) for e in info],
        outputs=[(list(o.shape), _dtype_name(o.dtype)) for o in outs], context_id=ctx.id,
        static_names=[name for name, _, _ in info if name in ctx.static],
        weight_bytes=int(weights), activation_bytes=int(act))
    return RBLNCompiledModel._from_program(header, program)


class RBLNCompiledModel:
    """A compiled program: loaded from a ``.rbln`` file, or fresh from a compile.

    Args:
        path: a ``.rbln`` file written by :meth:`save`.

    Raises:
        RBLNFileError: the file is missing or corrupt (names the file and the fault).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.header, self._blob = rblnfile.read(path)
        self._program: Any = None
        self.path = Path(path)

    @classmethod
    def _from_program(cls, header: rblnfile.Header, program: Any) -> "RBLNCompiledModel":
        self = cls.__new__(cls)
        self.header, self._blob, self._program, self.path = header, None, program, None
        return self

    # ------------------------------------------------------------------ program

    def program(self) -> Any:
        """The ``torch.export`` program (deserialized on first use)."""
        if self._program is None:
            try:
                self._program = torch.export.load(io.BytesIO(self._blob))
            except Exception as exc:
                raise RBLNFileError(f"{self.path}: the program does not load ({exc})") from exc
        return self._program

    def save(self, path: str | os.PathLike) -> None:
        """Write the program and its header (multipliers included) as a ``.rbln`` file."""
        if self._blob is None:
            buf = io.BytesIO()
            torch.export.save(self._program, buf)
            self._blob = buf.getvalue()
        rblnfile.write(path, self.header, self._blob)

    # ------------------------------------------------------------------ memory queries

    def _part(self) -> parts.Part:
        return parts.part_for(self.header.npu)

    def _static_bytes(self, name: str) -> int:
        for n, shape, dname in self.header.input_info:
            if n == name:
                numel = 1
                for d in shape:
                    numel *= d
                return numel * DTYPES[dname].itemsize * self.header.multipliers.get(name, 1)
        raise KeyError(name)

    def get_alloc_per_chiplet_by_key(self) -> dict[str, list[list[int]]]:
        """Bytes by kind (``Weight``, ``Activation``, ``DramTensor``), per chiplet per node."""
        nodes, chips = self.header.num_devices, self._part().chiplets
        static = sum(self._static_bytes(n) for n in self.header.static_names)
        return {"Weight": memory.split(self.header.weight_bytes, nodes, chips),
                "Activation": memory.split(self.header.activation_bytes, nodes, chips),
                "DramTensor": memory.split(static, nodes, chips)}

    def get_alloc_per_node_by_key(self) -> dict[str, list[int]]:
        """As :meth:`get_alloc_per_chiplet_by_key`, summed per node."""
        return {k: [sum(c) for c in v] for k, v in self.get_alloc_per_chiplet_by_key().items()}

    def exp_get_dram_tensor_sizes(self) -> dict[str, list[list[int]]]:
        """Bytes of each static-address buffer (multiplier applied), per chiplet per node."""
        nodes, chips = self.header.num_devices, self._part().chiplets
        return {n: memory.split(self._static_bytes(n), nodes, chips) for n in self.header.static_names}

    def exp_multiply_buffer_size(self, multipliers: dict[str, int]) -> None:
        """Grow static buffers' first dimension ``x multiplier`` (persisted by :meth:`save`).

        Raises:
            ValueError: a name that is not a static buffer of this program, or a multiplier < 1.
        """
        for name, mult in multipliers.items():
            if name not in self.header.static_names:
                raise ValueError(f"exp_multiply_buffer_size: {name!r} is not a static buffer of this "
                                 f"program (static: {self.header.static_names})")
            if not isinstance(mult, int) or isinstance(mult, bool) or mult < 1:
                raise ValueError(f"exp_multiply_buffer_size: multiplier for {name!r} must be an int >= 1, got {mult!r}")
        new = {**self.header.multipliers, **{k: int(v) for k, v in multipliers.items()}}
        from dataclasses import replace

        self.header = replace(self.header, multipliers=new)

    def buffer_shape(self, name: str) -> list[int]:
        """The run-time shape of static buffer ``name`` (first dimension x its multiplier)."""
        for n, shape, _ in self.header.input_info:
            if n == name:
                return [shape[0] * self.header.multipliers.get(name, 1), *shape[1:]]
        raise KeyError(name)

    def __repr__(self) -> str:
        h = self.header
        return (f"RBLNCompiledModel(npu={h.npu!r}, num_devices={h.num_devices}, "
                f"inputs={[n for n, _, _ in h.input_info if n not in h.static_names]}, "
                f"static={len(h.static_names)}, context={h.context_id[:8]})")
