"""Run one in-process ``vllm.LLM(..., quantization="ime2_q4")`` and write what the tests check.

Usage: ``python _ime2_probe.py MODEL_DIR OUT_JSON PROMPT_JSON MAX_TOKENS [DTYPE]`` (DTYPE: vLLM's
``dtype``, default ``float32``)

Run as a child process by ``test_ime2_vllm.py`` (vLLM's CPU worker binds threads and memory of
the process it runs in, so the pytest process stays clean). ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
keeps the engine in this process, so ``pack_count()`` observes the packing directly.

The JSON holds, per generate call: the greedy token ids and the full-vocabulary log-probs of
every generated position; which modules were packed and which kept a float weight
(``LLM.apply_model``); and ``pack_count()`` after loading and after each call. A start-up
error exits non-zero with the traceback on stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _describe(model) -> dict:
    """Per module kind: how many hold a packed weight, and which still hold a float ``weight``."""
    from vllm.model_executor.layers.linear import LinearBase

    linear = {name: m for name, m in model.named_modules() if isinstance(m, LinearBase)}
    return {
        "linear": sorted(linear),
        "linear_packed": sorted(n for n, m in linear.items() if hasattr(m, "ime2_weight")),
        "linear_with_float_weight": sorted(n for n, m in linear.items() if "weight" in m._parameters),
        "others_with_float_weight": sorted(n for n, m in model.named_modules()
                                           if n not in linear and "weight" in m._parameters
                                           and m._parameters["weight"] is not None
                                           and m._parameters["weight"].is_floating_point()),
    }


def main(argv: list[str]) -> int:
    model, out_path, prompt_path, max_tokens = argv[1], argv[2], argv[3], int(argv[4])
    dtype = argv[5] if len(argv) > 5 else "float32"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    prompts = json.loads(open(prompt_path).read())
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams

    from vllm_npu.ime2 import kernel, linear

    llm = LLM(model, quantization="ime2_q4", dtype=dtype, max_model_len=512,
              gpu_memory_utilization=0.1, max_logprobs=-1, seed=0)
    result = {"start_s": time.monotonic() - t0, "packs_after_load": linear.pack_count(),
              "auto_path": kernel.auto_path(), "calls": []}
    result["modules"] = llm.apply_model(_describe)[0]
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=vocab, ignore_eos=True)
    # One prompt per generate call: the kernel quantizes activation rows in groups of 4, so a
    # token's logits depend on which tokens share its forward call; alone, the prefill is one
    # call of M = len(prompt) rows and each decode step one of M = 1, as in the golden decoder.
    rounds = [prompts, prompts[:1]]  # the second round shows that generating does not pack again
    for round_prompts in rounds:
        call = []
        for prompt in round_prompts:
            (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            comp = out.outputs[0]
            rows = []
            for step in comp.logprobs:
                row = [float("nan")] * vocab  # every entry is filled: logprobs=vocab
                for tok, lp in step.items():
                    row[tok] = lp.logprob
                rows.append(row)
            call.append({"tokens": list(comp.token_ids), "logprobs": rows})
        result["calls"].append({"outputs": call, "packs_after": linear.pack_count()})
    with open(out_path, "w") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
