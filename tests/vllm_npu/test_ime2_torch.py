"""vllm_npu.ime2 on torch tensors and the custom op torch.ops.npu_harness.ime2_hp_gemm_cpu."""

from __future__ import annotations

import numpy as np
import pytest

import npusim.q4x32 as q
from vllm_npu.ime2 import kernel

torch = pytest.importorskip("torch")


def inputs(m: int, k: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    qw, sc = q.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))
    return a, qw, sc


@pytest.mark.parametrize("m, k, n", [(1, 32, 1), (5, 288, 33), (4, 512, 64)])
def test_tensors_in_tensor_out(m, k, n):
    a, qw, sc = inputs(m, k, n, seed=n)
    out = kernel.ime2_hp_gemm_cpu(torch.from_numpy(a), torch.from_numpy(qw), torch.from_numpy(sc))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and tuple(out.shape) == (m, n)
    np.testing.assert_array_equal(out.numpy(), kernel.ime2_hp_gemm_cpu(a, qw, sc))
    np.testing.assert_array_equal(out.numpy(), q.ime2_hp_gemm(a, qw, sc, level="hardware"))
    # the packers accept tensors too
    assert kernel.pack_b(torch.from_numpy(qw), torch.from_numpy(sc)) == q.pack_b(qw, sc)
    assert kernel.quantize_a(torch.from_numpy(a)) == q.pack_a(q.quantize_a(a))


def test_tensor_errors_are_the_same_exceptions():
    a, qw, sc = inputs(2, 64, 8)
    with pytest.raises(kernel.DTypeError, match="A must have dtype float32, got float64"):
        kernel.ime2_hp_gemm_cpu(torch.from_numpy(a).double(), torch.from_numpy(qw), torch.from_numpy(sc))
    with pytest.raises(kernel.DTypeError, match="A has dtype torch.bfloat16"):
        kernel.ime2_hp_gemm_cpu(torch.from_numpy(a).bfloat16(), torch.from_numpy(qw), torch.from_numpy(sc))
    t = torch.from_numpy(a.copy())
    t[0, 3] = float("inf")
    with pytest.raises(kernel.NonFiniteError, match=r"A\[0, 3\] = inf"):
        kernel.ime2_hp_gemm_cpu(t, torch.from_numpy(qw), torch.from_numpy(sc))


def test_custom_op_is_registered_idempotently_and_equals_the_direct_call():
    op = kernel.register_torch_op()
    assert kernel.register_torch_op() is op or kernel.register_torch_op() == op
    a, qw, sc = inputs(5, 320, 45, seed=3)
    ta, tq, ts = torch.from_numpy(a), torch.from_numpy(qw), torch.from_numpy(sc)
    out = torch.ops.npu_harness.ime2_hp_gemm_cpu(ta, tq, ts)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (5, 45)
    np.testing.assert_array_equal(out.numpy(), kernel.ime2_hp_gemm_cpu(a, qw, sc))
    schema = str(torch.ops.npu_harness.ime2_hp_gemm_cpu.default._schema)
    assert schema == "npu_harness::ime2_hp_gemm_cpu(Tensor a, Tensor qweight, Tensor scales) -> Tensor"


def test_custom_op_fake_impl_gives_shapes():
    kernel.register_torch_op()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(7, 96)
        qw = torch.empty(50, 3, 16, dtype=torch.uint8)
        sc = torch.empty(50, 3)
        out = torch.ops.npu_harness.ime2_hp_gemm_cpu(a, qw, sc)
        assert tuple(out.shape) == (7, 50) and out.dtype == torch.float32


def test_custom_op_opcheck():
    kernel.register_torch_op()
    a, qw, sc = inputs(4, 256, 40, seed=5)
    torch.library.opcheck(torch.ops.npu_harness.ime2_hp_gemm_cpu.default,
                          (torch.from_numpy(a), torch.from_numpy(qw), torch.from_numpy(sc)))
