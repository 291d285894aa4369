"""The Neuron device for the serving suite and the Neuron scenarios.

* On ``neuron-sim`` the model is the standard tiny llama, served with ``vllm serve`` by the
  Neuron plugin; its NEFFs are compiled at warm-up by the simulated compiler (``npusim.neff``)
  into a compile cache of this session (``VLLM_CACHE_ROOT``); the golden decoder
  (``npusim.llm``) is the reference for greedy outputs.
* On ``neuron-hw`` ``NPU_HARNESS_NEURON_MODEL`` may name another model directory; there is no
  golden decoder for it, so scenarios compare with the same requests sent alone.

Serving profile (:data:`SERVING_ARGS`): ``--max-model-len 1024 --max-num-batched-tokens 512``
(segmented prefill auto-enabled with ``kv_segment_size_buckets=[512]``, so prefix caching is
allowed), ``--max-num-seqs 8`` (decode buckets 1, 2, 4, 8), ``--block-size 32
--num-gpu-blocks-override 512`` (the seed's explicit block count).

Fault model (simulator only, ``NPUSIM_NEFF``): ``once`` fails the 11th NEFF execution of the
engine, which the worker retries (log ``Neuron ... failed; retrying once``); ``persistent``
fails every execution from the 11th on, the retry fails too (``failed twice``) and the engine
stops, so every request in flight gets an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from npu_conformance import prefork
from npu_conformance import vllm_server as vs
from npu_conformance.devices.base import HOST_SAMPLER_REFUSALS, LOGITS_PROCESSOR_REFUSALS, HOST_SERVING_ARGS, DeviceLab, FaultPlan, FaultsUnsupported, Refusal, TinyModelLab

MODEL_ENV = "NPU_HARNESS_NEURON_MODEL"
#: ``vllm serve`` arguments of the standard server (beside ``--max-model-len``).
SERVING_ARGS: tuple[str, ...] = ("--max-num-batched-tokens", "512", "--max-num-seqs", "8",
                                 "--block-size", "32", "--num-gpu-blocks-override", "512")

#: What ``NeuronPlatform.validate_request`` refuses with on-device sampling (the default).
ODS_REFUSALS: tuple[Refusal, ...] = (
    *HOST_SAMPLER_REFUSALS,
    *LOGITS_PROCESSOR_REFUSALS,
    Refusal("presence_penalty", {"presence_penalty": 0.5}),
    Refusal("frequency_penalty", {"frequency_penalty": 0.5}),
    Refusal("repetition_penalty", {"repetition_penalty": 1.2}),
    # the vendor's assertion: structured outputs need async scheduling off (served without it,
    # NeuronLab.grammar_server)
    Refusal("structured_outputs", {"structured_outputs": {"choice": ["a", "b"]}}),
    Refusal("structured_outputs", {"response_format": {"type": "json_object"}}, endpoint="chat/completions"),
)


#: ``vllm serve`` arguments that switch on-device sampling off (the guide's CPU sampling).
CPU_SAMPLING_ARGS: tuple[str, ...] = (
    "--no-async-scheduling", "--additional-config", json.dumps({"neuron_config": {"on_device_sampling_config": None}}))
#: What ``NeuronPlatform.validate_request`` refuses with CPU sampling: the host sampler's rules,
#: and structured outputs, which the guide says need on-device sampling (no logit mask without).
CPU_SAMPLING_REFUSALS: tuple[Refusal, ...] = (
    *HOST_SAMPLER_REFUSALS,
    Refusal("response_format", {"structured_outputs": {"choice": ["a", "b"]}}),
    Refusal("response_format", {"response_format": {"type": "json_object"}}, endpoint="chat/completions"),
)


@dataclass
class NeuronLab(TinyModelLab):
    """Per-session model, compile cache and servers for one Neuron target."""

    model_env: ClassVar[str] = MODEL_ENV
    device: ClassVar[str] = "neuron"
    max_model_len: ClassVar[int] = 1024
    refusals: ClassVar[tuple[Refusal, ...]] = ODS_REFUSALS
    serves_prompt_embeds: ClassVar[bool] = True  # the prefill NEFFs take inputs_embeds (the guide's section)

    def serving_args(self, **override: str) -> list[str]:
        """``--max-model-len`` and :data:`SERVING_ARGS`, with ``override`` (``{"--max-num-seqs": "4"}``)."""
        args = ["--max-model-len", str(self.max_model_len), *SERVING_ARGS]
        for flag, value in override.items():
            if flag in args:
                args[args.index(flag) + 1] = value
            else:
                args += [flag, value]
        return args

    def serving_server(self) -> vs.Server:
        return self.server(self.hf_dir(), self.serving_args(), pin=True)

    def sampler_server(self) -> vs.Server:
        """The guide's CPU sampling (``on_device_sampling_config`` null, the MRv1 case; async
        scheduling off, which the guide's rule asks for without on-device sampling): the worker
        samples on the host with vLLM's sampler."""
        return self.server(self.hf_dir(), [*self.serving_args(), *CPU_SAMPLING_ARGS, *HOST_SERVING_ARGS])

    def sampler_refusals(self) -> tuple[Refusal, ...]:
        return CPU_SAMPLING_REFUSALS

    def grammar_server(self) -> vs.Server:
        """On-device sampling under the grammar's ``logit_mask`` (the guide: "the same on-device
        bitmask approach as vLLM upstream"; structured outputs need async scheduling off)."""
        return self.server(self.hf_dir(), [*self.serving_args(), "--no-async-scheduling", *HOST_SERVING_ARGS])

    def fault(self, kind: str) -> FaultPlan:
        """``NPUSIM_NEFF`` execution failures from the 11th on (see the module docstring).

        Raises:
            FaultsUnsupported: on ``neuron-hw``.
            ValueError: an unknown ``kind``.
        """
        if kind not in self.FAULT_KINDS:
            raise ValueError(f"fault kind {kind!r} is not one of {self.FAULT_KINDS}")
        if not self.simulated:
            raise FaultsUnsupported("faults are injected only into the simulator (npusim.neff, NPUSIM_NEFF)")
        times, evidence = (1, r"Neuron .* failed; retrying once") if kind == "once" else (None, r"Neuron .* failed twice")
        return FaultPlan(self.hf_dir(), tuple(self.serving_args()),
                         {"NPUSIM_NEFF": json.dumps({"fault": {"after_calls": 10, "times": times}})}, evidence)


#: Runs ``npu-harness neuron plan``'s code path (``plan_cli.main``) once per ``[argv, env]`` pair
#: in one process, each with its environment laid over the process's, and prints each result.
_PLANS = r'''
import contextlib, io, json, os, sys
from vllm_npu.neuron import plan_cli

for argv, env in json.loads(sys.argv[1]):
    saved = dict(os.environ)
    os.environ.update(env)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = plan_cli.main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    text = out.getvalue()
    plan = json.loads(text[text.index("{"):]) if "{" in text else None
    print("NPU_HARNESS_PLAN " + json.dumps({"code": code, "plan": plan}), flush=True)
'''


def plans(lab: DeviceLab, model: Path, runs: list[tuple[list[str], dict[str, str]]]) -> list[tuple[int, dict[str, Any] | None]]:
    """``npu-harness neuron plan --model MODEL ARGS`` (its code path, ``plan_cli.main``) for each
    ``(args, env)`` pair, in one child process with ``lab``'s environment plus ``env`` (vLLM is
    imported once): ``(exit status, the plan or None)`` each.

    Raises:
        RuntimeError: the child failed before printing every result (its stderr attached).
    """
    payload = [[["--model", str(model), *args], env] for args, env in runs]
    proc = prefork.run_python(_PLANS, [json.dumps(payload)], env=lab.env(VLLM_LOGGING_STREAM="ext://sys.stderr"),
                              timeout=900)
    mark = "NPU_HARNESS_PLAN "
    found = [json.loads(line[len(mark):]) for line in proc.stdout.splitlines() if line.startswith(mark)]
    if len(found) != len(runs):
        raise RuntimeError(f"neuron plan probe failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [(f["code"], f["plan"]) for f in found]
