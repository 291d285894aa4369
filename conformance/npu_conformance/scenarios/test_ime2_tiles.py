"""IME2 Q4_0×32 tile GEMM scenarios (the ``ime2-qemu`` column; issue 3, section 3).

The real kernel sources, cross-built as the static riscv64 driver, run under
``qemu-riscv64-static`` on the portable, RVV and IME2 paths (the IME2 path's ``vmadot*.hp``
instructions emulated by the driver's SIGILL handler; VLEN 1024 only, ``WRONG_VLEN`` below).
Checks:

* the QEMU-run kernel equals ``npusim.q4x32.ime2_hp_gemm(level="hardware")`` bit for bit;
* its NMSE vs the float reference ``A @ dequant(W).T`` is at most :data:`MUL_MAT_NMSE`
  (llama.cpp test-backend-ops' mul_mat bound), recorded as the figure ``nmse_vs_float``;
* the QEMU wall time of the run is recorded as ``qemu_wall_s`` (a relative measure only).

The model is ``npusim.q4x32`` with this kernel's own choices (``order="hi_lo"``,
``m4="grouped"``). The portable and RVV paths implement the ``.hp`` arithmetic in C (unfused,
fp16 dot, overflow to inf); on the IME2 path the ``.hp`` options are the model's current
defaults, which the SIGILL emulator is set to follow (``NPU_IME2_EMU_*``): switch the defaults
to a board's answers (``NPUSIM_Q4X32_ANSWERS``) and the emulated kernel is checked against them.

These scenarios need QEMU: on ``ime2-hw`` the board questions (``test_ime2_board.py``) and the
native kernel runs (``test_ime2_layers.py``) take their place.
"""

from __future__ import annotations

import numpy as np
import pytest

#: llama.cpp test-backend-ops' NMSE bound for mul_mat, vs the float reference.
MUL_MAT_NMSE = 5e-4

#: This kernel's own choices (kernels/ime2/src), whatever the model's defaults are.
KERNEL_CHOICES = {"order": "hi_lo", "m4": "grouped"}
#: The .hp arithmetic the portable and RVV paths implement in C (gemm_portable.c), fixed.
C_HP_ARITHMETIC = {"rounding": "unfused", "dot": "fp16", "overflow": "inf"}
QEMU_ONLY = "QEMU-only scenario; on the board see ime2_board.* (test_ime2_board.py) and ime2_layers.*"

SHAPES = [  # (M, K, N): tails, K not a multiple of 256, and two seed (K, N) shapes at small M
    (1, 32, 7),
    (5, 288, 70),
    (1, 576, 1536),
    (4, 2048, 5632),
]


def operands(seed: int, shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A [M, K] ~ N(0, 1) and the Q4_0 quantization of a W [N, K] ~ N(0, 1), per seed and shape."""
    import npusim.q4x32 as q

    m, k, n = shape
    rng = np.random.default_rng([seed, m, k, n])
    a = rng.standard_normal((m, k)).astype(np.float32)
    return (a, *q.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32)))


def bits_differing(got: np.ndarray, model: np.ndarray, *, nan_equal: bool = False) -> int:
    """Elements whose float32 bits differ (with ``nan_equal``, two NaNs count as equal)."""
    differ = got.view(np.uint32) != model.view(np.uint32)
    if nan_equal:
        differ &= ~(np.isnan(got) & np.isnan(model))
    return int(np.count_nonzero(differ))


@pytest.mark.scenario(devices=("ime2",))
@pytest.mark.parametrize("path", ["portable", "rvv"])
@pytest.mark.parametrize("vlen", [128, 1024])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_qemu_gemm_matches_hardware_model(target, record, shape, vlen, path):
    if target.name != "ime2-qemu":
        pytest.skip(f"{target.name}: {QEMU_ONLY}")
    import npusim.q4x32 as q
    from npu_conformance import qemu_ime2

    m, k, n = shape
    a, qweight, scales = operands(3, shape)

    res = qemu_ime2.run(a, qweight, scales, vlen=vlen, path=path, timeout=120)
    assert res.status == 0, res.text
    assert res.guards_ok and res.vlenb == vlen // 8
    record.figure("qemu_wall_s", res.seconds, "s")

    model = q.ime2_hp_gemm(a, qweight, scales, level="hardware", **KERNEL_CHOICES, **C_HP_ARITHMETIC)
    mismatched = bits_differing(res.c, model)
    record.figure("bits_differing_from_model", mismatched, "elements")
    assert mismatched == 0, f"{mismatched} of {m * n} elements differ from npusim.q4x32 hardware"

    ref = a.astype(np.float64) @ q.dequantize_q4_0(qweight, scales, dtype=np.float64).T
    err = q.nmse(ref, res.c)
    record.figure("nmse_vs_float", err)
    assert err <= MUL_MAT_NMSE


# ---- the IME2 path (vmadot*.hp via .insn; run under QEMU through the driver's SIGILL emulator)

IME2_SHAPES = [(1, 32, 7), (5, 288, 70), (4, 512, 64)]  # tail only, tail + tiles, N % 32 == 0


@pytest.mark.scenario(devices=("ime2",))
@pytest.mark.parametrize("shape", IME2_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_ime2_path_matches_hardware_model_at_vlen_1024(target, record, shape, monkeypatch):
    """The IME2 path at VLEN 1024 equals npusim.q4x32 hardware bit for bit (NaN == NaN)."""
    if target.name != "ime2-qemu":
        pytest.skip(f"{target.name}: {QEMU_ONLY}")
    import npusim.q4x32 as q
    from npu_conformance import qemu_ime2

    m, k, n = shape
    a, qweight, scales = operands(4, shape)
    monkeypatch.setenv(qemu_ime2.EMU_ENV["count"], "1")  # the emulator reports the .hp count on stderr
    defaults = q.get_defaults()
    for option in ("rounding", "dot", "overflow"):  # the emulator follows the model's defaults
        monkeypatch.setenv(qemu_ime2.EMU_ENV[option], defaults[option])

    res = qemu_ime2.run(a, qweight, scales, vlen=1024, path="ime2", timeout=120)
    assert res.status == 0, res.text
    assert res.guards_ok and res.vlenb == 128
    record.figure("qemu_wall_s", res.seconds, "s")
    emulated = qemu_ime2.emulated_count(res.stderr)
    if emulated is not None:
        record.figure("hp_instructions", emulated, "instructions")

    model = q.ime2_hp_gemm(a, qweight, scales, level="hardware", **KERNEL_CHOICES)
    mismatched = bits_differing(res.c, model, nan_equal=True)
    record.figure("bits_differing_from_model", mismatched, "elements")
    assert mismatched == 0, f"{mismatched} of {m * n} elements differ from npusim.q4x32 hardware"


@pytest.mark.scenario(devices=("ime2",))
@pytest.mark.parametrize("vlen", [128, 256, 512])
def test_ime2_path_refuses_below_vlen_1024(target, vlen):
    """Below VLEN 1024 the IME2 path returns NPU_IME2_ERR_WRONG_VLEN: no crash, no C, guards intact."""
    if target.name != "ime2-qemu":
        pytest.skip(f"{target.name}: {QEMU_ONLY}")
    from npu_conformance import qemu_ime2

    a, qweight, scales = operands(5, (5, 288, 70))
    res = qemu_ime2.run(a, qweight, scales, vlen=vlen, path="ime2", timeout=120)
    assert (res.status, qemu_ime2.STATUS[res.status]) == (6, "WRONG_VLEN"), res.text
    assert res.c is None and res.guards_ok and res.vlenb == vlen // 8
