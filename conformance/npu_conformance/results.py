"""Scenario results: statuses, measured figures, and the fixture scenarios use to record them.

Results travel inside pytest reports (``user_properties``), so they survive pytest-xdist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

PASS = "pass"
FAIL = "fail"
SKIPPED = "skipped"
UNSUPPORTED = "unsupported"
#: A vendor column failed a scenario exactly as :mod:`npu_conformance.vendor_differences`
#: records (the difference is known and explained; passing instead is a failure).
DIFFERS = "differs"
#: Statuses in the order the report lists them.
STATUSES = (PASS, FAIL, DIFFERS, SKIPPED, UNSUPPORTED)

# Keys of the user_properties entries this plugin writes on each test item.
KEY_SCENARIO = "npu_conformance.scenario"
KEY_TARGET = "npu_conformance.target"
KEY_STATUS = "npu_conformance.status"
KEY_FIGURE = "npu_conformance.figure"


@dataclass(frozen=True)
class Figure:
    """One measured number, e.g. ``Figure("max_abs_logit_diff", 3e-6, "")``."""

    name: str
    value: float
    unit: str = ""

    def format(self) -> str:
        v = self.value
        text = f"{v:.3g}" if (abs(v) < 1e-2 or abs(v) >= 1e5) and v != 0 else f"{v:.4g}"
        return f"{self.name}={text}{(' ' + self.unit) if self.unit else ''}"


@dataclass
class ScenarioResult:
    """The outcome of one scenario on one target."""

    scenario: str
    target: str
    status: str
    duration_s: float = 0.0
    message: str = ""
    figures: list[Figure] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "target": self.target,
            "status": self.status,
            "duration_s": round(self.duration_s, 4),
            "message": self.message,
            "figures": {f.name: {"value": f.value, "unit": f.unit} for f in self.figures},
        }


class InvalidFigureError(ValueError):
    """A figure whose name is empty or whose value is not a finite number."""


class Recorder:
    """Handed to a scenario as the ``record`` fixture; figures land in the report.

    Example::

        def test_decode_speed(target, record):
            record.figure("decode_tok_per_s", 812.0, "tok/s")
    """

    def __init__(self, user_properties: list[tuple[str, object]]) -> None:
        self._props = user_properties

    def figure(self, name: str, value: float, unit: str = "") -> None:
        """Record a measured number.

        Raises:
            InvalidFigureError: ``name`` is empty or ``value`` is NaN/inf or not a number.
        """
        if not name:
            raise InvalidFigureError("a figure needs a non-empty name")
        try:
            number = float(value)
        except (TypeError, ValueError) as exc:
            raise InvalidFigureError(f"figure {name!r}: value {value!r} is not a number") from exc
        if not math.isfinite(number):
            raise InvalidFigureError(f"figure {name!r}: value {number} is not finite")
        self._props.append((KEY_FIGURE, (name, number, unit)))
