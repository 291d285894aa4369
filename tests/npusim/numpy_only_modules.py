"""The ``tests/npusim`` modules whose every test passes with torch, transformers, vLLM and
safetensors blocked: in a whole run (``test_npusim_numpy_only.py`` selected) they run once, in
its torch-free child, not a second time in the session (``conftest.pytest_collection_modifyitems``);
``test_npusim_tests_pass_without_torch`` checks that each ran there without a skip."""

NUMPY_ONLY_MODULES: frozenset[str] = frozenset({
    "test_alias", "test_eagle3_draft", "test_eagle3_round", "test_llm_config", "test_llm_decoder", "test_llm_properties",
    "test_llm_q4x32", "test_mxq_against_real_qbruntime", "test_mxq_asr", "test_mxq_compile", "test_mxq_config",
    "test_mxq_eagle3", "test_mxq_machine", "test_mxq_model", "test_mxq_moe", "test_mxq_mxqfile",
    "test_mxq_status_codes", "test_mxq_tracing", "test_mxq_types", "test_mxq_vlm", "test_neff_compile",
    "test_neff_execute", "test_neff_file", "test_neff_platform", "test_q4x32_errors", "test_q4x32_fp16",
    "test_q4x32_gemm", "test_q4x32_instr", "test_q4x32_layout", "test_q4x32_options", "test_q4x32_perf",
    "test_q4x32_quant", "test_qbruntime_vendor_surface",
})

#: The test that runs them.
RUNNER = "test_npusim_numpy_only.py::test_npusim_tests_pass_without_torch"
