"""``npusim.alias``: ``import qbruntime`` / ``import rebel`` load the simulators when enabled,
never shadow a real installation, and the ``.pth`` hook enables them at interpreter start.

Every import check runs in a fresh interpreter: an alias mutates :data:`sys.meta_path`. The
hook installed into ``.venv`` by ``ci/setup.sh`` runs in those interpreters too; the tests pick
what it does with ``NPU_HARNESS_TARGET`` / ``NPUSIM_ALIAS`` (and call ``activate_from_env()``
themselves, idempotently, so they pass without the hook as well).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from npusim import alias

REPO = Path(__file__).resolve().parents[2]
SIMULATORS = REPO / "simulators"


def _run(code: str, tmp_path: Path, *, flags: tuple[str, ...] = (), pythonpath: tuple[Path, ...] = (),
         **env_vars: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with NPU_HARNESS_TARGET/NPUSIM_ALIAS set only as given."""
    env = {k: v for k, v in os.environ.items() if k not in (alias.TARGET_ENV_VAR, alias.ALIAS_ENV_VAR)}
    env.update(env_vars)
    paths = [str(p) for p in pythonpath] + [str(SIMULATORS)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_qbruntime_is_the_simulator_module_object_and_so_are_its_submodules(tmp_path):
    out = _ok(_run("""
        import importlib.util, sys
        import npusim.alias as a
        a.activate_from_env()
        assert a.active() == ("qbruntime",), a.active()
        assert "npusim.mxq" not in sys.modules and "numpy" not in sys.modules  # lazy, stdlib only
        import qbruntime, npusim.mxq
        assert qbruntime is npusim.mxq and qbruntime.__spec__.name == "npusim.mxq"
        import qbruntime.machine, npusim.mxq.machine
        assert qbruntime.machine is npusim.mxq.machine
        from qbruntime.model import Model
        assert Model is npusim.mxq.model.Model is qbruntime.Model
        import qbruntime.compile  # a submodule not imported yet by npusim.mxq itself
        assert sys.modules["qbruntime.compile"] is sys.modules["npusim.mxq.compile"]
        assert importlib.util.find_spec("qbruntime.no_such_module") is None
        try:
            import qbruntime.no_such_module
        except ModuleNotFoundError as exc:
            assert exc.name == "qbruntime.no_such_module", exc.name
            print("MISSING", exc)
        print("STATUS", a.status("qbruntime").state)
    """, tmp_path, NPUSIM_ALIAS="qbruntime"))
    assert "MISSING No module named 'qbruntime.no_such_module'" in out
    assert "STATUS alias" in out


def test_npusim_alias_imports_the_standard_library_only(tmp_path):
    out = _ok(_run("""
        import sys
        before = set(sys.modules)
        import npusim.alias as a
        a.activate("rebel"); a.activate("qbruntime"); a.status("rebel"); a.status("qbruntime")
        new = {m.partition(".")[0] for m in set(sys.modules) - before}
        print("NONSTDLIB", sorted(new - set(sys.stdlib_module_names) - {"npusim"}))
    """, tmp_path))
    assert "NONSTDLIB []" in out


def test_rebel_top_level_import_is_npusim_rbln(tmp_path):
    out = _ok(_run("""
        import npusim.alias as a
        a.activate_from_env()
        import rebel
        print("NAME", rebel.__name__)
    """, tmp_path, NPUSIM_ALIAS="rebel"))
    assert "NAME npusim.rbln" in out


@pytest.mark.parametrize(("target_name", "on", "off"), [("rbln-sim", "rebel", "qbruntime"),
                                                     ("mblt-sim", "qbruntime", "rebel")])
def test_a_simulator_target_enables_its_own_alias_only(tmp_path, target_name, on, off):
    out = _ok(_run(f"""
        import npusim.alias as a
        a.activate_from_env()
        import {on}
        print("ON", {on}.__name__)
        try:
            import {off}
        except ModuleNotFoundError as exc:
            print("OFF", exc)
    """, tmp_path, NPU_HARNESS_TARGET=target_name))
    assert f"ON {alias.ALIASES[on]}" in out
    assert f"OFF No module named '{off}'" in out


@pytest.mark.parametrize("env", [{}, {"NPU_HARNESS_TARGET": "rbln-hw"}, {"NPU_HARNESS_TARGET": "mblt-hw"},
                                 {"NPU_HARNESS_TARGET": "nonsense"}, {"NPUSIM_ALIAS": ""}])
def test_without_an_enabling_variable_there_is_no_alias(tmp_path, env):
    out = _ok(_run("""
        import npusim.alias as a
        a.activate_from_env()
        for name in ("rebel", "qbruntime"):
            try:
                __import__(name)
            except ModuleNotFoundError as exc:
                print("MISSING", exc)
            st = a.status(name)
            print("STATUS", st.state, st.detail)
        print("ACTIVE", a.active())
    """, tmp_path, **env))
    assert "MISSING No module named 'rebel'" in out and "MISSING No module named 'qbruntime'" in out
    assert "STATUS inactive active when NPU_HARNESS_TARGET=rbln-sim or NPUSIM_ALIAS=rebel" in out
    assert "ACTIVE ()" in out


def test_a_real_installation_wins_and_status_names_its_path(tmp_path):
    real = tmp_path / "real"
    for name in alias.ALIASES:
        (real / name).mkdir(parents=True)
        (real / name / "__init__.py").write_text("REAL = True\n")
    out = _ok(_run("""
        import npusim.alias as a
        a.activate_from_env()
        for name in ("qbruntime", "rebel"):
            before = a.status(name)
            mod = __import__(name)
            after = a.status(name)
            assert mod.REAL and mod.__name__ == name
            print("REAL", name, before.state, before.module, after.state, after.module)
    """, tmp_path, pythonpath=(real,), NPUSIM_ALIAS="qbruntime,rebel"))
    for name in alias.ALIASES:
        origin = real / name / "__init__.py"
        assert f"REAL {name} real {origin} real {origin}" in out


def test_a_namespace_directory_is_not_a_real_installation(tmp_path):
    (tmp_path / "qbruntime").mkdir()  # in the working directory, first on sys.path for -c
    out = _ok(_run("""
        import npusim.alias as a
        a.activate_from_env()
        import qbruntime
        print("NAME", qbruntime.__name__)
    """, tmp_path, NPUSIM_ALIAS="qbruntime"))
    assert "NAME npusim.mxq" in out


def test_deactivate_removes_the_finder_and_keeps_imported_modules(tmp_path):
    out = _ok(_run("""
        import sys
        import npusim.alias as a
        a.activate("qbruntime"); a.activate("qbruntime"); a.activate("rebel")
        finders = [f for f in sys.meta_path if type(f).__name__ == "_AliasFinder"]
        assert len(finders) == 1 and sys.meta_path[0] is finders[0]
        import importlib.abc
        assert isinstance(finders[0], importlib.abc.MetaPathFinder)
        import qbruntime
        a.deactivate("qbruntime")
        assert a.active() == ("rebel",) and finders[0] in sys.meta_path
        a.deactivate("rebel"); a.deactivate("rebel")
        assert a.active() == () and finders[0] not in sys.meta_path
        assert sys.modules["qbruntime"] is sys.modules["npusim.mxq"]
        del sys.modules["qbruntime"]
        try:
            import qbruntime
        except ModuleNotFoundError:
            print("GONE")
    """, tmp_path))
    assert "GONE" in out


def test_unknown_alias_names_are_value_errors():
    for call in (alias.activate, alias.deactivate, alias.status):
        with pytest.raises(ValueError, match="unknown alias 'rebl'; expected one of: qbruntime, rebel"):
            call("rebl")


def test_enabled_by_env_reads_both_variables_and_reports_unknown_names():
    assert alias.enabled_by_env({}) == ({}, [])
    assert alias.enabled_by_env({"NPU_HARNESS_TARGET": " rbln-sim "}) == (
        {"rebel": "NPU_HARNESS_TARGET=rbln-sim"}, [])
    enabled, problems = alias.enabled_by_env({"NPUSIM_ALIAS": " qbruntime, ,rebl,"})
    assert enabled == {"qbruntime": "NPUSIM_ALIAS=qbruntime, ,rebl,"}
    assert problems == ["NPUSIM_ALIAS names unknown alias 'rebl'; expected some of: qbruntime, rebel"]


@pytest.mark.parametrize("environ", [42, None.__class__, {"NPUSIM_ALIAS": 5}, {"NPUSIM_ALIAS": b"rebel"},
                                     {"NPU_HARNESS_TARGET": ["rbln-sim"]}, {"NPUSIM_ALIAS": ",,\x00\udcff,"},
                                     {"NPU_HARNESS_TARGET": "x" * 100_000}])
def test_activate_from_env_never_raises_on_garbage(environ):
    before = list(sys.meta_path)
    assert alias.activate_from_env(environ) == ()
    assert sys.meta_path == before
    alias.activate_from_env({})  # clears the recorded problems
    assert alias.activation_errors() == ()


def test_garbage_variables_do_not_break_interpreter_start(tmp_path):
    proc = _run("import npusim.alias as a; print('ERRORS', a.activation_errors(), a.active())", tmp_path,
                NPUSIM_ALIAS=",,rebl;qbruntime ,\t", NPU_HARNESS_TARGET="???")
    out = _ok(proc)
    assert proc.stderr == ""
    if alias.installed_pth(Path(sysconfig.get_paths()["purelib"])):  # the hook recorded them at start
        assert "NPUSIM_ALIAS names unknown alias 'rebl;qbruntime'" in out and out.rstrip().endswith(" ()")


def test_pth_install_runs_activation_at_site_processing_and_remove_deletes_it(tmp_path):
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    path = alias.install_pth(site_dir)
    assert path == site_dir / "npu_harness_alias.pth" == alias.installed_pth(site_dir)
    text = path.read_text()
    assert text == alias.pth_line() + "\n" and text.count("\n") == 1 and text.startswith("import ")
    # -S: no site-packages processing (so not the venv's hook); npusim and numpy come from
    # PYTHONPATH, where .pth files are not read.
    code = f"""
        import site, sys
        assert "npusim.alias" not in sys.modules
        site.addsitedir({str(site_dir)!r})
        import npusim.alias as a
        print("ACTIVE", a.active())
        import qbruntime
        print("NAME", qbruntime.__name__)
    """
    purelib = Path(sysconfig.get_paths()["purelib"])
    proc = _run(code, tmp_path, flags=("-S",), pythonpath=(purelib,), NPUSIM_ALIAS="qbruntime")
    assert "ACTIVE ('qbruntime',)" in _ok(proc) and "NAME npusim.mxq" in proc.stdout
    quiet = _run(f"import site, sys; site.addsitedir({str(site_dir)!r}); print('npusim' in sys.modules)",
                 tmp_path, flags=("-S",))
    assert _ok(quiet).strip() == "False"  # no variable set: the hook imports nothing
    assert alias.remove_pth(site_dir) == path and not path.exists()
    assert alias.remove_pth(site_dir) is None and alias.installed_pth(site_dir) is None


def test_pth_line_is_harmless_where_npusim_is_not_importable(tmp_path):
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    alias.install_pth(site_dir)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["NPUSIM_ALIAS"] = "rebel"
    proc = subprocess.run([sys.executable, "-S", "-c", f"import site; site.addsitedir({str(site_dir)!r}); print('OK')"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK" and proc.stderr == "", proc.stderr


def test_the_venv_hook_enables_the_alias_in_every_new_interpreter(tmp_path):
    if alias.installed_pth(Path(sysconfig.get_paths()["purelib"])) is None:
        pytest.skip("the alias hook is not installed here (ci/setup.sh: npu-harness alias install)")
    out = _ok(_run("import rebel, sys; print('NAME', rebel.__name__, 'npusim.alias' in sys.modules)",
                   tmp_path, NPU_HARNESS_TARGET="rbln-sim"))
    assert "NAME npusim.rbln True" in out


def test_site_packages_of_a_venv(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no lib/python3"):
        alias.site_packages_of(tmp_path)
    sp = tmp_path / "lib" / "python3.11" / "site-packages"
    sp.mkdir(parents=True)
    assert alias.site_packages_of(tmp_path) == sp
    with pytest.raises(NotADirectoryError):
        alias.install_pth(tmp_path / "missing")


def test_hardware_probes_refuse_the_simulator_behind_a_vendor_name(tmp_path):
    out = _ok(_run("""
        import npusim.alias as a
        a.activate_from_env()
        from npu_conformance.targets import TARGETS
        print("HW", TARGETS["mblt-hw"].probe())
    """, tmp_path, NPUSIM_ALIAS="qbruntime"))
    assert "HW Availability(available=False, reason='import qbruntime gives the simulator npusim.mxq" in out


def test_cli_alias_status_install_and_remove(tmp_path, capsys):
    from npu_conformance.cli import main

    assert main(["alias", "status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["alias qbruntime", "alias rebel", "alias hook"]
    assert "-> npusim.rbln" in lines[1] or lines[1].startswith("alias rebel: real ")
    venv = tmp_path / "venv"
    sp = venv / "lib" / "python3.11" / "site-packages"
    sp.mkdir(parents=True)
    assert main(["alias", "install", "--env", str(venv)]) == 0
    assert (sp / alias.PTH_NAME).read_text() == alias.pth_line() + "\n"
    assert main(["alias", "status", "--env", str(venv)]) == 0
    assert f"alias hook: installed {sp / alias.PTH_NAME}" in capsys.readouterr().out
    assert main(["alias", "remove", "--env", str(venv)]) == 0
    assert main(["alias", "remove", "--env", str(venv)]) == 0
    out = capsys.readouterr().out
    assert f"alias start-up hook removed: {sp / alias.PTH_NAME}" in out and f"no alias start-up hook in {sp}" in out
    assert main(["alias", "install", "--env", str(tmp_path / "nothing")]) == 2
    assert "has no lib/python3.*/site-packages" in capsys.readouterr().err
