"""The ``vllm-mblt@mblt-sim`` column: Mobilint's own vLLM plugin (vllm-mblt 0.8.0 on vLLM 0.11.2,
unpatched, in its own environment, :mod:`npu_conformance.vendor_envs`) serving the same MXQ
artifacts as the ``mblt-sim`` column, on the same simulator (``npusim.mxq`` as ``qbruntime``),
through the same scenarios.

What differs from :class:`~npu_conformance.devices.mblt.MbltLab`, and nothing else:

* the servers run the vendor environment's ``vllm`` and ``python``, with
  :meth:`VendorEnv.server_environ <npu_conformance.vendor_envs.VendorEnv.server_environ>`;
* the artifacts carry the Hub releases' remote-code entry (``auto_map`` and a proxy module of
  ours, ``mxq compile --hub-proxy``), and every server gets ``--trust-remote-code`` unless its
  arguments have it (the engine-config probe too): that is how a Mobilint release registers its ``mobilint-*`` model type in
  vLLM's front end without our plugin;
* vllm-mblt logs no fault lines of its own, so the simulator's injected-fault message is the
  evidence that a fault struck.

The scenarios' expectations are the ``mblt-sim`` column's: where vllm-mblt behaves otherwise,
the report shows the difference (:mod:`npu_conformance.vendor_differences`) and
``docs/mblt.md`` says which side the seed supports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from npu_conformance import vendor_envs
from npu_conformance import vllm_server as vs
from npu_conformance.devices.mblt import MbltLab

_INJECTED = r"Injected fault: infer failed \(infer_fail_after=10"


@dataclass
class VllmMbltLab(MbltLab):
    """Per-session artifacts and vendor servers of the ``vllm-mblt@mblt-sim`` column."""

    vendor_env: ClassVar[str] = "mblt"
    hub_proxy: ClassVar[bool] = True
    probe_args: ClassVar[tuple[str, ...]] = ("--trust-remote-code",)
    worker_class: ClassVar[str] = "vllm_mblt.mblt_worker.MbltWorker"
    fault_evidence: ClassVar[dict[str, str]] = {"once": _INJECTED, "persistent": _INJECTED}

    @property
    def vendor(self) -> vendor_envs.VendorEnv:
        return vendor_envs.VENDOR_ENVS[self.vendor_env]

    def env(self, **extra: str) -> dict[str, str]:
        """The simulator target's vLLM environment and the vendor environment's additions
        (``extra`` wins)."""
        return vs.vllm_env(self.vendor.sim_target, **{**self.vendor.server_environ(), **extra})

    @property
    def python(self) -> str:
        return self.vendor.python()

    def command(self) -> list[str]:
        return self.vendor.vllm_command()

    def start(self, artifact: Path, args: Sequence[str], log: Path, *, timeout_s: float = vs.START_TIMEOUT_S,
              **env: str) -> vs.Server:
        """As :meth:`DeviceLab.start`, with ``--trust-remote-code``."""
        if "--trust-remote-code" not in args:
            args = (*args, "--trust-remote-code")
        return super().start(artifact, args, log, timeout_s=timeout_s, **env)
