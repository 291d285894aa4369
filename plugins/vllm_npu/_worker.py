"""What every NPU worker of this project answers vLLM the same way: :class:`NpuWorker`.

The model runs on the device through the vendor runtime, so the worker has no host
attention backend, no torch model, no compilation and no LoRA. vLLM still asks; these are
the answers. A step is the one step engine's (:class:`vllm_npu.step_engine.StepEngine`, set as
``self.engine`` by the device worker, which adds its lifecycle and its device runner).
"""

from __future__ import annotations

from typing import Any, ClassVar

from vllm.v1.worker.worker_base import WorkerBase


class NpuLoraError(RuntimeError):
    """LoRA adapters were asked of a device worker (none of them serves LoRA)."""


class NpuWorker(WorkerBase):
    """Base of the device workers: the device-neutral answers (see the module docstring)."""

    #: Device name used in messages (``MBLT``, ``RBLN``, ``Neuron``).
    npu_name: ClassVar[str] = "NPU"

    @staticmethod
    def platform_plan(vllm_config: Any, key: str, error: type[Exception], platform: str) -> dict[str, Any]:
        """The plan the device's platform left in ``vllm_config.additional_config[key]``.

        Raises:
            error: there is none (the platform did not configure this engine).
        """
        extra = vllm_config.additional_config or {}
        plan = extra.get(key) if isinstance(extra, dict) else None
        if not isinstance(plan, dict):
            raise error(f"the {platform} platform handed the worker no plan (additional_config[{key!r}])")
        return plan

    #: The step engine (the device worker builds it when it loads its model).
    engine: Any = None

    def execute_model(self, scheduler_output: Any):
        """One step (:meth:`vllm_npu.step_engine.StepEngine.execute`)."""
        return self.engine.execute(scheduler_output)

    def sample_tokens(self, grammar_output: Any):
        """The step ``execute_model`` left for vLLM's grammar bitmask
        (:meth:`vllm_npu.step_engine.StepEngine.sample_tokens`)."""
        return self.engine.sample_tokens(grammar_output)

    def get_supported_kv_cache_layouts(self) -> list[str]:
        """No host attention backend exists (the KV lives on the device), so every layout
        name is acceptable. ``WorkerBase``'s answer asks the attention-backend registry,
        which raises "Invalid attention backend" for a device with none."""
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

        return [layout.name for layout in get_supported_kv_cache_layouts([])]

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_model(self) -> None:
        """There is no host torch model: the model is the device's compiled program."""
        return None

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        self.kv_cache_config = kv_cache_config

    def compile_or_warm_up_model(self):
        from vllm.v1.worker.worker_base import CompilationTimes

        return CompilationTimes(language_model=0.0, encoder=0.0)

    def synchronize_device(self) -> None:
        """Every runtime call blocks until the device is done: nothing to wait for."""
        return None

    def add_lora(self, lora_request: Any) -> bool:  # noqa: ARG002
        """Raises:
        NpuLoraError: always (no device worker serves LoRA)."""
        raise NpuLoraError(f"LoRA is not supported by the {self.npu_name} worker")

    def remove_lora(self, lora_id: int) -> bool:  # noqa: ARG002
        return False

    def pin_lora(self, lora_id: int) -> bool:  # noqa: ARG002
        return False

    def list_loras(self) -> set[int]:
        return set()
