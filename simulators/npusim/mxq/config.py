"""``ModelConfig``: the core mode and cores a Model asks for at launch (qbruntime semantics).

Default: ``CoreMode.Auto``, ``CoreAllocationPolicy.Manual``. Setters return ``True`` on success
and ``False`` (with a glog detail line on stderr) when the request is invalid, leaving the
config unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import log
from .types import Cluster, Core, CoreAllocationPolicy, CoreId, CoreMode, core_key

__all__ = ["ModelConfig"]

ALL_CLUSTERS: tuple[Cluster, ...] = (Cluster.Cluster0, Cluster.Cluster1)


class ModelConfig:
    """Core mode, cores and clusters requested for a model.

    Every setter behaves as qbruntime 1.5.0's (checked against the real wheel's ``ModelConfig``,
    which runs without a device): the same return values, glog lines and side effects,
    including the activation-slot count each core-mode setter derives.
    """

    def __init__(self, num_cores: int | None = None) -> None:
        """``num_cores`` (deprecated form): single-core mode on that many cores (activation
        slots 1, as the real core leaves it)."""
        self._mode = CoreMode.Auto
        self._num_cores = 0
        self._core_ids: list[CoreId] = []
        self._clusters: list[Cluster] = []
        self._activation_slots = -1  # -1: not set (the runtime's default)
        self._async_pipeline = False
        self._forced_bundle = -1
        if num_cores is not None:
            log("`ModelConfig(int num_cores)` is deprecated and will be removed in a future release. "
                "Please use `ModelConfig()` and `ModelConfig::setSingleCoreMode(int num_cores)` instead.",
                "type.cc:70", "W")
            if self.set_single_core_mode(num_cores):
                self._activation_slots = 1

    def __repr__(self) -> str:
        return f"ModelConfig(core_mode={self._mode}, num_cores={self._num_cores}, core_ids={self._core_ids}, clusters={self._clusters})"

    # ---------------------------------------------------------------- setters
    def set_auto_core_mode(self) -> bool:
        """Let the runtime choose (the mode the artifact was compiled for); resets cores,
        clusters and activation slots."""
        self._mode, self._num_cores, self._core_ids, self._clusters = CoreMode.Auto, 0, [], []
        self._activation_slots = -1
        return True

    def set_single_core_mode(self, num_cores: int | Sequence[CoreId] | None = None, core_ids: Sequence[CoreId] | None = None) -> bool:
        """Single-core mode: ``(num_cores)`` (deprecated), ``(core_ids)`` or ``(None, core_ids)``.

        ``core_ids`` (deduplicated, sorted) sets activation slots to twice their number and
        leaves the clusters as they were; ``num_cores`` (>= 1, no upper bound: MXQ v7 takes all
        available cores whatever the number) leaves both. Returns False for an empty list,
        ``Core.GlobalCore``, a non-CoreId entry or ``num_cores < 1``, with the real glog line.
        """
        if core_ids is None and num_cores is not None and not isinstance(num_cores, int):
            core_ids, num_cores = list(num_cores), None
        if core_ids is not None:
            ids = list(core_ids)
            if any(not isinstance(c, CoreId) for c in ids):
                log(f"Invalid core ID: expected CoreId values, got {ids!r}.", "type.cc:41")
                return False
            if any(c.core == Core.GlobalCore for c in ids):
                log("Invalid core ID: `Core::GlobalCore` cannot be used in single-core mode.", "type.cc:43")
                return False
            if not ids:
                log("Invalid core IDs: `core_ids` must not be empty.", "type.cc:115")
                return False
            unique = sorted({core_key(c): c for c in ids}.values())  # CoreId is unhashable
            self._mode, self._core_ids, self._num_cores = CoreMode.Single, unique, len(unique)
            self._activation_slots = 2 * len(unique)
            return True
        log("`setSingleCoreMode(int num_cores)` is deprecated and will be removed in a future release. "
            "Please use `ModelConfig::setSingleCoreMode(std::vector<CoreId> core_ids)` instead. Note that "
            "when using MXQ v7 or later, this method configures all available cores regardless of the "
            "`num_cores` value.", "type.cc:89", "W")
        n = 1 if num_cores is None else num_cores
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            log(f"Invalid `num_cores` value: {n}. The value must be >= 1 to enable single-core mode.", "type.cc:97")
            return False
        self._mode, self._num_cores, self._core_ids = CoreMode.Single, n, []
        return True

    def _set_cluster_mode(self, mode: CoreMode, clusters: Sequence[Cluster] | None) -> bool:
        cl = list(ALL_CLUSTERS if clusters is None else clusters)
        if not cl:
            log("Invalid clusters: `clusters` must not be empty.", "type.cc:138")
            return False
        for c in cl:
            if c not in ALL_CLUSTERS:
                log(f"Invalid cluster: {int(c):x} is not a valid cluster.", "type.cc:25")
                return False
        self._mode, self._clusters, self._core_ids, self._num_cores = mode, list(dict.fromkeys(cl)), [], 0
        self._activation_slots = 2 * len(self._clusters)
        return True

    def set_multi_core_mode(self, clusters: Sequence[Cluster] | None = None) -> bool:
        """Multi-core mode on one of ``clusters`` (default both); activation slots 2 per cluster."""
        return self._set_cluster_mode(CoreMode.Multi, clusters)

    def set_global4_core_mode(self, clusters: Sequence[Cluster] | None = None) -> bool:
        """Global4 mode on one of ``clusters`` (default both); activation slots 2 per cluster."""
        return self._set_cluster_mode(CoreMode.Global4, clusters)

    def set_global8_core_mode(self) -> bool:
        """Global8 mode: all 8 cores (clusters and cores stay unnamed, as in the real config);
        activation slots 2."""
        self._mode, self._clusters, self._core_ids, self._num_cores = CoreMode.Global8, [], [], 0
        self._activation_slots = 2
        return True

    def set_global_core_mode(self, clusters: Sequence[Cluster] | None = None) -> bool:
        """Deprecated: the ``CoreMode.Global`` mode on one of ``clusters`` (the real core keeps
        it a mode of its own, distinct from ``Global4``)."""
        return self._set_cluster_mode(CoreMode.Global, clusters)

    def set_activation_slots(self, num: int) -> None:
        """Store the activation buffer slot count (``num >= 0``); the core-mode setters derive
        it again. A negative ``num`` logs the real error and keeps the count. (The LLM MXQs this
        simulator runs use one slot whatever the count, as the real docstring says.)"""
        if num < 0:
            log(f"Invalid activation slot num: {num}. Must be >= 0.", "type.cc:226")
            return
        self._activation_slots = int(num)

    def set_async_pipeline_enabled(self, enable: bool) -> None:
        self._async_pipeline = bool(enable)

    def force_single_npu_bundle(self, idx: int) -> bool:
        self._forced_bundle = int(idx)
        return True

    # ---------------------------------------------------------------- getters
    def get_core_mode(self) -> CoreMode:
        return self._mode

    def get_num_cores(self) -> int:
        return self._num_cores

    def get_core_ids(self) -> list[CoreId]:
        return list(self._core_ids)

    def get_clusters(self) -> list[Cluster]:
        return list(self._clusters)

    def get_core_allocation_policy(self) -> CoreAllocationPolicy:
        return CoreAllocationPolicy.Manual

    def get_activation_slots(self) -> int:
        return self._activation_slots

    def get_async_pipeline_enabled(self) -> bool:
        return self._async_pipeline

    def get_forced_npu_bundle_index(self) -> int:
        return self._forced_bundle
