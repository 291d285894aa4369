"""The pytest plugin (entry point ``pytest11``): ``--target``, ``--report``, the ``target``
parametrization of scenarios, availability skips, and report writing.

A scenario is a test function that takes the ``target`` fixture. It is collected once per
selected target. Its ``@pytest.mark.scenario(devices=(...))`` marker says which device
families it applies to; on other targets it is reported as unsupported. Unavailable targets
are skipped with the probe's one-line reason, never silently passed.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from npu_conformance import report as report_mod
from npu_conformance import results as res
from npu_conformance import targets as tg
from npu_conformance.fixtures import LABS_KEY, device_labs, golden_decoder, hf_model, tiny_model_dir  # noqa: F401

_TARGETS_KEY = pytest.StashKey[list[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("npu-harness", "npu-harness conformance targets")
    group.addoption(
        "--target",
        action="append",
        dest="npu_targets",
        metavar="TARGET",
        help=(
            "target to run scenarios on (repeatable): 'sim' (the reference and every "
            f"simulator) or one of {', '.join(tg.TARGETS)}. Default: $NPU_HARNESS_TARGET, else sim."
        ),
    )
    group.addoption(
        "--report",
        dest="npu_report",
        metavar="DIR",
        default=None,
        help="directory for report.json and report.md, written whenever a scenario ran "
        f"(default: <rootdir>/{report_mod.DEFAULT_REPORT_DIR})",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "scenario(devices=None, name=None): a conformance scenario; devices limits the "
        "device families it applies to (None: all); name overrides the report row name",
    )
    names = config.getoption("npu_targets") or tg.env_targets() or [tg.SIM_ALIAS]
    try:
        config.stash[_TARGETS_KEY] = tg.expand(names)
    except tg.UnknownTargetError as exc:
        raise pytest.UsageError(str(exc)) from exc
    config.pluginmanager.register(_Collector(config), "npu_conformance.collector")
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        config.pluginmanager.register(_StartCounter(config), "npu_conformance.start_counter")
    if _labels_starts(config):
        config.pluginmanager.register(_StartLabels(), "npu_conformance.start_labels")


def selected_targets(config: pytest.Config) -> list[str]:
    """The expanded ``--target`` selection of this run."""
    return config.stash[_TARGETS_KEY]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "target" in metafunc.fixturenames:
        metafunc.parametrize("target", selected_targets(metafunc.config), indirect=True)


def _scenario_name(item: pytest.Item) -> str:
    marker = item.get_closest_marker("scenario")
    base = (marker.kwargs.get("name") if marker else None) or item.originalname.removeprefix("test_")
    module = item.module.__name__.rsplit(".", 1)[-1].removeprefix("test_") if item.module else ""
    return f"{module}.{base}{_ids_without_target(item)}"


def _ids_without_target(item: pytest.Item) -> str:
    """``[ids]`` of the item's parameters (pytest's own ids) without the target's id."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or "[" not in item.name:
        return ""
    ids = item.name[item.name.index("[") + 1 : -1]
    target = callspec.params.get("target", "")
    if ids == target:
        ids = ""
    elif ids.startswith(target + "-"):
        ids = ids[len(target) + 1 :]
    elif ids.endswith("-" + target):
        ids = ids[: -len(target) - 1]
    else:
        ids = ids.replace(f"-{target}-", "-", 1)
    return f"[{ids}]" if ids else ""


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under ``-n N --dist loadfile``: :class:`~npu_conformance.xdist_scheduling.LabAwareLoadFile`
    (each target's lab servers start once). Other ``--dist`` modes: xdist's own scheduler."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from npu_conformance.xdist_scheduling import LabAwareLoadFile

    return LabAwareLoadFile(config, log)


def lab_target(item: pytest.Item) -> str | None:
    """The target whose device lab ``item`` uses (it takes ``device_labs`` and ``target``), else None."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or "device_labs" not in getattr(item, "fixturenames", ()):
        return None
    return callspec.params.get("target")


def order_lab_items(items: list[pytest.Item], targets: list[str]) -> list[pytest.Item]:
    """``items`` with the lab-using ones (:func:`lab_target`) moved together, target by target
    in ``targets`` order, at the place of the first of them; each target's keep their order,
    and every other item keeps its place relative to the rest. So each target's servers start
    once and stop before the next target's start."""
    lab = [(targets.index(t) if t in targets else len(targets), i) for i, t in enumerate(map(lab_target, items)) if t]
    if not lab:
        return items
    first = lab[0][1]
    moved = [items[i] for _, i in sorted(lab)]
    taken = {i for _, i in lab}
    rest = [item for i, item in enumerate(items) if i not in taken]
    at = sum(1 for i in range(first) if i not in taken)
    return rest[:at] + moved + rest[at:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the last scenario in a row that uses a target's device lab, stop that lab's
    servers (the next scenarios use another target or none), so one target's servers at a time
    hold memory."""
    result = yield
    name = lab_target(item)
    labs = item.config.stash.get(LABS_KEY, None)
    if name is not None and labs is not None and (nextitem is None or lab_target(nextitem) != name):
        labs.stop(name)
    return result


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from npu_conformance import vendor_differences

    items[:] = order_lab_items(items, selected_targets(config))
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or "target" not in callspec.params:
            continue
        name, target = _scenario_name(item), callspec.params["target"]
        item.user_properties.append((res.KEY_SCENARIO, name))
        item.user_properties.append((res.KEY_TARGET, target))
        known = vendor_differences.known(target, name)
        if known is not None:
            item.stash[_KNOWN_KEY] = known


_KNOWN_KEY = pytest.StashKey["vendor_differences.Difference"]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A vendor column's scenario with a known difference (:mod:`npu_conformance.vendor_differences`)
    is reported ``differs`` (pytest: xfailed) when it fails with the recorded evidence; failing
    otherwise stays a failure, and passing becomes one (the ledger is out of date)."""
    report = yield
    known = item.stash.get(_KNOWN_KEY, None)
    if known is None or report.when != "call":
        return report
    if report.passed:
        report.outcome = "failed"
        report.longrepr = (f"the known difference no longer shows (the scenario passes): {known.describe()}; "
                           f"remove it from npu_conformance/vendor_differences.py and its docs")
    elif report.failed and call.excinfo is not None:
        import re

        if re.search(known.evidence, str(call.excinfo.value)):
            report.outcome = "skipped"
            report.wasxfail = known.describe()
    return report


@pytest.fixture
def target(request: pytest.FixtureRequest) -> tg.Target:
    """The :class:`~npu_conformance.targets.Target` this scenario instance runs on.

    Skips (reported ``unsupported``) when the scenario's ``devices`` exclude the target's
    device, and skips (reported ``skipped``) with the probe's reason when the target is
    unavailable on this machine.
    """
    name: str = request.param
    tgt = tg.TARGETS[name]
    marker = request.node.get_closest_marker("scenario")
    devices = marker.kwargs.get("devices") if marker else None
    if devices is not None and tgt.device not in devices:
        request.node.user_properties.append((res.KEY_STATUS, res.UNSUPPORTED))
        pytest.skip(f"unsupported on {name}: scenario covers {', '.join(devices)}")
    avail = tg.availability(name)
    if not avail.available:
        pytest.skip(f"{name} unavailable: {avail.reason}")
    return tgt


@pytest.fixture
def record(request: pytest.FixtureRequest) -> res.Recorder:
    """Records measured figures of this scenario into the report."""
    return res.Recorder(request.node.user_properties)


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    """Count scenario instances that do not apply to a target as ``unsupported``, not as
    skips, so the skip summary lists only unavailable targets and self-skips."""
    if report.skipped and (res.KEY_STATUS, res.UNSUPPORTED) in getattr(report, "user_properties", ()):
        return "unsupported", "u", "UNSUPPORTED"
    return None


def _result_from_report(report: pytest.TestReport) -> res.ScenarioResult | None:
    props = dict((k, v) for k, v in report.user_properties if k != res.KEY_FIGURE)
    if res.KEY_SCENARIO not in props:
        return None
    if report.passed:
        status = res.PASS
    elif report.failed:
        status = res.FAIL
    elif getattr(report, "wasxfail", None):
        status = res.DIFFERS
    else:
        status = props.get(res.KEY_STATUS, res.SKIPPED)
    message = ""
    if status == res.DIFFERS:
        message = str(report.wasxfail)
    elif report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else report.longreprtext.strip()[-500:]
    figures = [res.Figure(*v) for k, v in report.user_properties if k == res.KEY_FIGURE]
    return res.ScenarioResult(
        scenario=str(props[res.KEY_SCENARIO]),
        target=str(props[res.KEY_TARGET]),
        status=status,
        duration_s=report.duration,
        message=message,
        figures=figures,
    )


class _Collector:
    """Collects one :class:`ScenarioResult` per scenario instance and writes the report.

    Registered in :func:`pytest_configure`; in an xdist run only the controller writes.
    """

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.results: dict[tuple[str, str], res.ScenarioResult] = {}
        self.started = time.time()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # Every phase reaches here (xdist workers' reports too). Keep the call phase, or the
        # phase that did not pass; a teardown failure replaces a passing call.
        if report.when == "call" or not report.passed:
            result = _result_from_report(report)
            if result is not None:
                self.results[(result.scenario, result.target)] = result

    def report_dir(self) -> Path:
        out = self.config.getoption("npu_report")
        return Path(out) if out else self.config.rootpath / report_mod.DEFAULT_REPORT_DIR

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # Written whenever a scenario ran (--report DIR, else <rootdir>/conformance-report).
        if self.results and not hasattr(self.config, "workerinput"):
            report_mod.write(
                self.report_dir(),
                results=list(self.results.values()),
                targets=selected_targets(self.config),
                started=self.started,
            )

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.results:
            out = self.report_dir()
            terminalreporter.write_line(
                f"conformance report: {out / 'report.json'}, {out / 'report.md'}")


#: Set by the outermost pytest run of a process tree to its pid: the run whose tests name the
#: vLLM starts (a pytest run inside a test, e.g. a pytester subprocess, leaves the names alone).
_ENV_OWNER = "NPU_HARNESS_START_OWNER"


def _labels_starts(config: pytest.Config) -> bool:
    """Whether this process's tests name the vLLM starts they make (see :data:`_ENV_OWNER`): the
    outermost run, or an xdist worker of it."""
    import os

    owner = os.environ.get(_ENV_OWNER)
    if hasattr(config, "workerinput"):
        return owner == str(os.getppid())
    if owner is None:
        os.environ[_ENV_OWNER] = str(os.getpid())
        return True
    return owner == str(os.getpid())


class _StartLabels:
    """While a test runs, ``NPU_HARNESS_START_LABEL`` is its node id, so each vLLM process it
    starts (directly or through a nested run) records the test that made it."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ARG002
        import os

        from npu_conformance.starts import ENV_LABEL

        os.environ[ENV_LABEL] = item.nodeid
        try:
            return (yield)
        finally:
            os.environ.pop(ENV_LABEL, None)


class _StartCounter:
    """Counts the run's vLLM starts and holds them to the start budget (:mod:`npu_conformance.starts`).

    Every vLLM process the run starts records itself in the directory ``NPU_HARNESS_START_PROFILE``
    names: the user's, else one this plugin makes for the session (its children and xdist workers
    inherit the variable) and removes at the end. When the run's root has
    :data:`~npu_conformance.starts.BUDGET_FILE`, a run whose modules start vLLM more often than
    their budgets allow (beyond :data:`~npu_conformance.starts.MARGIN`) fails, naming them.
    """

    def __init__(self, config: pytest.Config) -> None:
        import os
        import tempfile

        from npu_conformance import starts

        self.config = config
        self.owned: str | None = None
        if not os.environ.get(starts.ENV_DIR):
            self.owned = tempfile.mkdtemp(prefix="npu-harness-starts-")
            os.environ[starts.ENV_DIR] = self.owned
        self.dir = Path(os.environ[starts.ENV_DIR])
        self.summary: list[str] = []

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        import os
        import shutil

        from npu_conformance import starts

        found = starts.starts_of(starts.load_procs(self.dir)) if self.dir.is_dir() else []
        if found:
            counts = starts.per_module(found)
            self.summary.append(f"vLLM starts: {len(found)} ({sum(1 for s in found if s.kind == 'refused')} "
                                f"refused before an engine) in {len(counts)} modules")
            try:
                budget = starts.read_budget(self.config.rootpath / starts.BUDGET_FILE)
            except ValueError as exc:
                budget, problem = None, str(exc)
            else:
                problem = None if budget is None else starts.check_budget(counts, budget)
            if problem:
                self.summary.append(f"start budget exceeded: {problem}")
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.owned:
            shutil.rmtree(self.owned, ignore_errors=True)
            os.environ.pop(starts.ENV_DIR, None)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for line in self.summary:
            terminalreporter.write_line(line, red=line.startswith("start budget"))
