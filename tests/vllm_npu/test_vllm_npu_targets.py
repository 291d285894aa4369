"""NPU_HARNESS_TARGET parsing and which platform plugin it activates."""

from __future__ import annotations

import pytest

from vllm_npu import mblt, neuron, rbln
from vllm_npu.targets import (
    TARGET_NAMES,
    UnknownTargetError,
    invalid_target_platform,
    platform_for,
    selected_target,
)


def test_unset_or_empty_selects_nothing():
    assert selected_target({}) is None
    assert selected_target({"NPU_HARNESS_TARGET": "  "}) is None


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_every_target_name_is_accepted(name):
    assert selected_target({"NPU_HARNESS_TARGET": name}) == name


def test_invalid_value_names_itself_and_the_choices():
    with pytest.raises(UnknownTargetError, match=r"NPU_HARNESS_TARGET='sim' is not a target; "
                                                 r"expected one of: mblt-sim, mblt-hw"):
        selected_target({"NPU_HARNESS_TARGET": "sim"})


@pytest.mark.parametrize(
    ("value", "active"),
    [("mblt-sim", "mblt"), ("mblt-hw", "mblt"), ("rbln-sim", "rbln"), ("rbln-hw", "rbln"),
     ("neuron-sim", "neuron"), ("neuron-hw", "neuron"), ("ime2-qemu", None), ("", None)],
)
def test_exactly_the_matching_device_plugin_activates(monkeypatch, value, active):
    monkeypatch.setenv("NPU_HARNESS_TARGET", value)
    got = {name: mod.register() for name, mod in
           (("mblt", mblt), ("rbln", rbln), ("neuron", neuron))}
    assert [n for n, q in got.items() if q] == ([active] if active else [])
    assert invalid_target_platform() is None


def test_an_invalid_value_activates_only_the_error_reporting_plugin():
    env = {"NPU_HARNESS_TARGET": "mblt"}
    assert platform_for("mblt", "x.Y", env) is None
    assert invalid_target_platform(env) == "vllm_npu._invalid_target.InvalidTargetPlatform"
