"""AWS Neuron vLLM plugin: NEFF buckets through the Neuron runtime API (issue 11).

``platform.py`` (the plan, the scheduler, the worker), ``plan.py`` (every decision, pure),
``buckets.py``, ``memory.py``, ``runner.py``, ``parallel.py``, ``sampling.py``,
``quantization.py``, ``neuron_config.py`` (the seed's rules, stdlib only), ``scheduler.py``
(one prefill per step, padded), ``worker.py`` (NEFFs per bucket), ``compile_cache.py``,
``metrics.py`` (``vllm_neuron:`` Prometheus metrics), ``runtime.py`` (the seam).
"""

from __future__ import annotations

from vllm_npu.targets import platform_for


def register() -> str | None:
    """vLLM platform-plugin entry point (group ``vllm.platform_plugins``).

    Returns the platform class's qualified name when ``NPU_HARNESS_TARGET`` names one of
    this device's targets, else None (the plugin stays inactive). The metrics' multiprocess
    directory is made later, per serving process
    (``NeuronPlatform.pre_register_and_update``).
    """
    return platform_for("neuron", "vllm_npu.neuron.platform.NeuronPlatform")
