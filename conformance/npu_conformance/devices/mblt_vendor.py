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
  evidence that a fault struck;
* a Qwen3-ASR release gets ``--model-loader-extra-config`` with its two MXQs' absolute paths
  (``encoder_mxq_path``, ``decoder_mxq_path``; keys the scenario passes itself are kept): the
  vendor's Qwen3-ASR config does not pass the release directory on to its sub-configs, so
  without them its worker looks the relative ``mxq_path`` up as the Hub repository ``mobilint/``
  and stops (``HFValidationError``). That is what a user of a local release has to pass.

The scenarios' expectations are the ``mblt-sim`` column's: where vllm-mblt behaves otherwise,
the report shows the difference (:mod:`npu_conformance.vendor_differences`) and
``docs/mblt.md`` says which side the seed supports.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from npu_conformance import vendor_envs
from npu_conformance import vllm_server as vs
from npu_conformance.devices.mblt import MbltLab

_INJECTED = r"Injected fault: infer failed \(infer_fail_after=10"
#: The release model types of Mobilint Qwen2-VL / Qwen3-VL.
VLM_MODEL_TYPES = ("mobilint-qwen2_vl", "mobilint-qwen3_vl")
#: ``vllm serve`` flags of vLLM 0.32 that vLLM 0.11.2 does not have, dropped from a vendor server's
#: arguments: ``--trust-request-mm-kwargs`` (vLLM 0.11.2 takes a request's ``mm_processor_kwargs``
#: without being told to).
_NOT_IN_VLLM_0_11 = ("--trust-request-mm-kwargs",)


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

    def vlm_release(self, kind: str) -> Path:
        """As :meth:`MbltLab.vlm_release` (compiled with ``hub_proxy``: ``auto_map``,
        ``proxy_qwen2_vl.py`` / ``proxy_qwen3_vl.py`` and ``text_config.architectures``, as the Hub
        releases carry), named ``Qwen2TokenizerFast`` (:meth:`_hub_release`)."""
        return self._hub_release(super().vlm_release(kind))

    def _hub_release(self, release: Path) -> Path:
        """A Qwen2-VL / Qwen3-VL release this lab compiled, as the Hub's: with the remote-code entry
        (``npusim.mxq.compile_vlm.add_hub_proxy``, for a release a scenario compiled itself) and its
        ``tokenizer_config.json`` naming ``Qwen2TokenizerFast`` (the same ``tokenizer.json``), as
        the Hub release's does: vLLM 0.11.2's Qwen2-VL / Qwen3-VL processing info builds the
        transformers-mblt processor, a Qwen2VLProcessor / Qwen3VLProcessor, which under
        transformers 4.57.6 refuses any other tokenizer class (``TypeError: Received a
        CachedPreTrainedTokenizerFast for argument tokenizer``). Other artifacts, and releases not
        built by the lab, are left as they are."""
        release = Path(release)
        try:
            config = json.loads((release / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return release
        if config.get("model_type") not in VLM_MODEL_TYPES or not release.is_relative_to(self.workdir):
            return release
        from npusim.mxq.compile_vlm import add_hub_proxy

        add_hub_proxy(release)
        _name_qwen2_tokenizer(release)
        return release

    def asr_release(self) -> Path:
        """As :meth:`MbltLab.asr_release`; the simulated release's ``tokenizer_config.json`` names
        ``Qwen2TokenizerFast`` (the same ``tokenizer.json``), as the Hub release's Qwen2 tokenizer
        class does: vllm-mblt builds qwen-asr's ``Qwen3ASRProcessor``, which under transformers
        4.57.6 refuses any other tokenizer class (``TypeError: Received a
        CachedPreTrainedTokenizerFast for argument tokenizer``); the tiny model's generic
        ``PreTrainedTokenizerFast`` is what transformers 5 writes and accepts."""
        release = super().asr_release()
        if release.is_relative_to(self.workdir):  # ours, not a board's release
            _name_qwen2_tokenizer(release)
        return release

    def start(self, artifact: Path, args: Sequence[str], log: Path, *, timeout_s: float = vs.START_TIMEOUT_S,
              **env: str) -> vs.Server:
        """As :meth:`DeviceLab.start`, with ``--trust-remote-code`` (and a Qwen3-ASR release's
        absolute MXQ paths, :func:`asr_loader_args`)."""
        if "--trust-remote-code" not in args:
            args = (*args, "--trust-remote-code")
        artifact = self._hub_release(artifact)
        args = tuple(a for a in args if a not in _NOT_IN_VLLM_0_11)
        return super().start(artifact, asr_loader_args(artifact, args), log, timeout_s=timeout_s, **env)


def asr_loader_args(artifact: Path, args: Sequence[str]) -> tuple[str, ...]:
    """``args`` with a Qwen3-ASR release's ``encoder_mxq_path`` / ``decoder_mxq_path`` made
    absolute in ``--model-loader-extra-config`` (merged into one the arguments already have, whose
    keys win); other artifacts' arguments unchanged."""
    args = tuple(args)
    try:
        config = json.loads((Path(artifact) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return args
    if config.get("model_type") != "mobilint-qwen3_asr":
        return args
    thinker = config.get("thinker_config") or {}
    paths = {f"{role}_mxq_path": str((Path(artifact) / thinker[sub]["mxq_path"]).resolve())
             for role, sub in (("encoder", "audio_config"), ("decoder", "text_config"))
             if isinstance(thinker.get(sub), dict) and thinker[sub].get("mxq_path")}
    flag = "--model-loader-extra-config"
    if flag in args[:-1]:
        i = args.index(flag)
        return (*args[:i], flag, json.dumps({**paths, **json.loads(args[i + 1])}), *args[i + 2:])
    return (*args, flag, json.dumps(paths))


def _name_qwen2_tokenizer(release: Path) -> None:
    """``release/tokenizer_config.json``'s generic ``PreTrainedTokenizerFast`` (what transformers 5
    writes) renamed ``Qwen2TokenizerFast`` (the Hub releases' class, the same ``tokenizer.json``)."""
    cfg_path = Path(release) / "tokenizer_config.json"
    if not cfg_path.is_file():
        return
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    if cfg.get("tokenizer_class") == "PreTrainedTokenizerFast":
        cfg["tokenizer_class"] = "Qwen2TokenizerFast"
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
