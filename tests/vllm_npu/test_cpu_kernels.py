"""``vllm_npu.cpu_kernels`` and ``NpuPlatform.import_kernels``: the vLLM CPU kernel build is
chosen from the CPU's features as vLLM's ``CpuPlatform`` chooses it (on this host, with the
features reported by a patched torch; the emulated CPUs are ``test_isa_matrix.py``)."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm_npu import cpu_kernels  # noqa: E402
from vllm_npu.cpu_kernels import CpuIsa  # noqa: E402


def _isa(avx2: bool, avx512: bool, bf16: bool, machine: str = "x86_64") -> CpuIsa:
    return CpuIsa(machine, avx2, avx512, bf16, "TEST")


@pytest.mark.parametrize(("isa", "build", "level"), [
    (_isa(True, True, True), "vllm._C", "avx512-bf16"),
    (_isa(True, True, False), "vllm._C_AVX512", "avx512"),
    (_isa(True, False, False), "vllm._C_AVX2", "avx2"),
    (_isa(False, False, False), None, "x86-64"),
    (_isa(False, False, False, machine="riscv64"), "vllm._C", "riscv64"),
], ids=["avx512-bf16", "avx512", "avx2", "no-avx2", "riscv64"])
def test_the_build_follows_the_cpu(isa, build, level):
    assert cpu_kernels.vllm_kernel_build(isa) == build
    assert isa.level == level


@pytest.fixture
def imports(monkeypatch) -> list[str]:
    """Records the modules the loader imports instead of loading them (the real libraries
    register the same torch ops and cannot be loaded twice in one process)."""
    seen: list[str] = []
    monkeypatch.setattr(cpu_kernels.importlib, "import_module", seen.append)
    return seen


def _report(monkeypatch, *, avx2: bool, avx512: bool, bf16: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: avx2)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)


@pytest.mark.skipif(cpu_kernels.platform.machine() != "x86_64", reason="the x86-64 builds")
def test_without_avx512_the_platforms_load_the_avx2_build(monkeypatch, imports):
    from vllm_npu._platform import NpuPlatform
    from vllm_npu.mblt.platform import MbltPlatform

    _report(monkeypatch, avx2=True, avx512=False, bf16=False)
    MbltPlatform.import_kernels()
    NpuPlatform.import_kernels()
    assert imports == ["vllm._C_AVX2", "vllm._C_AVX2"]


@pytest.mark.skipif(cpu_kernels.platform.machine() != "x86_64", reason="the x86-64 builds")
def test_avx512_without_bf16_loads_the_avx512_build(monkeypatch, imports):
    _report(monkeypatch, avx2=True, avx512=True, bf16=False)
    assert cpu_kernels.load_vllm_cpu_kernels() == "vllm._C_AVX512"
    assert imports == ["vllm._C_AVX512"]


@pytest.mark.skipif(cpu_kernels.platform.machine() != "x86_64", reason="the x86-64 builds")
def test_without_avx2_nothing_is_loaded_and_a_warning_says_why(monkeypatch, imports, caplog):
    _report(monkeypatch, avx2=False, avx512=False, bf16=False)
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_npu"):
        assert cpu_kernels.load_vllm_cpu_kernels() is None
    assert imports == []
    assert "this x86-64 CPU has no AVX2" in caplog.text and "vllm._C_AVX2" in caplog.text


def test_loaded_but_no_init_is_not_an_error(monkeypatch, caplog):
    """``_C_AVX2.abi3.so`` loads (its ops register) but has no ``PyInit__C_AVX2``: vLLM's text
    for that is ignored; any other ImportError is logged."""
    def fail(name):
        raise ImportError(f"{cpu_kernels.LOADED_BUT_NO_INIT} (PyInit__C_AVX2)")

    monkeypatch.setattr(cpu_kernels.importlib, "import_module", fail)
    isa = _isa(True, False, False)
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_npu"):
        assert cpu_kernels.load_vllm_cpu_kernels(isa) == "vllm._C_AVX2"
    assert caplog.text == ""

    def missing(name):
        raise ImportError("libfoo.so: cannot open shared object file")

    monkeypatch.setattr(cpu_kernels.importlib, "import_module", missing)
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_npu"):
        cpu_kernels.load_vllm_cpu_kernels(isa)
    assert "Failed to import from vllm._C_AVX2" in caplog.text and "libfoo.so" in caplog.text


def test_loaded_kernels_are_read_from_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    site = "/venv/lib/python3.11/site-packages"
    maps.write_text(
        f"7f00-7f01 r-xp 0 08:01 1 {site}/vllm/_C_AVX2.abi3.so\n"
        f"7f01-7f02 r--p 0 08:01 1 {site}/vllm/_C_AVX2.abi3.so\n"
        f"7f02-7f03 r-xp 0 08:01 2 {site}/vllm/fs_io_C.abi3.so\n"
        f"7f03-7f04 r-xp 0 08:01 3 {site}/torch/lib/libtorch_cpu.so\n"
    )
    assert cpu_kernels.loaded_vllm_kernels(maps) == ["vllm._C_AVX2"]
    assert cpu_kernels.loaded_vllm_kernels(tmp_path / "absent") == []


def test_this_host_answers_as_vllms_cpu_platform_would():
    isa = cpu_kernels.host_isa()
    if not isa.is_x86:
        assert cpu_kernels.vllm_kernel_build(isa) == "vllm._C"
        return
    expected = ("vllm._C" if torch.cpu._is_avx512_bf16_supported() else "vllm._C_AVX512") \
        if torch.cpu._is_avx512_supported() else "vllm._C_AVX2"
    assert cpu_kernels.vllm_kernel_build(isa) == expected
