"""vllm_npu.settings: the plugins' one reader of switches, integers and JSON, and the readers that
moved onto it (each device keeps its exception class; the words and messages are one)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_npu import settings as S

PLUGINS = Path(S.__file__).resolve().parent
ALL_WORDS = "1, true, yes, on (on) or 0, false, no, off (off)"
RBLN_WORDS = "1, true (on) or 0, false (off)"


class DeviceError(ValueError):
    pass


@pytest.mark.parametrize("value, expected", [
    (True, True), (False, False), (1, True), (0, False),
    ("1", True), ("true", True), (" YES ", True), ("On", True),
    ("0", False), ("False", False), ("no", False), ("OFF\n", False)])
def test_every_spelling_has_one_meaning(value, expected):
    assert S.parse_switch(value, name="X") is expected


@pytest.mark.parametrize("value", ["", " ", "2", "-1", "enabled", "y", "n", "t", 2, 1.0, None, [], {}])
def test_any_other_value_is_refused_by_name_with_the_words(value):
    with pytest.raises(DeviceError) as err:
        S.parse_switch(value, name="NPU_X", error=DeviceError)
    assert str(err.value) == f"NPU_X={value!r} is not a switch: expected {ALL_WORDS}"


@pytest.mark.parametrize("value, expected", [("1", True), ("TRUE", True), ("0", False), (" false ", False)])
def test_rbln_words_are_the_ones_vllm_rbln_reads_alike(value, expected):
    assert S.parse_switch(value, name="VLLM_RBLN_X", words=S.RBLN_ENV_WORDS) is expected


@pytest.mark.parametrize("value", ["yes", "on", "no", "off"])
def test_rbln_words_refuse_what_vllm_rbln_reads_as_off(value):
    with pytest.raises(S.SettingError) as err:
        S.parse_switch(value, name="VLLM_RBLN_X", words=S.RBLN_ENV_WORDS)
    assert str(err.value) == f"VLLM_RBLN_X={value!r} is not a switch: expected {RBLN_WORDS}"


def test_switch_words_can_only_narrow():
    with pytest.raises(ValueError, match="non-empty subsets"):
        S.SwitchWords(on=("1", "enabled"))
    with pytest.raises(ValueError, match="non-empty subsets"):
        S.SwitchWords(off=())


@pytest.mark.parametrize("environ, expected", [({}, "dflt"), ({"V": ""}, "dflt"), ({"V": "  "}, "dflt"),
                                               ({"V": "on"}, True), ({"V": "0"}, False)])
def test_env_switch_takes_the_default_only_when_unset_or_blank(environ, expected):
    assert S.env_switch("V", default="dflt", environ=environ) == expected


def test_env_switch_reads_os_environ_at_each_call(monkeypatch):
    monkeypatch.setenv("NPU_TEST_SWITCH", "yes")
    assert S.env_switch("NPU_TEST_SWITCH", default=False) is True
    monkeypatch.setenv("NPU_TEST_SWITCH", "maybe")
    with pytest.raises(S.SettingError, match="NPU_TEST_SWITCH='maybe' is not a switch"):
        S.env_switch("NPU_TEST_SWITCH", default=False)


@pytest.mark.parametrize("value, expected", [(3, 3), ("3", 3), (" 42 ", 42), ("-2", -2), (0, 0)])
def test_integers(value, expected):
    assert S.parse_int(value, name="N") == expected


@pytest.mark.parametrize("value, kwargs, message", [
    (True, {}, "N=True must be an integer (an int or a decimal digit string)"),
    (1.5, {}, "N=1.5 must be an integer (an int or a decimal digit string)"),
    ("1e3", {}, "N='1e3' must be an integer (an int or a decimal digit string)"),
    ("+3", {}, "N='+3' must be an integer (an int or a decimal digit string)"),
    ("٣", {}, "N='٣' must be an integer (an int or a decimal digit string)"),  # a non-ASCII digit
    ("0", {"minimum": 1}, "N='0' must be an integer >= 1"),
    (9, {"maximum": 8}, "N=9 must be an integer <= 8"),
    ("zero", {"minimum": 1, "maximum": 256}, "N='zero' must be an integer between 1 and 256 (an int or a "
                                             "decimal digit string)"),
    (257, {"minimum": 1, "maximum": 256}, "N=257 must be an integer between 1 and 256"),
])
def test_bad_integers_are_named_with_their_rule(value, kwargs, message):
    with pytest.raises(DeviceError) as err:
        S.parse_int(value, name="N", error=DeviceError, **kwargs)
    assert str(err.value) == message


def test_env_int():
    assert S.env_int("N", default=None, environ={}) is None
    assert S.env_int("N", default=None, environ={"N": " "}) is None
    assert S.env_int("N", default=None, minimum=1, environ={"N": "7"}) == 7
    with pytest.raises(S.SettingError, match="N='0' must be an integer >= 1"):
        S.env_int("N", default=None, minimum=1, environ={"N": "0"})


def test_json():
    assert S.parse_json('{"a": 1}', name="J", kind=dict) == {"a": 1}
    assert S.env_json("J", default=None, environ={}) is None
    assert S.env_json("J", default=None, kind=list, environ={"J": "[1]"}) == [1]
    with pytest.raises(DeviceError, match=r"^J='\{a' is not valid JSON \("):
        S.parse_json("{a", name="J", error=DeviceError)
    with pytest.raises(DeviceError) as err:
        S.env_json("J", default=None, kind=dict, environ={"J": "[1]"}, error=DeviceError)
    assert str(err.value) == "J='[1]' must be a JSON object, got list"


# --------------------------------------------------------------------------------------------
# the readers that moved onto it


@pytest.mark.parametrize("var, read", [
    ("VLLM_MBLT_ENABLE_SAMPLING_PENALTIES", lambda env: __import__(
        "vllm_npu.mblt.sampling", fromlist=["x"]).penalties_enabled(env)),
    ("VLLM_RBLN_COMPILE_STRICT_MODE", lambda env: __import__(
        "vllm_npu.rbln.vllm_worker", fromlist=["x"]).strict_mode(env)),
    ("NPU_HARNESS_NEURON_PLAN_ONLY", lambda env: __import__(
        "vllm_npu.neuron.plan", fromlist=["x"]).plan_only(env)),
])
def test_an_unknown_word_is_an_error_on_every_device(var, read):
    """Before the one reader, ``maybe`` was on (RBLN strict mode), off (Neuron's plan-only switch)
    or an error (MBLT's penalties), depending on the variable."""
    with pytest.raises(ValueError) as err:
        read({var: "maybe"})
    assert str(err.value).startswith(f"{var}='maybe' is not a switch: expected ")


def test_rbln_strict_mode_refuses_the_words_vllm_rbln_reads_as_off():
    from vllm_npu.rbln.vllm_worker import strict_mode
    assert strict_mode({}) is True and strict_mode({"VLLM_RBLN_COMPILE_STRICT_MODE": "FALSE"}) is False
    with pytest.raises(S.SettingError, match=re.escape(f"='yes' is not a switch: expected {RBLN_WORDS}")):
        strict_mode({"VLLM_RBLN_COMPILE_STRICT_MODE": "yes"})


@pytest.mark.parametrize("var, field", [("NEURON_LIBTORCH_DISABLE_COMPILE_CACHE", "enabled"),
                                        ("VLLM_NEURON_DISABLE_WARMUP_COMPILE", "compile_allowed")])
def test_neuron_compile_cache_switches(var, field, tmp_path):
    from vllm_npu.neuron.compile_cache import CompileCache
    assert getattr(CompileCache.from_env(tmp_path, {}), field) is True
    assert getattr(CompileCache.from_env(tmp_path, {var: "on"}), field) is False
    assert getattr(CompileCache.from_env(tmp_path, {var: "0"}), field) is True
    with pytest.raises(S.SettingError, match=f"{var}='disable' is not a switch"):
        CompileCache.from_env(tmp_path, {var: "disable"})  # was read as "not disabled"


def test_mblt_recorded_engine_args_refuse_a_hand_set_non_object():
    from vllm_npu.mblt.engine_args import USER_ARGS_ENV, captured
    assert captured({}) is None
    assert captured({USER_ARGS_ENV: '{"max_num_seqs": 4}'})["max_num_seqs"] == 4
    with pytest.raises(S.SettingError, match=f"{USER_ARGS_ENV}='not json' is not valid JSON"):
        captured({USER_ARGS_ENV: "not json"})  # was read as "nothing recorded"


def test_no_plugin_parses_a_switch_word_itself():
    """The words live in vllm_npu.settings alone: a second tuple of them elsewhere in plugins/
    is a second reader with its own meaning (this pattern finds all eight readers of f884247)."""
    word_set = re.compile(r"""["'](?:true|yes|on)["']\s*,\s*["'](?:1|true|yes|on)["']|"""
                          r"""["'](?:false|no)["']\s*,\s*["'](?:0|false|no|off)["']|"""
                          r"""\(\s*["'](?:true|1)["']\s*,\s*["'](?:1|true)["']\s*\)""", re.IGNORECASE)
    offenders = [f"{p.relative_to(PLUGINS.parent)}:{n}" for p in sorted(PLUGINS.rglob("*.py")) if p.name != "settings.py"
                 or p.parent != PLUGINS for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
                 if word_set.search(line) and not line.lstrip().startswith("#")]
    assert offenders == []
