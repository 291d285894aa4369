"""pytest-xdist ``--dist loadfile`` that keeps the device labs' scenarios on one worker.

The device labs (:func:`npu_conformance.fixtures.device_labs`: per target, one set of artifacts
and ``vllm serve`` processes, session-scoped) exist once per xdist worker. Under plain
``loadfile`` the serving suite (``test_serving.py``) and each device's own scenario module
(``test_mblt_serving.py``, ...) can land on different workers, and then every target's servers
start twice and both sets stay in memory to the end of the session. :class:`LabAwareLoadFile`
is ``loadfile`` with one change: every scenario module of this package that uses the labs counts
as one file (:data:`LAB_SCOPE`), so each target's servers start once.

xdist's own ``loadgroup`` cannot do this here: it renames ``item._nodeid``, which pytest 9.2's
``Node.nodeid`` no longer reads.
"""

from __future__ import annotations

from pathlib import Path

from xdist.scheduler import LoadFileScheduling

#: The one xdist work unit of every lab-using scenario module.
LAB_SCOPE = "npu_conformance/scenarios[device_labs]"
SCENARIOS = Path(__file__).resolve().parent / "scenarios"


def lab_modules(scenarios: Path = SCENARIOS) -> frozenset[str]:
    """File names of the scenario modules that request the ``device_labs`` fixture."""
    return frozenset(p.name for p in scenarios.glob("test_*.py") if "device_labs" in p.read_text(encoding="utf-8"))


class LabAwareLoadFile(LoadFileScheduling):
    """``loadfile`` scheduling where the lab-using scenario modules are one work unit."""

    _lab_modules: frozenset[str] = lab_modules()

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        parent, _, name = path.rpartition("/")
        if name in self._lab_modules and parent.endswith("npu_conformance/scenarios"):
            return LAB_SCOPE
        return path
