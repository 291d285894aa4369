"""npusim.neff execution: golden equality through padded, paged buckets; errors; faults; sampling; fp8."""

from __future__ import annotations

import json

import numpy as np
import pytest

import npusim.neff as nrt
from npusim.llm import Decoder, ModelConfig, save_safetensors
from npusim.neff.runtime import quantize_fp8_e4m3
from npusim.neff.sampling import sample
from npusim.tinymodel import make_config, make_weights

pytestmark = pytest.mark.usefixtures("neff_env")

BS, NB, MAXLEN = 8, 32, 64


def _write_model(d, scale_k: float = 1.0):
    cfg = make_config("llama")
    w = make_weights(ModelConfig.from_dict(cfg))
    if scale_k != 1.0:
        for name in w:
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                w[name] = w[name] * scale_k
    (d / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    save_safetensors(d / "model.safetensors", w)
    return d


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _write_model(tmp_path_factory.mktemp("neff_model"))


@pytest.fixture(scope="module")
def golden(model_dir):
    return Decoder.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def neffs(model_dir, tmp_path_factory):
    """Program name -> NEFF path, compiled once (target trn2)."""
    out = tmp_path_factory.mktemp("neffs")
    specs = [
        nrt.NeffSpec(kind="prefill", tokens=16, max_model_len=MAXLEN, block_size=BS, num_blocks=NB),
        nrt.NeffSpec(kind="prefill", tokens=32, kv_segment=32, max_model_len=MAXLEN, block_size=BS, num_blocks=NB),
        nrt.NeffSpec(kind="decode", batch=4, max_model_len=MAXLEN, block_size=BS, num_blocks=NB),
        nrt.NeffSpec(kind="decode", batch=4, context=16, max_model_len=MAXLEN, block_size=BS, num_blocks=NB),
        nrt.NeffSpec(kind="decode", batch=2, max_model_len=MAXLEN, block_size=BS, num_blocks=NB,
                     on_device_sampling=False),
    ]
    paths = {}
    for s in specs:
        paths[s.name] = nrt.compile_neff(s, model_dir, out / f"{s.name}.neff", target="trn2").path
    return paths


T = nrt.NrtpyTensor.from_numpy


def i32(x):
    return T(np.asarray(x, np.int32))


class Host:
    """What a plugin does: one KV pool, block tables, padded inputs."""

    def __init__(self, model_dir, neffs):
        self.kv = T(np.zeros(nrt.kv_cache_shape(model_dir, NB, BS), np.float32), name="kv_cache")
        self.models = {n: nrt.NrtpyModel.load_from_neff(p) for n, p in neffs.items()}

    @staticmethod
    def slot(blocks, p):
        return blocks[p // BS] * BS + p % BS

    def prefill_inputs(self, name, ids, start, blocks, params=(0.0, 1.0, 0.0), rand=0.5, logit_mask=None):
        bucket = self.models[name].spec.tokens
        n = len(ids)
        pad = bucket - n
        table = np.full(-(-MAXLEN // BS), -1)
        table[: len(blocks)] = blocks
        return {
            "kv_cache": self.kv,
            "input_ids": i32(list(ids) + [0] * pad),
            "position_ids": i32(list(range(start, start + n)) + [0] * pad),
            "slot_mapping": i32([self.slot(blocks, p) for p in range(start, start + n)] + [-1] * pad),
            "block_table": i32(table),
            "last_token_index": i32([n - 1]),
            "sampling_params": T(np.asarray([params], np.float32)),
            "rand": T(np.asarray([rand], np.float32)),
            **({"logit_mask": i32(logit_mask)} if logit_mask is not None else {}),
        }

    def prefill(self, name, ids, start, blocks, **kw):
        return self.models[name](inputs=self.prefill_inputs(name, ids, start, blocks, **kw))

    def decode_inputs(self, name, rows, params=None, rand=None):
        """rows: list (len B) of None (padding) or (token, position, blocks)."""
        m = self.models[name]
        b, s = m.spec.batch, m.spec.context
        table = np.full((b, -(-s // BS)), -1)
        ids, pos, slots = [0] * b, [0] * b, [-1] * b
        for r, row in enumerate(rows):
            if row is None:
                continue
            tok, p, blocks = row
            ids[r], pos[r], slots[r] = tok, p, self.slot(blocks, p)
            k = min(len(blocks), table.shape[1])
            table[r, :k] = blocks[:k]
        inputs = {"kv_cache": self.kv, "input_ids": i32(ids), "position_ids": i32(pos),
                  "slot_mapping": i32(slots), "block_table": i32(table)}
        if m.spec.on_device_sampling:
            inputs["sampling_params"] = T(np.asarray(params if params is not None else [[0, 1, 0]] * b, np.float32))
            inputs["rand"] = T(np.asarray(rand if rand is not None else [0.5] * b, np.float32))
        return inputs

    def decode(self, name, rows, **kw):
        return self.models[name](inputs=self.decode_inputs(name, rows, **kw))


PROMPTS = [[5, 17, 99, 3, 250, 7, 61, 8, 12, 400, 33], [9, 8, 7, 6, 5, 4, 3, 2, 1], [1000, 2, 513, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86]]
BLOCKS = [[9, 2, 17, 30], [5, 21, 1, 14], [27, 3, 12, 19]]  # non-contiguous, 4 blocks = 32 tokens each


def test_greedy_through_padded_prefill_and_decode_buckets(model_dir, neffs, golden, monkeypatch):
    monkeypatch.setenv("NPUSIM_NEFF", json.dumps({"check_padding": True}))
    host = Host(model_dir, neffs)
    steps = 6
    want = [golden.generate_greedy(p, steps + 1) for p in PROMPTS]
    got, nxt = [[] for _ in PROMPTS], []
    for i, p in enumerate(PROMPTS):
        out = host.prefill("prefill_s16", p, 0, BLOCKS[i])
        ref = golden.prefill(p, golden.new_cache(len(p)))[-1]
        np.testing.assert_allclose(out["logits"].numpy()[0], ref, atol=1e-5)
        tok = int(out["tokens"].numpy()[0])
        assert tok == int(np.argmax(ref))
        got[i].append(tok)
        nxt.append(tok)
    lens = [len(p) for p in PROMPTS]
    for _ in range(steps):
        # row 1 of the bucket is padding: 3 real rows in B=4
        rows = [(nxt[0], lens[0], BLOCKS[0]), None, (nxt[1], lens[1], BLOCKS[1]), (nxt[2], lens[2], BLOCKS[2])]
        out = host.decode("decode_b4", rows)
        logits, toks = out["logits"].numpy(), out["tokens"].numpy()
        assert not logits[1].any() and toks[1] == 0
        for i, r in enumerate((0, 2, 3)):
            assert toks[r] == int(np.argmax(logits[r]))
            got[i].append(int(toks[r]))
            nxt[i] = int(toks[r])
            lens[i] += 1
    assert got == want
    assert nrt.execution_counts() == {"prefill_s16": 3, "decode_b4": steps}


def test_prefix_hit_reuses_blocks(model_dir, neffs, golden):
    host = Host(model_dir, neffs)
    a = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    b = a[:BS] + [300, 301, 302, 303, 304]
    host.prefill("prefill_s16", a, 0, [4, 6])
    # b shares a's first block (block 4): prefill only its tail, from position BS
    out = host.prefill("prefill_s16", b[BS:], BS, [4, 10])
    ref = golden.prefill(b, golden.new_cache(len(b)))[-1]
    np.testing.assert_allclose(out["logits"].numpy()[0], ref, atol=1e-5)


def test_segmented_prefill_two_chunks(model_dir, neffs, golden):
    host = Host(model_dir, neffs)
    prompt = [int(x) for x in np.random.default_rng(3).integers(0, 1024, 40)]
    blocks = [7, 1, 25, 13, 2, 18]
    host.prefill("prefill_s32_kv32", prompt[:32], 0, blocks)
    out = host.prefill("prefill_s32_kv32", prompt[32:], 32, blocks)
    ref = golden.prefill(prompt, golden.new_cache(40))[-1]
    np.testing.assert_allclose(out["logits"].numpy()[0], ref, atol=1e-5)
    want = golden.generate_greedy(prompt, 3)
    toks = [int(out["tokens"].numpy()[0])]
    for step in range(2):
        o = host.decode("decode_b4", [(toks[-1], 40 + step, blocks), None, None, None])
        toks.append(int(o["tokens"].numpy()[0]))
    assert toks == want


def test_decode_context_bucket_overflow(model_dir, neffs):
    host = Host(model_dir, neffs)
    host.prefill("prefill_s16", list(range(1, 17)), 0, [0, 1])
    ok = host.decode("decode_b4_s16", [(5, 15, [0, 1]), None, None, None])
    assert ok["logits"].numpy()[0].any()
    with pytest.raises(nrt.NrtError, match=r"row 2 has position 16.*S=16"):
        host.decode("decode_b4_s16", [None, None, (5, 16, [0, 1, 2]), None])


def test_recompile_error_text(model_dir, neffs):
    host = Host(model_dir, neffs)
    inputs = host.prefill_inputs("prefill_s16", [1, 2, 3], 0, [0])
    inputs["input_ids"] = i32(range(7))
    with pytest.raises(nrt.NeffRecompileError) as e:
        host.models["prefill_s16"](inputs=inputs)
    assert str(e.value) == (
        "Detected recompile when torch.compile stance is 'fail_on_recompile'. filename: "
        f"'{neffs['prefill_s16']}', function name: 'prefill_s16', line number: 0\n"
        "    triggered by the following guard failure(s):\n"
        "    - 0/0: tensor 'input_ids' size mismatch at index 0. expected 16, actual 7")
    assert isinstance(e.value, RuntimeError)


def test_bad_names_and_dtypes(model_dir, neffs):
    host = Host(model_dir, neffs)
    m = host.models["prefill_s16"]
    inputs = host.prefill_inputs("prefill_s16", [1, 2, 3], 0, [0])
    del inputs["rand"]
    inputs["temperature"] = T(np.zeros(1, np.float32))
    with pytest.raises(nrt.NrtError, match=r"NRT_INVALID\(2\).*missing inputs \['rand'\].*unexpected inputs \['temperature'\]"):
        m(inputs=inputs)
    inputs = host.prefill_inputs("prefill_s16", [1, 2, 3], 0, [0])
    inputs["position_ids"] = T(np.arange(16, dtype=np.int64))
    with pytest.raises(nrt.NrtError, match="'position_ids' has dtype int64, expected int32"):
        m(inputs=inputs)
    inputs = host.prefill_inputs("prefill_s16", [1, 2, 3], 0, [0])
    inputs["slot_mapping"] = i32([0, 1, 5] + [-1] * 13)
    with pytest.raises(nrt.NrtError, match="does not match the block table"):
        m(inputs=inputs)
    assert nrt.execution_counts() == {}


def test_padding_writes_nothing(model_dir, neffs):
    host = Host(model_dir, neffs)
    pool = host.kv.numpy()
    host.prefill("prefill_s16", [4, 5, 6], 0, [3])
    touched = np.flatnonzero(np.any(pool != 0, axis=(0, 1, 4, 5)).reshape(-1))
    assert touched.tolist() == [24, 25, 26]
    host.decode("decode_b2", [None, (7, 3, [3])])
    touched = np.flatnonzero(np.any(pool != 0, axis=(0, 1, 4, 5)).reshape(-1))
    assert touched.tolist() == [24, 25, 26, 27]


def test_faults_once_and_persistent(model_dir, neffs, monkeypatch):
    host = Host(model_dir, neffs)
    monkeypatch.setenv("NPUSIM_NEFF", json.dumps({"fault": {"after_calls": 1, "times": 1}}))
    host.prefill("prefill_s16", [1, 2], 0, [0])
    with pytest.raises(nrt.NrtError, match=r"^NRT Error NRT_FAILURE\(1\): Failed to execute model 'prefill_s16' \(execution 2"):
        host.prefill("prefill_s16", [1, 2], 0, [0])
    host.prefill("prefill_s16", [1, 2], 0, [0])
    nrt.reset()
    host = Host(model_dir, neffs)
    monkeypatch.setenv("NPUSIM_NEFF", json.dumps({"fault": {"after_calls": 0, "times": None}}))
    for _ in range(3):
        with pytest.raises(nrt.NrtError, match="NRT_FAILURE"):
            host.prefill("prefill_s16", [1, 2], 0, [0])
    assert nrt.execution_counts() == {}


def test_ods_greedy_topk_rand_through_neff(model_dir, neffs):
    host = Host(model_dir, neffs)
    host.prefill("prefill_s16", [1, 2, 3, 4], 0, [0])
    rest = [[0, 1, 0]] * 3

    def run(params, rand):  # one real row at position 4; rerunning rewrites the same slot
        return host.decode("decode_b4", [(9, 4, [0]), None, None, None], params=[params] + rest, rand=[rand, 0, 0, 0])

    greedy = run([0, 1, 0.0], 0.9)  # temperature 0 -> argmax
    argmax = int(np.argmax(greedy["logits"].numpy()[0]))
    assert int(greedy["tokens"].numpy()[0]) == argmax
    assert int(run([1, 1, 5.0], 0.99)["tokens"].numpy()[0]) == argmax  # top_k=1 -> argmax
    picks = {u: int(run([-1, 1, 3.0], u)["tokens"].numpy()[0]) for u in (0.05, 0.37, 0.95)}
    assert all(int(run([-1, 1, 3.0], u)["tokens"].numpy()[0]) == t for u, t in picks.items())  # same rand, same token
    assert len(set(picks.values())) > 1  # at temperature 3 different uniforms pick different tokens
    with pytest.raises(nrt.NrtError, match=r"rand of real rows must be uniforms in \[0, 1\)"):
        run([0, 1, 1.0], 1.0)


def test_sampling_kernel_edges():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    p = lambda k, tp, t: np.array([[k, tp, t]], np.float32)  # noqa: E731
    r = lambda u: np.array([u], np.float32)  # noqa: E731
    assert sample(logits, p(-1, 1.0, 0.0), r(0.99))[0] == 0  # temperature 0 -> argmax
    assert sample(logits, p(1, 1.0, 1.0), r(0.99))[0] == 0  # top_k=1 -> argmax
    assert sample(logits, p(-1, 1.0, 1.0), r(0.99))[0] == 3  # inverse CDF: 0.99 is in the last bin
    assert sample(logits, p(-1, 1.0, 1.0), r(0.6))[0] == 1
    assert sample(logits, p(2, 1.0, 1.0), r(0.99))[0] == 1  # top_k=2 drops the tail
    assert sample(logits, p(-1, 0.45, 1.0), r(0.99))[0] == 0  # cumsum reaches 0.45 at the first token
    assert sample(logits, p(-1, 0.55, 1.0), r(0.99))[0] == 1  # ... and 0.55 at the second
    assert sample(logits, p(-1, 0.55, 1.0), r(0.0))[0] == 0
    assert sample(logits, p(-1, 1e-9, 1.0), r(0.99))[0] == 0  # at least one token is kept
    assert sample(logits, p(-1, 1.0, 1.0), r(0.99), max_top_k=2)[0] == 1  # kernel top-k width
    for u in (0.0, 0.99):  # deterministic: 0.5 instead of rand
        assert sample(logits, p(-1, 1.0, 1.0), r(u), deterministic=True)[0] == sample(logits, p(-1, 1.0, 1.0), r(0.5))[0]
    ties = np.zeros((1, 6), np.float32)
    assert sample(ties, p(-1, 1.0, 0.0), r(0.5))[0] == 0  # lowest id on ties


def test_quantize_fp8():
    x = np.array([1000.0, -1000.0, 239.0, 241.0, 0.1, 1.0625, 300.0, 0.0], np.float32)
    q240 = quantize_fp8_e4m3(x, 240.0)
    assert q240.tolist()[:4] == [240.0, -240.0, 240.0, 240.0]
    assert q240[4] == pytest.approx(0.1015625) and q240[5] == 1.0 and q240[6] == 240.0 and q240[7] == 0.0
    q448 = quantize_fp8_e4m3(x, 448.0)
    assert q448.tolist()[:2] == [448.0, -448.0] and q448[6] == 288.0


@pytest.mark.parametrize("plat,limit", [("trn2", 240.0), ("trn3", 448.0)])
def test_fp8_kv_clamp_per_target(tmp_path, monkeypatch, plat, limit):
    d = _write_model(tmp_path, scale_k=400.0)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", plat)
    spec = nrt.NeffSpec(kind="prefill", tokens=16, max_model_len=MAXLEN, block_size=BS, num_blocks=NB, kv_dtype="fp8_e4m3")
    path = nrt.compile_neff(spec, d, tmp_path / "fp8.neff").path
    assert nrt.device_info().fp8_e4m3_max == limit
    m = nrt.NrtpyModel.load_from_neff(path)
    host = Host.__new__(Host)
    host.kv = T(np.zeros(nrt.kv_cache_shape(d, NB, BS), np.float32))
    host.models = {spec.name: m}
    host.prefill(spec.name, list(range(100, 112)), 0, [5, 6])
    pool = host.kv.numpy()
    assert np.abs(pool).max() == limit
    np.testing.assert_array_equal(quantize_fp8_e4m3(pool, limit), pool)


def test_deterministic_sampler_ignores_rand(model_dir, tmp_path):
    spec = nrt.NeffSpec(kind="prefill", tokens=16, max_model_len=MAXLEN, block_size=BS, num_blocks=NB, deterministic=True)
    m = nrt.NrtpyModel.load_from_neff(nrt.compile_neff(spec, model_dir, tmp_path / "det.neff").path)
    host = Host.__new__(Host)
    host.kv = T(np.zeros(nrt.kv_cache_shape(model_dir, NB, BS), np.float32))
    host.models = {spec.name: m}
    toks = {int(host.prefill(spec.name, [3, 1, 4, 1, 5], 0, [2], params=(-1, 1.0, 2.0), rand=u)["tokens"].numpy()[0])
            for u in (0.01, 0.5, 0.99)}
    assert len(toks) == 1


def test_two_rows_one_slot_rejected(model_dir, neffs):
    host = Host(model_dir, neffs)
    host.prefill("prefill_s16", [1, 2, 3], 0, [0])
    with pytest.raises(nrt.NrtError, match=r"KV slots \[3\] are written by two rows"):
        host.decode("decode_b4", [(5, 3, [0]), (6, 3, [0]), None, None])


def test_logit_mask_restricts_on_device_sampling_and_leaves_the_logits_raw(model_dir, golden, tmp_path):
    """A ``logit_mask`` program (structured outputs' grammar bitmask on device): the sampled token
    is the best allowed one (greedy), or drawn among the allowed ones only; the returned logits
    are the unmasked ones; a row that allows nothing, or a value other than 0/1, is refused."""
    spec = nrt.NeffSpec(kind="prefill", tokens=16, max_model_len=MAXLEN, block_size=BS, num_blocks=NB, logit_mask=True)
    from npusim.neff.compiler import io_info

    names = [i["name"] for i in io_info(spec, ModelConfig.from_dict(make_config("llama")))[0]]
    assert names[-1] == "logit_mask"
    host = Host(model_dir, {spec.name: nrt.compile_neff(spec, model_dir, tmp_path / "m.neff", target="trn2").path})
    vocab = golden.config.vocab_size
    prompt = [3, 17, 40, 9]
    want = np.asarray(golden.prefill(prompt, golden.new_cache(len(prompt))))[-1]
    allowed = np.argsort(want)[:5]  # the five least likely tokens
    mask = np.zeros((1, vocab), np.int32)
    mask[0, allowed] = 1
    out = host.prefill(spec.name, prompt, 0, [0], logit_mask=mask)
    assert int(out["tokens"].numpy()[0]) == int(allowed[np.argmax(want[allowed])])
    assert np.allclose(out["logits"].numpy()[0], want, atol=1e-4), "the logits stay raw"
    for r in (0.01, 0.5, 0.99):
        tok = int(host.prefill(spec.name, prompt, 0, [0], params=(0.0, 1.0, 1.0), rand=r, logit_mask=mask)["tokens"].numpy()[0])
        assert tok in allowed.tolist()
    with pytest.raises(nrt.NrtError, match="allows no token"):
        host.prefill(spec.name, prompt, 0, [0], logit_mask=np.zeros((1, vocab), np.int32))
    with pytest.raises(nrt.NrtError, match="0 or 1"):
        host.prefill(spec.name, prompt, 0, [0], logit_mask=mask * 2)
    with pytest.raises(ValueError, match="logit_mask needs on_device_sampling"):
        nrt.NeffSpec(kind="decode", on_device_sampling=False, logit_mask=True)


def test_prompt_embeds_prefill_takes_embedding_rows_where_masked(model_dir, golden, tmp_path):
    """A ``prompt_embeds`` prefill: masked positions take their ``inputs_embeds`` row, the others
    their token's embedding; embeddings equal to the tokens' give the tokens' logits, other
    embeddings the golden decoder's ``forward_embeddings``; a mask value other than 0/1 is refused."""
    spec = nrt.NeffSpec(kind="prefill", tokens=16, max_model_len=MAXLEN, block_size=BS, num_blocks=NB,
                        prompt_embeds=True)
    host = Host(model_dir, {spec.name: nrt.compile_neff(spec, model_dir, tmp_path / "e.neff", target="trn2").path})
    hidden = golden.config.hidden_size
    prompt = [3, 17, 40, 9, 12]

    def run(embeds, mask, ids=prompt):
        inputs = host.prefill_inputs(spec.name, ids, 0, [0])
        e = np.zeros((16, hidden), np.float32)
        e[: len(embeds)] = embeds
        m = np.zeros(16, np.int32)
        m[: len(mask)] = mask
        inputs.update(inputs_embeds=T(e), embeds_mask=i32(m))
        return host.models[spec.name](inputs=inputs)["logits"].numpy()[0]

    want = np.asarray(golden.prefill(prompt, golden.new_cache(len(prompt))))[-1]
    assert np.allclose(run(golden.embed(prompt), [1] * 5, ids=[0] * 5), want, atol=1e-4)
    assert np.allclose(run(golden.embed(prompt), [0, 1, 0, 1, 0], ids=[3, 0, 40, 0, 12]), want, atol=1e-4)
    free = np.random.default_rng(0).normal(size=(5, hidden)).astype(np.float32)
    ref = np.asarray(golden.forward_embeddings(free, golden.new_cache(5)))[-1]
    assert np.allclose(run(free, [1] * 5, ids=[0] * 5), ref, atol=1e-4)
    with pytest.raises(nrt.NrtError, match="embeds_mask values must be 0 or 1"):
        run(free, [2] * 5)
    with pytest.raises(ValueError, match="prompt_embeds is a prefill input"):
        nrt.NeffSpec(kind="decode", prompt_embeds=True)
