"""The simulators' one reader of their ``NPUSIM_*`` settings (stdlib only).

Every simulator takes its machine settings from one environment variable holding a JSON object
(``NPUSIM_MXQ``, ``NPUSIM_RBLN``, ``NPUSIM_NEFF``, ``NPUSIM_Q4X32``). This module reads it the same
way for all four:

- unset or blank: no settings (``{}``);
- not JSON, not an object, or an unknown key: an error naming the variable, the value (or the
  unknown keys) and what is accepted;
- parsed once per distinct value (:class:`EnvParseCache`): a test that changes the variable gets
  the new settings, a process that never changes it parses once.

Each simulator keeps its own exception class (``error=``) and checks its own fields' values.

The fault schedule ``{"after_calls": N, "times": k}`` (:class:`FaultSchedule`) is the one
``NPUSIM_RBLN`` and ``NPUSIM_NEFF`` take under ``fault``: device calls ``N+1 .. N+k`` fail,
``times`` null = every call from ``N+1`` on. (``NPUSIM_MXQ`` counts differently, successful
infers then failures, under its own ``infer_fail_*`` fields, as documented in
:mod:`npusim.mxq.machine`.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["EnvParseCache", "FaultSchedule", "check_keys", "is_int", "json_object", "parse_fault"]

_T = TypeVar("_T")
_K = TypeVar("_K")


def check_keys(source: str, values: Mapping[str, Any], known: Iterable[str], *,
               error: type[Exception] = ValueError) -> None:
    """Refuse keys of ``values`` not in ``known``.

    Raises:
        error: ``"{source}: unknown keys ['x']; known: a, b"`` (sorted).
    """
    known = list(known)
    unknown = sorted((k for k in values if k not in known), key=str)
    if unknown:
        raise error(f"{source}: unknown keys {unknown}; known: {', '.join(sorted(known))}")


def json_object(var: str, raw: str | None, *, known: Iterable[str],
                error: type[Exception] = ValueError) -> dict[str, Any]:
    """One value of environment variable ``var``: a JSON object of ``known`` keys (``{}`` when
    ``raw`` is None or blank). The values are the caller's to check.

    Raises:
        error: not valid JSON, not an object, or an unknown key; the message names ``var`` and
            the value or keys.
    """
    if raw is None or not raw.strip():
        return {}
    try:
        values = json.loads(raw)
    except ValueError as exc:
        raise error(f"{var}={raw!r} is not valid JSON ({exc})") from None
    if not isinstance(values, dict):
        raise error(f"{var}={raw!r} must be a JSON object, got {type(values).__name__}")
    check_keys(var, values, known, error=error)
    return values


@dataclass(frozen=True)
class FaultSchedule:
    """Device calls ``after_calls + 1 .. after_calls + times`` fail (1-based, counted by the
    simulator per process); ``times`` None: every call from ``after_calls + 1`` on."""

    after_calls: int = 0
    times: int | None = 1

    def strikes(self, call: int) -> bool:
        """Whether call number ``call`` (1-based) is an injected failure."""
        return call > self.after_calls and (self.times is None or call <= self.after_calls + self.times)


def is_int(v: object) -> bool:
    """Whether ``v`` is a JSON integer (an int, not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool)


def parse_fault(value: object, *, source: str, error: type[Exception] = ValueError) -> FaultSchedule | None:
    """``{"after_calls": N >= 0, "times": k >= 1 | null}`` (both optional: 0 and 1) as a
    :class:`FaultSchedule`; None stays None.

    Raises:
        error: another shape or value; the message names ``source`` (e.g. ``NPUSIM_RBLN: fault``)
            and the value.
    """
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"after_calls", "times"}:
        raise error(f'{source} must be {{"after_calls": N, "times": k|null}}, got {value!r}')
    after, times = value.get("after_calls", 0), value.get("times", 1)
    if not is_int(after) or after < 0:
        raise error(f"{source}.after_calls must be an integer >= 0, got {after!r}")
    if times is not None and (not is_int(times) or times < 1):
        raise error(f"{source}.times must be an integer >= 1 or null, got {times!r}")
    return FaultSchedule(after, times)


class EnvParseCache(Generic[_K, _T]):
    """The last parse of an environment-derived key: ``get(key)`` parses only when ``key`` differs
    from the previous call's (a failed parse is not kept: it raises again at the next call)."""

    def __init__(self, parse: Callable[[_K], _T]) -> None:
        self._parse = parse
        self._last: tuple[_K, _T] | None = None

    def get(self, key: _K) -> _T:
        """The parse of ``key`` (cached while the key stays the same).

        Raises:
            Whatever ``parse`` raises for a malformed value.
        """
        last = self._last
        if last is not None and last[0] == key:
            return last[1]
        value = self._parse(key)
        self._last = (key, value)
        return value

    def forget(self) -> None:
        """Parse again at the next :meth:`get`."""
        self._last = None

