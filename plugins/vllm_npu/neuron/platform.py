"""The neuron vLLM platform (not built yet: no issue filed yet)."""

raise NotImplementedError(
    "the neuron vLLM platform plugin (vllm_npu.neuron) is not built yet: no issue filed yet; "
    "unset NPU_HARNESS_TARGET to serve on vLLM's CPU backend"
)
