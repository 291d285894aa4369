"""Rebellions RBLN vLLM plugin: device adapter over the ``rebel`` runtime API (issue 16)."""

from __future__ import annotations

from vllm_npu.targets import platform_for


def register() -> str | None:
    """vLLM platform-plugin entry point (group ``vllm.platform_plugins``).

    Returns the platform class's qualified name when ``NPU_HARNESS_TARGET`` names one of
    this device's targets, else None (the plugin stays inactive).
    """
    return platform_for("rbln", "vllm_npu.rbln.platform.RblnPlatform")
