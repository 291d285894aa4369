"""``rebel.Runtime``: a compiled program loaded on devices, called with host tensors.

A runtime accepts exactly the non-static inputs of its program, in ``input_info`` order, with
their compiled shapes and dtypes; anything else is an :class:`RBLNInputError` naming the input.
The static-address buffers (the KV caches) live on the device: optimum-rbln never passes them.

**Buffer sharing.** Runtimes of programs compiled in one context (prefill and every
``decoder_batch_N`` of a model) share one set of static buffers, as on the device. Sharing is
by *group*: a new runtime joins the newest group of its context unless that group already holds
a runtime of the same program (the same input signature), in which case it opens a new group with fresh buffers. So
loading a model twice in one process gives two independent caches, and two models never
collide (their context ids differ).

**Memory.** A runtime allocates its program's weights and activations, and a group its static
buffers once, on the process-wide ledger of :mod:`npusim.rbln.memory`; an allocation that does
not fit fails with :class:`RBLNOutOfMemoryError`. Memory is released when the runtime (group)
is garbage collected.

**Faults** (``$NPUSIM_RBLN`` ``fault``): the process counts runtime calls; a call the fault
strikes raises :class:`RBLNRuntimeFault` before touching any buffer.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from . import memory, parts
from .compiler import DTYPES, RBLNCompiledModel
from .errors import RBLNDeviceError, RBLNInputError, RBLNRuntimeFault

__all__ = ["Runtime", "calls", "count_call", "invalid_device_message"]

_lock = threading.Lock()
_state = {"calls": 0}
_groups: dict[str, list["_Group"]] = {}
_ids = itertools.count(1)


def lower(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Point every ``rbln_custom_ops`` call of ``module``'s graph at its host kernel
    (:func:`npusim.rbln.ops.host_kernel`): what a device does when it loads a program, here
    to skip the dispatcher's per-call custom-op wrappers (same arguments, same results)."""
    from . import ops

    changed = False
    for node in list(module.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
            module.graph.erase_node(node)  # a trace-time dtype check of the inputs we check anyway
            changed = True
            continue
        name = getattr(node.target, "_schema", None)
        ns, _, op = str(getattr(name, "name", "")).partition("::")
        if ns == "rbln_custom_ops":
            kernel = ops.host_kernel(op)
            if kernel is not None:
                node.target = kernel
                changed = True
    if changed:
        module.recompile()
    # torch.export's own per-call input check: Runtime._check enforces the same contract
    # (exact shapes and dtypes) with the device's messages.
    module._forward_pre_hooks.clear()
    return module


def invalid_device_message(device_id: Any) -> str:
    """The real stack's message for a device id that is not a present NPU."""
    return (f"Device {device_id} is not a valid NPU device. Please check your NPU status with "
            "'rbln-smi' command.")


def calls() -> int:
    """Runtime calls made in this process so far (the fault counter)."""
    return _state["calls"]


def count_call(device: int) -> None:
    """Count one device call of this process (a :class:`Runtime` call or a call of a graph the
    torch.compile backend compiled) and let an injected fault strike it.

    Raises:
        RBLNRuntimeFault: the ``$NPUSIM_RBLN`` fault strikes this call (before any buffer is
            touched).
    """
    st = parts.settings()
    with _lock:
        _state["calls"] += 1
        n = _state["calls"]
    if st.fault is not None and st.fault.strikes(n):
        msg = (f"RBLN runtime error on device {device}: command timed out "
               f"(npusim.rbln injected fault, runtime call {n})")
        if st.fault_log:
            with open(st.fault_log, "a") as fh:
                fh.write(msg + "\n")
        raise RBLNRuntimeFault(msg)


class _Group:
    """The static buffers shared by the runtimes of one compile context on one device set."""

    def __init__(self, context_id: str, devices: tuple[int, ...]) -> None:
        self.context_id, self.devices = context_id, devices
        self.programs: set[str] = set()
        self.buffers: dict[str, torch.Tensor] = {}
        self.owner = f"buffers#{next(_ids)}"

    def ensure(self, cm: RBLNCompiledModel, mems: list[memory.DeviceMemory]) -> None:
        new = [n for n in cm.header.static_names if n not in self.buffers]
        if not new:
            return
        nodes, chips = cm.header.num_devices, mems[0].part.chiplets
        total = 0
        for n in new:
            shape = cm.buffer_shape(n)
            dt = next(DTYPES[d] for nm, _, d in cm.header.input_info if nm == n)
            total += int(torch.Size(shape).numel()) * dt.itemsize
        per_node = memory.split(total, nodes, chips)
        for mem, chunk in zip(mems, per_node):
            mem.allocate(self.owner, chunk)
        with torch.inference_mode(False):
            for n in new:
                dt = next(DTYPES[d] for nm, _, d in cm.header.input_info if nm == n)
                self.buffers[n] = torch.zeros(cm.buffer_shape(n), dtype=dt)


def _release(owner: str, mems: list[memory.DeviceMemory]) -> None:
    for mem in mems:
        mem.free(owner)


class Runtime:
    """A program loaded on devices.

    Args:
        compiled_model: the program.
        tensor_type: ``"pt"`` (torch tensors in and out; the only kind the simulator has).
        device: a device id, a list of ``num_devices`` ids, or None (``0 .. num_devices-1``).
        activate_profiler, timeout: accepted; no effect.

    Raises:
        ValueError: ``tensor_type`` is not ``"pt"``, or the device list has the wrong length.
        RBLNDeviceError: a device that is not present (the real stack's "Device N is not a
            valid NPU device..." message), or one of another NPU family than compiled for.
        RBLNOutOfMemoryError: weights, activations or the static buffers do not fit.
    """

    def __init__(self, compiled_model: RBLNCompiledModel, tensor_type: str = "pt",
                 device: int | Sequence[int] | None = None, activate_profiler: bool | None = None,
                 timeout: int | None = None) -> None:
        if tensor_type != "pt":
            raise ValueError(f"tensor_type {tensor_type!r}: the simulator runs torch tensors only ('pt')")
        h = compiled_model.header
        devices = (list(range(h.num_devices)) if device is None else [device] if isinstance(device, int)
                   else list(device))
        if len(devices) != h.num_devices:
            raise ValueError(f"device {device!r}: the program spans {h.num_devices} devices")
        st = parts.settings()
        mems: list[memory.DeviceMemory] = []
        for d in devices:
            part = st.part(d)
            if part is None:
                raise RBLNDeviceError(invalid_device_message(d))
            if part.family != parts.part_for(h.npu).family:
                raise RBLNDeviceError(f"device {d} is {part.name}; the program was compiled for {h.npu}")
            mems.append(memory.ledger.device(d, part))
        self.compiled_model, self.devices, self.timeout = compiled_model, tuple(devices), timeout
        self._inputs = [(n, s, DTYPES[t]) for n, s, t in h.input_info if n not in h.static_names]
        self._order = [n for n, _, _ in h.input_info]
        self._owner = f"runtime#{next(_ids)}"
        per = memory.split(h.weight_bytes + h.activation_bytes, h.num_devices, mems[0].part.chiplets)
        for mem, chunk in zip(mems, per):
            mem.allocate(self._owner, chunk)
        weakref.finalize(self, _release, self._owner, mems)
        with _lock:
            groups = _groups.setdefault(h.context_id, [])
            group = next((g for g in reversed(groups) if g.devices == self.devices), None)
            program = repr(h.input_info)  # which program of the context (prefill, decoder_batch_N)
            if group is None or program in group.programs:
                group = _Group(h.context_id, self.devices)
                groups.append(group)
                weakref.finalize(group, _release, group.owner, mems)
            try:
                group.ensure(compiled_model, mems)
            except Exception:
                _release(self._owner, mems)
                raise
            group.programs.add(program)
        self._group = group
        self._module = lower(compiled_model.program().module())

    # ------------------------------------------------------------------ calls

    def _check(self, tensors: Sequence[Any]) -> None:
        if len(tensors) != len(self._inputs):
            raise RBLNInputError(
                f"the program takes {len(self._inputs)} inputs "
                f"({', '.join(n for n, _, _ in self._inputs)}), got {len(tensors)}")
        for (name, shape, dt), t in zip(self._inputs, tensors):
            if not isinstance(t, torch.Tensor):
                raise RBLNInputError(f"input {name!r}: expected a torch.Tensor, got {type(t).__name__}")
            if list(t.shape) != shape or t.dtype != dt:
                raise RBLNInputError(
                    f"input {name!r}: got {list(t.shape)} {str(t.dtype).removeprefix('torch.')}, "
                    f"the program was compiled for {shape} {str(dt).removeprefix('torch.')} "
                    "(static shapes: pad or pick another compiled program)")

    def __call__(self, *tensors: torch.Tensor, out: Any = None) -> Any:
        """Run the program on ``tensors`` (the non-static inputs in order).

        Returns the single output tensor, or a list of them; with ``out`` (a tensor or list of
        tensors of the outputs' shapes) the results are copied there and ``out`` returned.

        Raises:
            RBLNInputError: a missing, extra or mis-shaped input (names it).
            RBLNRuntimeFault: an injected fault struck this call.
        """
        count_call(self.devices[0])
        self._check(tensors)
        it = iter(tensors)
        args = [self._group.buffers[n] if n in self._group.buffers else next(it) for n in self._order]
        with torch.no_grad():
            result = self._module(*args)
        outs = list(result) if isinstance(result, (list, tuple)) else [result]
        if out is not None:
            dst = [out] if isinstance(out, torch.Tensor) else list(out)
            if len(dst) != len(outs):
                raise RBLNInputError(f"out has {len(dst)} tensors, the program returns {len(outs)}")
            for i, (d, o) in enumerate(zip(dst, outs)):
                if tuple(d.shape) != tuple(o.shape):
                    raise RBLNInputError(f"out[{i}] is {list(d.shape)}, the output is {list(o.shape)}")
                d.copy_(o)
            return out
        return outs[0] if len(outs) == 1 else outs

    def _copy_kv_cache(self, src_block: int, dst_block: int, length: int) -> None:
        """Copy the first ``length`` slots of KV block ``src_block`` to ``dst_block`` in every
        static buffer of this runtime's group (prefix caching).

        Raises:
            RBLNInputError: a block id or length outside the buffers.
        """
        for name, buf in self._group.buffers.items():
            nb, slots = buf.shape[0], buf.shape[-2]
            if not (0 <= src_block < nb and 0 <= dst_block < nb and 0 <= length <= slots):
                raise RBLNInputError(
                    f"_copy_kv_cache({src_block}, {dst_block}, {length}): {name} has {nb} blocks of "
                    f"{slots} slots")
            buf[dst_block, ..., :length, :] = buf[src_block, ..., :length, :]

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The static buffers this runtime uses (shared with its group; for tests and tools)."""
        return self._group.buffers

    def __repr__(self) -> str:
        h = self.compiled_model.header
        return (f"<npusim.rbln.Runtime npu={h.npu} device={list(self.devices)} "
                f"inputs={[n for n, _, _ in self._inputs]}>")
