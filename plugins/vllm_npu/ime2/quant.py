"""The ``ime2_q4`` quantization method for vLLM's CPU platform (issue 5).

``vllm serve <bf16/fp32 checkpoint> --quantization ime2_q4`` (or ``vllm.LLM(...,
quantization="ime2_q4")``) loads the checkpoint as usual, then quantizes every **linear layer**
(vLLM ``LinearBase``: the fused ``qkv_proj``, ``o_proj``, the fused ``gate_up_proj`` and
``down_proj``) to Q4_0 and packs it once into the IME2 tile format
(:class:`vllm_npu.ime2.linear.PackedQ4Weight`). Each forward call of such a layer runs the
kernel (N tiles split over the worker threads, see ``linear.py``).

Not quantized, left exactly as vLLM has them: the token embedding (``VocabParallelEmbedding``),
the LM head (``ParallelLMHead``, tied or not), the norms, RoPE and attention.

Weight lifetime: ``create_weights`` registers the same float ``weight`` parameter as vLLM's
unquantized method (so bf16/fp32 checkpoints and the fused q/k/v and gate/up loaders work
unchanged); ``process_weights_after_loading`` packs it and deletes the parameter, so the float
copy is freed and only the packed tiles stay resident.

On a SpacemiT K3 the thread that loads the model passes the core fence before the first
weight is packed (:mod:`vllm_npu.ime2.fence`: kernel loaded on the X100 cores, then the kernel's
GEMM worker threads registered and pinned one per A100 core, whose IME2 instructions the ``ime2``
path needs, while this thread stays on the X100 cores); elsewhere the fence only logs that this
is not a K3. On a K3 a failed fence stops the load (:class:`CoreFenceError`),
and so does the K3 build of the kernel reading ``vlenb != 128`` after the fence
(``kernel.WrongVlenError``) unless the RVV/portable fallback is opted in
(``NPU_IME2_ALLOW_FALLBACK=1``): see :func:`pass_core_fence` and :func:`check_kernel_path`.

The kernel call is the torch custom op ``torch.ops.npu_harness.ime2_q4_linear`` (opaque to
``torch.compile``; its fake implementation gives the output shape), so compiled and eager
mode both work.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from vllm_npu.vllm_version import require_supported_vllm

require_supported_vllm("ime2")  # before any vLLM import: another vLLM is refused by name

import torch
from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED, LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from . import fence, kernel
from .linear import PackedQ4Weight, default_threads

__all__ = [
    "METHOD_NAME",
    "AlreadyQuantizedError",
    "CoreFenceError",
    "Ime2Q4Config",
    "Ime2Q4LinearMethod",
    "Ime2QuantError",
    "UnsupportedPlatformError",
    "check_kernel_path",
    "pass_core_fence",
    "register",
]

#: The name users pass to ``--quantization``.
METHOD_NAME = "ime2_q4"

# A child of vLLM's "vllm" logger, so the line shows up with vLLM's own logging set-up.
logger = logging.getLogger("vllm.vllm_npu.ime2")

_LOCK = threading.Lock()
_PATH_LOGGED = False
_OP_DEFINED = False


class Ime2QuantError(ValueError):
    """Base class of the ``ime2_q4`` configuration errors."""


class UnsupportedPlatformError(Ime2QuantError):
    """``--quantization ime2_q4`` on a vLLM platform other than CPU."""


class AlreadyQuantizedError(Ime2QuantError):
    """The checkpoint's ``config.json`` already carries another quantization scheme."""


class CoreFenceError(fence.FenceError):
    """``--quantization ime2_q4`` on a SpacemiT K3 whose core fence failed: the fence raised (its
    error is ``__cause__``) or came back without pinning the GEMM worker threads to the A100
    cores."""


def pass_core_fence(layout: fence.CoreLayout | None = None) -> fence.FenceResult:
    """Pass the K3 core fence once per process (:func:`fence.enter_ai_cores_once`), as a hard
    requirement on a K3.

    Off a K3 (x86-64 hosts and other machines :func:`fence.detect_k3` rejects) the fence is a
    no-op that logs one line, and so is this. On a K3 the kernel's GEMM worker threads must end
    up pinned to the A100 cores (the calling thread stays on the X100 cores).

    Args:
        layout: proc root and core sets (default :data:`fence.K3_LAYOUT`, read at call time).

    Returns:
        The fence's result (``moved`` is True on a K3).

    Raises:
        CoreFenceError: on a K3, the fence raised a :class:`fence.FenceError` (no
            ``/proc/set_ai_thread``, the write refused or failed, a worker's pin failed) or
            returned without moving the workers.
        vllm_npu.ime2.kernel.KernelUnavailableError: the kernel library is not built.
    """
    layout = fence.K3_LAYOUT if layout is None else layout
    cores = sorted(layout.a100_cores)
    try:
        result = fence.enter_ai_cores_once(logger=logger, layout=layout)
    except fence.FenceError as exc:
        raise CoreFenceError(
            f"--quantization {METHOD_NAME}: the SpacemiT K3 core fence failed, so the GEMM's worker threads cannot "
            f"reach the A100 cores {cores} whose IME2 instructions the kernel needs: {exc}", exc.path) from exc
    if not result.moved:
        found = fence.detect_k3(layout)
        if found.is_k3:
            raise CoreFenceError(
                f"--quantization {METHOD_NAME}: this host is a SpacemiT K3 ({found.reason}) but the core fence "
                f"did not move the threads of the GEMM to the A100 cores {cores} ({result.message})",
                layout.set_ai_thread)
    return result


def check_kernel_path() -> str:
    """The kernel path ``auto`` runs where the layers' GEMM slices run, checked before any weight
    is packed (:func:`kernel.check_gemm_path`: on the kernel's worker threads, which the core
    fence pinned to the A100 cores on a K3; elsewhere this thread).

    On the K3 build (``kernel.ime2_built()``) without the fallback opt-in that is ``ime2``, and
    it must be able to run there (vlenb 128, an A100 core); with ``NPU_IME2_ALLOW_FALLBACK=1`` it
    may be ``rvv``/``portable`` (logged as a warning). Other builds: ``x86`` or ``portable``.

    Raises:
        vllm_npu.ime2.kernel.WrongVlenError: the K3 build reads vlenb != 128 where the slices run
            (worker 0 of a pinned pool, else this thread) and the fallback is not opted in (names
            the vlenb and the CPUs).
        vllm_npu.ime2.kernel.FallbackSettingError: ``NPU_IME2_ALLOW_FALLBACK`` is malformed.
        vllm_npu.ime2.kernel.PathError: the resolved path cannot run on this CPU.
    """
    return kernel.check_gemm_path(context=f"--quantization {METHOD_NAME}, after the core fence")


def _log_path_once(path: str) -> None:
    """One INFO line per process: the kernel path ``path`` (from :func:`check_kernel_path`)."""
    global _PATH_LOGGED
    with _LOCK:
        if _PATH_LOGGED:
            return
        _PATH_LOGGED = True
    logger.info("ime2_q4: linear layers run the IME2 Q4_0x32 kernel, %s path (auto, where the GEMM runs; usable "
                "in this thread: %s), N tiles over %d threads", path, ", ".join(kernel.usable_paths()),
                default_threads())


def _define_op() -> None:
    """Define ``torch.ops.npu_harness.ime2_q4_linear(x, layer_name, n)`` once per process.

    The op finds its layer as vLLM's attention op does: by name in the forward context's
    ``no_compile_layers`` (the model's ``static_forward_context``), so a compiled graph holds
    only the name, never a process-specific handle, and two models in one process stay apart.
    """
    global _OP_DEFINED
    with _LOCK:
        if _OP_DEFINED:
            return
        try:
            torch.ops.npu_harness.ime2_q4_linear  # noqa: B018 - already defined (module reloaded)?
        except (AttributeError, RuntimeError):

            @torch.library.custom_op("npu_harness::ime2_q4_linear", mutates_args=(), device_types="cpu")
            def _op(x: torch.Tensor, layer_name: str, n: int) -> torch.Tensor:
                from vllm.forward_context import get_forward_context

                layer = get_forward_context().no_compile_layers[layer_name]
                return _apply_nan_rows(layer.ime2_weight, x)

            @_op.register_fake
            def _fake(x: torch.Tensor, layer_name: str, n: int) -> torch.Tensor:
                return x.new_empty((*x.shape[:-1], n))

        _OP_DEFINED = True


def _apply_nan_rows(packed: PackedQ4Weight, x: torch.Tensor) -> torch.Tensor:
    """``packed.apply(x)`` with float GEMM semantics for non-finite rows.

    The kernel rejects NaN/Inf activations (``NonFiniteError``), but vLLM's profile run and
    padded batch slots feed rows of uninitialised memory. Such rows are zeroed for the kernel
    and come out as NaN, as a float GEMM would give; the finite rows get the kernel's result for
    the batch with those rows zeroed (a 4-row group shares its activation scales). The kernel's own
    finite check decides, so finite activations (every call but those) take no extra pass.
    """
    try:
        return packed.apply(x)
    except kernel.NonFiniteError:
        pass
    finite = torch.isfinite(x).all(dim=-1)
    y = packed.apply(torch.where(finite.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype)))
    return y.masked_fill(~finite.unsqueeze(-1), float("nan"))


def _register_layer(layer: torch.nn.Module) -> None:
    """Put ``layer`` in the model's ``static_forward_context`` under its prefix (for the op).

    Raises:
        Ime2QuantError: the layer has no prefix or the prefix is already taken.
    """
    from vllm.config import get_current_vllm_config

    prefix = getattr(layer, "prefix", "")
    context = get_current_vllm_config().compilation_config.static_forward_context
    if not prefix or prefix in context:
        raise Ime2QuantError(
            f"--quantization {METHOD_NAME}: linear layer {type(layer).__name__} has "
            f"{'no prefix' if not prefix else f'the prefix {prefix!r}, already used by another layer'}; "
            "each quantized layer needs a unique name"
        )
    context[prefix] = layer


class Ime2Q4LinearMethod(LinearMethodBase):
    """Float weights at load (like vLLM's unquantized method), packed Q4_0 tiles afterwards.

    Raises (from :meth:`create_weights`):
        vllm_npu.ime2.kernel.KDimensionError: the layer's input size is not a multiple of 32.
        Ime2QuantError: the layer has no unique prefix (the op finds it by name).
    """

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        k = int(input_size_per_partition)
        if k <= 0 or k % kernel.QK:
            prefix = getattr(layer, "prefix", "") or type(layer).__name__
            raise kernel.KDimensionError(
                f"--quantization {METHOD_NAME}: linear layer {prefix!r} has input size K={k}, which is "
                f"not a multiple of {kernel.QK} (K % 32 = {k % kernel.QK}); the Q4_0 tile quantizes "
                f"blocks of 32 inputs. Serve this model without --quantization {METHOD_NAME}."
            )
        _register_layer(layer)
        weight_loader = extra_weight_attrs.pop("weight_loader")
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), k, dtype=params_dtype),
            input_dim=1, output_dim=0, weight_loader=weight_loader,
        )
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Quantize and pack ``layer.weight`` once, then delete the float parameter.

        The first call in a process passes the K3 core fence (:func:`pass_core_fence`: on a
        SpacemiT K3 the kernel is loaded on the X100 cores, then the kernel's GEMM worker threads
        are pinned one per A100 core, while this thread, the one that runs the forward passes,
        stays on the X100 cores; elsewhere one log line), checks the kernel path
        (:func:`check_kernel_path`) and logs it once.

        Raises:
            CoreFenceError: a K3 whose core fence fails (e.g. no ``/proc/set_ai_thread``).
            vllm_npu.ime2.kernel.WrongVlenError: the K3 build of the kernel reads vlenb != 128
                where the GEMM runs and ``NPU_IME2_ALLOW_FALLBACK`` is not set.
        """
        pass_core_fence()
        _log_path_once(check_kernel_path())
        _define_op()
        name = getattr(layer, "prefix", "") or "weight"
        packed = PackedQ4Weight.from_float(layer.weight.data, name=name)
        layer.ime2_weight = packed
        layer.ime2_n = packed.n
        del layer.weight  # frees the float copy; only the packed tiles stay

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.ops.npu_harness.ime2_q4_linear(x, layer.prefix, layer.ime2_n)
        return y if bias is None else y + bias


class Ime2Q4Config(QuantizationConfig):
    """``--quantization ime2_q4``: quantize linear layers to Q4_0 at load, run the IME2 kernel.

    Raises (at engine configuration, before any model is built):
        UnsupportedPlatformError: vLLM's current platform is not CPU.
    """

    def __init__(self) -> None:
        super().__init__()
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise UnsupportedPlatformError(
                f"--quantization {METHOD_NAME} runs only on vLLM's CPU platform, but the current platform "
                f"is {type(current_platform).__name__} (device {current_platform.device_name!r}); unset the "
                f"platform plugin's selector (e.g. NPU_HARNESS_TARGET) or drop --quantization {METHOD_NAME}"
            )

    def get_name(self) -> str:
        return METHOD_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # nothing to read: the checkpoint is a plain float one

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Ime2Q4Config:
        return cls()

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        """Reject ``--quantization ime2_q4`` on a checkpoint that is already quantized.

        Raises:
            AlreadyQuantizedError: ``user_quant`` is ``ime2_q4`` and the checkpoint's
                ``quantization_config`` names another ``quant_method``.
        """
        if user_quant != METHOD_NAME:
            return None
        scheme = (hf_quant_cfg or {}).get("quant_method", "")
        if scheme in ("", METHOD_NAME):
            return None
        raise AlreadyQuantizedError(
            f"--quantization {METHOD_NAME} quantizes an unquantized (bf16/fp16/fp32) checkpoint at load, "
            f"but this checkpoint's config.json already has quantization_config with "
            f"quant_method={scheme!r}; use the unquantized checkpoint with {METHOD_NAME}, or drop "
            f"--quantization {METHOD_NAME} to serve it with vLLM's {scheme!r} method"
        )

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            return Ime2Q4LinearMethod()
        return None  # embeddings, LM head: vLLM's own unquantized methods


def register() -> None:
    """Register ``ime2_q4`` with vLLM (idempotent: a second call changes nothing)."""
    with _LOCK:
        if Ime2Q4LinearMethod.__name__ not in WEIGHT_LOADER_V2_SUPPORTED:
            WEIGHT_LOADER_V2_SUPPORTED.append(Ime2Q4LinearMethod.__name__)
        if METHOD_NAME not in QUANTIZATION_METHODS:
            register_quantization_config(METHOD_NAME)(Ime2Q4Config)
