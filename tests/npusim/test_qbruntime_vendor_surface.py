"""Every qbruntime 1.5.0 name the Mobilint vendor stack uses resolves on ``npusim.mxq``, with the real
parameter names.

Where the list comes from: static call sites in transformers-mblt 0.6.1, mblt-npu-python 0.1.0
(``mblt_npu``) and vllm-mblt 0.8.0, read from their wheels. Every ``import qbruntime`` /
``from qbruntime import X`` was followed to its ``qbruntime.X`` / ``X`` uses, and every method or
attribute name of the real qbruntime Python layer (``Model``, ``ModelConfig``, ``CacheInfo``,
``BufferInfo``, ``Scale``, ``NPUData``, ``ModelVariantHandle``, ...) was searched for as ``.name``
(and as a ``getattr(obj, "name")`` string), keeping only hits whose receiver is a qbruntime
object (a ``Model`` from a backend's ``mxq_models``, a ``get_cache_infos()`` entry, an NPUData from
``acquire_*_npu_data``...). One call site per package and name is in ``/tmp/surface.md`` (the
survey that produced this list), not here.

The expected parameter names are those of the real ``mobilint-qb-runtime`` 1.5.0 wheel's Python
layer (``qbruntime/model.py``, ``type.py``, ``accelerator.py``, ``npu_data.py``,
``model_variant_handle.py``). ``ModelVariantHandle`` is not exported by the real top-level
``qbruntime`` (only ``qbruntime.model_variant_handle``); the vendor reaches it through
``Model.get_model_variant_handle``, and ``npusim.mxq`` exports it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import pytest

import npusim.mxq as mxq

#: Every qbruntime name the three vendor packages use (sorted by class, then name).
VENDOR_NAMES: tuple[str, ...] = (
    "Accelerator",
    "Accelerator.__init__",
    "BatchParam",
    "BatchParam.__init__",
    "BufferInfo.max_cache_size",
    "BufferInfo.max_width",
    "CacheInfo.cache_type",
    "CacheInfo.layer_hash",
    "CacheInfo.name",
    "CacheInfo.num_batches",
    "CacheInfo.size",
    "Cluster",
    "Cluster.Cluster0",
    "Cluster.Cluster1",
    "Core",
    "Core.Core0",
    "Core.Core1",
    "Core.Core2",
    "Core.Core3",
    "CoreId",
    "CoreId.__init__",
    "CoreId.cluster",
    "CoreId.core",
    "LogLevel",
    "LogLevel.Warn",
    "Model",
    "Model.__init__",
    "Model._acc",
    "Model.acquire_input_npu_data",
    "Model.acquire_output_npu_data",
    "Model.dispose",
    "Model.dump_cache_memory",
    "Model.dump_cache_memory_to",
    "Model.get_cache_infos",
    "Model.get_core_mode",
    "Model.get_input_buffer_info",
    "Model.get_input_scale",
    "Model.get_model_input_data_type",
    "Model.get_model_input_shape",
    "Model.get_model_output_shape",
    "Model.get_model_variant_handle",
    "Model.get_num_model_variants",
    "Model.get_output_buffer_info",
    "Model.get_output_scale",
    "Model.infer",
    "Model.infer_npu_data",
    "Model.launch",
    "Model.load_cache_memory",
    "Model.load_cache_memory_from",
    "ModelConfig",
    "ModelConfig.__init__",
    "ModelConfig.set_activation_slots",
    "ModelConfig.set_auto_core_mode",
    "ModelConfig.set_global4_core_mode",
    "ModelConfig.set_global8_core_mode",
    "ModelConfig.set_multi_core_mode",
    "ModelConfig.set_single_core_mode",
    "ModelVariantHandle.get_model_input_shape",
    "ModelVariantHandle.get_model_output_shape",
    "NPUData.__getitem__",
    "NPUData.__setitem__",
    "NPUData.copy_from",
    "QbRuntimeError",
    "Scale.is_uniform",
    "Scale.scale",
    "Scale.scale_list",
    "set_log_level",
    "start_tracing_events",
    "stop_tracing_events",
)

#: Parameter names (without ``self``) of the callables above, from the real wheel's Python layer.
#: Names absent here are not checked: classes (the ``__init__`` row checks construction), enum
#: members, properties/fields, the ``Model._acc`` instance attribute, and ``QbRuntimeError``, which
#: is the pybind11 extension's exception class (``qbruntime.qbruntime.QbRuntimeError``) and has no
#: introspectable signature.
EXPECTED_PARAMS: dict[str, tuple[str, ...]] = {
    "Accelerator.__init__": ("device_name", "dev_no"),
    "BatchParam.__init__": ("sequence_length", "cache_size", "cache_id"),
    "CoreId.__init__": ("cluster", "core"),
    "Model.__init__": ("path", "model_config"),
    "Model.acquire_input_npu_data": ("shape", "idx", "upload", "dtype"),
    "Model.acquire_output_npu_data": ("shape", "idx", "upload", "dtype"),
    "Model.dispose": (),
    "Model.dump_cache_memory": ("cache_id",),
    "Model.dump_cache_memory_to": ("cache_dir", "cache_id"),
    "Model.get_cache_infos": (),
    "Model.get_core_mode": (),
    "Model.get_input_buffer_info": (),
    "Model.get_input_scale": (),
    "Model.get_model_input_data_type": (),
    "Model.get_model_input_shape": (),
    "Model.get_model_output_shape": (),
    "Model.get_model_variant_handle": ("variant_idx",),
    "Model.get_num_model_variants": (),
    "Model.get_output_buffer_info": (),
    "Model.get_output_scale": (),
    "Model.infer": ("inputs", "outputs", "cache_size", "params"),
    "Model.infer_npu_data": ("inputs", "outputs", "cache_size"),
    "Model.launch": ("acc",),
    "Model.load_cache_memory": ("bufs", "cache_id"),
    "Model.load_cache_memory_from": ("cache_dir", "cache_id"),
    "ModelConfig.__init__": ("num_cores",),
    "ModelConfig.set_activation_slots": ("num",),
    "ModelConfig.set_auto_core_mode": (),
    "ModelConfig.set_global4_core_mode": ("clusters",),
    "ModelConfig.set_global8_core_mode": (),
    "ModelConfig.set_multi_core_mode": ("clusters",),
    "ModelConfig.set_single_core_mode": ("num_cores", "core_ids"),
    "ModelVariantHandle.get_model_input_shape": (),
    "ModelVariantHandle.get_model_output_shape": (),
    "NPUData.__getitem__": ("key",),
    "NPUData.__setitem__": ("key", "value"),
    "NPUData.copy_from": ("src",),
    "set_log_level": ("level",),
    "start_tracing_events": ("path",),
    "stop_tracing_events": (),
}

#: Attributes the real layer sets on instances only (``Model.launch`` sets ``_acc``, ``dispose``
#: clears it; transformers-mblt's ``cache_residency._is_disposed`` reads it), checked on a Model.
INSTANCE_ATTRS: frozenset[str] = frozenset({"Model._acc"})

#: Known gaps in npusim.mxq, each expected to fail (strict). Empty: the survey's gaps (NPUData
#: members, Scale fields, the variant_idx and num parameter names) are closed.
KNOWN_GAPS: dict[str, str] = {}


def _params(obj: Any) -> tuple[str, ...]:
    """Parameter names of ``obj`` without ``self`` and without private keyword-only extras
    (``Model.__init__``'s ``_summary_only`` is the simulator's, invisible to real-API callers)."""
    return tuple(
        p.name for p in inspect.signature(obj).parameters.values()
        if p.name != "self" and not (p.kind is p.KEYWORD_ONLY and p.name.startswith("_"))
    )


def _resolve(dotted: str) -> Any:
    """``getattr`` chain from ``npusim.mxq``; a dataclass field with no class default (an
    instance attribute, e.g. ``CoreId.cluster``) resolves to its ``dataclasses.Field``."""
    obj: Any = mxq
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        fields = {f.name: f for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else {}
        if i == len(parts) - 1 and part in fields:
            return fields[part]
        raise AttributeError(f"npusim.mxq has no {'.'.join(parts[: i + 1])}")
    return obj


@pytest.fixture
def launched_model(mxq_machine: Any, mxq_artifact: Any) -> Iterator[Any]:
    """A ``Model`` launched on a fresh simulated card; disposed afterwards."""
    model = mxq.Model(str(mxq_artifact()))
    model.launch(mxq.Accelerator())
    yield model
    model.dispose()


def _cases() -> list[Any]:
    return [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[n])) if n in KNOWN_GAPS else n
        for n in VENDOR_NAMES
    ]


def _by_class_then_name(name: str) -> tuple[str, str]:
    return (name.split(".")[0].lower(), name)


def test_name_list_is_sorted_unique_and_consistent() -> None:
    """The data above agrees with itself: sorted, no duplicates, every checked name listed."""
    assert list(VENDOR_NAMES) == sorted(set(VENDOR_NAMES), key=_by_class_then_name)
    assert set(EXPECTED_PARAMS) <= set(VENDOR_NAMES)
    assert set(KNOWN_GAPS) <= set(VENDOR_NAMES) and INSTANCE_ATTRS <= set(VENDOR_NAMES)


@pytest.mark.parametrize("name", _cases())
def test_vendor_name_resolves_with_real_parameters(name: str, request: pytest.FixtureRequest) -> None:
    """``name`` resolves on ``npusim.mxq`` and, for a callable, has the real parameter names."""
    if name in INSTANCE_ATTRS:
        model = request.getfixturevalue("launched_model")
        attr = name.split(".", 1)[1]
        assert getattr(model, attr) is not None, f"{name} is not set after launch()"
        model.dispose()
        assert getattr(model, attr) is None, f"{name} is not cleared by dispose()"
        return
    obj = _resolve(name)
    if name in EXPECTED_PARAMS:
        assert callable(obj), f"{name} is not callable"
        assert _params(obj) == EXPECTED_PARAMS[name]


def test_qbruntime_error_is_a_runtime_error() -> None:
    """``QbRuntimeError`` is pybind11's (no signature to compare): vendor code catches it and
    reads ``str(exc)``, so it must be an exception class deriving from ``RuntimeError`` as the real one."""
    assert issubclass(mxq.QbRuntimeError, RuntimeError)
