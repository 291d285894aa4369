"""The MBLT device for the serving suite and the MBLT scenarios: artifacts for the target,
vLLM servers on them, the plugin's refusals and injectable faults, and vLLM's resolved engine
config for a given artifact and command line.

* On ``mblt-sim`` artifacts are compiled here from the tiny llama (``npusim.mxq.compile``),
  and the golden decoder (``npusim.llm``) is the reference for greedy outputs.
* On ``mblt-hw`` the base artifact is a real Mobilint release directory named by
  ``NPU_HARNESS_MBLT_ARTIFACT``; scenarios that need another ``config.json`` get a copy of
  it whose other files are symlinks (the MXQ is never copied). There is no golden decoder for
  a release model: scenarios compare against the same requests sent one at a time.

Servers are real ``vllm serve`` processes with ``NPU_HARNESS_TARGET`` set to the target;
each distinct (artifact, arguments, environment) starts once per session
(:class:`npu_conformance.devices.base.DeviceLab`).

Fault model (simulator only, ``NPUSIM_MXQ``): ``once`` makes one ``Model.infer`` fail, which
the worker retries (log line ``MBLT infer failed on slots``); ``persistent`` makes every infer
fail from the 10th on, and the worker's retry fails too (``MBLT infer failed twice``): the
engine stops and every request in flight gets an error. Start-up faults (BadAlloc at launch,
no device) are MBLT scenarios of their own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from npu_conformance import prefork
from npu_conformance import vllm_server as vs
from npu_conformance.devices.base import HOST_SAMPLER_REFUSALS, HOST_SERVING_ARGS, STANDARD_TINY_OVERRIDES, ArtifactUnavailable, DeviceLab, FaultPlan, FaultsUnsupported, Refusal

ARTIFACT_ENV = "NPU_HARNESS_MBLT_ARTIFACT"
#: A Mobilint Mixture-of-Experts release directory (e.g. mobilint/Qwen3-30B-A3B) for ``mblt-hw``.
MOE_RELEASE_ENV = "NPU_HARNESS_MBLT_MOE_RELEASE"
#: On ``mblt-hw``: the directory of a Mobilint EAGLE-3 release (``eagle3_*`` scenarios).
EAGLE3_RELEASE_ENV = "NPU_HARNESS_MBLT_EAGLE3_RELEASE"
#: On ``mblt-hw``: the directory of a Mobilint Qwen3-ASR release (``asr_*`` scenarios).
ASR_RELEASE_ENV = "NPU_HARNESS_MBLT_ASR_RELEASE"
#: On ``mblt-hw``: the release directory of each vision-language build the ``vlm_*`` scenarios use,
#: ``NPU_HARNESS_MBLT_VLM_RELEASE_<KIND>`` with KIND one of :data:`VLM_RELEASES` upper-cased.
VLM_RELEASE_ENV = "NPU_HARNESS_MBLT_VLM_RELEASE_"
#: The vision-language builds the scenarios serve: the tiny family, ``mxq compile``'s ``vlm``
#: options and its other options that make the simulated one (the shipped kinds: static
#: Qwen2-VL-2B, static Qwen3-VL-2B W8 (bundled, no RoPE input), dynamic Qwen3-VL-8B W8 (bundled,
#: RoPE input), and a Batch16-style dynamic Qwen3-VL (batch text MXQ, 4 cache ids here)).
VLM_RELEASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "qwen2_vl": ("qwen2_vl", {"vision": "static"}, {}),
    "qwen3_vl": ("qwen3_vl", {"vision": "static", "text_layout": "bundled"}, {}),
    "qwen3_vl_dynamic": ("qwen3_vl", {"vision": "dynamic", "text_layout": "bundled"}, {}),
    "qwen3_vl_batch": ("qwen3_vl", {"vision": "dynamic", "text_layout": "bundled"},
                       {"max_batch_size": 4, "prefill_chunk_size": 64}),
}
#: Cards the simulated MoE release is placed on (the release's default placement: 3).
MOE_DEVICES = 3
CONFIG_MARK = "NPU_HARNESS_CONFIG "

_PROBE = r'''
import json, sys
from vllm.engine.arg_utils import EngineArgs
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
for argv in json.loads(sys.argv[1]):
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    try:
        cfg = EngineArgs.from_cli_args(parser.parse_args(argv)).create_engine_config()
    except Exception as exc:
        print("NPU_HARNESS_CONFIG " + json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        continue
    s, c = cfg.scheduler_config, cfg.cache_config
    print("NPU_HARNESS_CONFIG " + json.dumps({
        "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
        "long_prefill_token_threshold": s.long_prefill_token_threshold,
        "block_size": c.block_size, "enable_prefix_caching": c.enable_prefix_caching,
        "max_model_len": cfg.model_config.max_model_len,
        "worker_cls": cfg.parallel_config.worker_cls}), flush=True)
'''


#: The seed's chunk dict of the standard artifact (``single`` 64, ``global4`` 256).
SERVING_CHUNKS = {"single": 64, "global4": 256}


@dataclass
class MbltLab(DeviceLab):
    """Per-session artifacts and servers for one MBLT target (``mblt-sim`` or ``mblt-hw``)."""

    _artifacts: dict[str, Path] = field(default_factory=dict)
    _hf_dir: Path | None = None
    _golden: Any = None
    _moe: Path | None = None
    _moe_golden: Any = None
    _eagle3: Path | None = None
    _eagle3_golden: Any = None
    _asr: Path | None = None
    _asr_golden: Any = None
    _vlm: dict[str, Path] = field(default_factory=dict)
    _vlm_golden: dict[str, Any] = field(default_factory=dict)

    device: ClassVar[str] = "mblt"
    max_model_len: ClassVar[int] = 1024
    #: What ``MbltPlatform.validate_request`` refuses (``vllm_npu.mblt.platform``). ``min_p``
    #: needs a temperature: vLLM clears it for greedy requests before the platform sees them.
    refusals: ClassVar[tuple[Refusal, ...]] = HOST_SAMPLER_REFUSALS
    serves_prompt_embeds: ClassVar[bool] = True  # its MXQs take embeddings from the host
    #: Whether simulated artifacts carry the Hub releases' remote-code entry (``auto_map`` and
    #: the proxy module: ``mxq compile --hub-proxy``), which vLLM needs without our plugin.
    hub_proxy: ClassVar[bool] = False
    #: The worker class the platform resolves (``scheduler_from_artifact`` checks it).
    worker_class: ClassVar[str] = "vllm_npu.mblt.worker.MbltWorker"
    #: Added to every argument list of :meth:`engine_configs`.
    probe_args: ClassVar[tuple[str, ...]] = ()
    #: Per fault kind, what the server log shows once the fault struck (the worker's own lines).
    fault_evidence: ClassVar[dict[str, str]] = {"once": r"MBLT infer failed on slots",
                                                "persistent": r"MBLT infer failed twice"}

    @property
    def trace_dir(self) -> Path:
        """Where :meth:`serving_server` writes NPU traces (``VLLM_TORCH_PROFILER_DIR``)."""
        path = self.workdir / "traces"
        path.mkdir(exist_ok=True)
        return path

    def serving_server(self) -> vs.Server:
        """K=4 artifact with the seed's chunk dict, ``--max-model-len 1024``; NPU tracing on
        and prefix min-hit 256 (for the MBLT prefix scenario; greedy requests do not notice)."""
        art = self.artifact(k=4, chunk=SERVING_CHUNKS)
        return self.server(art, ["--max-model-len", str(self.max_model_len), *HOST_SERVING_ARGS], pin=True,
                           VLLM_TORCH_PROFILER_DIR=str(self.trace_dir),
                           VLLM_MBLT_PREFIX_CACHE_AUTO_THRESHOLD="0",
                           VLLM_MBLT_PREFIX_CACHE_MIN_HIT_TOKENS="256")

    def fault(self, kind: str) -> FaultPlan:
        """``NPUSIM_MXQ`` infer failures from the 10th infer on: one (``once``) or all
        (``persistent``). No start-up calibration, so the fault hits a request's infer.

        Raises:
            FaultsUnsupported: on ``mblt-hw`` (faults are injected into the simulator only).
            ValueError: an unknown ``kind``.
        """
        if kind not in self.FAULT_KINDS:
            raise ValueError(f"fault kind {kind!r} is not one of {self.FAULT_KINDS}")
        if not self.simulated:
            raise FaultsUnsupported("faults are injected only into the simulator (npusim.mxq, NPUSIM_MXQ)")
        times = 1 if kind == "once" else 1000
        return FaultPlan(self.artifact(k=4, chunk=128), ("--max-model-len", str(self.max_model_len)),
                         {"VLLM_MBLT_PREFIX_CACHE_CALIBRATE": "0",
                          "NPUSIM_MXQ": json.dumps({"infer_fail_after": 10, "infer_fail_times": times})},
                         self.fault_evidence[kind])

    # ------------------------------------------------------------------ artifacts

    def hf_dir(self) -> Path:
        """The tiny llama HF directory the simulated artifacts are compiled from."""
        if self._hf_dir is None:
            from npusim import tinymodel

            self._hf_dir = tinymodel.build("llama", self.workdir / "tiny-llama", **dict(STANDARD_TINY_OVERRIDES))
        return self._hf_dir

    def golden(self):
        """The golden decoder of the simulated artifacts (None on hardware)."""
        if not self.simulated:
            return None
        if self._golden is None:
            from npusim.llm import Decoder

            self._golden = Decoder.from_pretrained(self.hf_dir())
        return self._golden

    def base_k(self, artifact: Path) -> int:
        """The compiled batch capacity K the artifact's config declares (1 when absent)."""
        cfg = json.loads((artifact / "config.json").read_text())
        return int(cfg.get("max_batch_size") or 1)

    def kv_capacity(self, artifact: Path) -> int:
        """KV tokens per cache id of the artifact's MXQ, read through the target's runtime
        (``Model(path).get_input_buffer_info()[0].max_cache_size``; no launch needed)."""
        import importlib

        runtime = importlib.import_module("npusim.mxq" if self.simulated else "qbruntime")
        cfg = json.loads((artifact / "config.json").read_text())
        model = runtime.Model(str(artifact / cfg["mxq_path"]))
        return int(model.get_input_buffer_info()[0].max_cache_size)

    def artifact(self, *, k: int = 4, core_mode: str = "single", chunk: Any = None,
                 max_cache_size: int | None = None, edits: Mapping[str, Any] | None = None,
                 drop: Sequence[str] = ()) -> Path:
        """An artifact with batch capacity ``k`` (``k=0``: whatever the hardware base has),
        its ``config.json`` changed by ``edits`` and without the keys in ``drop``.

        Raises:
            ArtifactUnavailable: on hardware, no ``NPU_HARNESS_MBLT_ARTIFACT``, or its K
                differs from a required ``k``.
        """
        key = json.dumps([k, core_mode, chunk, max_cache_size, dict(edits or {}), list(drop)],
                         sort_keys=True, default=str)
        if key in self._artifacts:
            return self._artifacts[key]
        if self.simulated:
            from npusim.mxq.compile import compile_artifact

            base = self.workdir / f"mxq-{len(self._artifacts)}"
            compile_artifact(self.hf_dir(), base, max_batch_size=max(k, 1), core_mode=core_mode,
                             prefill_chunk_size=chunk if chunk is not None else 128,
                             max_cache_size=max_cache_size, hub_proxy=self.hub_proxy)
            out = base
            if edits or drop:
                out = self._variant(base, edits, drop)
        else:
            raw = os.environ.get(ARTIFACT_ENV, "")
            if not raw:
                raise ArtifactUnavailable(f"set {ARTIFACT_ENV} to a Mobilint MXQ artifact directory")
            base = Path(raw)
            if k and self.base_k(base) != k:
                raise ArtifactUnavailable(
                    f"scenario needs an MXQ compiled with batch {k}; {base} declares {self.base_k(base)}"
                )
            out = self._variant(base, edits, drop) if (edits or drop) else base
        self._artifacts[key] = out
        return out

    def _variant(self, base: Path, edits: Mapping[str, Any] | None, drop: Sequence[str]) -> Path:
        out = self.workdir / f"variant-{len(self._artifacts)}-{base.name}"
        out.mkdir(parents=True, exist_ok=True)
        for f in base.iterdir():
            if f.name != "config.json" and not (out / f.name).exists():
                (out / f.name).symlink_to(f.resolve())
        cfg = json.loads((base / "config.json").read_text())
        for name in drop:
            cfg.pop(name, None)
        cfg.update(edits or {})
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        return out

    # ------------------------------------------------------------------ Mixture-of-Experts
    def moe_release(self) -> Path:
        """A Mixture-of-Experts release: on ``mblt-sim`` the tiny Qwen3-MoE (2 layers, 8 experts,
        top-2) compiled by ``mxq compile`` in the release layout (packs and index, placed on
        :data:`MOE_DEVICES` cards, chunk 64); on ``mblt-hw`` the directory ``NPU_HARNESS_MBLT_MOE_RELEASE``
        names.

        Raises:
            ArtifactUnavailable: on hardware, the variable is not set.
        """
        if self._moe is None:
            if self.simulated:
                from npusim import tinymodel
                from npusim.mxq.compile import compile_artifact

                hf = tinymodel.build("qwen3_moe", self.workdir / "tiny-qwen3-moe")
                self._moe = compile_artifact(hf, self.workdir / "moe-release", prefill_chunk_size=64,
                                             hub_proxy=self.hub_proxy, moe={"devices": MOE_DEVICES})
            else:
                raw = os.environ.get(MOE_RELEASE_ENV, "")
                if not raw:
                    raise ArtifactUnavailable(f"set {MOE_RELEASE_ENV} to a Mobilint Mixture-of-Experts release directory")
                self._moe = Path(raw)
        return self._moe

    def moe_golden(self):
        """The golden decoder of the simulated MoE release (None on hardware)."""
        if not self.simulated:
            return None
        if self._moe_golden is None:
            from npusim.llm import Decoder

            self.moe_release()
            self._moe_golden = Decoder.from_pretrained(self.workdir / "tiny-qwen3-moe")
        return self._moe_golden

    def moe_env(self) -> dict[str, str]:
        """The environment a MoE server needs: on the simulator, :data:`MOE_DEVICES` cards."""
        return {"NPUSIM_MXQ": json.dumps({"devices": MOE_DEVICES})} if self.simulated else {}

    # ------------------------------------------------------------------ EAGLE-3
    def eagle3_release(self) -> Path:
        """An EAGLE-3 release: on ``mblt-sim`` the tiny fitted EAGLE-3 checkpoint
        (``make-model --eagle3``: a 4-layer Llama base and its one-block draft) compiled by
        ``mxq compile`` in the release layout (the vendor's tree 5/8/64, chunk 64); on
        ``mblt-hw`` the directory ``NPU_HARNESS_MBLT_EAGLE3_RELEASE`` names.

        Raises:
            ArtifactUnavailable: on hardware, the variable is not set.
        """
        if self._eagle3 is None:
            if self.simulated:
                from npusim.mxq.compile import compile_artifact
                from npusim.tinymodel.eagle3 import build_eagle3

                hf = build_eagle3(self.workdir / "tiny-eagle3")
                self._eagle3 = compile_artifact(hf, self.workdir / "eagle3-release", prefill_chunk_size=64,
                                                hub_proxy=self.hub_proxy, eagle3={})
            else:
                raw = os.environ.get(EAGLE3_RELEASE_ENV, "")
                if not raw:
                    raise ArtifactUnavailable(f"set {EAGLE3_RELEASE_ENV} to a Mobilint EAGLE-3 release directory")
                self._eagle3 = Path(raw)
        return self._eagle3

    def eagle3_golden(self):
        """The golden decoder of the simulated EAGLE-3 release's base (None on hardware): speculation
        must not change greedy output, so the base's plain greedy decoding is the reference."""
        if not self.simulated:
            return None
        if self._eagle3_golden is None:
            from npusim.llm import Decoder

            self.eagle3_release()
            self._eagle3_golden = Decoder.from_pretrained(self.workdir / "tiny-eagle3")
        return self._eagle3_golden

    # ------------------------------------------------------------------ Qwen3-ASR
    def asr_release(self) -> Path:
        """A Qwen3-ASR release: on ``mblt-sim`` the tiny fitted Qwen3-ASR checkpoint
        (``make-model --arch qwen3_asr``) compiled by ``mxq compile`` in the release layout; on
        ``mblt-hw`` the directory ``NPU_HARNESS_MBLT_ASR_RELEASE`` names.

        Raises:
            ArtifactUnavailable: on hardware, the variable is not set.
        """
        if self._asr is None:
            if self.simulated:
                from npusim.mxq.compile import compile_artifact
                from npusim.tinymodel.asr import build_qwen3_asr

                hf = build_qwen3_asr(self.workdir / "tiny-qwen3-asr")
                self._asr = compile_artifact(hf, self.workdir / "qwen3-asr-release", hub_proxy=self.hub_proxy)
            else:
                raw = os.environ.get(ASR_RELEASE_ENV, "")
                if not raw:
                    raise ArtifactUnavailable(f"set {ASR_RELEASE_ENV} to a Mobilint Qwen3-ASR release directory")
                self._asr = Path(raw)
        return self._asr

    def asr_golden(self):
        """The golden Qwen3-ASR pipeline of the simulated release
        (``npusim.llm.asr_reference.AsrReference``; None on hardware)."""
        if not self.simulated:
            return None
        if self._asr_golden is None:
            from npusim.llm.asr_reference import AsrReference

            self.asr_release()
            self._asr_golden = AsrReference.from_pretrained(self.workdir / "tiny-qwen3-asr")
        return self._asr_golden

    # ------------------------------------------------------------------ Qwen2-VL / Qwen3-VL
    def vlm_release(self, kind: str) -> Path:
        """A vision-language release of :data:`VLM_RELEASES` ``kind``: on ``mblt-sim`` the tiny
        checkpoint (``make-model --arch qwen2_vl|qwen3_vl``) compiled by ``mxq compile`` with that
        kind's options; on ``mblt-hw`` the directory ``NPU_HARNESS_MBLT_VLM_RELEASE_<KIND>`` names.

        Raises:
            KeyError: ``kind`` is not one of :data:`VLM_RELEASES`.
            ArtifactUnavailable: on hardware, the variable is not set.
        """
        family, options, compile_options = VLM_RELEASES[kind]
        if kind not in self._vlm:
            if self.simulated:
                from npusim.mxq.compile import compile_artifact
                from npusim.tinymodel.vlm import build_qwen2_vl, build_qwen3_vl

                hf = self.workdir / f"tiny-{family}"
                if not (hf / "config.json").is_file():
                    (build_qwen2_vl if family == "qwen2_vl" else build_qwen3_vl)(hf)
                self._vlm[kind] = compile_artifact(hf, self.workdir / f"{kind}-release", hub_proxy=self.hub_proxy,
                                                   vlm=dict(options), **compile_options)
            else:
                var = VLM_RELEASE_ENV + kind.upper()
                raw = os.environ.get(var, "")
                if not raw:
                    raise ArtifactUnavailable(f"set {var} to a Mobilint {kind} release directory")
                self._vlm[kind] = Path(raw)
        return self._vlm[kind]

    def vlm_golden(self, kind: str):
        """The golden pipeline of the simulated ``kind`` release
        (``npusim.llm.vlm_reference.VlmReference`` of its tiny checkpoint; None on hardware)."""
        if not self.simulated:
            return None
        family = VLM_RELEASES[kind][0]
        if family not in self._vlm_golden:
            from npusim.llm.vlm_reference import VlmReference

            self.vlm_release(kind)
            self._vlm_golden[family] = VlmReference.from_pretrained(self.workdir / f"tiny-{family}")
        return self._vlm_golden[family]

    # ------------------------------------------------------------------ vLLM

    def engine_configs(self, runs: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
        """vLLM's resolved scheduler/cache config for each argument list (``--model`` ...),
        through vLLM's own ``EngineArgs.create_engine_config`` with this target's platform,
        in one subprocess. An argument list vLLM rejects gives ``{"error": message}``."""
        runs = [[*r, *self.probe_args] for r in runs]
        proc = prefork.run_python(_PROBE, [json.dumps(runs)], env=self.env(), timeout=600, python=self.python)
        found = [json.loads(line[len(CONFIG_MARK):]) for line in proc.stdout.splitlines()
                 if line.startswith(CONFIG_MARK)]
        if len(found) != len(runs):
            raise RuntimeError(f"engine config probe failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return found
