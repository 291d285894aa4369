"""The ``vllm-rbln@rbln-sim`` column: Rebellions' own vLLM plugin (vllm-rbln 0.12.0, unpatched,
in its own environment, :mod:`npu_conformance.vendor_envs`) serving the same tiny model as the
``rbln-sim`` column, on the same simulator (``npusim.rbln`` as ``rebel``), through the same
scenarios.

What differs from :class:`~npu_conformance.devices.rbln.RblnLab`, and nothing else:

* the servers run the vendor environment's ``vllm`` and ``python``, with
  :meth:`VendorEnv.server_environ <npu_conformance.vendor_envs.VendorEnv.server_environ>`
  (``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` and the torchvision import placeholder; ``docs/rbln.md``
  says why each is needed);
* the scenarios read vllm-rbln's worker classes, and no plan of ours in ``additional_config``;
* its fault plans let vllm-rbln's longer warm-up pass (:attr:`VllmRblnLab.fault_after_calls`)
  and take the simulator's own fault message as evidence;
* every server gets ``--dtype float32`` unless its arguments name a dtype: vLLM 0.30 downcasts
  a float32 checkpoint to bfloat16 on CPU, and the golden decoder the scenarios compare with is
  float32 (our plugin keeps the checkpoint's float32 on ``rbln-sim``).

The scenarios' expectations (the refusals, the faults, the seed's rules) are the
``rbln-sim`` column's: where the vendor's plugin behaves otherwise, the report shows the
difference and ``docs/rbln.md`` says which side the seed supports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from npu_conformance import vendor_envs
from npu_conformance import vllm_server as vs
from npu_conformance.devices.rbln import RblnLab

#: Added to every vendor server's arguments that name no dtype (see the module docstring).
FLOAT32_ARGS: tuple[str, ...] = ("--dtype", "float32")


@dataclass
class VllmRblnLab(RblnLab):
    """Per-session models, compile cache and vendor servers of the ``vllm-rbln@rbln-sim`` column."""

    vendor_env: ClassVar[str] = "rbln"
    worker_classes: ClassVar[dict[str, str]] = {"optimum": "vllm_rbln.v1.worker.optimum_worker.RBLNOptimumWorker",
                                                "vllm": "vllm_rbln.v1.worker.rbln_worker.RBLNWorker"}
    writes_plan: ClassVar[bool] = False  # vllm-rbln's additional_config is its own config class
    #: vllm-rbln's start-up makes 11 to 20 runtime calls (its warm-up runs the sampler programs
    #: of greedy, random, top-p and top-k on every decode batch); a fault plan starts after them.
    fault_after_calls: ClassVar[int] = 20
    #: vllm-rbln logs no fault lines of its own: the simulator's message in its traceback is the
    #: evidence (``npusim.rbln.runtime``).
    fault_evidence: ClassVar[dict[str, str]] = {"once": r"npusim\.rbln injected fault, runtime call 21\)",
                                                "persistent": r"npusim\.rbln injected fault, runtime call 21\)"}

    @property
    def vendor(self) -> vendor_envs.VendorEnv:
        return vendor_envs.VENDOR_ENVS[self.vendor_env]

    def env(self, **extra: str) -> dict[str, str]:
        """The simulator target's vLLM environment, this session's ``VLLM_CACHE_ROOT`` and the
        vendor environment's additions (``extra`` wins)."""
        return vs.vllm_env(self.vendor.sim_target, **{"VLLM_CACHE_ROOT": str(self.cache_root),
                                                      **self.vendor.server_environ(), **extra})

    @property
    def python(self) -> str:
        return self.vendor.python()

    def command(self) -> list[str]:
        return self.vendor.vllm_command()

    def start(self, artifact: Path, args: Sequence[str], log: Path, *, timeout_s: float = vs.START_TIMEOUT_S,
              **env: str) -> vs.Server:
        """As :meth:`DeviceLab.start`, with :data:`FLOAT32_ARGS` unless ``args`` name a dtype."""
        if "--dtype" not in args:
            args = (*args, *FLOAT32_ARGS)
        return super().start(artifact, args, log, timeout_s=timeout_s, **env)
