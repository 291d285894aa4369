"""The pytest plugin: target parametrization, statuses, figures and the report files,
exercised on throwaway scenario files with pytester."""

from __future__ import annotations

import json

import pytest

from npu_conformance import targets as tg

SCENARIOS = '''
import pytest

@pytest.mark.scenario(devices=("ref",))
def test_passes(target, record):
    record.figure("speed", 12.5, "tok/s")

@pytest.mark.scenario(devices=("ref",))
def test_fails(target):
    assert 1 == 2, "wrong answer on purpose"

@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_everywhere(target, arch):
    pass

def test_not_a_scenario():
    pass
'''


@pytest.fixture
def fake_availability(monkeypatch):
    """ref is available, every other target is not (with a recognisable reason)."""

    def availability(name):
        if name == "ref":
            return tg.Availability(True, "fake reference")
        return tg.Availability(False, f"fake probe says no for {name}")

    monkeypatch.setattr(tg, "availability", availability)


def _report(pytester, *args):
    pytester.makepyfile(test_scn=SCENARIOS)
    result = pytester.runpytest("-p", "no:cacheprovider", "--report", "out", *args)
    return result, json.loads((pytester.path / "out" / "report.json").read_text())


def _status(report, scenario, target):
    [row] = [r for r in report["results"] if (r["scenario"], r["target"]) == (scenario, target)]
    return row


def test_sim_expands_to_reference_and_every_simulator(pytester, fake_availability):
    result, report = _report(pytester, "--target", "sim")
    assert [t["name"] for t in report["targets"]] == [
        "ref", "mblt-sim", "rbln-sim", "neuron-sim", "ime2-qemu"]
    # 2 ref-only scenarios + 2 parametrized everywhere, over 5 targets; the plain test once.
    # Instances that do not apply to a target count as "unsupported", not as skips.
    result.assert_outcomes(passed=1 + 2 + 1, failed=1, skipped=4 * 2)
    result.stdout.fnmatch_lines(["*1 failed, 4 passed, 8 skipped*, 8 unsupported*"])
    assert _status(report, "scn.passes", "ref")["status"] == "pass"
    assert _status(report, "scn.fails", "ref")["status"] == "fail"
    assert "wrong answer on purpose" in _status(report, "scn.fails", "ref")["message"]
    assert _status(report, "scn.passes", "mblt-sim")["status"] == "unsupported"
    skipped = _status(report, "scn.everywhere[qwen3]", "rbln-sim")
    assert skipped["status"] == "skipped"
    assert skipped["message"] == "rbln-sim unavailable: fake probe says no for rbln-sim"
    assert _status(report, "scn.passes", "ref")["figures"] == {
        "speed": {"value": 12.5, "unit": "tok/s"}}
    assert report["summary"] == {"pass": 3, "fail": 1, "differs": 0, "skipped": 8, "unsupported": 8}
    assert not [r for r in report["results"] if r["scenario"].endswith("not_a_scenario")]


def test_markdown_puts_sim_and_hw_columns_side_by_side(pytester, fake_availability):
    _report(pytester, "--target", "mblt-hw", "--target", "ref", "--target", "mblt-sim")
    md = (pytester.path / "out" / "report.md").read_text()
    assert "| scenario | ref | mblt-sim | mblt-hw |" in md
    assert "| scn.passes | pass | n/a | n/a |" in md
    assert "| scn.fails | FAIL | n/a | n/a |" in md
    assert "fake probe says no for mblt-hw" in md
    assert "speed=12.5 tok/s" in md


def test_env_var_selects_the_default_target(pytester, fake_availability, monkeypatch):
    monkeypatch.setenv("NPU_HARNESS_TARGET", "neuron-sim")
    _, report = _report(pytester)
    assert [t["name"] for t in report["targets"]] == ["neuron-sim"]


def test_unknown_target_is_a_usage_error_naming_it(pytester):
    pytester.makepyfile(test_scn=SCENARIOS)
    result = pytester.runpytest("--target", "mblt-simm")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown target 'mblt-simm'*sim*mblt-sim*"])


def test_report_survives_xdist(pytester):
    # Subprocess: xdist workers are separate processes, so availability is probed for real;
    # the 'ref' column of these scenarios needs nothing but the plugin.
    pytester.makepyfile(test_scn='''
import pytest
@pytest.mark.parametrize("n", range(6))
def test_figure(target, record, n):
    record.figure("n_squared", n * n)
''')
    result = pytester.runpytest_subprocess("-n", "2", "--target", "neuron-hw", "--report", "out")
    report = json.loads((pytester.path / "out" / "report.json").read_text())
    assert len(report["results"]) == 6
    assert all(r["status"] == "skipped" and "neuron-hw unavailable" in r["message"]
               for r in report["results"]), report["results"]
    result.assert_outcomes(skipped=6)


def test_figures_reach_the_report_through_xdist(pytester, monkeypatch):
    pytester.makeconftest('''
from npu_conformance import targets as tg
tg.availability = lambda name: tg.Availability(True, "forced by conftest")
''')
    pytester.makepyfile(test_scn='''
import pytest
@pytest.mark.parametrize("n", range(4))
def test_figure(target, record, n):
    record.figure("n_squared", n * n)
''')
    pytester.runpytest_subprocess("-n", "2", "--target", "ref", "--report", "out")
    report = json.loads((pytester.path / "out" / "report.json").read_text())
    got = {r["scenario"]: r["figures"]["n_squared"]["value"] for r in report["results"]}
    assert got == {f"scn.figure[{n}]": float(n * n) for n in range(4)}



def test_loadfile_splits_the_lab_scenarios_by_target_and_module():
    from xdist.scheduler import LoadFileScheduling

    from npu_conformance import xdist_scheduling as xs

    labs = xs.lab_modules()
    assert {"test_serving.py", "test_mblt_serving.py", "test_rbln_serving.py", "test_neuron_serving.py"} <= labs
    assert "test_ime2_tiles.py" not in labs
    sched = xs.LabAwareLoadFile.__new__(xs.LabAwareLoadFile)  # _split_scope uses no other state
    split = type(sched)._split_scope
    base = "conformance/npu_conformance/scenarios/"
    # the serving suite joins the device's own module on each target (both use the standard server)
    assert split(sched, base + "test_serving.py::test_load[mblt-sim]") == \
        xs.lab_unit("mblt-sim", "test_mblt_serving.py")
    assert split(sched, base + "test_serving.py::test_hostile_input[rbln-sim]") == \
        split(sched, base + "test_rbln_serving.py::test_impl_matrix[rbln-sim]") == xs.lab_unit("rbln-sim", "test_rbln_serving.py")
    assert split(sched, base + "test_serving.py::test_load[ref]") == xs.lab_unit("ref", "test_serving.py")
    # the target is found among the ids wherever it stands, whatever else they hold
    assert split(sched, base + "test_mblt_serving.py::test_prefix_cost_model_measured[mblt-sim-load_cheap]") == \
        xs.lab_unit("mblt-sim", "test_mblt_serving.py")
    assert split(sched, base + "test_mblt_vlm.py::test_vlm_greedy[qwen2_vl-mblt-sim]") == \
        xs.lab_unit("mblt-sim", "test_mblt_vlm.py")
    units = {split(sched, base + n) for n in ("test_serving.py::test_load[mblt-sim]",
                                              "test_mblt_vlm.py::test_vlm_video[mblt-sim]",
                                              "test_serving.py::test_load[rbln-sim]",
                                              "test_serving.py::test_load[neuron-sim]")}
    assert len(units) == 4 and all(u.startswith(xs.LAB_SCOPE) for u in units)
    other = base + "test_ime2_tiles.py::test_x[ime2-qemu]"
    assert split(sched, other) == LoadFileScheduling._split_scope(sched, other)
    assert split(sched, "tests/test_cli.py::test_a") == "tests/test_cli.py"
    assert split(sched, "mine/test_serving.py::test_a") == "mine/test_serving.py"
    assert xs.target_of("x.py::test_a[n1]") == "" and xs.target_of("x.py::test_a") == ""


class _Node:
    """What xdist's ``_assign_work_unit`` asks of a worker: the test indexes it is sent."""

    def __init__(self):
        self.sent: list[list[int]] = []

    def send_runtest_some(self, indexes):
        self.sent.append(list(indexes))


def _scheduler(tmp_path, units: dict[str, int], durations):
    """A LabAwareLoadFile over ``units`` (work unit -> test count) whose run root is
    ``tmp_path``, with ``durations`` written to its durations file (None: no file)."""
    from collections import OrderedDict
    from types import SimpleNamespace

    from npu_conformance import xdist_scheduling as xs

    if durations is not None:
        (tmp_path / xs.DURATIONS_FILE).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / xs.DURATIONS_FILE).write_text(durations if isinstance(durations, str) else json.dumps(durations))
    collection = [f"{unit}::t{i}" for unit, n in units.items() for i in range(n)]
    node = _Node()
    sched = xs.LabAwareLoadFile.__new__(xs.LabAwareLoadFile)
    sched.config = SimpleNamespace(rootpath=tmp_path)
    sched.workqueue = OrderedDict((u, {f"{u}::t{i}": False for i in range(n)}) for u, n in units.items())
    sched.assigned_work = {}
    sched.registered_collections = {node: collection}
    return sched, node, collection


def _handed_out(sched, node, collection) -> list[str]:
    while sched.workqueue:
        sched._assign_work_unit(node)
    return [collection[batch[0]].split("::")[0] for batch in node.sent]


@pytest.mark.parametrize(("durations", "want"), [
    # longest first; a unit the file does not know counts as the median (20 s)
    ({"a.py": 5, "b.py": 300, "c.py": 20}, ["b.py", "c.py", "d.py", "a.py"]),
    # no file, or a broken one: xdist's own order (units with the most tests first)
    (None, ["a.py", "b.py", "c.py", "d.py"]),
    ("{not json", ["a.py", "b.py", "c.py", "d.py"]),
    ('["a.py"]', ["a.py", "b.py", "c.py", "d.py"]),
])
def test_loadfile_hands_out_the_longest_known_units_first(tmp_path, durations, want):
    # xdist's own _assign_work_unit pops the queue; the scheduler orders it once, before the first.
    sched, node, collection = _scheduler(tmp_path, {"a.py": 9, "b.py": 1, "c.py": 3, "d.py": 2}, durations)
    assert _handed_out(sched, node, collection) == want


def test_durations_from_a_junit_report_sum_each_work_unit(tmp_path):
    from npu_conformance import xdist_scheduling as xs

    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.vllm_npu.test_isa_serve" name="test_a" time="100.25"/>'
        '<testcase classname="tests.vllm_npu.test_isa_serve" name="test_b" time="20"/>'
        '<testcase classname="tests.test_cli.TestHelp" name="test_c" time="1.5"/>'
        '<testcase classname="conformance.npu_conformance.scenarios.test_serving" name="test_d[mblt-sim]" time="30"/>'
        '<testcase classname="conformance.npu_conformance.scenarios.test_serving" name="test_g[mblt-sim]" time="5"/>'
        '<testcase classname="conformance.npu_conformance.scenarios.test_rbln_serving" name="test_e[rbln-sim]" time="12"/>'
        '<testcase classname="conformance.npu_conformance.scenarios.test_ime2_tiles" name="test_f" time="3"/>'
        '</testsuite></testsuites>')
    assert xs.durations_from_junit(junit) == {
        "conformance/npu_conformance/scenarios/test_ime2_tiles.py": 3.0,
        xs.lab_unit("mblt-sim", "test_mblt_serving.py"): 35.0,
        xs.lab_unit("rbln-sim", "test_rbln_serving.py"): 12.0,
        "tests/test_cli.py": 1.5,
        "tests/vllm_npu/test_isa_serve.py": 120.2,
    }
    out = tmp_path / "durations.json"
    assert xs.main([str(junit), str(out)]) == 0
    assert xs.read_durations(out)[xs.lab_unit("mblt-sim", "test_mblt_serving.py")] == 35.0
    empty = tmp_path / "empty.xml"
    empty.write_text("<testsuites/>")
    with pytest.raises(ValueError, match="no test case"):
        xs.durations_from_junit(empty)


def test_the_committed_durations_cover_the_suite_s_long_units(pytestconfig):
    # tests/durations.json is what orders ./dev test's queue (refresh it with the module's main
    # from a whole run's --junitxml report): it knows every lab unit of every serving target.
    from npu_conformance import xdist_scheduling as xs

    seconds = xs.read_durations(pytestconfig.rootpath / xs.DURATIONS_FILE)
    assert seconds, f"{xs.DURATIONS_FILE} is missing or empty"
    for target, device in (("mblt-sim", "mblt"), ("rbln-sim", "rbln"), ("neuron-sim", "neuron")):
        assert xs.lab_unit(target, f"test_{device}_serving.py") in seconds, target
    assert xs.lab_unit("mblt-sim", "test_mblt_vlm.py") in seconds



def test_the_plugin_gives_xdist_the_lab_aware_scheduler_for_loadfile_only(pytestconfig, monkeypatch):
    # Real xdist asks the plugin's hook first (tryfirst, firstresult): for --dist loadfile it gets
    # LabAwareLoadFile, for any other mode None (xdist's own scheduler). Each worker's tests are
    # too quick to show the grouping through a real run (one worker takes them all), so the
    # scope rule itself is tested above.
    from npu_conformance import plugin
    from npu_conformance.xdist_scheduling import LabAwareLoadFile

    impl = plugin.pytest_xdist_make_scheduler
    assert getattr(impl, "pytest_impl", {}).get("tryfirst") is True
    monkeypatch.setattr(pytestconfig.option, "dist", "loadfile", raising=False)
    monkeypatch.setattr(pytestconfig.option, "tx", ["popen", "popen"], raising=False)
    assert isinstance(impl(pytestconfig, None), LabAwareLoadFile)
    for mode in ("load", "loadscope", "loadgroup", "no"):
        monkeypatch.setattr(pytestconfig.option, "dist", mode)
        assert impl(pytestconfig, None) is None, mode


LAB_CONFTEST = '''
import json, os
from npu_conformance import devices, targets as tg
from npu_conformance.devices.base import DeviceLab

tg.availability = lambda name: tg.Availability(True, "forced by conftest")
EVENTS = os.path.join(os.path.dirname(__file__), "events.jsonl")

def log(*event):
    with open(EVENTS, "a") as f:
        f.write(json.dumps(event) + "\\n")

class FakeServer:
    def __init__(self, target):
        self.target = target
    def alive(self):
        return True
    def stop(self):
        log("stop", self.target)

class FakeLab(DeviceLab):
    def serving_server(self):
        key = "standard"
        if key not in self.servers:
            log("start", self.target)
            self.servers[key] = FakeServer(self.target)
        return self.servers[key]

devices.lab_class = lambda device: FakeLab
'''

LAB_SCENARIOS = {
    "test_a_suite": '''
def test_one(target, device_labs):
    device_labs(target.name).serving_server()

def test_plain(target):
    pass

def test_two(target, device_labs):
    device_labs(target.name).serving_server()
''',
    "test_b_device": '''
def test_three(target, device_labs):
    device_labs(target.name).serving_server()

def test_no_lab():
    pass
''',
}


def _events(pytester):
    """The fake lab's ``(start|stop, target)`` events, in order."""
    return [tuple(json.loads(line)) for line in (pytester.path / "events.jsonl").read_text().splitlines()]


def _lab_events(pytester, *args):
    pytester.makeconftest(LAB_CONFTEST)
    pytester.makepyfile(**LAB_SCENARIOS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", "--report", "out", *args)
    return result, _events(pytester)


def test_lab_scenarios_run_target_by_target_and_each_targets_servers_stop_before_the_next_start(pytester):
    result, events = _lab_events(pytester, "--target", "ref", "--target", "mblt-sim")
    result.assert_outcomes(passed=9)
    # One start per target, and the first target's servers are stopped before the second's start:
    # at most one target's servers at a time.
    assert events == [("start", "ref"), ("stop", "ref"), ("start", "mblt-sim"), ("stop", "mblt-sim")]
    ran = [line.split(" ")[0] for line in result.outlines if " PASSED" in line]
    # The lab-using scenarios of both modules, target by target, where the first of them was;
    # the rest after them in their own order.
    assert ran == [
        "test_a_suite.py::test_one[ref]", "test_a_suite.py::test_two[ref]", "test_b_device.py::test_three[ref]",
        "test_a_suite.py::test_one[mblt-sim]", "test_a_suite.py::test_two[mblt-sim]",
        "test_b_device.py::test_three[mblt-sim]",
        "test_a_suite.py::test_plain[ref]", "test_a_suite.py::test_plain[mblt-sim]", "test_b_device.py::test_no_lab",
    ]


def test_a_lab_asked_again_after_its_servers_stopped_starts_them_again(pytester):
    # Stopping keeps the lab (its artifacts); asking for its server again starts a new one.
    pytester.makeconftest(LAB_CONFTEST)
    pytester.makepyfile(test_c='''
def test_both(device_labs):
    device_labs("ref").serving_server()
    device_labs.stop("ref")
    device_labs("ref").serving_server()
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert _events(pytester) == [("start", "ref"), ("stop", "ref"), ("start", "ref"), ("stop", "ref")]


def test_known_vendor_differences_are_reported_as_differs_and_cannot_go_stale(pytester, fake_availability,
                                                                                monkeypatch):
    from npu_conformance import vendor_differences as vd

    def diff(scenario: str) -> vd.Difference:
        return vd.Difference("ref", scenario, r"HTTP 500 \(expected 400\)", "It answers 500.", "vendor bug", "docs/x.md")

    monkeypatch.setattr(vd, "KNOWN", (diff("scn.as_recorded"), diff("scn.otherwise"), diff("scn.now_passes")))
    pytester.makepyfile(test_scn='''
def test_as_recorded(target):
    assert False, "refused prompt_logprobs: HTTP 500 (expected 400)"

def test_otherwise(target):
    assert False, "a wrong token"

def test_now_passes(target):
    pass

def test_unrecorded(target):
    assert False, "HTTP 500 (expected 400)"
''')
    result = pytester.runpytest("-p", "no:cacheprovider", "--report", "out", "--target", "ref")
    result.assert_outcomes(failed=3, xfailed=1)
    report = json.loads((pytester.path / "out" / "report.json").read_text())
    got = {r["scenario"]: (r["status"], r["message"]) for r in report["results"]}
    assert got["scn.as_recorded"] == ("differs", "It answers 500. Verdict: vendor bug (docs/x.md)")
    assert got["scn.otherwise"][0] == "fail" and "a wrong token" in got["scn.otherwise"][1]
    assert got["scn.now_passes"][0] == "fail"
    assert "the known difference no longer shows (the scenario passes): It answers 500." in got["scn.now_passes"][1]
    assert got["scn.unrecorded"][0] == "fail"
    assert report["summary"]["differs"] == 1
    md = (pytester.path / "out" / "report.md").read_text()
    assert "| scn.as_recorded | differs |" in md
    assert "## Known differences\n\n- `scn.as_recorded` on `ref`: It answers 500. Verdict: vendor bug (docs/x.md)" in md
