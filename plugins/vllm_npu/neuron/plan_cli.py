"""``npu-harness neuron plan --model DIR [vllm serve options]``: the Neuron plan as JSON,
through the plugin's own code path, without starting an engine.

It runs vLLM's ``EngineArgs.create_engine_config`` with the Neuron platform active
(``NPU_HARNESS_TARGET`` ``neuron-sim`` unless it already names ``neuron-hw``) and
``NPU_HARNESS_NEURON_PLAN_ONLY=1``, so :meth:`NeuronPlatform.configure` records the plan
(:func:`vllm_npu.neuron.plan.build`) with every validation error instead of raising the first.
Printed: compile targets, bucket lists, the KV budget and block count with the formula's
inputs, the runner and why, sampling/async, and ``errors`` (each ``"Type: message"``, the
message the server would fail with). Exit status 0 with no errors, 1 with errors, 2 when vLLM
itself rejects the options (its message on stderr).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    """Run the planning tool on ``argv`` (``vllm serve``-style options; ``--model`` required)."""
    target = os.environ.get("NPU_HARNESS_TARGET", "")
    if target not in ("neuron-sim", "neuron-hw"):
        os.environ["NPU_HARNESS_TARGET"] = "neuron-sim"
    os.environ["NPU_HARNESS_NEURON_PLAN_ONLY"] = "1"
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the JSON alone
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_npu.neuron.worker import PLAN_KEY

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="npu-harness neuron plan"))
    args = parser.parse_args(list(argv))
    if not args.model:
        print("npu-harness neuron plan: --model DIR is required", file=sys.stderr)
        return 2
    try:
        cfg = EngineArgs.from_cli_args(args).create_engine_config()
    except Exception as exc:  # noqa: BLE001 - vLLM's own validation: report and exit 2
        print(f"npu-harness neuron plan: vLLM rejected the options: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    plan = (cfg.additional_config or {}).get(PLAN_KEY)
    if not isinstance(plan, dict):
        print("npu-harness neuron plan: the Neuron platform did not run (is NPU_HARNESS_TARGET a neuron target?)",
              file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2, sort_keys=True, default=str))
    return 1 if plan.get("errors") else 0
