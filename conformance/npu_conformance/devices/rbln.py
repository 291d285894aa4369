"""The RBLN device for the serving suite and the RBLN scenarios.

* On ``rbln-sim`` the model is the standard tiny llama of every lab
  (:data:`npu_conformance.devices.base.STANDARD_TINY_OVERRIDES`: ``head_dim`` 64, the width the
  RBLN CPU kernels of torch-rbln require, so the same model compiles for a board), served with
  ``vllm serve`` and compiled at engine start by the vendor's optimum-rbln on ``npusim.rbln``
  into a compile cache of this session (``VLLM_CACHE_ROOT``); the golden decoder
  (``npusim.llm``) is the reference for greedy outputs.
* On ``rbln-hw`` the same tiny model is compiled by the real rebel-compiler on the board
  (``NPU_HARNESS_RBLN_MODEL`` may name another HF or compiled directory instead); there is no
  golden decoder for a model named that way, so scenarios compare against the same requests
  sent alone.

Serving profile: ``--max-model-len 1024 --block-size 1024`` (eager attention, one KV block per
sequence), ``--max-num-seqs 4`` with decoders for batches 4, 2 and 1.

Fault model (simulator only, ``NPUSIM_RBLN``): ``once`` fails the 11th runtime call
(:attr:`RblnLab.fault_after_calls` + 1) of the engine, which the worker retries (log ``RBLN ... failed; retrying once``); ``persistent`` fails
every call from the 11th on, the retry fails too (``failed twice``) and the engine stops, so
every request in flight gets an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from npu_conformance import prefork
from npu_conformance import vllm_server as vs
from npu_conformance.devices.base import HOST_SAMPLER_REFUSALS, HOST_SERVING_ARGS, DeviceLab, FaultPlan, FaultsUnsupported, Refusal, TinyModelLab

MODEL_ENV = "NPU_HARNESS_RBLN_MODEL"
#: ``vllm serve`` arguments of the standard server (beside ``--max-model-len``).
SERVING_ARGS: tuple[str, ...] = (
    "--block-size", "1024", "--max-num-seqs", "4",
    "--rbln-optimum-overrides", json.dumps({"decoder_batch_sizes": [4, 2, 1]}),
)
#: The tiny model of the RBLN scenarios: the standard tiny llama with 64-wide heads.


@dataclass
class RblnLab(TinyModelLab):
    """Per-session models, compile cache and servers for one RBLN target."""

    model_env: ClassVar[str] = MODEL_ENV
    device: ClassVar[str] = "rbln"
    max_model_len: ClassVar[int] = 1024
    #: Runtime calls a fault plan lets pass before it strikes: more than the engine's start-up
    #: makes (compile, warm-up), fewer than its first served requests make.
    fault_after_calls: ClassVar[int] = 10
    #: Per fault kind, what the server log shows once the fault struck (the worker's own lines).
    fault_evidence: ClassVar[dict[str, str]] = {"once": r"RBLN .* failed; retrying once",
                                                "persistent": r"RBLN .* failed twice"}
    #: The worker class the platform resolves for each model path (``impl_matrix`` checks it).
    worker_classes: ClassVar[dict[str, str]] = {"optimum": "vllm_npu.rbln.worker.RblnOptimumWorker",
                                                "vllm": "vllm_npu.rbln.vllm_worker.RblnVllmWorker"}
    #: Whether the platform writes its plan into ``additional_config`` (``npu_harness_rbln_plan``).
    writes_plan: ClassVar[bool] = True
    #: What ``RblnPlatform.validate_request`` refuses (``vllm_npu.rbln.platform``).
    refusals: ClassVar[tuple[Refusal, ...]] = HOST_SAMPLER_REFUSALS
    #: --enable-prompt-embeds (HOST_SERVING_ARGS): optimum-rbln compiles the graphs to take inputs_embeds
    serves_prompt_embeds: ClassVar[bool] = True

    def serving_server(self) -> vs.Server:
        """The standard server, which also samples on the host (with vLLM's tool-call parser)."""
        return self.server(self.hf_dir(), ["--max-model-len", str(self.max_model_len), *SERVING_ARGS, *HOST_SERVING_ARGS],
                           pin=True)

    def fault(self, kind: str) -> FaultPlan:
        """``NPUSIM_RBLN`` runtime-call failures from the 11th call on (see the module docstring).

        Raises:
            FaultsUnsupported: on ``rbln-hw``.
            ValueError: an unknown ``kind``.
        """
        if kind not in self.FAULT_KINDS:
            raise ValueError(f"fault kind {kind!r} is not one of {self.FAULT_KINDS}")
        if not self.simulated:
            raise FaultsUnsupported("faults are injected only into the simulator (npusim.rbln, NPUSIM_RBLN)")
        times = 1 if kind == "once" else None
        return FaultPlan(self.hf_dir(), ("--max-model-len", str(self.max_model_len), *SERVING_ARGS),
                         {"NPUSIM_RBLN": json.dumps({"fault": {"after_calls": self.fault_after_calls, "times": times}})},
                         self.fault_evidence[kind])


#: Runs ``EngineArgs.create_engine_config`` for each argument list, with the target's plugin,
#: and prints what the RBLN platform resolved (or the error), one JSON line each.
_PROBE = r'''
import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

for argv in json.loads(sys.argv[1]):
    print("NPU_HARNESS_RUN", flush=True)
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    from vllm.platforms import current_platform
    current_platform.pre_register_and_update(parser)
    try:
        cfg = EngineArgs.from_cli_args(parser.parse_args(argv)).create_engine_config()
    except BaseException as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    else:
        s, c = cfg.scheduler_config, cfg.cache_config
        extra = cfg.additional_config if isinstance(cfg.additional_config, dict) else {}  # a vendor's: its own class
        out = {"max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
               "block_size": c.block_size, "enable_prefix_caching": c.enable_prefix_caching,
               "num_gpu_blocks_override": c.num_gpu_blocks_override,
               "worker_cls": cfg.parallel_config.worker_cls,
               "plan": extra.get("npu_harness_rbln_plan")}
    sys.stderr.flush()
    sys.stdout.flush()
    print("NPU_HARNESS_CONFIG " + json.dumps(out, default=str), flush=True)
'''


def engine_configs(lab: DeviceLab, runs: list[list[str]], **env: str) -> list[dict[str, Any]]:
    """What the RBLN platform resolves for each ``vllm serve`` argument list (``--model M ...``),
    through vLLM's own ``EngineArgs.create_engine_config`` in one subprocess with ``lab``'s
    environment plus ``env``; each result has ``log`` (the run's log lines) and, for a refused one,
``error`` (``"Type: message"``).

    Raises:
        RuntimeError: the probe itself failed (its stderr attached).
    """
    proc = prefork.run_python(_PROBE, [json.dumps(runs)], env=lab.env(**env), timeout=600, python=lab.python)
    mark = "NPU_HARNESS_CONFIG "
    found = [json.loads(line[len(mark):]) for line in proc.stdout.splitlines() if line.startswith(mark)]
    if len(found) != len(runs):
        raise RuntimeError(f"engine config probe failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    logs = proc.stdout.split("NPU_HARNESS_RUN\n")[1:]  # vLLM logs to stdout
    for out, log in zip(found, logs):
        out["log"] = log
    return found
