"""What the ``vllm serve`` tests with the ``openai`` client share: starting the module's server
(a failed start fails the test with the server's log tail), the client, random token prompts
and vLLM's extension fields of an ``openai`` response."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from npu_conformance import vllm_server as vs


def start_or_fail(model: str | Path, args: list[str], work: Path, target: str, **env: str) -> vs.Server:
    """``vllm serve MODEL ARGS`` on ``target`` with ``VLLM_CACHE_ROOT`` in ``work`` (``env``
    added), logging to ``work/serve.log``; a server that does not come up fails the test."""
    try:
        return vs.start(model, args, env=vs.vllm_env(target, VLLM_CACHE_ROOT=str(work / "cache"), **env),
                        log=work / "serve.log")
    except vs.ServerError as exc:
        pytest.fail(str(exc))


def client_for(server: vs.Server) -> Any:
    """An ``openai.OpenAI`` client of ``server`` (no retries, 300 s timeout)."""
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=300)


def prompt_ids(n: int, seed: int) -> list[int]:
    """``n`` random token ids in 10..999 (every tiny model's vocabulary has them)."""
    return np.random.default_rng(seed).integers(10, 1000, size=n).tolist()


def chat_greedy_ids(client: Any, server: vs.Server, content: str, max_tokens: int) -> tuple[list[int], list[int]]:
    """One greedy chat turn (``ignore_eos``) of ``content``: (the templated prompt's token ids
    the server reports, the generated token ids); a test compares them with the golden decoder."""
    res = client.chat.completions.create(model=server.model, max_tokens=max_tokens, temperature=0,
                                         messages=[{"role": "user", "content": content}],
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt = extra(res, "prompt_token_ids")
    assert prompt, "the server returned no prompt_token_ids"
    return prompt, extra(res.choices[0], "token_ids")


def extra(obj: Any, name: str) -> Any:
    """A vLLM extension field (``token_ids``, ``prompt_token_ids``) of an openai response object."""
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value
