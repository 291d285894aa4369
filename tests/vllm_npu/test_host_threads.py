"""vllm_npu.host_threads: the engine process's OpenBLAS is set to one thread."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_npu.host_threads import limit_host_blas_threads

PROBE = r"""
import ctypes, numpy, sys
from vllm_npu.host_threads import limit_host_blas_threads, _loaded_openblas
libs = _loaded_openblas()
if not libs:
    print("NOLIB"); sys.exit(0)
lib = ctypes.CDLL(libs[0])
get = next(getattr(lib, n) for n in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                                      "openblas_get_num_threads") if hasattr(lib, n))
before = get()
changed = limit_host_blas_threads(1, environ={})
print("THREADS", before, get(), len(changed))
"""


def test_loaded_openblas_goes_to_one_thread():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    if "NOLIB" in proc.stdout:
        pytest.skip("numpy here is not linked against OpenBLAS")
    _, before, after, changed = proc.stdout.split()
    assert (int(after), int(changed)) == (1, 1), proc.stdout
    assert int(before) >= 1


def test_an_operator_choice_wins():
    assert limit_host_blas_threads(1, environ={"OPENBLAS_NUM_THREADS": "2"}) == []
    assert limit_host_blas_threads(1, environ={"OMP_NUM_THREADS": "4"}) == []


def test_no_library_no_change(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libc.so.6\n")
    assert limit_host_blas_threads(1, environ={}, maps_path=str(maps)) == []


def test_bad_thread_count():
    with pytest.raises(ValueError, match="threads=0 must be >= 1"):
        limit_host_blas_threads(0, environ={})
