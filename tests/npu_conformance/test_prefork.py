"""The prefork zygote: a forked child is what a new interpreter running the same script is.

These tests use a zygote that preloads ``json`` only and a probe script instead of vLLM (every
served scenario of the suite is the test of the real thing, ``vllm serve`` through the zygote);
one test checks :data:`prefork.PRELOAD` against what vLLM's own processes import.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict
from pathlib import Path

import pytest

from npu_conformance import prefork
from npu_conformance import vllm_server as vs

PROBE = textwrap.dedent('''\
    #!{python}
    import json, multiprocessing as mp, os, sys, time

    def child(conn, code):
        conn.send({{"pid": os.getpid(), "ppid": os.getppid(), "main": sys.modules["__main__"].__file__,
                    "asked_by": os.environ.get("NPU_HARNESS_START_PPID"),
                    "env": os.environ.get("PROBE"), "argv": sys.argv}})
        if code == "sleep":
            time.sleep(60)
        sys.exit(code)

    if __name__ == "__main__":
        mode = os.environ.get("PROBE_MODE", "")
        cmdline = open("/proc/self/cmdline").read()
        print(json.dumps({{"argv": sys.argv, "path0": sys.path[0], "file": __file__, "cwd": os.getcwd(),
                          "ps": " ".join(w for w in cmdline.split(chr(0)) if w),
                          "env": os.environ.get("PROBE"), "stdin": os.readlink("/proc/self/fd/0"),
                          "fds": sorted(int(n) for n in os.listdir("/proc/self/fd"))}}), flush=True)
        if mode == "numpy":
            import numpy.random
            print(json.dumps({{"draw": int(numpy.random.randint(0, 2**31))}}), flush=True)
        if mode == "exit3":
            sys.exit(3)
        if mode == "raise":
            raise RuntimeError("boom from the probe")
        if mode == "sleep":
            time.sleep(60)
        if mode.startswith("spawn"):
            if mode == "spawn-flags":  # other interpreter flags than the zygote's
                sys.warnoptions.append("ignore::DeprecationWarning")
            ctx = mp.get_context("spawn")
            for code in (0, 7, "sleep"):
                recv, send = ctx.Pipe(False)
                p = ctx.Process(target=child, args=(send, code))
                p.start()
                send.close()
                got = recv.recv()
                if code == "sleep":
                    p.terminate()
                p.join(30)
                print(json.dumps({{"code": code, "exitcode": p.exitcode, **got}}), flush=True)
''')


@pytest.fixture
def zygotes(monkeypatch):
    """A private zygote registry with a json-only preload; closed afterwards."""
    registry: OrderedDict = OrderedDict()
    monkeypatch.setattr(prefork, "PRELOAD", ("json",))
    monkeypatch.setattr(prefork, "_zygotes", registry)
    yield registry
    while registry:
        registry.popitem()[1].close()


@pytest.fixture
def probe(tmp_path) -> Path:
    path = tmp_path / "bin" / "probe"
    path.parent.mkdir()
    path.write_text(PROBE.format(python=sys.executable))
    path.chmod(0o755)
    return path


def _env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != prefork.ENV_SWITCH}, **extra}


def _run_forked(probe: Path, tmp_path: Path, env: dict, args=("a", "b c")) -> tuple[prefork.PreforkProcess, Path]:
    log = tmp_path / f"forked-{time.monotonic_ns()}.log"
    with open(log, "w") as fh:
        proc = prefork.launch([str(probe), *args], env=env, stdout=fh.fileno(), cwd=str(tmp_path))
    return proc, log


def _lines(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def test_a_forked_child_is_what_a_new_interpreter_running_the_script_is(zygotes, probe, tmp_path):
    env = _env(PROBE="forty-two")
    proc, log = _run_forked(probe, tmp_path, env)
    assert proc.wait(60) == 0
    fresh_log = tmp_path / "fresh.log"
    with open(fresh_log, "w") as fh:
        assert subprocess.run([str(probe), "a", "b c"], stdin=subprocess.DEVNULL, stdout=fh,
                              stderr=subprocess.STDOUT, env=env, cwd=tmp_path).returncode == 0
    (forked,), (fresh,) = _lines(log), _lines(fresh_log)
    assert forked == fresh
    assert forked["argv"] == [str(probe), "a", "b c"] and forked["path0"] == str(probe.parent)
    assert forked["stdin"] == "/dev/null" and forked["fds"][:3] == [0, 1, 2] and len(forked["fds"]) == 4
    assert proc.pid != os.getpid() and proc.returncode == 0


def test_numpy_s_global_random_state_is_not_shared_between_children(zygotes, probe, tmp_path, monkeypatch):
    monkeypatch.setattr(prefork, "PRELOAD", ("json", "numpy.random"))
    draws = []
    for _ in range(2):
        proc, log = _run_forked(probe, tmp_path, _env(PROBE_MODE="numpy"))
        assert proc.wait(60) == 0
        draws.append(_lines(log)[1]["draw"])
    assert draws[0] != draws[1], "two children drew the same number from numpy's global state"


def test_exit_codes_and_tracebacks_are_the_interpreter_s(zygotes, probe, tmp_path):
    proc, _ = _run_forked(probe, tmp_path, _env(PROBE_MODE="exit3"))
    assert proc.wait(60) == 3
    proc, log = _run_forked(probe, tmp_path, _env(PROBE_MODE="raise"))
    assert proc.wait(60) == 1
    text = log.read_text()
    assert "Traceback" in text and "RuntimeError: boom from the probe" in text
    for code in ("sys.exit(-1)", "sys.exit(256 + 7)", "sys.exit('a message')"):  # the interpreter's exit()
        program = f"import sys; {code}"
        fresh = subprocess.run([sys.executable, "-c", program], env=_env(), capture_output=True, text=True)
        forked = prefork.run_python(program, env=_env(), timeout=60)
        assert (forked.returncode, forked.stderr) == (fresh.returncode, fresh.stderr), code


def test_terminate_kill_wait_and_poll_behave_like_popen(zygotes, probe, tmp_path):
    proc, _ = _run_forked(probe, tmp_path, _env(PROBE_MODE="sleep"))
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.3)
    proc.terminate()
    assert proc.wait(30) == -signal.SIGTERM
    proc.kill()  # after the end: nothing happens, as with Popen
    proc, _ = _run_forked(probe, tmp_path, _env(PROBE_MODE="sleep"))
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL


def test_a_child_whose_client_is_gone_is_killed(zygotes, probe, tmp_path):
    proc, _ = _run_forked(probe, tmp_path, _env(PROBE_MODE="sleep"))
    pid = proc.pid
    proc._conn.close()  # what the client's death does to the connection
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text(errors="replace").rsplit(")", 1)[-1].split()[0] \
            if Path(f"/proc/{pid}/stat").exists() else "X"
        if state == "Z":
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or state == "Z", f"pid {pid} still runs"


def test_spawned_processes_of_a_forked_child_come_from_the_zygote(zygotes, probe, tmp_path):
    proc, log = _run_forked(probe, tmp_path, _env(PROBE_MODE="spawn", PROBE="seen",
                                                   NPU_HARNESS_START_PROFILE=str(tmp_path / "starts")))
    assert proc.wait(120) == 0, log.read_text()
    (zygote,) = zygotes.values()
    first, *children = _lines(log)
    assert [c["code"] for c in children] == [0, 7, "sleep"]
    assert [c["exitcode"] for c in children] == [0, 7, -signal.SIGTERM]  # codes and signals relayed
    for c in children:
        assert c["ppid"] == zygote.proc.pid, "the spawn did not come from the zygote"
        # what multiprocessing's prepare() gives any spawned child: the parent's argv and main
        assert c["main"] == str(probe) and c["env"] == "seen" and c["argv"] == [str(probe), "a", "b c"]
        assert c["asked_by"] == str(proc.pid), "start_profile must record the spawner as the parent"


def test_a_spawn_with_other_interpreter_flags_runs_a_new_interpreter(zygotes, probe, tmp_path):
    proc, log = _run_forked(probe, tmp_path, _env(PROBE_MODE="spawn-flags"))
    assert proc.wait(120) == 0, log.read_text()
    (zygote,) = zygotes.values()
    first, *children = _lines(log)
    assert [c["exitcode"] for c in children] == [0, 7, -signal.SIGTERM]
    assert all(c["ppid"] == proc.pid for c in children), "flags the zygote lacks must not be forked"
    assert all(c["main"] == str(probe) and c["argv"] == [str(probe), "a", "b c"] for c in children)


def test_the_spawn_launcher_runs_anything_else_itself(zygotes, tmp_path):
    zygote = prefork.zygote_for(_env())
    out = subprocess.run([str(zygote.launcher), "-c", "import sys; print('ran', sys.argv[1:])", "x"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ran ['x']", out.stderr


def test_one_zygote_per_import_environment(zygotes, probe, tmp_path):
    for env in (_env(VLLM_LOGGING_LEVEL="DEBUG"), _env(NPU_HARNESS_TARGET="mblt-sim"), _env()):
        proc, _ = _run_forked(probe, tmp_path, env)
        assert proc.wait(60) == 0
    assert len(zygotes) == 1, "VLLM_* and NPU_* are read after the preloaded imports"
    proc, log = _run_forked(probe, tmp_path, _env(OMP_NUM_THREADS="1"))
    assert proc.wait(60) == 0
    assert len(zygotes) == 2, "a variable a preloaded module may read at import needs its own zygote"
    assert prefork.import_key({"VLLM_X": "1", "HF_HUB_OFFLINE": "1"}) == (("HF_HUB_OFFLINE", "1"),)


def test_the_switch_takes_effect_and_refuses_other_words(zygotes, tmp_path, monkeypatch):
    fake = tmp_path / "vllm"
    fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent('''\
        import http.server, sys
        port = int(sys.argv[sys.argv.index("--port") + 1])
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers()
        http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
        '''))
    fake.chmod(0o755)
    monkeypatch.setattr(vs, "vllm_command", lambda: [str(fake)])
    kinds = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(prefork.ENV_SWITCH, switch)
        server = vs.start("m", env=_env(), log=tmp_path / f"s{switch}.log", timeout_s=60)
        kinds[switch] = type(server.proc)
        server.stop()
        assert server.proc.returncode == -signal.SIGTERM
    assert kinds == {"1": prefork.PreforkProcess, "0": subprocess.Popen}
    monkeypatch.setenv(prefork.ENV_SWITCH, "yes")
    with pytest.raises(ValueError, match="NPU_HARNESS_PREFORK='yes': must be 1"):
        vs.start("m", env=_env(), log=tmp_path / "s.log")
    monkeypatch.delenv(prefork.ENV_SWITCH)
    assert prefork.enabled() is True


def test_a_zygote_that_cannot_import_says_why(zygotes, monkeypatch):
    monkeypatch.setattr(prefork, "PRELOAD", ("no_such_module_anywhere",))
    with pytest.raises(prefork.PreforkError, match="No module named 'no_such_module_anywhere'"):
        prefork.zygote_for(_env()).wait_ready(60)


def test_the_preloaded_modules_are_ones_vllm_s_processes_import_anyway():
    """A forked API server or engine core holds no module a new one would not."""
    code = ("import sys, vllm.entrypoints.cli.main, vllm.v1.engine.core; "
            f"print(repr([m for m in {prefork.PRELOAD!r} if m not in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=vs.vllm_env(None))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_run_python_is_subprocess_run_of_python_c(zygotes, monkeypatch, tmp_path):
    code = "import os, sys; print(sys.argv, sys.path[0] == '', os.getppid()); print('to stderr', file=sys.stderr); sys.exit(4)"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(prefork.ENV_SWITCH, "1")  # whatever the run's own setting
    got = prefork.run_python(code, ["x", "y z"], env=_env(), timeout=60)
    want = subprocess.run([sys.executable, "-c", code, "x", "y z"], env=_env(), capture_output=True, text=True)
    (zygote,) = zygotes.values()
    assert (got.returncode, got.stderr) == (want.returncode, want.stderr) == (4, "to stderr\n")
    assert got.stdout.rsplit(" ", 1)[0] == want.stdout.rsplit(" ", 1)[0] == "['-c', 'x', 'y z'] True"
    assert int(got.stdout.split()[-1]) == zygote.proc.pid and got.args == [sys.executable, "-c", code, "x", "y z"]
    monkeypatch.setenv(prefork.ENV_SWITCH, "0")
    assert int(prefork.run_python(code, env=_env(), timeout=60).stdout.split()[-1]) == os.getpid()
    monkeypatch.setenv(prefork.ENV_SWITCH, "1")
    with pytest.raises(subprocess.TimeoutExpired):
        prefork.run_python("import time; time.sleep(30)", env=_env(), timeout=0.5)
