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
        if mode == "spawn-hold":  # a spawned child that sleeps; its pid printed
            ctx = mp.get_context("spawn")
            recv, send = ctx.Pipe(False)
            p = ctx.Process(target=child, args=(send, "sleep"))
            p.start()
            send.close()
            print("HOLDING", recv.recv()["pid"], flush=True)
            time.sleep(60)
        elif mode.startswith("spawn"):
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
    vllm_registry: OrderedDict = OrderedDict()
    monkeypatch.setattr(prefork, "PRELOAD", ("json",))
    monkeypatch.setattr(prefork, "VLLM_PRELOAD", ("json",))
    monkeypatch.setattr(prefork, "_zygotes", registry)
    monkeypatch.setattr(prefork, "_vllm_zygotes", vllm_registry)
    monkeypatch.setattr(prefork, "_vllm_refused", set())
    monkeypatch.setenv(prefork.ENV_SWITCH, "1")  # the default, whatever the run's own setting
    yield registry
    while vllm_registry:
        vllm_registry.popitem()[1].close()
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
    (zygote,) = prefork._vllm_zygotes.values()  # a start's spawns come from the zygote it came from
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
    kinds, vllm_zygotes = {}, {}
    for switch in ("deps", "1", "0"):
        monkeypatch.setenv(prefork.ENV_SWITCH, switch)
        server = vs.start("m", env=_env(), log=tmp_path / f"s{switch}.log", timeout_s=60)
        kinds[switch], vllm_zygotes[switch] = type(server.proc), len(prefork._vllm_zygotes)
        server.stop()
        assert server.proc.returncode == -signal.SIGTERM
    assert kinds == {"deps": prefork.PreforkProcess, "1": prefork.PreforkProcess, "0": subprocess.Popen}
    assert vllm_zygotes == {"deps": 0, "1": 1, "0": 1}, "deps forks from the plain zygote only"
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


def test_run_script_is_subprocess_run_of_python_script(zygotes, probe, tmp_path, monkeypatch):
    monkeypatch.setenv(prefork.ENV_SWITCH, "1")
    work = tmp_path / "work"
    work.mkdir()
    env = _env(PROBE_MODE="exit3", PROBE="s")
    got = prefork.run_script(probe, ["x", "y z"], env=env, timeout=60, cwd=work)
    want = subprocess.run([sys.executable, str(probe), "x", "y z"], env=env, capture_output=True, text=True,
                          cwd=work)
    (zygote,) = zygotes.values()
    assert got.returncode == want.returncode == 3 and got.stderr == want.stderr == ""
    mine, theirs = json.loads(got.stdout), json.loads(want.stdout)
    for field in ("argv", "path0", "file", "cwd", "env"):
        assert mine[field] == theirs[field], field
    assert mine["cwd"] == str(work) and got.args == [sys.executable, str(probe), "x", "y z"]
    monkeypatch.setenv(prefork.ENV_SWITCH, "0")
    assert prefork.run_script(probe, env=env, timeout=60).returncode == 3 and len(zygotes) == 1
    monkeypatch.setenv(prefork.ENV_SWITCH, "1")
    with pytest.raises(subprocess.TimeoutExpired):
        prefork.run_script(probe, env=_env(PROBE_MODE="sleep"), timeout=0.5)


def test_new_session_makes_the_child_a_process_group_leader(zygotes, probe, tmp_path):
    """``new_session=True`` is ``Popen(start_new_session=True)``; without it the child stays in
    the zygote's session."""
    children = []
    for session in (True, False):
        with open(tmp_path / f"{session}.log", "w") as fh:
            children.append(prefork.launch([str(probe)], env=_env(PROBE_MODE="sleep"), stdout=fh.fileno(),
                                           new_session=session))
    leader, plain = children
    assert os.getsid(leader.pid) == leader.pid == os.getpgid(leader.pid) != os.getpgid(0)
    assert os.getsid(plain.pid) != plain.pid
    for child in children:
        child.kill()
        assert child.wait(30) == -signal.SIGKILL


def test_killpg_of_a_new_session_ends_the_child_and_its_spawned_process(zygotes, probe, tmp_path):
    log = tmp_path / "spawn.log"
    with open(log, "w") as fh:
        proc = prefork.launch([str(probe), "hold"], env=_env(PROBE_MODE="spawn-hold"), stdout=fh.fileno(),
                              new_session=True)
    deadline = time.monotonic() + 60
    while "HOLDING" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    spawned = int(log.read_text().split("HOLDING")[1].split()[0])
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    while True:  # the zygote kills the spawned process once its launcher is gone
        try:
            os.kill(spawned, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline + 30, "the spawned process outlived its killed parent"
        time.sleep(0.2)


def test_poll_from_another_thread_while_one_waits(zygotes, probe, tmp_path):
    import threading

    with open(tmp_path / "log", "w") as fh:
        proc = prefork.launch([str(probe)], env=_env(PROBE_MODE="sleep"), stdout=fh.fileno())
    codes: list = []
    waiter = threading.Thread(target=lambda: codes.append(proc.wait(60)))
    waiter.start()
    polls = [proc.poll() for _ in range(20)]
    assert polls == [None] * 20
    proc.kill()
    waiter.join(60)
    assert codes == [-signal.SIGKILL] and proc.poll() == -signal.SIGKILL


ENV_MODULE = textwrap.dedent('''\
    import os
    SEEN = os.environ.get("VLLM_READ_AT_IMPORT")
    os.environ["VLLM_WRITTEN_AT_IMPORT"] = "w"
    os.environ.pop("VLLM_DELETED_AT_IMPORT", None)
    if os.environ.get("ENVMOD_FAIL"):
        raise ImportError("envmod refuses")
''')

SHOW = textwrap.dedent('''\
    #!{python}
    import json, os, sys
    mod = sys.modules.get("envmod")
    print(json.dumps({{"seen": getattr(mod, "SEEN", "not imported"), "ppid": os.getppid(),
                       "env": {{k: v for k, v in os.environ.items() if k.startswith("VLLM_") and k.endswith(("_AT_IMPORT", "_LATER"))}}}}))
''')


@pytest.fixture
def envmod(tmp_path, monkeypatch):
    """A vLLM zygote preload that reads, writes and deletes variables at import."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "envmod.py").write_text(ENV_MODULE)
    show = tmp_path / "show"
    show.write_text(SHOW.format(python=sys.executable))
    show.chmod(0o755)
    monkeypatch.setattr(prefork, "VLLM_PRELOAD", ("envmod",))
    return show, str(tmp_path / "mods")


def _show(show: Path, tmp_path: Path, **extra: str) -> dict:
    log = tmp_path / "show.log"
    with open(log, "w") as fh:
        proc = prefork.launch([str(show)], env=_env(**extra), stdout=fh.fileno())
    assert proc.wait(60) == 0, log.read_text()
    return json.loads(log.read_text().splitlines()[-1])


def test_a_vllm_zygote_serves_the_environments_equal_where_its_imports_read(zygotes, envmod, tmp_path):
    show, mods = envmod
    a = _show(show, tmp_path, PYTHONPATH=mods, VLLM_READ_AT_IMPORT="a", VLLM_DELETED_AT_IMPORT="x")
    (first,) = prefork._vllm_zygotes.values()
    assert first.reads is not None and "VLLM_READ_AT_IMPORT" in first.reads
    assert first.writes == {"VLLM_WRITTEN_AT_IMPORT": "w", "VLLM_DELETED_AT_IMPORT": None}
    # what a new interpreter importing envmod would have: its reads, its writes, its deletions
    assert a["seen"] == "a" and a["ppid"] == first.proc.pid
    assert a["env"] == {"VLLM_READ_AT_IMPORT": "a", "VLLM_WRITTEN_AT_IMPORT": "w"}
    # (pop() reads before it deletes: VLLM_DELETED_AT_IMPORT is a read too)
    other = _show(show, tmp_path, PYTHONPATH=mods, VLLM_READ_AT_IMPORT="a", VLLM_DELETED_AT_IMPORT="x",
                  VLLM_ONLY_READ_LATER="y")
    assert other["ppid"] == first.proc.pid and other["env"]["VLLM_ONLY_READ_LATER"] == "y"
    assert len(prefork._vllm_zygotes) == 1, "a variable the imports never read needs no zygote of its own"
    b = _show(show, tmp_path, PYTHONPATH=mods, VLLM_READ_AT_IMPORT="b", VLLM_DELETED_AT_IMPORT="x")
    assert b["seen"] == "b" and b["ppid"] != first.proc.pid and len(prefork._vllm_zygotes) == 2
    target = _show(show, tmp_path, PYTHONPATH=mods, VLLM_READ_AT_IMPORT="a", VLLM_DELETED_AT_IMPORT="x",
                   NPU_HARNESS_TARGET="rbln-sim")
    assert target["ppid"] not in (first.proc.pid, b["ppid"]), "the start-up hook's variables are keyed too"
    assert len(zygotes) == 1  # all forked from the one plain zygote of this import key


def test_a_vllm_zygote_refuses_a_spawn_whose_environment_its_imports_read_differently(zygotes, envmod, tmp_path):
    show, mods = envmod
    (tmp_path / "mods" / "spawner.py").write_text(textwrap.dedent('''\
        import multiprocessing as mp, os
        def child(conn):
            import envmod
            conn.send((os.getppid(), envmod.SEEN))
        def run(value):
            os.environ["VLLM_READ_AT_IMPORT"] = value
            ctx = mp.get_context("spawn")
            recv, send = ctx.Pipe(False)
            p = ctx.Process(target=child, args=(send,))
            p.start()
            send.close()
            got = recv.recv()
            p.join(30)
            return got
    '''))
    script = tmp_path / "spawns"
    script.write_text(f"#!{sys.executable}\nimport os, spawner\nif __name__ == '__main__':\n"
                      "    print('SAME', *spawner.run('a'), os.getpid())\n"
                      "    print('CHANGED', *spawner.run('c'), os.getpid())\n")
    log = tmp_path / "spawns.log"
    with open(log, "w") as fh:
        proc = prefork.launch([str(script)], env=_env(PYTHONPATH=mods, VLLM_READ_AT_IMPORT="a"), stdout=fh.fileno())
    assert proc.wait(120) == 0, log.read_text()
    (zygote,) = prefork._vllm_zygotes.values()
    same, changed = (line.split() for line in log.read_text().splitlines() if line.startswith(("SAME", "CHANGED")))
    assert same[1:3] == [str(zygote.proc.pid), "a"]
    # the spawn's environment reads 'c' where the zygote's imports read 'a': a new interpreter
    assert changed[1:3] == [changed[3], "c"]


def test_a_vllm_zygote_that_cannot_import_falls_back_to_the_plain_zygote_once(zygotes, envmod, tmp_path, capfd):
    show, mods = envmod
    for _ in range(2):
        got = _show(show, tmp_path, PYTHONPATH=mods, ENVMOD_FAIL="1", VLLM_READ_AT_IMPORT="a")
        (plain,) = zygotes.values()
        assert got["ppid"] == plain.proc.pid and got["seen"] == "not imported"
    assert not prefork._vllm_zygotes
    err = capfd.readouterr().err
    assert err.count("no vLLM zygote for this environment") == 1 and "ImportError: envmod refuses" in err


@pytest.mark.slow
def test_the_vllm_preload_is_what_both_vllm_processes_import_anyway(tmp_path, monkeypatch):
    """A new ``vllm serve`` on mblt-sim (``NPU_HARNESS_PREFORK=0``), with ``python -X
    importtime`` in both its processes: the API server and the engine core it spawns each
    import every module of :data:`prefork.VLLM_PRELOAD` (the engine core runs the ``vllm``
    script as ``__mp_main__``), so a forked one holds nothing a new one would not."""
    from npusim import tinymodel
    from npusim.mxq.compile import compile_artifact

    hf = tinymodel.build("llama", tmp_path / "hf")
    art = compile_artifact(hf, tmp_path / "art", max_batch_size=2, prefill_chunk_size=64)
    monkeypatch.setenv(prefork.ENV_SWITCH, "0")
    env = vs.vllm_env("mblt-sim", PYTHONPROFILEIMPORTTIME="1", VLLM_MBLT_PREFIX_CACHE_CALIBRATE="0")
    server = vs.start(art, ["--max-model-len", "256"], env=env, log=tmp_path / "serve.log")
    try:
        text = server.log_text()
    finally:
        server.stop()
    imported = [line.rsplit("|", 1)[-1].strip() for line in text.splitlines() if line.startswith("import time:")]
    for name in prefork.VLLM_PRELOAD:
        assert imported.count(name) == 2, f"{name}: imported by {imported.count(name)} of the 2 processes"


def _gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def test_a_zygote_with_a_live_child_is_not_evicted_and_its_children_die_with_it(zygotes, probe, tmp_path, monkeypatch):
    """LRU eviction skips a zygote whose child still runs (a server a lab keeps, a vLLM zygote);
    a child never outlives its zygote as an orphan (``PR_SET_PDEATHSIG``)."""
    monkeypatch.setattr(prefork, "MAX_ZYGOTES", 1)

    def start(mode: str, threads: str, kind: str = "script") -> prefork.PreforkProcess:
        with open(tmp_path / f"{threads}.log", "w") as fh:
            return prefork.launch([str(probe)], env=_env(PROBE_MODE=mode, OMP_NUM_THREADS=threads),
                                  stdout=fh.fileno(), kind=kind)

    kept = start("sleep", "1")
    first = next(iter(zygotes.values()))
    assert start("", "2").wait(60) == 0
    assert len(zygotes) == 2 and first.proc.poll() is None and kept.poll() is None, "a busy zygote was closed"
    kept.kill()
    assert kept.wait(30) == -signal.SIGKILL
    assert start("", "3").wait(60) == 0
    assert first.proc.poll() is not None and first not in zygotes.values(), "an idle zygote beyond the limit stays"
    for kind in ("script", "serve"):  # forked by a plain zygote, and by a vLLM zygote
        child = start("sleep", "3", kind)
        parent = next(iter(prefork._vllm_zygotes.values())) if kind == "serve" else zygotes[next(reversed(zygotes))]
        os.kill(parent.proc.pid, signal.SIGKILL)  # the zygote that forked it dies
        assert _gone(child.pid), f"a child of a {kind} zygote outlived it"
        assert child.wait(30) == -signal.SIGKILL



#: A stand-in for vLLM's registry module at its import name: what vLLM's runs it (``python -m``)
#: with a pickled callable on stdin, as vLLM's ``_run_in_subprocess`` does.
FAKE_REGISTRY = textwrap.dedent('''\
    import json, os, sys
    _SUBPROCESS_COMMAND = [sys.executable, "-m", __name__]

    def where():
        return {"ppid": os.getppid(), "argv": sys.argv, "path0": sys.path[0], "main": __name__,
                "stdin": sys.stdin.read()}

    if __name__ == "__main__":
        print(json.dumps(where()))
''')
REGISTRY_USER = textwrap.dedent('''\
    #!{python}
    import json, subprocess, sys
    from vllm.model_executor.models import registry
    def run(command):
        out = subprocess.run(command, input=b"pickled", capture_output=True, check=True)
        return json.loads(out.stdout)
    if __name__ == "__main__":
        print(json.dumps({{"command": registry._SUBPROCESS_COMMAND, "routed": run(registry._SUBPROCESS_COMMAND),
                          "new": run([sys.executable, "-m", registry.__name__])}}))
''')


@pytest.mark.parametrize("switch", ["1", "deps"])
def test_vllm_s_model_registry_run_is_forked_by_the_zygote_as_python_m_runs_it(zygotes, tmp_path, monkeypatch, switch):
    """vLLM inspects a model class it has not met in a new interpreter (``python -m
    vllm.model_executor.models.registry``, whose ``_SUBPROCESS_COMMAND`` vLLM documents as the
    value to change). A forked child points it at its zygote's launcher, whether it imported
    the registry before the fork (``1``: a vLLM zygote preloads it here) or after (``deps``);
    the run is then forked by the zygote, with what ``python -m`` gives a module: its file as
    ``sys.argv[0]``, the directory first on ``sys.path``, ``__main__``, the same stdin."""
    pkg = tmp_path / "fake" / "vllm" / "model_executor" / "models"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "registry.py").write_text(FAKE_REGISTRY)
    script = tmp_path / "user"
    script.write_text(REGISTRY_USER.format(python=sys.executable))
    monkeypatch.setenv(prefork.ENV_SWITCH, switch)
    if switch == "1":
        monkeypatch.setattr(prefork, "VLLM_PRELOAD", ("vllm.model_executor.models.registry",))
    log = tmp_path / "user.log"
    with open(log, "w") as fh:
        proc = prefork.launch([str(script)], env=_env(PYTHONPATH=str(tmp_path / "fake")), stdout=fh.fileno(),
                              cwd=str(tmp_path))
    assert proc.wait(60) == 0, log.read_text()
    got = json.loads(log.read_text().splitlines()[-1])
    zygote = next(iter((prefork._vllm_zygotes if switch == "1" else zygotes).values()))
    assert bool(prefork._vllm_zygotes) == (switch == "1")
    assert got["command"] == [str(zygote.launcher), "-m", "vllm.model_executor.models.registry"]
    assert got["routed"]["ppid"] == zygote.proc.pid, zygote.log.read_text()
    assert got["new"]["ppid"] == proc.pid
    for key in ("argv", "path0", "main", "stdin"):
        assert got["routed"][key] == got["new"][key], key
    assert got["routed"]["argv"] == [str(pkg / "registry.py")] and got["routed"]["stdin"] == "pickled"



REGISTRY_PROBE = textwrap.dedent('''\
    #!{python}
    import json, os
    from vllm.model_executor.models import registry

    def inspect():
        return os.getppid(), registry._ModelInfo.from_model_cls(
            registry.ModelRegistry.models["LlamaForCausalLM"].load_model_cls())

    if __name__ == "__main__":
        ppid, info = registry._run_in_subprocess(inspect)
        print(json.dumps({{"ppid": ppid, "info": repr(info)}}))
''')


@pytest.mark.slow
def test_vllm_s_model_registry_answers_from_the_zygote_what_it_answers_in_process(tmp_path):
    """The real thing, with this process's zygotes (the suite's own): a forked start's
    inspection of Llama comes from its vLLM zygote and holds what vLLM finds in this process."""
    pytest.importorskip("vllm")
    from vllm.model_executor.models import registry

    script = tmp_path / "registry_probe"
    script.write_text(REGISTRY_PROBE.format(python=sys.executable))
    log = tmp_path / "registry.log"
    env = {**_env(), prefork.ENV_SWITCH: "1"}
    with open(log, "w") as fh:
        proc = prefork.launch([str(script)], env=env, stdout=fh.fileno(), cwd=str(tmp_path))
    assert proc.wait(300) == 0, log.read_text()[-4000:]
    got = json.loads(log.read_text().splitlines()[-1])
    zygote = prefork.vllm_zygote_for(env)
    assert zygote is not None and got["ppid"] == zygote.proc.pid, zygote.log.read_text()[-3000:]
    here = registry._ModelInfo.from_model_cls(registry.ModelRegistry.models["LlamaForCausalLM"].load_model_cls())
    assert got["info"] == repr(here)
