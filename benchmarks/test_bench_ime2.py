"""IME2 Q4_0x32 GEMM on the host, side by side (issue 3, section 5). Not part of the test run.

Run (see ``benchmarks/README.md``)::

    .venv/bin/python -m pytest -p no:cacheprovider benchmarks/test_bench_ime2.py \
        --benchmark-json=/tmp/ime2-bench.json
    .venv/bin/python benchmarks/summarize.py /tmp/ime2-bench.json

The seed's nine (K, N) feed-forward shapes (eight distinct: StableLM 2 1.6B has TinyLlama's),
M = 1 and 4, one pytest-benchmark group per (K, N, M). Every implementation gets the same
quantized weights (random codes, fp16-representable scales), prepared once per shape:

* ``npusim_exact``: ``npusim.q4x32.ime2_hp_gemm_prepared(A, w, level="exact")`` with
  ``w = prepare_weight(qweight, scales)`` built (and its caches warmed) once.
* ``c_portable``: the host C kernel as the seed's table times it (weights packed once):
  ``pack_b`` once, then per call ``quantize_a(A)`` + ``gemm_packed(..., path="portable")``.
  ``c_quantize_a`` and ``c_gemm_only`` time those two halves separately.
* ``c_x86``: the same with ``path="x86"`` (skipped where the CPU lacks AVX2 + F16C), the best
  variant for this CPU (AVX-512 VNNI + FP16 where present), and ``c_x86_gemm_only`` its GEMM
  half; ``c_x86_avx2``: the X86 path's AVX2 + F16C variant (``NPU_IME2_X86_ISA=avx2``);
  ``c_x86_vnni``: at most its AVX-512 VNNI + F16C variant (``NPU_IME2_X86_ISA=avx512-vnni``; the
  AVX2 one on a CPU without AVX-512 VNNI). ``c_auto``: the same with ``path="auto"``, the best host
  path the library picks (what ``ime2_hp_gemm_cpu`` and the torch op run); the floor is checked
  on it.
* ``c_auto_2t``: ``c_auto`` with the N tiles split over two threads
  (``gemm_packed(..., threads=2)``, i.e. ``npu_ime2_gemm_mt``).
* ``ort4_1t`` (the headline peer, issue 12) / ``ort4_2t``: ONNX Runtime
  ``com.microsoft::MatMulNBits`` with ``accuracy_level=4`` (int8 activations: ORT's fastest CPU
  path, the same int8 x int4 arithmetic the IME2 instructions do), one CPU InferenceSession per
  shape with ``intra_op_num_threads`` 1 / 2. ``ort0_1t`` / ``ort0_2t``: the same at the default
  ``accuracy_level`` 0 (fp32 compute), the second column. Attributes: bits 4, block_size 32, no
  zero points (zero point 8). Our ``qweight [N, K/32, 16]`` is already MatMulNBits' B layout
  (adjacent pairs, low nibble first); ``scales`` is flattened to ``[N * K/32]``. The fixture
  checks each output against ``A @ dequant(W).T`` (NMSE <= 5e-4).
* ``test_stream_copy``: the machine's single-core memory bandwidth, a STREAM-like copy of a
  256 MiB float32 array (``np.copyto``, one thread; bytes moved = read + write), measured in the
  same run so that the weight traffic of the GEMMs (``summarize.py``: packed weight bytes / time)
  can be set against it.
"""

from __future__ import annotations

import numpy as np
import pytest

from npusim import q4x32 as q

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
kernel = pytest.importorskip("vllm_npu.ime2.kernel")

MUL_MAT_NMSE = 5e-4  # llama.cpp's mul_mat bound, as in tests/vllm_npu/test_ime2_kernel.py

# (K, N) of the seed's IME2 GEMM table, with the models that have that feed-forward gate shape.
SEED_SHAPES = {
    (576, 1536): "SmolLM2 135M",
    (960, 2560): "SmolLM2 360M",
    (896, 4864): "Qwen2.5 0.5B",
    (2048, 5632): "TinyLlama 1.1B, StableLM 2 1.6B",
    (1536, 8960): "Qwen2.5 1.5B (and DeepSeek R1 distill Qwen 1.5B)",
    (2048, 8192): "SmolLM2 1.7B",
    (2560, 10240): "Phi-2",
    (2048, 11008): "Qwen2.5 3B",
}
MS = (1, 4)
IMPLS = ("npusim_exact", "c_portable", "c_x86_avx2", "c_x86_vnni", "c_x86", "c_auto", "c_auto_2t", "c_quantize_a",
         "c_gemm_only", "c_x86_gemm_only", "ort4_1t", "ort4_2t", "ort0_1t", "ort0_2t")
#: ORT implementation -> (accuracy_level, intra_op_num_threads)
ORT_IMPLS = {"ort4_1t": (4, 1), "ort4_2t": (4, 2), "ort0_1t": (0, 1), "ort0_2t": (0, 2)}
STREAM_BYTES = 256 << 20  # one array of the STREAM-like copy (well beyond any last-level cache)
#: impl -> the C path it runs
C_PATHS = {"c_portable": "portable", "c_x86_avx2": "x86", "c_x86_vnni": "x86", "c_x86": "x86", "c_auto": "auto",
           "c_auto_2t": "auto", "c_gemm_only": "portable", "c_x86_gemm_only": "x86"}


def _weights(k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 * k + n)
    qw = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    sc = rng.uniform(0.5, 1.5, (n, k // 32)) * rng.choice([-1, 1], (n, k // 32)) / 8
    return qw, sc.astype(np.float16).astype(np.float32)


def _ort_session(qw: np.ndarray, sc: np.ndarray, k: int, n: int, threads: int, level: int):
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node("MatMulNBits", ["A", "B", "scales"], ["Y"], domain="com.microsoft",
                            bits=4, block_size=32, K=k, N=n, accuracy_level=level)
    graph = helper.make_graph(
        [node], "ime2_matmulnbits",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        initializer=[numpy_helper.from_array(np.ascontiguousarray(qw), "B"),  # [N, K/32, 16]
                     numpy_helper.from_array(np.ascontiguousarray(sc.reshape(-1)), "scales")],
    )
    model = helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module", params=list(SEED_SHAPES), ids=lambda s: f"K{s[0]}-N{s[1]}")
def shape_ctx(request):
    """Weights and every implementation's prepared form for one (K, N), built once."""
    k, n = request.param
    qw, sc = _weights(k, n)
    w = q.prepare_weight(qw, sc)
    _ = w.w_deq  # warm the exact level's cache (the "prepared once" part)
    ctx = {
        "k": k, "n": n, "qw": qw, "sc": sc, "w": w,
        "w_ref": q.dequantize_q4_0(qw, sc, dtype=np.float64),
        "b_packed": kernel.pack_b(qw, sc),
    }
    for impl, (level, threads) in ORT_IMPLS.items():
        ctx[impl] = _ort_session(qw, sc, k, n, threads, level)
    yield ctx
    ctx.clear()


def _call(impl: str, ctx: dict, a: np.ndarray):
    """(function, args) that computes ``impl`` once; ``c_gemm_only`` gets A quantized outside."""
    k, n, m = ctx["k"], ctx["n"], a.shape[0]
    if impl == "npusim_exact":
        return q.ime2_hp_gemm_prepared, (a, ctx["w"])
    path = C_PATHS.get(impl)
    if path is not None and path != "auto" and path not in kernel.usable_paths():
        pytest.skip(f"path {path!r} does not run on this CPU")
    if path is not None and not impl.endswith("_gemm_only"):  # quantize_a + gemm_packed per call
        b, threads = ctx["b_packed"], 2 if impl.endswith("_2t") else 1
        return (lambda x: kernel.gemm_packed(kernel.quantize_a(x), b, m, k, n, path=path, threads=threads)), (a,)
    if impl == "c_quantize_a":
        return kernel.quantize_a, (a,)
    if impl in ("c_gemm_only", "c_x86_gemm_only"):
        b, ap = ctx["b_packed"], kernel.quantize_a(a)
        return (lambda: kernel.gemm_packed(ap, b, m, k, n, path=path)), ()
    sess = ctx[impl]
    return (lambda x: sess.run(None, {"A": x})[0]), (a,)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("m", MS)
def test_ime2_gemm(benchmark, shape_ctx, m, impl, monkeypatch):
    k, n = shape_ctx["k"], shape_ctx["n"]
    if impl in ("c_x86_avx2", "c_x86_vnni"):  # the X86 path's AVX2 variant / at most its VNNI + F16C one
        monkeypatch.setenv("NPU_IME2_X86_ISA", "avx2" if impl == "c_x86_avx2" else "avx512-vnni")
    else:
        monkeypatch.delenv("NPU_IME2_X86_ISA", raising=False)
    a = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    fn, args = _call(impl, shape_ctx, a)
    out = fn(*args)  # warm-up and correctness, untimed
    if impl != "c_quantize_a":
        ref = a.astype(np.float64) @ shape_ctx["w_ref"].T
        assert out.shape == (m, n) and out.dtype == np.float32
        err = q.nmse(ref, out)
        assert err <= MUL_MAT_NMSE, f"{impl}: NMSE {err:.3e} against A @ dequant(W).T > {MUL_MAT_NMSE}"
    benchmark.group = f"K={k} N={n} M={m}"
    # weight bytes one call streams: our packed B (fp16 scales), or ORT's B + fp32 scales
    w_bytes = k * n // 2 + n * (k // 32) * 4 if impl.startswith("ort") else len(shape_ctx["b_packed"])
    benchmark.extra_info.update(impl=impl, K=k, N=n, M=m, models=SEED_SHAPES[(k, n)], weight_bytes=w_bytes,
                                ort_version=ort.__version__, auto_path=kernel.auto_path(),
                                x86_variant=kernel.x86_variant())  # after the NPU_IME2_X86_ISA choice above
    benchmark(fn, *args)


def test_stream_copy(benchmark):
    """Single-core memory bandwidth: copy one 256 MiB float32 array into another (STREAM "Copy").

    ``summarize.py`` reports 2 * STREAM_BYTES / median (read + write) in GB/s; numpy's copy is a
    single-threaded memcpy."""
    src = np.ones(STREAM_BYTES // 4, dtype=np.float32)
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # fault the pages in, untimed
    benchmark.group = "memory bandwidth"
    benchmark.extra_info.update(impl="stream_copy", bytes_moved=2 * STREAM_BYTES)
    benchmark.pedantic(np.copyto, args=(dst, src), rounds=10, warmup_rounds=1)
    assert dst[-1] == 1.0
