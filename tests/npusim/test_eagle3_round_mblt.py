"""transformers-mblt's EAGLE-3 rounds (``eagle3_prefill`` / ``eagle3_decode_step``) on a release
compiled for ``npusim.mxq``, against the golden reference round of ``test_eagle3_round.py``
(split from it: these need torch, the rest of it runs in the torch-free child,
``numpy_only_modules.py``)."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from test_eagle3_round import _rounds

from npusim.llm.eagle3_round import Eagle3Reference


# ---------------------------------------------------------------- transformers-mblt on npusim.mxq


@pytest.fixture(scope="module")
def mblt(eagle3_release) -> Iterator[Any]:
    """transformers-mblt on ``qbruntime`` = npusim.mxq, and the default tiny EAGLE-3 release (5/8/64)
    loaded; afterwards the alias and the modules bound to it are removed."""
    torch = pytest.importorskip("torch")
    if importlib.util.find_spec("transformers_mblt") is None or importlib.util.find_spec("mblt_npu") is None:
        pytest.skip("transformers-mblt / mblt-npu-python (pinned test dependencies) are not installed")
    from npusim import alias

    if alias.status("qbruntime").state == "real":
        pytest.skip("a real qbruntime is installed")
    release = eagle3_release()
    alias.activate("qbruntime")
    from npusim.mxq import machine

    machine.reset()
    import transformers_mblt
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers_mblt.register()
        model = AutoModelForCausalLM.from_pretrained(str(release))
    model.configure_eagle3_tree()
    try:
        yield torch, model
    finally:
        model.dispose() if callable(getattr(model, "dispose", None)) else None
        machine.reset()
        alias.deactivate("qbruntime")
        for name in [n for n in sys.modules if n.split(".")[0] in ("qbruntime", "transformers_mblt", "mblt_npu")]:
            del sys.modules[name]


def _vendor_rounds(torch: Any, model: Any, prompt: list[int], budget: int, eos: Any) -> tuple[list, list]:
    from transformers_mblt.utils.cache_utils import MobilintEagle3Cache

    cache = MobilintEagle3Cache(*model.get_cache_mxq_models())
    cache.reset()
    root = model.eagle3_prefill(torch.tensor([prompt]), cache, max_new_tokens=budget)
    first_tree = [cache.pending_draft_tokens[0].tolist(), cache.retrieve_indices.tolist(),
                  cache.tree_mask[0, 0].bool().tolist(), cache.tree_position_ids.tolist()]
    groups: list[tuple[list[int], int | None]] = [([int(root)], None)]
    left = budget
    while True:
        step = model.eagle3_decode_step(cache, max_new_tokens=left, eos_token_id=eos)
        nxt = None if step.next_token is None else int(step.next_token)
        groups.append((step.tokens[0].tolist(), nxt))
        left -= int(step.tokens.shape[1])
        if step.stopped:
            return groups, first_tree


@pytest.mark.parametrize("prompt, budget, eos", [
    ([5, 6, 7, 8, 9], 30, None),
    ([300, 2, 2, 7, 11, 500, 61], 25, None),
    ([42], 12, None),
    ([9, 8, 7, 6, 5, 4, 3, 2, 1] * 2, 20, "cut"),  # longer than the release's prefill chunk (16); an EOS mid-way
])
def test_transformers_mblt_rounds_equal_the_reference(mblt, eagle3_golden, prompt, budget, eos):
    """The vendor's ``eagle3_prefill`` / ``eagle3_decode_step`` on the compiled release settle the
    same groups of tokens, round by round, as the golden reference (greedy), and build the same
    first tree."""
    torch, model = mblt
    base, draft = eagle3_golden.base, eagle3_golden.draft
    if eos == "cut":
        eos = [base.generate_greedy(prompt, budget)[budget // 2]]
    ref = Eagle3Reference(base, draft, 5, 8, 64, capacity=256)
    ours = _rounds(ref, prompt, budget, eos)
    ref.prefill(prompt, budget)
    t = ref.tree
    theirs, first_tree = _vendor_rounds(torch, model, prompt, budget, eos)
    assert first_tree == [t.tokens.tolist(), t.retrieve_indices.tolist(), t.tree_mask.tolist(), t.position_ids.tolist()]
    assert theirs == ours
    flat = [tok for toks, _ in ours[1:] for tok in toks]
    assert flat == base.generate_greedy(prompt, budget, eos_token_id=eos)
