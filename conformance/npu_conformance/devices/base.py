"""What a device gives the device-neutral serving suite (``scenarios/test_serving.py``):
:class:`DeviceLab`, one per target per session.

A device module (``devices/<device>.py``) subclasses :class:`DeviceLab` and supplies only:

- :meth:`DeviceLab.serving_server`: its standard artifact served by ``vllm serve`` with the
  target's plugin (built once, started once per session);
- :meth:`DeviceLab.golden`: the golden decoder of that artifact on a simulator target, None on
  hardware (scenarios then compare with the same request sent alone);
- :attr:`DeviceLab.refusals`: the request parameters its plugin refuses (each must be a 400
  naming the parameter, streamed or not);
- :meth:`DeviceLab.fault`: how to start a server with an injected device fault, or
  :class:`FaultsUnsupported` with the reason.

The lab also owns the servers it starts (one per distinct artifact, arguments and
environment, stopped by :meth:`DeviceLab.close`). Nothing here imports vLLM or the device
runtime.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from npu_conformance import vllm_server as vs


class ArtifactUnavailable(Exception):
    """The target cannot provide the artifact a scenario needs (the scenario skips)."""


class FaultsUnsupported(Exception):
    """The target cannot inject this fault (the scenario skips with the message)."""


@dataclass(frozen=True)
class Refusal:
    """A request parameter the device's plugin refuses.

    Attributes:
        param: the parameter's name, which the 400's ``param`` field or message must name.
        body: the request fields that ask for it (added to an otherwise valid request).
        endpoint: ``completions`` or ``chat/completions``.
    """

    param: str
    body: Mapping[str, Any]
    endpoint: str = "completions"


#: The sampling parameters vLLM's logits processors, mask and grammar bitmask serve on the host
#: (:mod:`vllm_npu.host_sampling`) and a device sampling on the device refuses (Neuron's
#: on-device sampling). ``min_p`` needs a temperature: vLLM clears it for greedy requests
#: before the platform sees them.
LOGITS_PROCESSOR_REFUSALS: tuple[Refusal, ...] = (
    Refusal("min_p", {"min_p": 0.1, "temperature": 0.8}),
    Refusal("min_tokens", {"min_tokens": 2}),
    Refusal("logit_bias", {"logit_bias": {"5": 10}}),
    Refusal("allowed_token_ids", {"allowed_token_ids": [5, 6]}),
)

#: ``tinymodel.build("llama", ...)`` overrides of the standard tiny llama, the one checkpoint every
#: simulated lab serves (``head_dim`` 64: the width the RBLN CPU kernels of torch-rbln require,
#: so the same model compiles for a board). One checkpoint for every target: a scenario whose
#: answers equal the golden decoder on each target gives the same answers on all of them.
STANDARD_TINY_OVERRIDES: Mapping[str, Any] = {"head_dim": 64}

#: What every worker with host sampling still refuses (``vllm_npu._platform.refuse_unsampled``).
HOST_SAMPLER_REFUSALS: tuple[Refusal, ...] = (
    Refusal("thinking_token_budget", {"thinking_token_budget": 8}),
)


#: ``vllm serve`` arguments of every server that samples on the host: prompt embeddings on
#: (``--enable-prompt-embeds``: the plugin serves or refuses them, not vLLM's front end); a
#: tool-call parser (a ``tool_choice`` ``required`` or ``auto`` request needs one; ``pythonic``
#: needs no special token and leaves ``required`` to vLLM's plain JSON array of calls, where
#: ``hermes`` wraps it in its own structural tag); and xgrammar (the golden decoder's masks are
#: xgrammar's) with JSON grammars without free whitespace (``disable_any_whitespace``): a tiny
#: random model under vLLM's default grammar may fill ``max_tokens`` with whitespace and never
#: close an object.
HOST_SERVING_ARGS: tuple[str, ...] = (
    "--enable-prompt-embeds", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
    "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}')


def random_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids in [10, 1000) (inside every real vocabulary
    and the tiny models' 1024, above their special tokens), reproducible from ``seed``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(10, 1000, size=length).tolist() for _ in range(n)]


#: (checkpoint digest, prompt, n) -> the golden decoder's greedy tokens, for this process: every
#: simulated lab serves one checkpoint (:data:`STANDARD_TINY_OVERRIDES`), so a prompt another
#: target's scenario already decoded is not decoded again.
_GOLDEN_GREEDY: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def golden_ids(lab: DeviceLab, prompt: Sequence[int], n: int) -> list[int] | None:
    """The golden decoder's ``n`` greedy tokens after ``prompt``; None on hardware (remembered
    per checkpoint for this process: :data:`_GOLDEN_GREEDY`)."""
    golden = lab.golden()
    if golden is None:
        return None
    key = (golden.fingerprint(), tuple(int(t) for t in prompt), int(n))
    if key not in _GOLDEN_GREEDY:
        _GOLDEN_GREEDY[key] = [int(t) for t in golden.generate_greedy(list(prompt), n)]
    return list(_GOLDEN_GREEDY[key])


@dataclass(frozen=True)
class FaultPlan:
    """A server with an injected device fault.

    Attributes:
        artifact: what it serves.
        args: extra ``vllm serve`` arguments.
        env: environment that injects the fault.
        evidence: a regular expression the server log matches once the fault struck (so a
            scenario proves the fault happened rather than passing on a server without it).
    """

    artifact: Path
    args: tuple[str, ...]
    env: Mapping[str, str]
    evidence: str


@dataclass
class DeviceLab:
    """Per-session artifacts and servers of one target (see the module docstring).

    Attributes:
        target: the target name (``mblt-sim``...).
        workdir: a directory of this session for artifacts and server logs.
    """

    target: str
    workdir: Path
    servers: dict[str, vs.Server] = field(default_factory=dict)
    _pinned: set[str] = field(default_factory=set)
    _refusals: int = 0
    _started: int = 0

    #: How many servers besides the pinned one (:meth:`serving_server`'s, which scenarios of
    #: several modules share) a lab keeps running: before another starts, the least recently
    #: used is stopped. The scenarios that share a server run next to each other (file order;
    #: a parameter that picks a server is module-scoped), so each distinct server still starts
    #: once, while a lab holds at most this many + 1 servers (about 1.2 GiB each) in memory.
    keep_servers: ClassVar[int] = 2

    #: The device family (``mblt``...).
    device: ClassVar[str] = ""
    #: ``--max-model-len`` of :meth:`serving_server` (tokens).
    max_model_len: ClassVar[int] = 1024
    #: The parameters this device's plugin refuses (HTTP 400 naming each).
    refusals: ClassVar[tuple[Refusal, ...]] = ()
    #: Whether its plugin takes ``prompt_embeds`` on :meth:`sampler_server` (else it refuses
    #: them with a 400 naming ``prompt_embeds``).
    serves_prompt_embeds: ClassVar[bool] = False
    #: Injectable faults, by kind: ``once`` (a one-off infer failure, retried invisibly) and
    #: ``persistent`` (every infer fails: requests in flight must get errors).
    FAULT_KINDS: ClassVar[tuple[str, ...]] = ("once", "persistent")

    @property
    def simulated(self) -> bool:
        return self.target.endswith("-sim")

    # ------------------------------------------------------------------ device hooks

    def serving_server(self) -> vs.Server:
        """The device's standard artifact served with ``--max-model-len``
        :attr:`max_model_len`, shared by every scenario that needs no special server."""
        raise NotImplementedError(f"{type(self).__name__} defines no serving_server")

    def golden(self) -> Any:
        """The golden decoder (``npusim.llm.Decoder``) of :meth:`serving_server`'s model on a
        simulator target; None on hardware."""
        return None

    def sampler_server(self) -> vs.Server:
        """The server whose worker samples on the host with vLLM's sampler (its logits
        processors: ``min_p``, ``min_tokens``, ``logit_bias``, ``allowed_token_ids``). Default:
        :meth:`serving_server`; a device that samples on the device by default starts its
        host-sampling configuration (Neuron: CPU sampling)."""
        return self.serving_server()

    def sampler_refusals(self) -> tuple[Refusal, ...]:
        """What :meth:`sampler_server` refuses (default: :attr:`refusals`)."""
        return self.refusals

    def grammar_server(self) -> vs.Server | None:
        """The server that serves structured outputs and grammar-constrained tool calls
        (vLLM's grammar bitmask applied before sampling). Default: :meth:`sampler_server`,
        unless it refuses them (None); a device whose grammar runs where it samples on the
        device starts that configuration (Neuron: on-device sampling, without async
        scheduling)."""
        refused = {r.param for r in self.sampler_refusals()}
        return None if "response_format" in refused else self.sampler_server()

    def fault(self, kind: str) -> FaultPlan:
        """How to start a server with fault ``kind`` (one of :attr:`FAULT_KINDS`).

        Raises:
            FaultsUnsupported: this target cannot inject it (the reason is the message).
        """
        raise FaultsUnsupported(f"{self.target}: the device profile injects no faults")

    # ------------------------------------------------------------------ servers

    def env(self, **extra: str) -> dict[str, str]:
        return vs.vllm_env(self.target, **extra)

    @property
    def python(self) -> str:
        """The interpreter of the environment the servers run in (this one; a vendor lab's own)."""
        import sys

        return sys.executable

    def command(self) -> list[str] | None:
        """The ``vllm`` command the servers run (None: this environment's,
        :func:`~npu_conformance.vllm_server.vllm_command`; a vendor lab names its own)."""
        return None

    def start(self, artifact: Path, args: Sequence[str], log: Path, *, timeout_s: float = vs.START_TIMEOUT_S,
              **env: str) -> vs.Server:
        """``vllm serve ARTIFACT ARGS`` with this lab's command and :meth:`env` plus ``env``,
        logging to ``log``; the caller stops it (:meth:`server` keeps the ones it shares).

        Raises:
            vllm_server.ServerError: it exited or did not become healthy.
        """
        return vs.start(artifact, args, env=self.env(**env), log=log, timeout_s=timeout_s, command=self.command())

    def server(self, artifact: Path, args: Sequence[str] = (), *, pin: bool = False, **env: str) -> vs.Server:
        """A running, healthy ``vllm serve ARTIFACT ARGS`` (started once per session per
        combination while it is among the :attr:`keep_servers` most recently used, and again
        when an earlier scenario left it dead or unhealthy). ``pin``: never stopped to make room
        (the shared :meth:`serving_server`).

        Raises:
            vllm_server.ServerError: it exited or did not become healthy.
        """
        key = json.dumps([str(artifact), list(args), env], sort_keys=True)
        if pin:
            self._pinned.add(key)
        srv = self.servers.pop(key, None)
        if srv is not None and srv.healthy():
            self.servers[key] = srv  # now the most recently used
            return srv
        if srv is not None:  # an earlier scenario left it dead or its engine stopped: start anew
            srv.stop()
        self._make_room(keep=self.keep_servers - (0 if key in self._pinned else 1))
        log = self.workdir / f"serve-{self._started}.log"  # a restarted server gets a new log
        self._started += 1
        srv = self.start(artifact, args, log, **env)
        self.servers[key] = srv
        return srv

    def _make_room(self, keep: int) -> None:
        """Stop the least recently used unpinned servers until at most ``keep`` remain."""
        unpinned = [k for k in self.servers if k not in self._pinned]
        for key in unpinned[: max(0, len(unpinned) - keep)]:
            self.servers.pop(key).stop()

    def fault_server(self, kind: str) -> tuple[vs.Server, FaultPlan]:
        """A server started with :meth:`fault` ``(kind)`` and its plan.

        Raises:
            FaultsUnsupported: as :meth:`fault`.
        """
        plan = self.fault(kind)
        return self.server(plan.artifact, plan.args, **plan.env), plan

    def refused_start(self, artifact: Path, args: Sequence[str] = (), **env: str) -> str:
        """Start ``vllm serve`` expecting it to exit; returns its log.

        Raises:
            AssertionError: it became healthy instead.
        """
        self._refusals += 1
        log = self.workdir / f"refused-{self._refusals}.log"  # one log per refused start
        try:
            srv = self.start(artifact, args, log, timeout_s=300, **env)
        except vs.ServerError:
            return log.read_text(errors="replace")
        srv.stop()
        raise AssertionError(f"vllm serve {artifact} {' '.join(args)} started; expected a refusal")

    def close(self) -> None:
        """Stop every server of this lab (its artifacts stay; :meth:`server` starts again)."""
        for srv in self.servers.values():
            srv.stop()
        self.servers.clear()


@dataclass
class TinyModelLab(DeviceLab):
    """A lab serving a Hugging Face model directory that the plugin compiles at engine start
    (RBLN, Neuron): the standard tiny llama on a simulator target (or, on hardware, the
    directory named by :attr:`model_env`), its golden decoder, and a compile cache of this
    session (``VLLM_CACHE_ROOT``) shared by every server the lab starts."""

    _hf_dir: Path | None = None
    _golden: Any = None
    _cache_root: Path | None = None

    #: Variable naming another model directory on hardware (``NPU_HARNESS_RBLN_MODEL``...).
    model_env: ClassVar[str] = ""
    #: ``tinymodel.build`` overrides of the standard tiny llama, and its directory name.
    tiny_overrides: ClassVar[Mapping[str, Any]] = STANDARD_TINY_OVERRIDES
    tiny_name: ClassVar[str] = "tiny-llama"

    @property
    def cache_root(self) -> Path:
        """``VLLM_CACHE_ROOT`` of this session's servers (the compile cache lives under it)."""
        if self._cache_root is None:
            self._cache_root = self.workdir / "vllm-cache"
            self._cache_root.mkdir(parents=True, exist_ok=True)
        return self._cache_root

    def env(self, **extra: str) -> dict[str, str]:
        """The target's vLLM environment with this session's ``VLLM_CACHE_ROOT`` (``extra`` wins)."""
        return vs.vllm_env(self.target, **{"VLLM_CACHE_ROOT": str(self.cache_root), **extra})

    def named_model(self) -> str:
        """The directory :attr:`model_env` names on a hardware target, else ``""``."""
        import os

        return "" if self.simulated else os.environ.get(self.model_env, "")

    def hf_dir(self) -> Path:
        """The model the servers serve (built once per session unless :meth:`named_model`)."""
        if self._hf_dir is None:
            if self.named_model():
                self._hf_dir = Path(self.named_model())
            else:
                from npusim import tinymodel

                self._hf_dir = tinymodel.build("llama", self.workdir / self.tiny_name, **dict(self.tiny_overrides))
        return self._hf_dir

    def golden(self):
        """The golden decoder of the tiny model (None when a named model is served on hardware)."""
        if self.named_model():
            return None
        if self._golden is None:
            from npusim.llm import Decoder

            self._golden = Decoder.from_pretrained(self.hf_dir())
        return self._golden
