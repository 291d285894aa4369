"""The rbln vLLM platform (not built yet: no issue filed yet)."""

raise NotImplementedError(
    "the rbln vLLM platform plugin (vllm_npu.rbln) is not built yet: no issue filed yet; "
    "unset NPU_HARNESS_TARGET to serve on vLLM's CPU backend"
)
