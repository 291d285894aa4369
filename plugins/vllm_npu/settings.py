"""The plugins' one reader of settings: switches, integers and JSON, from the environment and
from configuration (``additional_config``, ``model_loader_extra_config``, ``neuron_config``).

One meaning everywhere:

- a switch is on for ``1 true yes on`` and off for ``0 false no off`` (any case, surrounding
  blanks ignored); a JSON ``true``/``false`` and the integers 1/0 are switches too. Any other
  word is an error naming the setting, the value and the accepted words, never a silent on or
  off. An unset or blank environment variable takes the setting's default.
- A device whose vendor reads a variable more narrowly narrows the accepted words, never widens
  or changes them: vllm-rbln's ``envs.py`` reads ``true``/``1`` (any case) as on and every other
  value as off, so for its variables ``yes`` would be on here and off on the board. They take
  :data:`RBLN_ENV_WORDS` (``1 true`` / ``0 false``) and refuse the rest by name.
- an integer is an int (not a bool) or a decimal digit string, checked against its bounds;
- JSON is parsed with the standard library and must have the expected top-level kind.

Each device passes its own exception class (``error=``), a subclass of :class:`ValueError`, so
its callers keep catching what they caught; the message is the same on every device.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["ON_WORDS", "OFF_WORDS", "RBLN_ENV_WORDS", "SWITCH_WORDS", "SettingError", "SwitchWords",
           "env_int", "env_json", "env_switch", "parse_int", "parse_json", "parse_switch"]

ON_WORDS: tuple[str, ...] = ("1", "true", "yes", "on")
OFF_WORDS: tuple[str, ...] = ("0", "false", "no", "off")

_D = TypeVar("_D")


def _set_value(name: str, environ: Mapping[str, str] | None) -> str | None:
    """Variable ``name`` of ``environ`` (default ``os.environ``); None when unset or blank."""
    raw = (os.environ if environ is None else environ).get(name)
    return None if raw is None or not raw.strip() else raw


class SettingError(ValueError):
    """A setting whose value breaks its rule; the message names the setting, the value and the
    rule (the default ``error=`` of every reader here)."""


@dataclass(frozen=True)
class SwitchWords:
    """The words a switch accepts: ``on`` words read as True, ``off`` words as False (lower
    case; matched case-insensitively). Always a subset of :data:`ON_WORDS` / :data:`OFF_WORDS`.

    Raises:
        ValueError: a word outside those sets, or an empty side (a class bug, at import).
    """

    on: tuple[str, ...] = ON_WORDS
    off: tuple[str, ...] = OFF_WORDS

    def __post_init__(self) -> None:
        if not self.on or not self.off or not set(self.on) <= set(ON_WORDS) or not set(self.off) <= set(OFF_WORDS):
            raise ValueError(f"switch words must be non-empty subsets of {ON_WORDS} / {OFF_WORDS}: {self}")

    def describe(self) -> str:
        """The accepted words as a message fragment: ``1, true, yes, on (on) or 0, ... (off)``."""
        return f"{', '.join(self.on)} (on) or {', '.join(self.off)} (off)"


#: The words every switch accepts unless its device narrows them.
SWITCH_WORDS = SwitchWords()
#: vllm-rbln's ``VLLM_RBLN_*`` variables: its ``envs.py`` reads ``value.lower() in ("true",
#: "1")``, so only these words mean the same there and here.
RBLN_ENV_WORDS = SwitchWords(on=("1", "true"), off=("0", "false"))


def parse_switch(value: object, *, name: str, words: SwitchWords = SWITCH_WORDS,
                 error: type[ValueError] = SettingError) -> bool:
    """A switch: a bool, the ints 1/0, or one of ``words`` (any case, blanks ignored).

    Args:
        value: the raw value (a JSON value or an environment string).
        name: the setting's name for the message (a variable, or a key such as
            ``neuron_config.enable_bucketing``).

    Raises:
        error: any other value (a blank string too); the message names ``name``, the value and
            the accepted words.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in words.on:
            return True
        if word in words.off:
            return False
    raise error(f"{name}={value!r} is not a switch: expected {words.describe()}")


def env_switch(name: str, *, default: _D, environ: Mapping[str, str] | None = None,
               words: SwitchWords = SWITCH_WORDS, error: type[ValueError] = SettingError) -> bool | _D:
    """Environment variable ``name`` as a switch; ``default`` when it is unset or blank.

    Args:
        environ: the environment to read (default ``os.environ``, read at each call).

    Raises:
        error: a value that is not one of ``words`` (see :func:`parse_switch`).
    """
    raw = _set_value(name, environ)
    if raw is None:
        return default
    return parse_switch(raw, name=name, words=words, error=error)


def parse_int(value: object, *, name: str, minimum: int | None = None, maximum: int | None = None,
              error: type[ValueError] = SettingError) -> int:
    """An integer: an int (not a bool) or a decimal digit string (blanks ignored; a leading
    ``-`` allowed), within ``minimum .. maximum`` (each None: unbounded).

    Raises:
        error: a bool, float, other string or type, or a value out of bounds; the message names
            ``name``, the value and the rule.
    """
    parsed: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        parsed = value
    elif isinstance(value, str):
        text = value.strip()
        digits = text[1:] if text.startswith("-") else text
        if digits.isascii() and digits.isdecimal():
            parsed = int(text)
    if minimum is not None and maximum is not None:
        rule = f"an integer between {minimum} and {maximum}"
    elif minimum is not None:
        rule = f"an integer >= {minimum}"
    elif maximum is not None:
        rule = f"an integer <= {maximum}"
    else:
        rule = "an integer"
    if parsed is None:
        raise error(f"{name}={value!r} must be {rule} (an int or a decimal digit string)")
    if (minimum is not None and parsed < minimum) or (maximum is not None and parsed > maximum):
        raise error(f"{name}={value!r} must be {rule}")
    return parsed


def env_int(name: str, *, default: _D, minimum: int | None = None, maximum: int | None = None,
            environ: Mapping[str, str] | None = None, error: type[ValueError] = SettingError) -> int | _D:
    """Environment variable ``name`` as an integer (:func:`parse_int`); ``default`` when it is
    unset or blank.

    Raises:
        error: see :func:`parse_int`.
    """
    raw = _set_value(name, environ)
    if raw is None:
        return default
    return parse_int(raw, name=name, minimum=minimum, maximum=maximum, error=error)


_KINDS: dict[type, str] = {dict: "a JSON object", list: "a JSON array"}


def parse_json(text: str, *, name: str, kind: type | None = None,
               error: type[ValueError] = SettingError) -> Any:
    """``text`` parsed as JSON; with ``kind`` (``dict`` or ``list``), it must be one.

    Raises:
        error: not valid JSON, or not of ``kind``; the message names ``name`` and the text.
    """
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise error(f"{name}={text!r} is not valid JSON ({exc})") from None
    if kind is not None and not isinstance(value, kind):
        raise error(f"{name}={text!r} must be {_KINDS.get(kind, kind.__name__)}, "
                    f"got {type(value).__name__}")
    return value


def env_json(name: str, *, default: _D, kind: type | None = None,
             environ: Mapping[str, str] | None = None, error: type[ValueError] = SettingError) -> Any:
    """Environment variable ``name`` parsed as JSON (:func:`parse_json`); ``default`` when it is
    unset or blank.

    Raises:
        error: see :func:`parse_json`.
    """
    raw = _set_value(name, environ)
    if raw is None:
        return default
    return parse_json(raw, name=name, kind=kind, error=error)
