"""Where compiled NEFFs live between server starts: the compile cache and
``NEURON_COMPILED_ARTIFACTS``.

**The compile cache** (the native route's layout, reference §10.4):
``$VLLM_CACHE_ROOT/neuron/compile_cache/<hash>/`` holding ``graph_<hash>.neff``,
``.artifact_metadata_v0.json`` (the key's inputs) and ``.compilation_complete``
(``completed:<unix time>`` and ``neff_size:<bytes>``), written last, so an entry without it is
an interrupted compile and is ignored. ``<hash>`` is :func:`cache_key`: the MD5 (first 32 hex
digits) of everything that changes the program: the compile target (bucket shape, KV blocks,
KV dtype, sampling), the model's fingerprint (its ``config.json`` and weight files), the
platform target (``trn2``/``trn3``), the compiler's version and its arguments. Environment:

* ``NEURON_LIBTORCH_DISABLE_COMPILE_CACHE=1``: never read or write the cache (compile every start);
* ``VLLM_NEURON_DISABLE_WARMUP_COMPILE=1``: never compile; a miss is
  :class:`WarmupCompileDisabledError` with the vendor's text.

**NEURON_COMPILED_ARTIFACTS=DIR** (the seed): if ``DIR`` holds valid artifacts for this
configuration they are loaded with no compile; if it is empty (or absent) the NEFFs are
compiled and saved there. Its manifest ``neuron_config.json`` names the configuration's hash
(:func:`config_hash` over every target's key) and each NEFF file. A directory holding another
configuration's artifacts logs the vendor's ``Unable to find precompiled artifacts from DIR.
Recompiling...`` and is rewritten. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_npu.settings import env_switch

logger = logging.getLogger("vllm.vllm_npu.neuron")

MANIFEST = "neuron_config.json"
COMPLETE = ".compilation_complete"
METADATA = ".artifact_metadata_v0.json"
#: Weight files larger than this are fingerprinted by size and mtime, not content (bytes).
_HASH_CONTENT_LIMIT = 256 * 2**20


class WarmupCompileDisabledError(RuntimeError):
    """``VLLM_NEURON_DISABLE_WARMUP_COMPILE`` is set and a NEFF is not in the cache."""


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """SHA-256 over the model's ``config.json`` and weight files (content up to 256 MiB a
    file, size and mtime beyond), as hex.

    Raises:
        FileNotFoundError: ``model_dir`` has no ``config.json``.
    """
    d = Path(model_dir)
    h = hashlib.sha256((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        st = f.stat()
        h.update(f.name.encode())
        if st.st_size <= _HASH_CONTENT_LIMIT:
            h.update(f.read_bytes())
        else:
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def cache_key(target: Mapping[str, Any], *, model_fingerprint: str, platform_target: str,
              compiler_version: str, compiler_args: Sequence[str] = ()) -> str:
    """The cache hash of one compile target: ``md5("|".join(parts))[:32]``, with the target's
    fields and the compiler arguments as sorted ``k=v`` pairs."""
    parts = [f"{k}={target[k]}" for k in sorted(target)]
    parts += [f"model={model_fingerprint}", f"target={platform_target}", f"neuronxcc:{compiler_version}"]
    parts += sorted(str(a) for a in compiler_args)
    return hashlib.md5("|".join(parts).encode()).hexdigest()[:32]


def config_hash(keys: Sequence[str]) -> str:
    """The hash naming a whole configuration (every target's :func:`cache_key`, in order)."""
    return hashlib.md5("|".join(keys).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class CompileCache:
    """The on-disk compile cache under ``root`` (see the module docstring).

    Attributes:
        root: ``$VLLM_CACHE_ROOT/neuron/compile_cache``.
        enabled: False under ``NEURON_LIBTORCH_DISABLE_COMPILE_CACHE``.
        compile_allowed: False under ``VLLM_NEURON_DISABLE_WARMUP_COMPILE``.
    """

    root: Path
    enabled: bool = True
    compile_allowed: bool = True

    @classmethod
    def from_env(cls, vllm_cache_root: str | os.PathLike, environ: Mapping[str, str] = os.environ) -> CompileCache:
        """The cache under ``vllm_cache_root``, switched by ``NEURON_LIBTORCH_DISABLE_COMPILE_CACHE``
        and ``VLLM_NEURON_DISABLE_WARMUP_COMPILE`` (switches, unset or blank: off).

        Raises:
            SettingError: either variable is neither on nor off (named, with the accepted words).
        """
        return cls(Path(vllm_cache_root) / "neuron" / "compile_cache",
                   enabled=not env_switch("NEURON_LIBTORCH_DISABLE_COMPILE_CACHE", default=False, environ=environ),
                   compile_allowed=not env_switch("VLLM_NEURON_DISABLE_WARMUP_COMPILE", default=False,
                                                  environ=environ))

    def neff_path(self, key: str) -> Path:
        return self.root / key / f"graph_{key}.neff"

    def lookup(self, key: str) -> Path | None:
        """The cached NEFF of ``key``, or None (cache disabled, absent or incomplete entry)."""
        if not self.enabled:
            return None
        path = self.neff_path(key)
        return path if (path.parent / COMPLETE).is_file() and path.is_file() else None

    def require_compile(self, key: str) -> None:
        """Raises:
        WarmupCompileDisabledError: compiling is disabled (the vendor's miss text)."""
        if not self.compile_allowed:
            raise WarmupCompileDisabledError(
                f"VLLM_NEURON_DISABLE_WARMUP_COMPILE: local compile cache miss for key {key}. All graphs "
                "must be pre-compiled when warmup compilation is disabled.")

    def store(self, key: str, neff: Path, metadata: Mapping[str, Any]) -> Path:
        """Move the freshly compiled ``neff`` into the entry of ``key``; returns its path there
        (``neff`` itself when the cache is disabled). ``.compilation_complete`` is written last."""
        if not self.enabled:
            return neff
        entry = self.root / key
        partial = self.root / f"{key}.partial-{os.getpid()}"
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
        shutil.copyfile(neff, partial / f"graph_{key}.neff")
        (partial / METADATA).write_text(json.dumps({"cache_key": key, **metadata}, indent=1, sort_keys=True))
        (partial / COMPLETE).write_text(f"completed:{time.time():.0f}\nneff_size:{neff.stat().st_size}\n")
        if (entry / COMPLETE).is_file():  # another process finished first: keep the finished one
            shutil.rmtree(partial)
        else:
            if entry.exists():
                shutil.rmtree(entry)
            partial.rename(entry)
        return self.neff_path(key)


@dataclass(frozen=True)
class CompiledArtifacts:
    """``NEURON_COMPILED_ARTIFACTS``: one configuration's NEFFs in one directory."""

    path: Path

    def load(self, cfg_hash: str) -> dict[str, Path] | None:
        """Target name -> NEFF path when the directory holds valid artifacts of ``cfg_hash``;
        None when it is empty or absent; None with the vendor's log line when it holds another
        configuration's (or broken) artifacts."""
        manifest = self.path / MANIFEST
        if not self.path.is_dir() or not any(self.path.iterdir()):
            return None
        try:
            data = json.loads(manifest.read_text())
            files = {name: self.path / f for name, f in data["neffs"].items()}
            valid = data["config_hash"] == cfg_hash and all(p.is_file() for p in files.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            valid = False
        if not valid:
            logger.warning("Unable to find precompiled artifacts from %s. Recompiling...", self.path)
            return None
        return files

    def save(self, cfg_hash: str, neffs: Mapping[str, Path], targets: Sequence[Mapping[str, Any]]) -> None:
        """Copy ``neffs`` (target name -> path) here and write the manifest last."""
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / MANIFEST).unlink(missing_ok=True)
        for name, src in neffs.items():
            if Path(src).resolve() != (self.path / f"{name}.neff").resolve():
                shutil.copyfile(src, self.path / f"{name}.neff")
        (self.path / MANIFEST).write_text(json.dumps(
            {"config_hash": cfg_hash, "neffs": {n: f"{n}.neff" for n in neffs}, "targets": list(targets)},
            indent=1, sort_keys=True))
        logger.info("Saved %d compiled NEFFs to NEURON_COMPILED_ARTIFACTS=%s", len(neffs), self.path)
