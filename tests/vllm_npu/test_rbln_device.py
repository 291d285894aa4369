"""vllm_npu.rbln.device: NPU name lookup, family and family defaults (rbln.md §2)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_npu.rbln import device as D

NO_NPU_MESSAGE = (
    "Could not determine the RBLN NPU name (rebel.get_npu_name({id}) returned None). On a host "
    "without an NPU mounted (e.g., a CPU-only compile worker running with "
    "VLLM_RBLN_COMPILE_ONLY=1), set RBLN_FORCE_NPU_NAME to the target NPU (e.g., RBLN-CA25) so "
    "compilation can target it.")


def fake_rebel(names: dict[int, str | None]):
    calls: list[int] = []

    def get_npu_name(device_id):
        calls.append(device_id)
        return names.get(device_id)

    return SimpleNamespace(get_npu_name=get_npu_name, calls=calls)


def test_rebel_name_comes_first():
    rebel = fake_rebel({0: "RBLN-CA25", 2: "RBLN-CR13"})
    env = {"RBLN_FORCE_NPU_NAME": "RBLN-CR03", "RBLN_TARGET_SOC": "RBLN-CR23"}
    assert D.device_name(rebel, environ=env) == "RBLN-CA25"
    assert D.device_name(rebel, 2, environ=env) == "RBLN-CR13"
    assert rebel.calls == [0, 2]


@pytest.mark.parametrize(("env", "expected"), [
    ({"RBLN_FORCE_NPU_NAME": "RBLN-CR03", "RBLN_TARGET_SOC": "RBLN-CR23"}, "RBLN-CR03"),
    ({"RBLN_FORCE_NPU_NAME": "", "RBLN_TARGET_SOC": "RBLN-CR23"}, "RBLN-CR23"),
    ({"RBLN_TARGET_SOC": "RBLN-CA22"}, "RBLN-CA22"),
])
def test_environment_names_the_npu_when_rebel_does_not(env, expected):
    for missing in (None, ""):
        assert D.device_name(fake_rebel({0: missing}), environ=env) == expected


@pytest.mark.parametrize("device_id", [0, 3])
def test_no_name_anywhere_is_a_runtime_error(device_id):
    with pytest.raises(D.NpuNameUnavailableError) as err:
        D.device_name(fake_rebel({}), device_id, environ={"RBLN_FORCE_NPU_NAME": ""})
    assert isinstance(err.value, RuntimeError)
    assert str(err.value) == NO_NPU_MESSAGE.format(id=device_id)


def test_default_environment_is_os_environ(monkeypatch):
    monkeypatch.delenv("RBLN_TARGET_SOC", raising=False)
    monkeypatch.setenv("RBLN_FORCE_NPU_NAME", "RBLN-CA25")
    assert D.device_name(fake_rebel({})) == "RBLN-CA25"
    monkeypatch.delenv("RBLN_FORCE_NPU_NAME")
    with pytest.raises(RuntimeError, match=r"rebel\.get_npu_name\(0\) returned None"):
        D.device_name(fake_rebel({}))


@pytest.mark.parametrize(("name", "ca", "cr13", "family", "chunk"), [
    ("RBLN-CA22", True, False, "atom", 128),
    ("RBLN-CA25", True, False, "atom", 128),
    (" rbln-ca02 ", True, False, "atom", 128),
    ("RBLN-CR03", False, False, "rebel100", 512),
    ("RBLN-CR13", False, True, "rebel100", 512),
    ("RBLN-CR23", False, False, "rebel100", 512),
    ("rbln-cr13", False, False, "rebel100", 512),
])
def test_family_of_known_names(name, ca, cr13, family, chunk):
    assert D.is_ca(name) is ca
    assert D.is_cr13(name) is cr13
    assert D.family(name) == family
    assert D.prefill_chunk_size(name) == chunk


@pytest.mark.parametrize("name", ["", "RBLN-X1", "CA25", "NPU-RBLN-CA25", "rebel100"])
def test_unknown_names_are_refused_with_the_vendor_messages(name):
    assert not D.is_ca(name) and not D.is_cr13(name)
    with pytest.raises(D.UnknownDeviceError) as err:
        D.family(name)
    assert str(err.value) == "invalid RBLN architecture, candidates = [ATOM(ca), REBEL(cr)]"
    with pytest.raises(D.UnknownDeviceError) as err:
        D.prefill_chunk_size(name)
    assert str(err.value) == (
        f"Unknown NPU device {name!r}; expected an ATOM (ca) or REBEL (cr) device.")
    # One class, catchable as either of the vendor's exception types.
    assert isinstance(err.value, ValueError) and isinstance(err.value, RuntimeError)


def test_prefill_chunk_table():
    assert dict(D.PREFILL_CHUNK_SIZE_BY_FAMILY) == {"ca": 128, "cr": 512}
