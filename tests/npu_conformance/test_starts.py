"""``npu_conformance.starts``: the vLLM starts of a run read back from the ``start_profile``
records, and the start budget that fails a run making more starts than it measured.

The records here are written by hand in the plugin's format; the records of real vLLM processes
are checked where a test starts one anyway (``tests/test_vllm_commands.py``).
"""

from __future__ import annotations

import json
import os
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from npu_conformance import starts


def _write(directory: Path, *records: dict) -> None:
    for rec in records:
        with open(directory / f"{rec['pid']}.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")


def _proc(pid: int, ppid: int, argv: list[str], created: float, test: str = "", label: str = "",
          target: str = "mblt-sim") -> dict:
    return {"kind": "process", "pid": pid, "ppid": ppid, "argv": argv, "created": created, "loaded": created + 1,
            "target": target, "test": test, "label": label}


def _ms(pid: int, name: str, t: float, test: str = "", label: str = "") -> dict:
    return {"kind": "milestone", "name": name, "pid": pid, "t": t, "message": name, "test": test, "label": label}


SERVE = ["/venv/bin/vllm", "serve", "/tmp/art", "--host", "127.0.0.1", "--port", "5000", "--max-model-len", "512"]


def test_a_vllm_serve_is_its_api_server_joined_with_its_engine_core(tmp_path):
    _write(tmp_path,
           _proc(10, 1, SERVE, 100.0, label="tests/test_a.py::test_x"),
           _ms(10, "args", 108.0),
           _proc(11, 10, SERVE, 108.5, label="tests/test_a.py::test_x"),  # spawn copies the parent's argv
           _ms(11, "engine_init", 116.5),
           _ms(11, "engine_ready", 117.0),
           _ms(10, "server_ready", 118.0))
    [s] = starts.starts_of(starts.load_procs(tmp_path))
    assert (s.kind, s.who, s.module, s.target, s.ok) == ("serve", "tests/test_a.py::test_x", "tests/test_a.py",
                                                         "mblt-sim", True)
    assert s.args == "serve art --max-model-len 512"
    assert (s.front_s, s.spawn_s, s.engine_s, s.serve_s, s.total_s) == (8.0, 8.0, 0.5, 1.0, 18.0)


def test_a_refused_serve_and_in_process_engines_are_starts_too(tmp_path):
    pytest_argv = ["/venv/bin/pytest", "-q"]
    _write(tmp_path,
           # a vllm serve that exited while building its config: no engine core
           _proc(20, 1, SERVE, 200.0, test="tests/test_b.py::test_refused (call)"),
           _ms(20, "args", 209.0),
           # two in-process engines of one pytest process, each named by the test running then
           _proc(30, 1, pytest_argv, 300.0),
           _ms(30, "engine_init", 310.0, test="tests/test_c.py::test_one (call)"),
           _ms(30, "engine_ready", 311.0, test="tests/test_c.py::test_one (call)"),
           _ms(30, "engine_init", 320.0, label="tests/test_d.py::test_two"),
           _ms(30, "engine_ready", 322.5, label="tests/test_d.py::test_two"))
    got = sorted(starts.starts_of(starts.load_procs(tmp_path)), key=lambda s: s.who)
    assert [(s.kind, s.who, s.engine_s) for s in got] == [
        ("refused", "tests/test_b.py::test_refused", None),
        ("engine", "tests/test_c.py::test_one", 1.0),
        ("engine", "tests/test_d.py::test_two", 2.5),
    ]
    assert got[0].front_s == 9.0 and not got[0].ok
    assert starts.per_module(got) == Counter({"tests/test_b.py": 1, "tests/test_c.py": 1, "tests/test_d.py": 1})


def test_an_engine_core_that_died_before_its_first_line_is_a_failed_serve(tmp_path):
    _write(tmp_path, _proc(40, 1, SERVE, 400.0, label="t.py::a"), _ms(40, "args", 408.0),
           _proc(41, 40, SERVE, 409.0, label="t.py::a"))
    [s] = starts.starts_of(starts.load_procs(tmp_path))
    # one start (the API server with its child), not a refusal: it paid for the engine core
    assert (s.kind, s.who, s.ok, s.front_s, s.spawn_s) == ("serve", "t.py::a", False, 8.0, 1.0)


def test_broken_lines_and_orphan_milestones_are_skipped(tmp_path):
    (tmp_path / "50.jsonl").write_text("{not json\n" + json.dumps(_ms(99, "engine_init", 1.0)) + "\n")
    assert starts.starts_of(starts.load_procs(tmp_path)) == []


def test_the_budget_allows_the_margin_in_all_and_names_the_modules_over_it():
    budget = {"tests/a.py": 3, "tests/b.py": 1}
    assert starts.check_budget(Counter({"tests/a.py": 3, "tests/b.py": 1}), budget) is None
    assert starts.check_budget(Counter({"tests/a.py": 1}), budget) is None  # a partial run
    assert starts.check_budget(Counter({"tests/a.py": 4, "tests/b.py": 2}), budget, margin=2) is None
    msg = starts.check_budget(Counter({"tests/a.py": 4, "tests/b.py": 2, "tests/new.py": 1}), budget, margin=2)
    assert msg is not None and "3 times more" in msg
    assert "tests/new.py: 1 (budget 0)" in msg and "tests/a.py: 4 (budget 3)" in msg
    assert starts.MARGIN >= 0


def test_read_budget_names_a_broken_file(tmp_path):
    assert starts.read_budget(tmp_path / "missing.json") is None
    bad = tmp_path / "bad.json"
    for text in ('["a"]', '{"a": 1.5}', '{"a": -1}', '{"a": true}'):
        bad.write_text(text)
        with pytest.raises(ValueError, match="bad.json"):
            starts.read_budget(bad)


def test_main_writes_the_starts_per_module(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _write(run, _proc(60, 1, SERVE, 600.0, label="tests/test_e.py::t"), _ms(60, "args", 601.0))
    out = tmp_path / "budget.json"
    assert starts.main([str(run), str(out)]) == 0
    assert starts.read_budget(out) == {"tests/test_e.py": 1}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert starts.main([str(empty), str(out)]) == 1
    assert starts.main([]) == 2


def test_the_recorded_parent_is_the_process_that_asked(monkeypatch):
    """A prefork spawn names its spawner in NPU_HARNESS_START_PPID: recorded, then consumed."""
    from vllm_npu import start_profile

    monkeypatch.setenv(start_profile.ENV_PPID, "4242")
    assert start_profile._process_record()["ppid"] == 4242
    assert start_profile.ENV_PPID not in os.environ
    assert start_profile._process_record()["ppid"] == os.getppid()


def test_the_label_names_match_the_writer():
    from vllm_npu import start_profile

    assert (start_profile.ENV_DIR, start_profile.ENV_LABEL) == (starts.ENV_DIR, starts.ENV_LABEL)


# ----------------------------------------------------------------------------- the plugin

_FAKE_START = '''
import itertools, json, os, time
from pathlib import Path

_SEQ = itertools.count()

def fake_start(n=1):
    """What a vLLM process of this test writes (the plugin's format), ``n`` times."""
    d = Path(os.environ["NPU_HARNESS_START_PROFILE"])
    for i in range(n):
        pid = 10_000_000 + os.getpid() * 100 + next(_SEQ)  # unique across xdist workers writing at once
        rec = {"kind": "process", "pid": pid, "ppid": 1, "argv": ["vllm", "serve", "/m"], "created": time.time(),
               "loaded": time.time(), "target": "", "test": "", "label": os.environ.get("NPU_HARNESS_START_LABEL", "")}
        (d / f"{pid}.jsonl").write_text(json.dumps(rec) + "\\n")
'''


@pytest.fixture
def budget_project(pytester):
    pytester.makeconftest(_FAKE_START + "\nimport pytest\n@pytest.fixture\ndef start():\n    return fake_start\n")
    pytester.makepyfile(test_two=textwrap.dedent('''
        def test_starts_twice(start):
            start(2)
        '''), test_new=textwrap.dedent('''
        def test_starts_once(start):
            start(1)
        '''))
    (pytester.path / "tests").mkdir()
    return pytester


def test_a_run_over_its_budget_fails_naming_the_module(budget_project, monkeypatch):
    monkeypatch.delenv("NPU_HARNESS_START_PROFILE", raising=False)
    monkeypatch.delenv("NPU_HARNESS_START_OWNER", raising=False)
    monkeypatch.delenv("NPU_HARNESS_START_LABEL", raising=False)
    (budget_project.path / "tests" / "start_budget.json").write_text(json.dumps({"test_two.py": 0}))
    result = budget_project.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*vLLM starts: 3 (3 refused before an engine) in 2 modules*",
                                 "*start budget exceeded*3 times more*test_new.py: 1 (budget 0)*"
                                 "test_two.py: 2 (budget 0)*"])


def test_a_run_within_its_budget_passes_and_cleans_up(budget_project, monkeypatch):
    monkeypatch.delenv("NPU_HARNESS_START_PROFILE", raising=False)
    monkeypatch.delenv("NPU_HARNESS_START_OWNER", raising=False)
    monkeypatch.delenv("NPU_HARNESS_START_LABEL", raising=False)
    (budget_project.path / "tests" / "start_budget.json").write_text(json.dumps({"test_two.py": 1}))
    result = budget_project.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")  # 1 over: within the margin
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*vLLM starts: 3*in 2 modules*"])
    assert "start budget exceeded" not in result.stdout.str()
