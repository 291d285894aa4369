"""The performance model's instruction counts are those our IME2 path really issues (issue 12,
section 2).

:func:`npusim.q4x32.perf.instruction_counts` derives the ``.hp`` count from the loop structure of
``kernels/ime2/src/gemm_ime2.c``; here the riscv64 driver runs that path under QEMU at VLEN 1024
with ``NPU_IME2_EMU_COUNT`` set, and the SIGILL emulator's count of emulated ``.hp``
instructions must equal the model's, exactly. Small shapes only (the emulator is slow): 4-row
groups, remainder rows, K padded to a superblock, an N tail. Skips with the missing piece's reason
when QEMU or the driver is absent (``bash ci/setup.sh`` installs and builds both).
"""

from __future__ import annotations

import numpy as np
import pytest

import npusim.q4x32 as q
from npu_conformance import qemu_ime2
from npusim.q4x32 import perf

_missing = qemu_ime2.missing_reason()
pytestmark = pytest.mark.skipif(_missing is not None, reason=_missing or "")

#: (M, K, N): one row; a 4-row group; a group plus a remainder row, two superblocks, a
#: 6-column scalar tail; K = 288 padded to two superblocks; three remainder rows.
SHAPES = ((1, 256, 32), (4, 256, 64), (5, 512, 38), (2, 288, 32), (3, 256, 64))


def _operands(m: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng([12, m, k, n])
    a = rng.standard_normal((m, k)).astype(np.float32)
    qweight, scales = q.quantize_q4_0(rng.standard_normal((n, k)).astype(np.float32))
    return a, qweight, scales


@pytest.mark.parametrize("m,k,n", SHAPES, ids=lambda v: str(v))
def test_model_hp_count_equals_the_emulated_count(m, k, n, monkeypatch):
    monkeypatch.setenv(qemu_ime2.EMU_ENV["count"], "1")
    a, qweight, scales = _operands(m, k, n)
    res = qemu_ime2.run(a, qweight, scales, vlen=1024, path="ime2")
    assert res.status == 0 and res.guards_ok, res.text
    emulated = qemu_ime2.emulated_count(res.stderr)
    assert emulated is not None, f"the driver printed no emulated count: {res.stderr!r}"
    counts = perf.instruction_counts(k, n, m)
    assert counts.hp == emulated, (m, k, n, counts)
    assert counts.hp > 0
