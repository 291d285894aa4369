"""The golden decoder under a grammar: greedy decoding of ``npusim.llm.Decoder`` with xgrammar's
token mask, the grammar compiled as vLLM's xgrammar backend compiles it (its ``TokenizerInfo``
from the served tokenizer and the model's vocabulary size; regex; JSON schema with or without
free whitespace, as the server's ``disable_any_whitespace``; choices through vLLM's own
``choice_as_grammar``). A structured request's answer on
a simulator target is then compared with it token for token.

Greedy is argmax over the masked logits (lowest id on ties), as vLLM's sampler takes it; a
token the grammar forbids has ``-inf``. Decoding stops after a stop token of the tokenizer (the
grammar allows only those once it is complete) or after ``max_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GrammarGolden"]


class GrammarGolden:
    """A golden decoder and the served model's tokenizer, for masked greedy decoding.

    Args:
        decoder: the golden ``npusim.llm.Decoder`` of the served model.
        tokenizer_dir: the served model's directory (its Hugging Face tokenizer files).
        any_whitespace: JSON grammars allow whitespace between tokens (vLLM's default; the
            server's ``--structured-outputs-config '{"disable_any_whitespace": true}'`` turns
            it off, with the separators ``,`` and ``:``).
    """

    def __init__(self, decoder: Any, tokenizer_dir: str | Path, *, any_whitespace: bool = True) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self.decoder = decoder
        self.vocab_size = int(decoder.config.vocab_size)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info)
        self.any_whitespace = any_whitespace

    def compile(self, spec: Mapping[str, Any]) -> Any:
        """xgrammar's compiled grammar of a ``structured_outputs`` request field: ``{"regex":
        ...}``, ``{"json": schema}`` or ``{"choice": [...]}``.

        Raises:
            ValueError: another kind.
        """
        import xgrammar as xgr

        if "regex" in spec:
            return self.compiler.compile_regex(spec["regex"])
        if "json" in spec:
            schema = spec["json"] if isinstance(spec["json"], str) else json.dumps(spec["json"])
            return self.compiler.compile_json_schema(schema, any_whitespace=self.any_whitespace,
                                                     separators=None if self.any_whitespace else (",", ":"))
        if "choice" in spec:
            from vllm.v1.structured_output.backend_xgrammar import choice_as_grammar

            return self.compiler.compile_grammar(xgr.Grammar.from_ebnf(choice_as_grammar(list(spec["choice"]))))
        raise ValueError(f"no golden for structured output {sorted(spec)}")

    def greedy(self, prompt_ids: Sequence[int], spec: Mapping[str, Any], max_tokens: int) -> list[int]:
        """Masked greedy tokens after ``prompt_ids`` (the stop token that ends them included)."""
        import torch
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(spec))
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        cache = self.decoder.new_cache(len(prompt_ids) + max_tokens)
        logits = self.decoder.prefill(list(prompt_ids), cache)[-1]
        out: list[int] = []
        stops = set(self.info.stop_token_ids)
        for _ in range(max_tokens):
            row = torch.from_numpy(np.array(logits, dtype=np.float32, copy=True)).unsqueeze(0)
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(row, bitmask)
            tok = int(torch.argmax(row[0]))
            out.append(tok)
            if tok in stops or not matcher.accept_token(tok):
                break
            logits = self.decoder.prefill([tok], cache)[-1]
        return out
