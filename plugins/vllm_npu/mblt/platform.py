"""The mblt vLLM platform (not built yet: issue 4)."""

raise NotImplementedError(
    "the mblt vLLM platform plugin (vllm_npu.mblt) is not built yet: issue 4; "
    "unset NPU_HARNESS_TARGET to serve on vLLM's CPU backend"
)
