"""vllm_npu.neuron.buckets: ladders, validation, segmented prefill, selection and the compile
set (neuron.md §2)."""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest

from vllm_npu.neuron import buckets as B
from vllm_npu.neuron.buckets import BucketConfigError, BucketPlan, resolve_buckets
from vllm_npu.neuron.neuron_config import NeuronConfig

LOGGER = "vllm.vllm_npu.neuron"




def messages(caplog, level=None):
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and (level is None or r.levelno == level)]


def test_pure_stdlib():
    """The configuration modules import neither vLLM nor torch nor npusim."""
    mods = ", ".join(f"vllm_npu.neuron.{m}" for m in (
        "buckets", "neuron_config", "memory", "runner", "parallel", "sampling", "quantization"))
    code = (f"import sys, {mods}\n"
            "bad = [m for m in ('vllm', 'torch', 'npusim', 'numpy') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_constants():
    assert B.SUPPORTED_KV_SEGMENT_SIZES == {512, 1024, 2048, 4096, 8192}
    assert B.MAX_MODEL_LEN_SINGLE_SHOT == 16384


@pytest.mark.parametrize("m, expected", [
    (2048, [128, 256, 512, 1024, 2048]),
    (3000, [128, 256, 512, 1024, 2048, 3000]),
    (128, [128]), (100, [100]), (1, [1]), (129, [128, 129]), (700, [128, 256, 512, 700]),
])
def test_default_prefill_ladder(m, expected):
    assert B.get_default_num_batched_tokens_buckets(m) == expected


@pytest.mark.parametrize("n, expected", [(8, [1, 2, 4, 8]), (6, [1, 2, 4, 6]), (1, [1]),
                                         (2, [1, 2]), (3, [1, 2, 3])])
def test_default_seqs_ladder(n, expected):
    assert B.get_default_num_seqs_buckets(n) == expected


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_default_ladder_rejects_non_positive(bad):
    with pytest.raises(BucketConfigError, match="must be a positive integer"):
        B.get_default_num_batched_tokens_buckets(bad)
    with pytest.raises(BucketConfigError, match="max_num_seqs must be a positive integer"):
        B.get_default_num_seqs_buckets(bad)


def test_get_max_num_batched_tokens():
    assert B.get_max_num_batched_tokens(8192, 4096) == 4096
    assert B.get_max_num_batched_tokens(2048, 4096) == 2048
    assert B.get_max_num_batched_tokens(None, 4096) == 4096


# --------------------------------------------------------------------------------------------
# user lists

@pytest.mark.parametrize("validate, name, limit_text", [
    (B.validate_num_batched_tokens_buckets, "num_batched_tokens_buckets", "max_num_batched_tokens"),
    (B.validate_num_seqs_buckets, "num_seqs_buckets", "max_num_seqs"),
])
def test_list_validation_messages(validate, name, limit_text):
    def err(value, limit=512):
        with pytest.raises(BucketConfigError) as info:
            validate(value, limit)
        return str(info.value)

    assert err((128, 512)) == f"{name} must be a list, got tuple"
    assert err("128") == f"{name} must be a list, got str"
    assert err([]) == f"{name} cannot be empty"
    assert err([128, "a"]) == f"{name}[1] must be an integer, got 'a'"
    assert err([128, 2.0]) == f"{name}[1] must be an integer, got 2.0"
    assert err([True]) == f"{name}[0] must be an integer, got True"
    assert err([0, 512]) == f"{name}[0] must be positive, got 0"
    assert err([128, -4]) == f"{name}[1] must be positive, got -4"
    assert err([256, 128, 512]) == f"{name} must be in strictly ascending order, got [256, 128, 512]"
    assert err([128, 128, 512]) == f"{name} must be in strictly ascending order, got [128, 128, 512]"
    assert err([128, 256]) == (f"Last bucket in {name} must equal {limit_text} (512), got 256")
    assert validate([128, 512], 512) == [128, 512]
    assert isinstance(BucketConfigError("x"), ValueError)


def test_decode_context_length_buckets():
    v = B.validate_decode_context_length_buckets
    assert v(None, 4096) is None
    assert v([1024, 2048], 4096) == [1024, 2048]
    with pytest.raises(BucketConfigError) as info:
        v([1024, 4096], 4096)
    assert str(info.value) == ("decode_context_length_buckets[1]=4096 must be strictly less than "
                               "max_model_len=4096; max_model_len is the implicit fallback bucket.")
    with pytest.raises(BucketConfigError) as info:
        v([1000], 4096)
    assert str(info.value) == ("decode_context_length_buckets[0]=1000 must be divisible by 128 "
                               "to satisfy the attention kernel tile constraint.")
    with pytest.raises(BucketConfigError, match=r"^decode_context_length_buckets cannot be empty$"):
        v([], 4096)
    with pytest.raises(BucketConfigError, match="strictly ascending"):
        v([2048, 1024], 4096)


def test_kv_segment_size_buckets():
    v = B.validate_kv_segment_size_buckets
    assert v([1024], None, 32) == [1024]
    assert v([2048], [2048], 32) == [2048]
    with pytest.raises(BucketConfigError) as info:
        v([1000], None, 32)
    assert str(info.value) == ("kv_segment_size_buckets[0]=1000 is not a supported KV segment "
                               "size on Neuron. Supported values: [512, 1024, 2048, 4096, 8192].")
    with pytest.raises(BucketConfigError) as info:
        v([512, 1024], None, 32)
    assert str(info.value) == "Only one segment size is currently supported"
    with pytest.raises(BucketConfigError) as info:
        v([512], None, 384)
    assert str(info.value) == "kv_segment_size_buckets[0]=512 must be divisible by block_size=384."
    with pytest.raises(BucketConfigError) as info:
        v([1024], [512, 1024], 32)
    assert str(info.value) == ("num_batched_tokens_buckets ([512, 1024]) must equal "
                               "kv_segment_size_buckets ([1024]) when both are set "
                               "(segmented-prefill kernel constraint).")
    with pytest.raises(BucketConfigError, match="kv_segment_size_buckets must be a list"):
        v(1024, None, 32)


# --------------------------------------------------------------------------------------------
# segmented prefill

def test_single_shot(neuron_caplog):
    assert B.resolve_segmented_prefill_config(4096, 4096) == (None, None)
    assert B.resolve_segmented_prefill_config(16384, 16384) == (None, None)
    assert messages(neuron_caplog, logging.INFO) == [
        "Segmented prefill disabled (single-shot prefill; max_num_batched_tokens == "
        "max_model_len)"] * 2


def test_single_shot_too_long():
    with pytest.raises(BucketConfigError) as info:
        B.resolve_segmented_prefill_config(32768, 32768)
    assert str(info.value) == (
        "Single-shot prefill (max_num_batched_tokens=32768 >= max_model_len=32768) is only "
        "supported when max_model_len <= 16384. Set max_num_batched_tokens to one of "
        "[512, 1024, 2048, 4096, 8192] to enable chunked prefill.")


def test_segmented_auto(neuron_caplog):
    assert B.resolve_segmented_prefill_config(8192, 131072) == ([8192], [8192])
    assert messages(neuron_caplog, logging.INFO) == [
        "Segmented prefill auto-enabled with kv_segment_size_buckets=[8192], "
        "num_batched_tokens_buckets=[8192]"]


def test_unsupported_chunk():
    with pytest.raises(BucketConfigError) as info:
        B.resolve_segmented_prefill_config(3000, 131072)
    assert str(info.value) == (
        "max_num_batched_tokens=3000 is not a supported chunked prefill size on Neuron. "
        "Supported values: [512, 1024, 2048, 4096, 8192].")
    with pytest.raises(BucketConfigError) as info:
        B.resolve_segmented_prefill_config(3000, 8192)
    assert str(info.value) == (
        "max_num_batched_tokens=3000 is not a supported chunked prefill size on Neuron. "
        "Supported values: [512, 1024, 2048, 4096, 8192]. Alternatively, set "
        "max_num_batched_tokens to max_model_len (8192) for single-shot prefill.")


def test_prefix_caching_needs_segmented():
    B.check_prefix_caching(True, True)
    B.check_prefix_caching(False, False)
    with pytest.raises(BucketConfigError) as info:
        B.check_prefix_caching(True, False)
    assert str(info.value) == (
        "Automatic Prefix Caching (APC) requires segmented prefill to be enabled. Either "
        "disable APC with '--no-enable-prefix-caching' or set 'max_num_batched_tokens' to a "
        "supported segmented prefill size [512, 1024, 2048, 4096, 8192] to auto-enable "
        "segmented prefill.")


# --------------------------------------------------------------------------------------------
# selection

@pytest.mark.parametrize("count, expected", [(100, 128), (128, 128), (129, 256), (512, 512),
                                             (513, 1024), (1024, 1024)])
def test_get_bucket_for_count(count, expected, neuron_caplog):
    assert B.get_bucket_for_count(count, [128, 256, 512, 1024]) == expected
    assert messages(neuron_caplog) == []


def test_get_bucket_overflow_and_zero(neuron_caplog):
    assert B.get_bucket_for_count(2000, [128, 256, 512, 1024]) == 1024
    assert B.get_bucket_for_count(0, [128, 256]) == 128
    assert B.get_bucket_for_count(-3, (4, 8)) == 4
    assert messages(neuron_caplog, logging.WARNING) == [
        "Count 2000 exceeds all buckets [128, 256, 512, 1024], returning largest bucket 1024",
        "Count is 0, returning smallest bucket", "Count is -3, returning smallest bucket"]
    with pytest.raises(BucketConfigError):
        B.get_bucket_for_count(1, [])


def test_decode_context_bucket():
    assert B.decode_context_bucket(1000, [1024, 2048], 4096) == 1024
    assert B.decode_context_bucket(1024, [1024, 2048], 4096) == 1024
    assert B.decode_context_bucket(1025, [1024, 2048], 4096) == 2048
    assert B.decode_context_bucket(3000, [1024, 2048], 4096) == 4096
    assert B.decode_context_bucket(5000, [1024], 4096) == 4096
    assert B.decode_context_bucket(10, None, 4096) == 4096
    assert B.decode_context_bucket(10, [], 4096) == 4096


# --------------------------------------------------------------------------------------------
# resolve_buckets / BucketPlan

def plan(**kw):
    nc = kw.pop("nc", NeuronConfig())
    args = dict(max_num_batched_tokens=4096, max_model_len=4096, max_num_seqs=8, block_size=32)
    args.update(kw)
    return resolve_buckets(neuron_config=nc, **args)


def test_resolve_defaults_single_shot(neuron_caplog):
    p = plan()
    assert p == BucketPlan((128, 256, 512, 1024, 2048, 4096), None, (1, 2, 4, 8), None, False,
                           4096, 4096, 8, 32)
    assert messages(neuron_caplog, logging.INFO) == [
        "Segmented prefill disabled (single-shot prefill; max_num_batched_tokens == max_model_len)",
        "Using default num_batched_tokens_buckets: [128, 256, 512, 1024, 2048, 4096]",
        "Using default num_seqs_buckets: [1, 2, 4, 8]"]
    targets = p.compile_targets()
    assert targets[:2] == [{"kind": "prefill", "tokens": 128, "kv_segment": 0},
                           {"kind": "prefill", "tokens": 256, "kv_segment": 0}]
    assert targets[6:] == [{"kind": "decode", "batch": b, "context": 4096} for b in (1, 2, 4, 8)]
    assert [p.target_name(t) for t in targets] == [
        "prefill_s128", "prefill_s256", "prefill_s512", "prefill_s1024", "prefill_s2048",
        "prefill_s4096", "decode_b1", "decode_b2", "decode_b4", "decode_b8"]


def test_resolve_m_is_min_with_max_model_len():
    p = plan(max_num_batched_tokens=8192, max_model_len=2048)
    assert p.num_batched_tokens_buckets == (128, 256, 512, 1024, 2048)
    assert p.max_num_batched_tokens == 2048 and not p.segmented


def test_resolve_segmented_auto(neuron_caplog):
    p = plan(max_num_batched_tokens=1024, max_model_len=8192, enable_prefix_caching=True)
    assert p.segmented and p.kv_segment_size_buckets == (1024,)
    assert p.num_batched_tokens_buckets == (1024,)
    assert [p.target_name(t) for t in p.compile_targets()][:1] == ["prefill_s1024_kv1024"]
    assert "Using default num_batched_tokens_buckets: [1024]" not in messages(neuron_caplog)


def test_resolve_user_lists(neuron_caplog):
    nc = NeuronConfig.from_additional_config({"neuron_config": {
        "num_batched_tokens_buckets": [256, 512, 1024], "num_seqs_buckets": [2, 8],
        "decode_context_length_buckets": [1024, 2048]}})
    p = plan(max_num_batched_tokens=1024, max_model_len=4096, nc=nc)
    assert p.num_batched_tokens_buckets == (256, 512, 1024)
    assert p.kv_segment_size_buckets == (1024,)  # auto, from M
    assert p.num_seqs_buckets == (2, 8)
    assert p.decode_context_length_buckets == (1024, 2048)
    assert p.decode_context_targets == (1024, 2048, 4096)
    assert "Using num_batched_tokens_buckets from config: [256, 512, 1024]" in messages(neuron_caplog)
    assert "Using num_seqs_buckets from config: [2, 8]" in messages(neuron_caplog)
    names = [p.target_name(t) for t in p.compile_targets()]
    assert names == ["prefill_s256_kv1024", "prefill_s512_kv1024", "prefill_s1024_kv1024",
                     "decode_b2_s1024", "decode_b2_s2048", "decode_b2",
                     "decode_b8_s1024", "decode_b8_s2048", "decode_b8"]
    assert p.prefill_bucket(300) == 512
    assert p.decode_batch_bucket(3) == 8
    assert p.decode_ctx_bucket(1500) == 2048


def test_compile_targets_skip_bucket_above_segment():
    p = BucketPlan((512, 1024, 2048), (1024,), (1,), None, True, 8192, 2048, 1, 32)
    prefill = [t for t in p.compile_targets() if t["kind"] == "prefill"]
    assert prefill == [{"kind": "prefill", "tokens": 512, "kv_segment": 1024},
                       {"kind": "prefill", "tokens": 1024, "kv_segment": 1024}]


def test_resolve_explicit_kv_segments(neuron_caplog):
    nc = NeuronConfig.from_additional_config({"neuron_config": {"kv_segment_size_buckets": [2048]}})
    p = plan(max_num_batched_tokens=2048, max_model_len=32768, nc=nc)
    assert p.kv_segment_size_buckets == (2048,) and p.num_batched_tokens_buckets == (2048,)
    assert "Segmented prefill auto-enabled; num_batched_tokens_buckets=[2048]" in messages(neuron_caplog)
    # the segment list must cover M
    with pytest.raises(BucketConfigError, match=r"max_num_batched_tokens \(4096\), got 2048"):
        plan(max_num_batched_tokens=4096, max_model_len=32768, nc=nc)
    nc2 = NeuronConfig.from_additional_config({"neuron_config": {
        "kv_segment_size_buckets": [2048], "num_batched_tokens_buckets": [1024, 2048]}})
    with pytest.raises(BucketConfigError, match="must equal kv_segment_size_buckets"):
        plan(max_num_batched_tokens=2048, max_model_len=32768, nc=nc2)


def test_resolve_errors():
    with pytest.raises(BucketConfigError, match="Automatic Prefix Caching"):
        plan(enable_prefix_caching=True)
    with pytest.raises(BucketConfigError, match="is not a supported chunked prefill size"):
        plan(max_num_batched_tokens=3000, max_model_len=8192)
    nc = NeuronConfig.from_additional_config({"neuron_config": {"num_seqs_buckets": [1, 4]}})
    with pytest.raises(BucketConfigError, match=r"^Last bucket in num_seqs_buckets must equal "
                                                r"max_num_seqs \(8\), got 4$"):
        plan(nc=nc)
    nc = NeuronConfig.from_additional_config({"neuron_config": {
        "decode_context_length_buckets": [4096]}})
    with pytest.raises(BucketConfigError, match="strictly less than max_model_len=4096"):
        plan(nc=nc)


def test_resolve_accepts_plain_namespace():
    ns = SimpleNamespace(num_seqs_buckets=[1, 8])
    p = resolve_buckets(max_num_batched_tokens=512, max_model_len=512, max_num_seqs=8,
                        block_size=32, neuron_config=ns)
    assert p.num_seqs_buckets == (1, 8) and p.num_batched_tokens_buckets == (128, 256, 512)


def test_target_name():
    assert B.target_name({"kind": "prefill", "tokens": 1024, "kv_segment": 0}) == "prefill_s1024"
    assert B.target_name({"kind": "prefill", "tokens": 512, "kv_segment": 1024}) == \
        "prefill_s512_kv1024"
    assert B.target_name({"kind": "decode", "batch": 8, "context": 2048}, 2048) == "decode_b8"
    assert B.target_name({"kind": "decode", "batch": 8, "context": 2048}, 4096) == \
        "decode_b8_s2048"
    with pytest.raises(ValueError):
        B.target_name({"kind": "decode", "batch": 8, "context": 2048})
    with pytest.raises(ValueError):
        B.target_name({"kind": "encode"})


def test_plan_is_frozen():
    p = plan()
    with pytest.raises(AttributeError):
        p.segmented = True  # type: ignore[misc]
