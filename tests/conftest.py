"""Test-suite wiring: pytester (for testing the conformance plugin in throwaway projects) and
the Hypothesis profiles."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

pytest_plugins = ["pytester"]

# Property tests: no per-example deadline (the machine is noisy). With CI set, Hypothesis's
# "ci" profile (derandomized: the same examples every run) is used with these bounds; local
# runs explore new examples each time.
_BOUNDS = dict(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", settings.get_profile("ci"), **_BOUNDS)
settings.register_profile("dev", **_BOUNDS)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
