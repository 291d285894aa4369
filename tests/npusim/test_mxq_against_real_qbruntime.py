"""``npusim.mxq`` against the real ``qbruntime`` 1.5.0 wheel, on everything that runs without an NPU.

The real wheel (``mobilint-qb-runtime==1.5.0``, pinned in ``ci/setup.sh``) imports and runs its
host side on a machine without a device: ``ModelConfig`` and its setters, the enums, ``CoreId``,
``BufferInfo``/``CacheInfo``, log levels, and the errors of ``Accelerator()`` without a card and
of ``Model()`` on a file that is not an MXQ. ``ci/setup.sh`` installs it with ``--target`` into
``<venv>/vendor/mobilint-qb-runtime-1.5.0``, outside ``sys.path``: nothing imports it but this
test, so it never shadows the simulator (``npusim.alias`` would step aside for it).

``qbruntime_probe.py`` runs the same calls under each, in a subprocess, and prints return
values, exceptions and glog lines (severity and text, per stream); the two transcripts must be
equal. When they disagree, the simulator has the bug.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REAL = Path(sys.prefix) / "vendor" / "mobilint-qb-runtime-1.5.0"
PROBE = Path(__file__).with_name("qbruntime_probe.py")


def _run(env_extra: dict[str, str]) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("NPU_HARNESS_TARGET", "NPUSIM_ALIAS", "NPUSIM_MXQ")}
    env.update(env_extra)
    done = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def transcripts() -> tuple[dict[str, object], dict[str, object]]:
    if platform.machine() != "x86_64":
        pytest.skip(f"the qbruntime 1.5.0 wheel is x86-64 only; this host is {platform.machine()}")
    if not (REAL / "qbruntime" / "__init__.py").is_file():
        pytest.fail(f"the real qbruntime 1.5.0 is not at {REAL}: ci/setup.sh installs it there")
    real = _run({"PYTHONPATH": str(REAL)})
    sim = _run({"NPUSIM_ALIAS": "qbruntime", "NPUSIM_MXQ": '{"no_device": true}'})
    return real, sim


def test_the_probe_reaches_the_real_wheel_and_the_simulator(transcripts):
    real, sim = transcripts
    assert real["accelerator without a device"]["raise"] == "QbRuntimeError"
    assert real.keys() == sim.keys() and len(real) >= 30


def test_every_probe_behaves_as_the_real_runtime(transcripts):
    real, sim = transcripts
    differing = {name: {"real": real[name], "sim": sim.get(name)} for name in real if real[name] != sim.get(name)}
    assert not differing, json.dumps(differing, indent=1)
