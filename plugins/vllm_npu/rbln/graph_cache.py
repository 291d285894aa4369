"""The compile cache of the RBLN ``vllm`` model path: ``rebel.core.mega_cache`` bundles.

As vllm-rbln's mega cache (reference §5.2): one bundle per configuration at
``$VLLM_CACHE_ROOT/rbln/<model>-<sha1(model)[:8]>/<signature>/rank<LOCAL_RANK>/mega_cache.bin``,
loaded before warm-up (a compile whose program the bundle holds is a cache hit) and written
atomically after it. The signature (:func:`signature`) digests everything that changes the
compiled programs: vLLM's config hash, the graph shapes (``max_num_seqs``, the decode buckets,
the prefill chunk, the KV blocks), the compile environment (``VLLM_RBLN_NUM_HIDDEN_LAYERS``,
``VLLM_RBLN_USE_DEVICE_TENSOR``), the NPU and the compiler's major.minor version. So an
identical configuration reuses the bundle and any change writes a new one.
``VLLM_DISABLE_COMPILE_CACHE=1`` turns it off.

The ``rebel`` module is an argument (the real rebel-compiler or the simulator through the
alias); this module never imports the simulator.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from importlib import import_module
from typing import Any

__all__ = ["COMPILE_ENV", "signature", "bundle_path", "cache_root", "load", "save"]

logger = logging.getLogger("vllm.vllm_npu.rbln")

#: Environment variables that change the compiled graphs (reference §4, ``RBLN_COMPILE_ENV``).
COMPILE_ENV = ("VLLM_RBLN_USE_VLLM_MODEL", "VLLM_RBLN_NUM_HIDDEN_LAYERS", "VLLM_RBLN_USE_DEVICE_TENSOR")


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def signature(config_hash: str, plan: dict[str, Any], rebel_version: str, environ: Any = None) -> str:
    """The bundle's configuration signature (16 hex digits; see the module docstring)."""
    env = os.environ if environ is None else environ
    graphs = _sha1(repr((plan["max_num_seqs"], plan["decode_buckets"], plan["chunk"], plan["num_blocks"],
                         plan["block_size"], plan["max_seq_len"])))
    env_hash = _sha1(repr([(k, env.get(k)) for k in COMPILE_ENV]))
    major_minor = ".".join(str(rebel_version).split(".")[:2])
    return _sha1("|".join([config_hash, graphs, env_hash, f"npu={plan['npu']}", f"rebel={major_minor}"]))[:16]


def cache_root(vllm_cache_root: str) -> str:
    """The directory ``rbln_backend`` keeps its programs under."""
    return os.path.join(vllm_cache_root, "rbln")


def bundle_path(vllm_cache_root: str, model: str, sig: str, local_rank: int | str = 0) -> str:
    """Where the bundle of ``model`` at ``sig`` lives (see the module docstring)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model or "unknown").strip("_")[-80:]
    return os.path.join(cache_root(vllm_cache_root), f"{safe}-{_sha1(model or 'unknown')[:8]}", sig,
                        f"rank{local_rank}", "mega_cache.bin")


def _mega_cache(rebel: Any) -> Any:
    return import_module(rebel.__name__ + ".core.mega_cache")


def load(rebel: Any, vllm_cache_root: str, path: str) -> dict[str, Any] | None:
    """Load the bundle at ``path`` into ``rebel``'s program cache, if there is a usable one.

    Returns:
        What ``read_bundle`` answered, or None (no bundle, or an unreadable one: logged,
        and the graphs compile anew).
    """
    mc = _mega_cache(rebel)
    mc.set_dir(cache_root(vllm_cache_root))
    if not os.path.isfile(path):
        logger.info("RBLN compile cache: no mega-cache bundle at %s; the graphs compile (cold start)", path)
        return None
    with open(path, "rb") as src:
        info = mc.read_bundle(src)
    if info is None:
        logger.warning("Ignored an unreadable rbln mega-cache bundle at %s; recompiling", path)
        return None
    logger.info("Loaded rbln mega-cache bundle from %s (%s)", path, info)
    return info


def save(rebel: Any, vllm_cache_root: str, path: str) -> int:
    """Write ``rebel``'s program cache to ``path`` atomically (a temporary file renamed into
    place). Returns the bytes written (0: nothing to write)."""
    mc = _mega_cache(rebel)
    mc.set_dir(cache_root(vllm_cache_root))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as dst:
            written = mc.write_bundle(dst)
            if written:
                dst.flush()
                os.fsync(dst.fileno())
        if not written:
            os.remove(tmp)
            return 0
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    logger.info("Saved rbln mega-cache bundle to %s (%d bytes)", path, written)
    return int(written)
