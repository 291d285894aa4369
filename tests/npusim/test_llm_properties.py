"""Property tests (Hypothesis) of the golden decoder's contracts: any chunking of a prompt and
any batching of sequences give the logits of one-shot prefill (max |Δ| ≤ 1e-5), and the
safetensors writer/reader round-trips any tensors bit-exactly."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from npusim.llm import load_safetensors, save_safetensors  # noqa: E402
from npusim.tinymodel import ARCHES  # noqa: E402

TOL = 1e-5
PROMPT = np.random.default_rng(99).integers(4, 1024, size=48)


@st.composite
def partitions(draw, total: int) -> list[int]:
    """Chunk sizes (each ≥ 1) that add up to ``total``."""
    sizes, left = [], total
    while left:
        n = draw(st.integers(1, left))
        sizes.append(n)
        left -= n
    return sizes


@given(arch=st.sampled_from(ARCHES), sizes=partitions(len(PROMPT)))
def test_any_chunking_equals_one_shot(tiny_decoder, arch, sizes):
    dec = tiny_decoder(arch)
    whole = dec.prefill(PROMPT, dec.new_cache(len(PROMPT)))
    cache = dec.new_cache(len(PROMPT))
    parts, start = [], 0
    for n in sizes:
        parts.append(dec.prefill(PROMPT[start:start + n], cache))
        start += n
    assert np.max(np.abs(np.concatenate(parts) - whole)) <= TOL


@given(arch=st.sampled_from(ARCHES),
       seqs=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 6)), min_size=1, max_size=4))
def test_any_batch_equals_solo_steps(tiny_decoder, arch, seqs):
    """Sequences with cached prefixes of various lengths step together in one batch."""
    dec = tiny_decoder(arch)
    rng = np.random.default_rng(len(seqs))
    solo, batch = [], []
    for prefix_len, step_len in seqs:
        ids = rng.integers(4, 1024, size=prefix_len + step_len)
        cache = dec.new_cache(prefix_len + step_len)
        dec.prefill(ids[:prefix_len], cache)
        batch.append((ids[prefix_len:], cache.copy()))
        solo.append(dec.prefill(ids[prefix_len:], cache))
    for got, want in zip(dec.step_batch(batch), solo):
        assert np.max(np.abs(got - want)) <= TOL


_DTYPES = st.sampled_from(["<f8", "<f4", "<f2", "<i8", "<i4", "<i2", "i1", "<u4", "u1", "?"])
_SHAPES = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
_NAMES = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1,
                 max_size=12).filter(lambda s: s != "__metadata__")


@given(st.dictionaries(_NAMES, st.tuples(_DTYPES, _SHAPES, st.integers(0, 2**32 - 1)),
                       min_size=1, max_size=5))
def test_safetensors_round_trip(tmp_path_factory, spec):
    tensors = {}
    for name, (dtype, shape, seed) in spec.items():
        raw = np.random.default_rng(seed).bytes(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        arr = np.frombuffer(raw, dtype=np.uint8).copy()
        tensors[name] = (arr.astype(bool) if dtype == "?" else arr.view(dtype)).reshape(shape)
    path = tmp_path_factory.mktemp("st") / "t.safetensors"
    save_safetensors(path, tensors)
    back = load_safetensors(path)
    assert set(back) == set(tensors)
    for name, arr in tensors.items():
        assert back[name].dtype == arr.dtype and back[name].shape == arr.shape
        assert back[name].tobytes() == arr.tobytes(), name
