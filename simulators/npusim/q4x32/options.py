"""Named options for the details the public IME2 spec leaves open, their validation, and their
switchable defaults.

The ``.hp`` instructions compute ``vd[p] += (fp16)tmp * scale`` (Zvvm_spacemit v0.6, section 5.4.3)
without saying how many roundings happen, how precise ``(fp16)tmp`` is internally, or what an
fp16 overflow produces (ime2.md, "Open questions"); how the kernel around them orders its
instructions and groups activation rows is the kernel's choice (the fork's is not public). Each
is a named option. The built-in defaults follow the reference's model of the real kernel
(ime2.md section 3.3: ``d16 + fp16(fp16(dot) * sc)``, IEEE overflow to inf; llama.cpp's m1/m4
kernels at 81b0d882).

=========== ================================ ==================================================
option      values (built-in default first)  meaning
=========== ================================ ==================================================
rounding    ``"unfused"``, ``"fused"``       ``unfused``: ``fp16(vd + fp16(t * scale))`` (two
                                             roundings); ``fused``: ``fp16(vd + t * scale)`` (one)
dot         ``"fp16"``, ``"exact"``          ``t = fp16(tmp)`` (RNE) or the exact int32 ``tmp``
overflow    ``"inf"``, ``"saturate"``        an fp16 result beyond 65504 is +/-inf (IEEE) or
                                             clamps to +/-65504
order       ``"hi_lo"``, ``"lo_hi"``         GEMM kernels only: the kernel issues the high-nibble
                                             ``vmadotsu.hp`` before the low-nibble ``vmadotu.hp``
                                             (``hi_lo``, as in ``gemm_kernel_i8i4_hp_m1/m4``)
m4          ``"grouped"``, ``"rowwise"``     GEMM and activation quantization: rows
                                             ``0 .. 4*(M//4)-1`` in 4-row groups sharing their
                                             scales, with the m4 kernel's
                                             ``sc16 = fp16(d * fp16(rel * 16))``, the ``M % 4``
                                             rows after them alone (``grouped``, ggml's
                                             ``ime.cpp``); or every row alone with the m1 rules
                                             (``rowwise``)
=========== ================================ ==================================================

Defaults. Every function taking these options accepts ``None`` (the default) for "the current
default", which is, in order of precedence:

1. :func:`set_defaults` (or the :func:`option_defaults` context manager) in this process;
2. the environment variable ``NPUSIM_Q4X32``: a JSON object, e.g.
   ``NPUSIM_Q4X32='{"rounding": "fused", "overflow": "saturate"}'``;
3. the environment variable ``NPUSIM_Q4X32_ANSWERS``: the path of a board answers file
   (``ime2-board-answers.json``, written by ``npu-harness conformance --target ime2-hw`` into
   its report directory; :func:`load_answers`);
4. the built-in defaults (:data:`BUILTIN_DEFAULTS`).

The environment is read when a default is needed, parsed once per distinct value of the two
variables (and again after :func:`reset_defaults`, which re-reads the answers file), with the
simulators' one reader (:mod:`npusim.env_settings`); a bad value raises :class:`~npusim.q4x32.errors.OptionError` naming the
variable, the key and the value, at that point and at every later use, never silently.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..env_settings import EnvParseCache, check_keys, json_object
from .errors import AnswersError, OptionError

__all__ = [
    "ANSWERS_FILE",
    "ANSWERS_SCHEMA",
    "BUILTIN_DEFAULTS",
    "DOT",
    "ENV_ANSWERS",
    "ENV_DEFAULTS",
    "LEVELS",
    "M4",
    "OPTIONS",
    "ORDERS",
    "OVERFLOW",
    "ROUNDING",
    "HpMode",
    "check_option",
    "get_defaults",
    "load_answers",
    "option_defaults",
    "reset_defaults",
    "resolve",
    "set_defaults",
    "set_defaults_from_answers",
]

Rounding = Literal["unfused", "fused"]
Dot = Literal["fp16", "exact"]
Overflow = Literal["inf", "saturate"]
Order = Literal["hi_lo", "lo_hi"]
M4Rule = Literal["grouped", "rowwise"]
Level = Literal["exact", "hardware"]

ROUNDING: tuple[str, ...] = ("unfused", "fused")
DOT: tuple[str, ...] = ("fp16", "exact")
OVERFLOW: tuple[str, ...] = ("inf", "saturate")
ORDERS: tuple[str, ...] = ("hi_lo", "lo_hi")
M4: tuple[str, ...] = ("grouped", "rowwise")
LEVELS: tuple[str, ...] = ("exact", "hardware")

#: Every option with a switchable default, and its values (built-in default first).
OPTIONS: dict[str, tuple[str, ...]] = {
    "rounding": ROUNDING,
    "dot": DOT,
    "overflow": OVERFLOW,
    "order": ORDERS,
    "m4": M4,
}
#: The defaults when nothing is set (the reference's model of llama.cpp's kernel).
BUILTIN_DEFAULTS: dict[str, str] = {name: values[0] for name, values in OPTIONS.items()}
#: Environment variable: a JSON object of option defaults.
ENV_DEFAULTS = "NPUSIM_Q4X32"
#: Environment variable: the path of a board answers file.
ENV_ANSWERS = "NPUSIM_Q4X32_ANSWERS"
#: File name the ``ime2-hw`` conformance run writes into its report directory.
ANSWERS_FILE = "ime2-board-answers.json"
#: Schema version of the answers file this module reads.
ANSWERS_SCHEMA = 1


def check_option(name: str, value: object, allowed: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``allowed``.

    Raises:
        OptionError: ``value`` is not one of ``allowed``; the message names both.
    """
    if not isinstance(value, str) or value not in allowed:
        raise OptionError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")
    return value


@dataclass(frozen=True)
class HpMode:
    """The open ``.hp`` arithmetic details, validated. See the module docstring for each.

    The field defaults are the built-in ones; :meth:`current` gives the current defaults.
    """

    rounding: Rounding = "unfused"
    dot: Dot = "fp16"
    overflow: Overflow = "inf"

    def __post_init__(self) -> None:
        check_option("rounding", self.rounding, ROUNDING)
        check_option("dot", self.dot, DOT)
        check_option("overflow", self.overflow, OVERFLOW)

    @property
    def saturate(self) -> bool:
        """True when fp16 overflow clamps to +/-65504."""
        return self.overflow == "saturate"

    @classmethod
    def current(cls, rounding: str | None = None, dot: str | None = None, overflow: str | None = None) -> "HpMode":
        """The mode with each ``None`` replaced by the current default.

        Raises:
            OptionError: a bad value, or a bad default in the environment.
        """
        return cls(rounding=resolve("rounding", rounding), dot=resolve("dot", dot),  # type: ignore[arg-type]
                   overflow=resolve("overflow", overflow))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# switchable defaults

_set: dict[str, str] = {}  # set_defaults() in this process


def _validated(options: Mapping[str, object], source: str) -> dict[str, str]:
    """``options`` checked against :data:`OPTIONS`.

    Raises:
        OptionError: an unknown key or a value not allowed for its key; the message names
            ``source``, the key, the value and what is allowed.
    """
    check_keys(source, options, OPTIONS, error=OptionError)
    out: dict[str, str] = {}
    for key, value in options.items():
        try:
            out[key] = check_option(key, value, OPTIONS[key])
        except OptionError as exc:
            raise OptionError(f"{source}: {exc}") from None
    return out


def _parse_environment(key: tuple[str, str | None]) -> dict[str, str]:
    """``(answers path, $NPUSIM_Q4X32)`` -> the defaults they set (the JSON variable wins)."""
    path, text = key
    found: dict[str, str] = {}
    if path:
        found.update(load_answers(path, source=f"{ENV_ANSWERS}={path}"))
    found.update(_validated(json_object(ENV_DEFAULTS, text, known=OPTIONS, error=OptionError), ENV_DEFAULTS))
    return found


_env = EnvParseCache(_parse_environment)


def _environment_defaults() -> dict[str, str]:
    """The defaults from ``NPUSIM_Q4X32_ANSWERS`` then ``NPUSIM_Q4X32`` (which wins), parsed once
    per distinct value of the two.

    Raises:
        OptionError: a bad value in either variable (not cached: raised again at the next use).
        AnswersError: the answers file is unreadable or malformed.
    """
    return _env.get((os.environ.get(ENV_ANSWERS, "").strip(), os.environ.get(ENV_DEFAULTS)))


def get_defaults() -> dict[str, str]:
    """The current default of every option (a new dict: changing it changes nothing).

    Raises:
        OptionError, AnswersError: a bad default in the environment (see the module docstring).
    """
    return {**BUILTIN_DEFAULTS, **_environment_defaults(), **_set}


def resolve(name: str, value: str | None) -> str:
    """``value`` validated, or the current default of option ``name`` when ``value`` is None.

    Raises:
        OptionError: ``name`` is not an option, or ``value`` is not one of its values.
    """
    if name not in OPTIONS:
        raise OptionError(f"unknown npusim.q4x32 option {name!r}; expected one of {', '.join(OPTIONS)}")
    if value is None:
        return get_defaults()[name]
    return check_option(name, value, OPTIONS[name])


def set_defaults(**options: str) -> dict[str, str]:
    """Set the defaults of the named options for this process (others keep theirs).

    Example: ``set_defaults(rounding="fused")`` after a K3 showed fused ``.hp`` rounding.

    Returns:
        The defaults before the call (pass them to :func:`set_defaults` to restore them).

    Raises:
        OptionError: an unknown option or value; nothing is changed then.
    """
    checked = _validated(options, "set_defaults()")
    before = get_defaults()
    _set.update(checked)
    return before


def reset_defaults() -> dict[str, str]:
    """Forget :func:`set_defaults` and re-read the environment at the next use.

    Returns:
        The defaults before the call (best effort: the built-in ones if the environment was bad).
    """
    try:
        before = get_defaults()
    except OptionError:
        before = dict(BUILTIN_DEFAULTS)
    _set.clear()
    _env.forget()
    return before


@contextmanager
def option_defaults(**options: str) -> Iterator[dict[str, str]]:
    """Context manager: the defaults of the named options inside the block, restored after it.

    Yields:
        The defaults in effect inside the block.

    Raises:
        OptionError: an unknown option or value (before the block runs).
    """
    saved = dict(_set)
    set_defaults(**options)
    try:
        yield get_defaults()
    finally:
        _set.clear()
        _set.update(saved)


# ---------------------------------------------------------------------------------------------
# board answers


def _answers_payload(path: Path, source: str) -> dict[str, Any]:
    """The parsed answers file, checked for its schema and its ``answers`` object.

    Raises:
        AnswersError: unreadable, not JSON, wrong schema, or no ``answers`` object.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise AnswersError(f"{source}: cannot read the answers file: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise AnswersError(f"{source}: the answers file is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("schema") != ANSWERS_SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise AnswersError(f"{source}: answers schema {got!r} is not {ANSWERS_SCHEMA}")
    if not isinstance(data.get("answers"), dict):
        raise AnswersError(f"{source}: the answers file has no 'answers' object")
    return data


def load_answers(path: str | os.PathLike[str], *, source: str | None = None) -> dict[str, str]:
    """The option defaults a board answers file settles.

    The file (written by the ``ime2-hw`` conformance scenarios, ``test_ime2_board.py``) is::

        {"schema": 1, "target": "ime2-hw", "answers": {
            "rounding": {"value": "fused", "scenario": "...", ...},
            "layout": {"value": "spec", ...}, ...}}

    Answers whose key is an option (:data:`OPTIONS`) become defaults; the others (``layout``,
    ``qweight_nibbles``, ``subnormals``: facts the simulator does not switch on) are ignored
    here. An option the board answered with ``null`` (none of the modelled values) is an error:
    the simulator cannot follow it.

    Raises:
        AnswersError: the file is unreadable or malformed, an option's answer is ``null`` or not
            an object with a ``value``.
        OptionError: an option's value is not one of its values.
    """
    p = Path(path)
    src = source or str(p)
    answers = _answers_payload(p, src)["answers"]
    found: dict[str, object] = {}
    for key, entry in answers.items():
        if key not in OPTIONS:
            continue
        if not isinstance(entry, dict) or "value" not in entry:
            raise AnswersError(f"{src}: answer {key!r} must be an object with a 'value', got {entry!r}")
        if entry["value"] is None:
            raise AnswersError(f"{src}: the board showed none of {', '.join(OPTIONS[key])} for {key!r} "
                               f"({entry.get('detail', 'no detail')}); npusim.q4x32 cannot model it")
        found[key] = entry["value"]
    return _validated(found, src)


def set_defaults_from_answers(path: str | os.PathLike[str]) -> dict[str, str]:
    """:func:`set_defaults` with the options a board answers file settles (:func:`load_answers`).

    Returns:
        The defaults before the call.

    Raises:
        AnswersError, OptionError: see :func:`load_answers`.
    """
    return set_defaults(**load_answers(path))
