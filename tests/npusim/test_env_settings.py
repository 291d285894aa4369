"""npusim.env_settings: the simulators' one reader of ``NPUSIM_*`` JSON settings and fault
schedules, and the four simulators that read through it (same words, same messages)."""

from __future__ import annotations

import pytest

from npusim import env_settings as E


class SimError(ValueError):
    pass


@pytest.mark.parametrize("raw", [None, "", "  \n"])
def test_unset_or_blank_is_no_settings(raw):
    assert E.json_object("NPUSIM_X", raw, known=("a",)) == {}


@pytest.mark.parametrize("raw, message", [
    ("{bad", "NPUSIM_X='{bad' is not valid JSON ("),
    ("[1]", "NPUSIM_X='[1]' must be a JSON object, got list"),
    ('"a"', "NPUSIM_X='\"a\"' must be a JSON object, got str"),
    ('{"b": 1, "a": 2, "c": 3}', "NPUSIM_X: unknown keys ['b', 'c']; known: a"),
])
def test_malformed_values_are_named(raw, message):
    with pytest.raises(SimError) as err:
        E.json_object("NPUSIM_X", raw, known=("a",), error=SimError)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("value, expected", [
    (None, None), ({}, E.FaultSchedule(0, 1)), ({"after_calls": 3}, E.FaultSchedule(3, 1)),
    ({"after_calls": 2, "times": None}, E.FaultSchedule(2, None))])
def test_fault_schedules(value, expected):
    assert E.parse_fault(value, source="NPUSIM_X: fault") == expected


def test_a_schedule_strikes_the_calls_it_names():
    once, always = E.FaultSchedule(2, 1), E.FaultSchedule(2, None)
    assert [c for c in range(1, 8) if once.strikes(c)] == [3]
    assert [c for c in range(1, 8) if always.strikes(c)] == [3, 4, 5, 6, 7]
    assert [c for c in range(1, 8) if E.FaultSchedule(0, 2).strikes(c)] == [1, 2]


@pytest.mark.parametrize("value, message", [
    ([1], 'NPUSIM_X: fault must be {"after_calls": N, "times": k|null}, got [1]'),
    ({"after": 1}, 'NPUSIM_X: fault must be {"after_calls": N, "times": k|null}, got {\'after\': 1}'),
    ({"after_calls": -1}, "NPUSIM_X: fault.after_calls must be an integer >= 0, got -1"),
    ({"after_calls": True}, "NPUSIM_X: fault.after_calls must be an integer >= 0, got True"),
    ({"times": 0}, "NPUSIM_X: fault.times must be an integer >= 1 or null, got 0"),
])
def test_bad_fault_schedules_are_named(value, message):
    with pytest.raises(SimError) as err:
        E.parse_fault(value, source="NPUSIM_X: fault", error=SimError)
    assert str(err.value) == message


def test_the_cache_parses_once_per_distinct_value_and_keeps_no_failure():
    seen: list[str] = []

    def parse(raw: str) -> int:
        seen.append(raw)
        if raw == "bad":
            raise SimError(raw)
        return len(raw)

    cache = E.EnvParseCache(parse)
    assert [cache.get("ab"), cache.get("ab"), cache.get("abc"), cache.get("ab")] == [2, 2, 3, 2]
    assert seen == ["ab", "abc", "ab"]
    for _ in range(2):
        with pytest.raises(SimError):
            cache.get("bad")
    assert seen[-2:] == ["bad", "bad"]
    cache.forget()
    cache.get("ab")
    assert seen[-1] == "ab"


# --------------------------------------------------------------------------------------------
# the four simulators read through it


@pytest.mark.parametrize("var, read", [
    ("NPUSIM_NEFF", lambda: __import__("npusim.neff.config", fromlist=["x"]).settings()),
    ("NPUSIM_RBLN", lambda: __import__("npusim.rbln.parts", fromlist=["x"]).settings()),
    ("NPUSIM_MXQ", lambda: __import__("npusim.mxq.machine", fromlist=["x"]).settings()),
    ("NPUSIM_Q4X32", lambda: __import__("npusim.q4x32.options", fromlist=["x"]).get_defaults()),
])
@pytest.mark.parametrize("raw, start", [("{bad", "='{bad' is not valid JSON ("),
                                        ("[1]", "='[1]' must be a JSON object, got list"),
                                        ('{"nope": 1}', ": unknown keys ['nope']; known: ")])
def test_every_simulator_refuses_a_malformed_variable_alike(monkeypatch, var, read, raw, start):
    if var == "NPUSIM_RBLN":
        pytest.importorskip("torch")  # npusim.rbln's package imports torch (rebel is a torch compiler)
    monkeypatch.setenv(var, raw)
    with pytest.raises(ValueError) as err:
        read()
    assert str(err.value).startswith(var + start)


@pytest.mark.parametrize("module, var", [("npusim.neff.config", "NPUSIM_NEFF"), ("npusim.rbln.parts", "NPUSIM_RBLN")])
def test_neff_and_rbln_take_one_fault_schedule(monkeypatch, module, var):
    if var == "NPUSIM_RBLN":
        pytest.importorskip("torch")
    mod = __import__(module, fromlist=["x"])
    monkeypatch.setenv(var, '{"fault": {"after_calls": 4, "times": null}}')
    assert mod.settings().fault == E.FaultSchedule(4, None)
    monkeypatch.setenv(var, '{"fault": {"after_calls": 4, "times": 0}}')
    with pytest.raises(ValueError, match=rf"^{var}: fault.times must be an integer >= 1 or null, got 0$"):
        mod.settings()
