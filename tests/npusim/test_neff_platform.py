"""npusim.neff device model: target, LNC, cores, HBM, $NPUSIM_NEFF parsing, visible cores."""

from __future__ import annotations

import json

import pytest

from npusim.env_settings import FaultSchedule

import npusim.neff as nrt
from npusim.neff import config

pytestmark = pytest.mark.usefixtures("neff_env")

GIB = 2**30


def test_versions():
    assert nrt.__version__ == "0.1.0"
    assert nrt.COMPILER_VERSION.startswith("2.") and "npusim" in nrt.COMPILER_VERSION


def test_defaults_trn2_lnc2():
    assert nrt.get_platform_target() == "trn2"
    assert nrt.logical_nc_config() == 2
    info = nrt.device_info()
    assert info == nrt.DeviceInfo("trn2", 1, 8, 2, 4, 24 * GIB, 240.0, False)
    assert nrt.get_nc_count() == 4
    assert nrt.get_total_available_memory() == 24.0
    assert nrt.get_vnc_memory_stats(0) == (0, 24 * GIB)


@pytest.mark.parametrize("plat,lnc,cores,gib,fp8,mx", [
    ("trn2", "1", 8, 12, 240.0, False), ("trn3", "2", 4, 36, 448.0, True),
    ("trn3", "1", 8, 18, 448.0, True), ("trn3pre", "2", 4, 36, 448.0, True)])
def test_targets_and_lnc(monkeypatch, plat, lnc, cores, gib, fp8, mx):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", plat)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", lnc)
    info = nrt.device_info()
    assert (info.target, info.lnc, info.logical_cores, info.hbm_bytes_per_logical_core) == (plat, int(lnc), cores, gib * GIB)
    assert (info.fp8_e4m3_max, info.supports_mxfp4) == (fp8, mx)
    assert nrt.get_total_available_memory() == gib


def test_override_wins_over_npusim_neff(monkeypatch):
    monkeypatch.setenv("NPUSIM_NEFF", json.dumps({"target": "trn3", "chips": 16}))
    assert nrt.get_platform_target() == "trn3"
    assert nrt.device_info().logical_cores == 64 and nrt.get_nc_count() == 64
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    assert nrt.get_platform_target() == "trn2"


def test_bad_target(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "inf2")
    with pytest.raises(nrt.NeffTargetError, match=r"'inf2'.*trn2, trn3, trn3pre"):
        nrt.get_platform_target()
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE")
    monkeypatch.setenv("NPUSIM_NEFF", '{"target": "trn1"}')
    with pytest.raises(nrt.NeffConfigError, match="target.*'trn1'"):
        nrt.get_platform_target()


def test_bad_lnc(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "4")
    with pytest.raises(nrt.NeffConfigError, match="NEURON_LOGICAL_NC_CONFIG must be 1 or 2, got '4'"):
        nrt.logical_nc_config()


def test_hbm_override(monkeypatch):
    monkeypatch.setenv("NPUSIM_NEFF", json.dumps({"hbm_gib_per_core": 0.5}))
    assert nrt.device_info().hbm_bytes_per_logical_core == GIB // 2
    assert nrt.get_total_available_memory() == 0.5


@pytest.mark.parametrize("raw,match", [
    ("not json", "not valid JSON"), ("[1]", "JSON object"), ('{"colour": 1}', r"unknown keys \['colour'\]"),
    ('{"chips": 0}', "chips"), ('{"hbm_gib_per_core": -1}', "hbm_gib_per_core"),
    ('{"check_padding": 1}', "check_padding"), ('{"fault": {"after": 1}}', "fault"),
    ('{"fault": {"after_calls": -1}}', "after_calls"), ('{"fault": {"times": 0}}', "times")])
def test_npusim_neff_rejects(raw, match):
    with pytest.raises(nrt.NeffConfigError, match=match):
        config.parse(raw)


def test_npusim_neff_parse_cached(monkeypatch):
    monkeypatch.setenv("NPUSIM_NEFF", '{"fault": {"after_calls": 2, "times": null}}')
    s = config.settings()
    assert s is config.settings()
    assert s.fault == FaultSchedule(2, None) and s.fault.strikes(3) and s.fault.strikes(99) and not s.fault.strikes(2)
    assert FaultSchedule(1, 2).strikes(3) and not FaultSchedule(1, 2).strikes(4)


def test_configure_visible_cores(monkeypatch):
    nrt.configure([0, 1, 2])
    import os
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "0-2" and nrt.get_nc_count() == 3
    nrt.configure([1, 3])
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "1,3" and nrt.get_nc_count() == 2
    with pytest.raises(nrt.NrtError, match=r"NRT_LOAD_NOT_ENOUGH_NC\(9\)"):
        nrt.configure("2-7")
    assert os.environ["NEURON_RT_VISIBLE_CORES"] == "1,3"
    nrt.configure(None)
    assert "NEURON_RT_VISIBLE_CORES" not in os.environ and nrt.get_nc_count() == 4
    with pytest.raises(nrt.NrtError, match="logical core 4 is not available"):
        nrt.get_vnc_memory_stats(4)


def test_error_hierarchy():
    for cls in (nrt.NrtpyError, nrt.NrtError, nrt.NeffRecompileError, nrt.NeffCompileError):
        assert issubclass(cls, RuntimeError)
    assert issubclass(nrt.NeffFileError, nrt.NrtError) and issubclass(nrt.NeffTargetError, nrt.NrtError)
