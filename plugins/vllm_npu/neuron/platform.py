"""The neuron vLLM platform (not built yet: issue 11)."""

raise NotImplementedError(
    "the neuron vLLM platform plugin (vllm_npu.neuron) is not built yet (issue 11); "
    "unset NPU_HARNESS_TARGET to serve on vLLM's CPU backend"
)
