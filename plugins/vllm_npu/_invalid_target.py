"""Imported by vLLM only when ``NPU_HARNESS_TARGET`` is invalid: raises the error naming it."""

from vllm_npu.targets import selected_target

selected_target()  # raises UnknownTargetError naming the value and the valid targets
