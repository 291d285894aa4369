"""``$NPUSIM_NEFF``: the simulator's settings, a JSON object (stdlib only).

Keys (all optional):

===================  ==========================================================================
``target``           platform target when ``$NEURON_PLATFORM_TARGET_OVERRIDE`` is unset
                     (``"trn2"``, ``"trn3"``, ``"trn3pre"``; default ``"trn2"``)
``chips``            Trainium chips of the simulated instance (int >= 1, default 1)
``hbm_gib_per_core`` HBM per logical core in GiB (number > 0), overriding the part's (for tests)
``check_padding``    bool: re-run the real rows of every call alone and compare (slow)
``fault``            ``{"after_calls": N, "times": k}``: NEFF executions ``N+1 .. N+k`` of the
                     runtime fail with ``NRT_FAILURE``; ``times`` null = every call from ``N+1``
===================  ==========================================================================

The variable is parsed once per distinct value (the parse is cached on the raw string, so a test
that changes the variable gets the new settings; a process that never changes it parses once).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..env_settings import EnvParseCache, FaultSchedule, is_int, json_object, parse_fault
from .errors import NeffConfigError

__all__ = ["ENV_VAR", "TARGETS", "Settings", "settings", "parse"]

ENV_VAR = "NPUSIM_NEFF"
TARGETS = ("trn2", "trn3", "trn3pre")
_KNOWN = ("target", "chips", "hbm_gib_per_core", "check_padding", "fault")


@dataclass(frozen=True)
class Settings:
    """Parsed ``$NPUSIM_NEFF`` (defaults when unset)."""

    target: str | None = None
    chips: int = 1
    hbm_gib_per_core: float | None = None
    check_padding: bool = False
    fault: FaultSchedule | None = None


def parse(raw: str | None) -> Settings:
    """Parse one value of ``$NPUSIM_NEFF`` (None or blank: defaults).

    Raises:
        NeffConfigError: not JSON, not an object, an unknown key, or a bad value (named).
    """
    values = json_object(ENV_VAR, raw, known=_KNOWN, error=NeffConfigError)
    target = values.get("target")
    if target is not None and target not in TARGETS:
        raise NeffConfigError(f"{ENV_VAR}: target must be one of {list(TARGETS)}, got {target!r}")
    chips = values.get("chips", 1)
    if not is_int(chips) or chips < 1:
        raise NeffConfigError(f"{ENV_VAR}: chips must be an integer >= 1, got {chips!r}")
    hbm = values.get("hbm_gib_per_core")
    if hbm is not None and (isinstance(hbm, bool) or not isinstance(hbm, (int, float)) or not hbm > 0):
        raise NeffConfigError(f"{ENV_VAR}: hbm_gib_per_core must be a number > 0 (GiB), got {hbm!r}")
    check = values.get("check_padding", False)
    if not isinstance(check, bool):
        raise NeffConfigError(f"{ENV_VAR}: check_padding must be true or false, got {check!r}")
    fault = parse_fault(values.get("fault"), source=f"{ENV_VAR}: fault", error=NeffConfigError)
    return Settings(target, chips, None if hbm is None else float(hbm), check, fault)


_cache: EnvParseCache[str | None, Settings] = EnvParseCache(parse)


def settings() -> Settings:
    """The settings of the current ``$NPUSIM_NEFF`` (parsed once per distinct value).

    Raises:
        NeffConfigError: the variable is malformed.
    """
    return _cache.get(os.environ.get(ENV_VAR))
