"""The target registry and its probes."""

from __future__ import annotations

import pytest

from npu_conformance import targets as tg
from vllm_npu.targets import TARGET_NAMES, UnknownTargetError


def test_registry_holds_every_contract_target_in_column_order():
    assert [n for n, t in tg.TARGETS.items() if t.kind != "vendor"] == ["ref", *TARGET_NAMES]
    assert {t.kind for t in tg.TARGETS.values()} == {"reference", "sim", "vendor", "hw"}


def test_vendor_columns_stand_beside_their_simulator_and_only_on_request():
    names = list(tg.TARGETS)
    for name, t in tg.TARGETS.items():
        if t.kind == "vendor":
            assert names.index(name) == names.index(t.base) + 1 and tg.TARGETS[t.base].kind == "sim"
            assert t.device == tg.TARGETS[t.base].device
    assert not any(tg.TARGETS[n].kind == "vendor" for n in tg.expand(["sim"]))
    assert tg.vendor_columns(["sim"]) == ["vllm-mblt@mblt-sim", "vllm-rbln@rbln-sim"]
    assert tg.vendor_columns(["rbln-sim", "neuron-sim"]) == ["vllm-rbln@rbln-sim"]
    assert tg.vendor_columns(["neuron-sim", "rbln-hw"]) == []
    assert tg.expand(["vllm-rbln@rbln-sim"]) == ["vllm-rbln@rbln-sim"]


def test_expand_sim_and_dedupe():
    assert tg.expand(["mblt-hw", "sim", "ref"]) == [
        "ref", "mblt-sim", "mblt-hw", "rbln-sim", "neuron-sim", "ime2-qemu"]


def test_expand_rejects_unknown_names():
    with pytest.raises(UnknownTargetError, match="'rbln'; expected 'sim' or one of"):
        tg.expand(["rbln"])


@pytest.mark.parametrize("name", list(tg.TARGETS))
def test_every_probe_answers_with_a_one_line_reason(name):
    avail = tg.availability(name)
    assert isinstance(avail.available, bool)
    assert avail.reason and "\n" not in avail.reason


def test_mblt_sim_is_available_and_ime2_qemu_names_what_is_missing():
    assert tg.availability("mblt-sim") == tg.Availability(True, "npusim.mxq (qbruntime surface)")
    ime2 = tg.availability("ime2-qemu")
    # Available once qemu-riscv64-static is installed and the riscv64 driver built (the set-up
    # does both, the driver with npu-harness ime2 build-driver). Unavailable names what is missing.
    if ime2.available:
        assert ime2.reason == ("kernels/ime2 riscv64 driver under qemu-riscv64-static "
                               "(portable, RVV and IME2 paths; IME2 .hp emulated on SIGILL)")
    else:
        assert "qemu-riscv64-static" in ime2.reason or "npu-harness ime2 build-driver" in ime2.reason


def test_ime2_qemu_probe_names_what_is_missing(tmp_path, monkeypatch):
    from npu_conformance import qemu_ime2

    monkeypatch.setenv(qemu_ime2.DRIVER_ENV, str(tmp_path / "npu_ime2_driver"))
    monkeypatch.setattr(qemu_ime2.shutil, "which", lambda name: "/usr/bin/" + name)
    avail = tg._probe_ime2_qemu()
    assert not avail.available
    assert str(tmp_path / "npu_ime2_driver") in avail.reason
    assert ("npu-harness ime2 build-driver  (needs clang-19, lld-19 and the riscv64 cross glibc: "
            "sudo apt-get install make clang-19 lld-19 gcc-riscv64-linux-gnu libc6-dev-riscv64-cross)") in avail.reason
    monkeypatch.setattr(qemu_ime2.shutil, "which", lambda name: None)
    avail = tg._probe_ime2_qemu()
    assert not avail.available and avail.reason.startswith("qemu-riscv64-static is not on PATH")


def test_hardware_probes_name_the_failed_import_or_device():
    assert "import qbruntime failed" in tg.availability("mblt-hw").reason
    assert "import rebel failed" in tg.availability("rbln-hw").reason
    assert "/dev/neuron" in tg.availability("neuron-hw").reason


def test_ime2_hw_probe_uses_the_fence_rule(tmp_path, monkeypatch):
    monkeypatch.setattr(tg.platform, "machine", lambda: "riscv64")
    (tmp_path / "cpuinfo").write_text("isa : rv64imafdcv\nuarch : thead,c910\n")
    reason = tg._probe_ime2_hw(str(tmp_path)).reason
    assert reason.startswith("not a SpacemiT K3: ") and "no K3 marker" in reason
    assert "is not readable" in tg._probe_ime2_hw(str(tmp_path / "missing")).reason
    (tmp_path / "cpuinfo").write_text("isa : rv64imafdcv\nuarch : spacemit,x100\n")
    avail = tg._probe_ime2_hw(str(tmp_path))
    assert avail.available and "spacemit,x100" in avail.reason


def test_a_crashing_probe_becomes_a_reason(monkeypatch):
    def boom():
        raise RuntimeError("driver exploded")

    monkeypatch.setitem(tg.TARGETS, "neuron-hw", tg.Target("neuron-hw", "neuron", "hw", "x", boom))
    monkeypatch.setattr(tg, "_cache", {})
    assert tg.availability("neuron-hw") == tg.Availability(
        False, "probe crashed: RuntimeError: driver exploded")
