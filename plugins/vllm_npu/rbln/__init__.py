"""Rebellions RBLN vLLM plugin: device adapter over the ``rebel`` runtime API (issue 16).

Entry points: :func:`register` (``vllm.platform_plugins``) and :func:`register_general`
(``vllm.general_plugins``). Nothing is imported at module level (vLLM's plugin loader imports
this package while vLLM itself is half initialised).
"""

from __future__ import annotations

from vllm_npu.targets import platform_for


def register() -> str | None:
    """vLLM platform-plugin entry point (group ``vllm.platform_plugins``).

    Returns the platform class's qualified name when ``NPU_HARNESS_TARGET`` names one of
    this device's targets, else None (the plugin stays inactive).
    """
    return platform_for("rbln", "vllm_npu.rbln.platform.RblnPlatform")


def register_general() -> None:
    """vLLM general-plugin entry point: on an ``rbln-*`` target, record the user's
    ``--model-impl`` and batch arguments before vLLM defaults them
    (:mod:`vllm_npu.rbln.engine_args`)."""
    if platform_for("rbln", "x") is None:
        return
    from vllm_npu.rbln import engine_args

    engine_args.install()
