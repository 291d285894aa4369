"""What every NPU platform of this project shares: :class:`NpuPlatform`.

An NPU platform is an out-of-tree, CPU-hosted vLLM platform (``PlatformEnum.OOT``,
``device_type == "cpu"``): the model runs inside the device (or its simulator) through the
vendor runtime API, so vLLM's part is the scheduler, the API server and the worker hook.
This base holds the parts that do not depend on the device:

- :meth:`NpuPlatform.import_kernels`: vLLM's CPU kernels loaded the way vLLM's own
  ``CpuPlatform`` picks them (:mod:`vllm_npu.cpu_kernels`). The inherited
  ``Platform.import_kernels`` loads the AVX-512-BF16 build unconditionally and dies with
  SIGILL on a CPU without AVX-512;
- :meth:`NpuPlatform.check_and_update_config`: the worker hook (``worker_cls``), the
  in-process executor for one worker, no torch.compile and no CUDA graphs, eager mode, async
  scheduling off (the two-step ``execute_model`` / ``sample_tokens`` protocol runs
  synchronously), then the device's own :meth:`NpuPlatform.configure` step;
- :meth:`NpuPlatform.pre_register_and_update`: ``--middleware`` defaults to
  :class:`vllm_npu.stream_errors.StreamErrorStatusMiddleware`, so a streamed request the
  plugin refuses is an HTTP 400 like the same request unstreamed;
- :mod:`vllm_npu.torch_accelerator`: ``torch.accelerator.empty_cache`` / ``empty_host_cache``
  do nothing while torch has no accelerator, so vLLM's ``cleanup_dist_env_and_memory()`` (its
  test conftest's teardown) works under these platforms;
- the device-neutral answers: dtypes, no pinned memory, no device memory, ``no_grad``
  inference, and no attention backend to size the block for.

Each device's ``platform.py`` subclasses it with its worker class, its name and what
differs (scheduler plan, request refusals). The KV-layout and supported-task answers a
worker owes vLLM are in :mod:`vllm_npu._worker`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_npu import cpu_kernels, stream_errors, torch_accelerator

# vLLM's cleanup_dist_env_and_memory() calls torch.accelerator on any non-CPU platform.
torch_accelerator.install()


class NpuPlatform(Platform):
    """Base of the MBLT, RBLN and Neuron platforms (see the module docstring).

    Subclasses set :attr:`worker_cls` and :attr:`npu_name`, and may override
    :meth:`configure`.
    """

    _enum = PlatformEnum.OOT
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    simple_compile_backend: str = "eager"

    #: Qualified name of the device's ``WorkerBase`` subclass (set by each subclass).
    worker_cls: ClassVar[str] = ""
    #: What :meth:`get_device_name` answers (``mblt``, ``rbln``, ``neuron``).
    npu_name: ClassVar[str] = "npu"
    #: The ``--middleware`` defaults this platform installs, in order (a user's own follow them).
    middlewares: ClassVar[tuple[str, ...]] = (stream_errors.MIDDLEWARE,)

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def import_kernels(cls) -> None:
        """Load the vLLM CPU kernel build this CPU can run (never ``vllm._C`` blindly)."""
        cpu_kernels.load_vllm_cpu_kernels()

    @classmethod
    def pre_register_and_update(cls, parser: Any = None) -> None:
        """Make :attr:`middlewares` (:data:`vllm_npu.stream_errors.MIDDLEWARE` on every NPU
        platform) the default of ``--middleware`` (``vllm serve`` only: the offline ``vllm.LLM``
        passes no parser). A user's own ``--middleware`` values are appended to it."""
        if parser is None:
            return
        try:
            current = parser.get_default("middleware")
        except AttributeError:
            return
        if current is None:  # not the API server's parser (no --middleware option)
            return
        missing = [m for m in cls.middlewares if m not in current]
        if missing:
            parser.set_defaults(middleware=[*missing, *current])

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:  # noqa: ARG003
        return cls.npu_name

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:  # noqa: ARG003
        return 0

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def set_device(cls, device: torch.device) -> None:  # noqa: ARG003
        return None

    @classmethod
    def update_block_size_for_backend(cls, vllm_config: Any) -> None:  # noqa: ARG003
        """No attention backend runs on the host: the block size stays as configured."""
        return None

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        """Point vLLM at the device's worker, run it in-process and eagerly, then let the
        device configure the rest (:meth:`configure`, only when a model is configured).

        Raises:
            whatever the device's :meth:`configure` raises for a bad value (named).
        """
        from vllm.config import CompilationMode

        if not cls.worker_cls:
            raise TypeError(f"{cls.__qualname__} sets no worker_cls")
        parallel = vllm_config.parallel_config
        parallel.worker_cls = cls.worker_cls
        if parallel.distributed_executor_backend in (None, "mp") and parallel.world_size == 1:
            parallel.distributed_executor_backend = "uni"

        comp = vllm_config.compilation_config
        comp.mode = CompilationMode.NONE
        comp.cudagraph_capture_sizes = []
        vllm_config.scheduler_config.async_scheduling = False
        if vllm_config.model_config is not None:
            vllm_config.model_config.enforce_eager = True
            cls.configure(vllm_config)

    @classmethod
    def configure(cls, vllm_config: Any) -> None:  # noqa: ARG003
        """The device's part of :meth:`check_and_update_config` (scheduler and cache sizes
        from the artifact...); called only when a model is configured. Default: nothing."""
        return None


#: Prompt logprobs of a prompt sent as embeddings (there are no prompt token ids to score).
EMBEDS_LOGPROBS_REFUSAL = "prompt_logprobs score a prompt's token ids, and a prompt sent as prompt_embeds has none"


def refuse_embeds_logprobs(params: Any, error: type[Exception]) -> None:
    """Refuse ``prompt_logprobs`` on a ``prompt_embeds`` request (:data:`EMBEDS_LOGPROBS_REFUSAL`).

    Raises:
        error: they were asked for (``parameter="prompt_logprobs"``).
    """
    if getattr(params, "prompt_logprobs", None) is not None:
        raise error(EMBEDS_LOGPROBS_REFUSAL, parameter="prompt_logprobs")


def refuse_unsampled(processed_inputs: Any, params: Any, *, worker: str, error: type[Exception],
                     serves_prompt_embeds: bool = False) -> None:
    """What a device worker with host sampling (:mod:`vllm_npu.host_sampling`) cannot honour,
    refused in ``Platform.validate_request`` so that vLLM answers HTTP 400 naming it.

    Args:
        worker: the worker's name in messages (``MBLT worker``).
        error: the device's request-error class (a ``VLLMValidationError`` subclass taking
            ``parameter=``; anything else becomes an HTTP 500).
        serves_prompt_embeds: the worker takes ``prompt_embeds`` (MBLT: its MXQs take
            embeddings from the host); else they are refused.

    Raises:
        error: pooling requests, prompt embeddings (unless served; served, with
            ``prompt_logprobs``: :data:`EMBEDS_LOGPROBS_REFUSAL`),
            ``prompt_logprob_token_ids`` or ``thinking_token_budget`` (each named;
            ``parameter`` is the first). ``min_p``, ``min_tokens``, ``logit_bias``,
            ``allowed_token_ids``, ``logprob_token_ids`` and structured outputs are served:
            vLLM's own logits processors, masks and grammar bitmask run in
            :mod:`vllm_npu.host_sampling`; prompt logprobs are scored by every worker
            (:mod:`vllm_npu.prompt_logprobs`).
    """
    from vllm.sampling_params import SamplingParams

    if not isinstance(params, SamplingParams):
        raise error(f"the {worker} serves text generation only (no pooling requests)")
    if isinstance(processed_inputs, dict) and processed_inputs.get("prompt_embeds") is not None:
        if not serves_prompt_embeds:
            raise error(f"the {worker} takes token prompts only: prompt_embeds is not supported",
                        parameter="prompt_embeds")
        refuse_embeds_logprobs(params, error)
    refused: list[tuple[str, str]] = []  # (parameter, text)
    if getattr(params, "prompt_logprob_token_ids", None) is not None:
        refused.append(("prompt_logprob_token_ids", "prompt_logprob_token_ids"))
    if getattr(params, "thinking_token_budget", None) not in (None, -1):  # -1: unlimited, i.e. unset
        refused.append(("thinking_token_budget", f"thinking_token_budget={params.thinking_token_budget}"))
    if refused:
        raise error(
            f"the {worker} samples on the host with vLLM's sampler, logits processors and grammar "
            "bitmask (temperature, top_p, top_k, min_p, seed, penalties, bad_words, min_tokens, "
            "logit_bias, allowed_token_ids, logprobs, logprob_token_ids, prompt logprobs, structured outputs), not yet "
            "with prompt_logprob_token_ids or a thinking budget (issue 41); refused: "
            + ", ".join(t for _p, t in refused),
            parameter=refused[0][0],
        )
