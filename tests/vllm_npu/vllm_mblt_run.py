"""Run inside the vllm-mblt environment (``tools/vllm-mblt-env/build.sh``): greedy ``LLM.generate``
of Mobilint's own vllm-mblt 0.8.0 on vLLM 0.11.2, on an MXQ artifact, one prompt at a time and
then all in one call. Prints ``{"one": [[ids]...], "all": [[ids]...]}`` as JSON on the last line.

usage: python vllm_mblt_run.py ARTIFACT_DIR PROMPTS_JSON MAX_TOKENS

Our artifacts carry no ``auto_map`` proxy as the Hub releases do, so the Mobilint config types are
registered with transformers first (``transformers_mblt.register()``), as the Hub proxy would.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    model, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    import transformers_mblt
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    transformers_mblt.register()
    llm = LLM(model=model, tokenizer=model, max_model_len=1024, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    one = [list(llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0].outputs[0].token_ids)
           for p in prompts]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    print(json.dumps({"one": one, "all": [list(o.outputs[0].token_ids) for o in outs]}))


if __name__ == "__main__":
    main()
