"""pytest-xdist ``--dist loadfile`` where a work unit of the device labs is one target's
scenarios of one module, handed out longest first.

The device labs (:func:`npu_conformance.fixtures.device_labs`: per target, one set of artifacts
and ``vllm serve`` processes, session-scoped) exist once per xdist worker, and a lab runs one
target's servers at a time. :class:`LabAwareLoadFile` is ``loadfile`` with one change: a lab-using
scenario module (:data:`LAB_SCOPE`) is split by target, so that ``test_mblt_serving.py[mblt-sim]``
and ``test_rbln_serving.py[rbln-sim]`` run on two workers at once while each unit's servers
start once on its worker (:func:`lab_unit`). The device-neutral serving suite joins each
target's device module (:data:`SERVING_SUITE`): both use the lab's standard server. A worker
keeps a target's servers between two units of that target that it runs in a row (the labs stop
them only when the next scenario is of another target), so a unit's ``serving_server`` is
shared with the next unit's when both land on one worker.

xdist's own ``loadgroup`` cannot do this here: it renames ``item._nodeid``, which pytest 9.2's
``Node.nodeid`` no longer reads.

Order: longest first. xdist hands out work units in queue order, by default the units with the
most tests first, so a module of one long test (a ``vllm serve`` under QEMU, a ``vllm bench``
run) can start last and run alone while the other worker idles. When the run's root has
:data:`DURATIONS_FILE` (seconds per work unit, written by ``python -m
npu_conformance.xdist_scheduling JUNIT_XML`` from a ``--junitxml`` report of a whole run), the
queue is ordered by those seconds, longest first (the classic longest-processing-time rule for
two or more workers); a unit the file does not know counts as the file's median. Without the
file the order is xdist's.
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ET
from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from pathlib import Path

from xdist.scheduler import LoadFileScheduling

#: The prefix of every work unit of the lab-using scenario modules (:func:`lab_unit`).
LAB_SCOPE = "npu_conformance/scenarios[device_labs"
SCENARIOS = Path(__file__).resolve().parent / "scenarios"
#: Seconds per work unit of a whole run, relative to the run's root directory.
DURATIONS_FILE = Path("tests") / "durations.json"


def lab_unit(target: str, module: str) -> str:
    """The work unit of lab scenario module ``module`` (``test_serving.py``) on ``target``."""
    return f"{LAB_SCOPE}:{target}:{module.removesuffix('.py')}]"


def target_of(nodeid: str) -> str:
    """The target among a scenario's parameter ids (``test_x[mblt-sim-load_cheap]`` ->
    ``mblt-sim``), or ``""`` when none of its ``-``-separated ids starts one."""
    from npu_conformance.targets import TARGETS

    if "[" not in nodeid:
        return ""
    ids = nodeid[nodeid.index("[") + 1 : nodeid.rindex("]")]
    parts = ids.split("-")
    for i in range(len(parts)):
        for j in range(i + 1, len(parts) + 1):
            if "-".join(parts[i:j]) in TARGETS:
                return "-".join(parts[i:j])
    return ""


#: The device-neutral serving suite: on a target, it joins the unit of that device's own scenario
#: module (``test_<device>_serving.py``), with which it shares the lab's standard server.
SERVING_SUITE = "test_serving.py"


def scope_of(nodeid: str, lab: frozenset[str]) -> str:
    """The work unit of test ``nodeid``: its file, or :func:`lab_unit` (its target and module)
    for a scenario module of this package whose file name is in ``lab``; the serving suite's
    scenarios on a target join that target's device module (:data:`SERVING_SUITE`) when ``lab``
    has one."""
    path = nodeid.split("::", 1)[0]
    parent, _, name = path.rpartition("/")
    if name in lab and parent.endswith("npu_conformance/scenarios"):
        target = target_of(nodeid)
        if name == SERVING_SUITE and target:
            from npu_conformance.targets import TARGETS

            own = f"test_{TARGETS[target].device}_serving.py"
            if own in lab:
                name = own
        return lab_unit(target, name)
    return path


def longest_first(queue: Mapping[str, dict], seconds: Mapping[str, float]) -> OrderedDict:
    """``queue`` (work unit -> its tests) reordered by ``seconds``, longest first; a unit not in
    ``seconds`` counts as their median (0 when empty). Ties keep the queue's order."""
    default = statistics.median(seconds.values()) if seconds else 0.0
    order = sorted(queue, key=lambda unit: -float(seconds.get(unit, default)))
    return OrderedDict((unit, queue[unit]) for unit in order)


def read_durations(path: Path) -> dict[str, float]:
    """The seconds per work unit in ``path``; empty when the file is missing or not a JSON
    object of numbers (the order then stays xdist's: a stale or broken file never fails a run)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def durations_from_junit(junit_xml: Path, lab: frozenset[str] | None = None) -> dict[str, float]:
    """Seconds per work unit of a pytest ``--junitxml`` report (its ``testcase`` times summed by
    :func:`scope_of`, rounded to 0.1 s), sorted by unit.

    Raises:
        ValueError: the report holds no test case with a ``file`` or ``classname``.
    """
    lab = lab_modules() if lab is None else lab
    total: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).iter("testcase"):
        file = case.get("file")
        if not file:
            classname = case.get("classname", "")
            if not classname:
                continue
            parts = classname.split(".")
            while parts and parts[-1][:1].isupper():  # a test class, not a module
                parts.pop()
            file = "/".join(parts) + ".py"
        total[scope_of(f"{file}::{case.get('name', '')}", lab)] += float(case.get("time") or 0.0)
    if not total:
        raise ValueError(f"{junit_xml}: no test case with a file or classname")
    return {unit: round(total[unit], 1) for unit in sorted(total)}


def lab_modules(scenarios: Path = SCENARIOS) -> frozenset[str]:
    """File names of the scenario modules that request the ``device_labs`` fixture."""
    return frozenset(p.name for p in scenarios.glob("test_*.py") if "device_labs" in p.read_text(encoding="utf-8"))


class LabAwareLoadFile(LoadFileScheduling):
    """``loadfile`` scheduling where the lab-using scenario modules are one work unit."""

    _lab_modules: frozenset[str] = lab_modules()
    _ordered: bool = False

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid, self._lab_modules)

    def _assign_work_unit(self, node) -> None:
        if not self._ordered:  # the queue is complete when the first unit is handed out
            self._ordered = True
            seconds = read_durations(Path(self.config.rootpath) / DURATIONS_FILE)
            if seconds:
                self.workqueue = longest_first(self.workqueue, seconds)
        super()._assign_work_unit(node)


def main(argv: list[str]) -> int:
    """``python -m npu_conformance.xdist_scheduling JUNIT_XML [OUT]``: write the seconds per work
    unit of a whole run's ``--junitxml`` report to OUT (default ``tests/durations.json``)."""
    if len(argv) not in (1, 2):
        print(main.__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1]) if len(argv) == 2 else DURATIONS_FILE
    out.write_text(json.dumps(durations_from_junit(Path(argv[0])), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
