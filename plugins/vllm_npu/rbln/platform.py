"""The rbln vLLM platform (not built yet: issue 16)."""

raise NotImplementedError(
    "the rbln vLLM platform plugin (vllm_npu.rbln) is not built yet (issue 16); "
    "unset NPU_HARNESS_TARGET to serve on vLLM's CPU backend"
)
