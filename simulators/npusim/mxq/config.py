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
    """Core mode, cores and clusters requested for a model."""

    def __init__(self, num_cores: int | None = None) -> None:
        """``num_cores`` (deprecated form): single-core mode on that many cores."""
        self._mode = CoreMode.Auto
        self._num_cores = 0
        self._core_ids: list[CoreId] = []
        self._clusters: list[Cluster] = []
        self._activation_slots = 1
        self._async_pipeline = False
        self._forced_bundle = -1
        if num_cores is not None:
            self.set_single_core_mode(num_cores)

    def __repr__(self) -> str:
        return f"ModelConfig(core_mode={self._mode}, num_cores={self._num_cores}, core_ids={self._core_ids}, clusters={self._clusters})"

    # ---------------------------------------------------------------- setters
    def set_auto_core_mode(self) -> bool:
        """Let the runtime choose (the mode the artifact was compiled for)."""
        self._mode, self._num_cores, self._core_ids, self._clusters = CoreMode.Auto, 0, [], []
        return True

    def set_single_core_mode(self, num_cores: int | Sequence[CoreId] | None = None, core_ids: Sequence[CoreId] | None = None) -> bool:
        """Single-core mode: ``(num_cores)``, ``(core_ids)`` or ``(None, core_ids)``.

        Returns False for ``Core.GlobalCore`` in ``core_ids``, a non-CoreId entry or ``num_cores < 1``.
        """
        if core_ids is None and num_cores is not None and not isinstance(num_cores, int):
            core_ids, num_cores = list(num_cores), None
        if core_ids is not None:
            ids = list(core_ids)
            if any(not isinstance(c, CoreId) for c in ids):
                log(f"Invalid core ID: expected CoreId values, got {ids!r}.", "model_config.cc:41")
                return False
            if any(c.core == Core.GlobalCore for c in ids):
                log("Invalid core ID: `Core::GlobalCore` cannot be used in single-core mode.", "model_config.cc:45")
                return False
            if not ids:
                log("Invalid core ID: `core_ids` must not be empty.", "model_config.cc:49")
                return False
            unique = sorted({core_key(c): c for c in ids}.values())  # CoreId is unhashable
            self._mode, self._core_ids, self._num_cores, self._clusters = CoreMode.Single, unique, len(unique), []
            return True
        n = 1 if num_cores is None else num_cores
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 8:
            log(f"Invalid number of cores: {n!r} (need 1 <= num_cores <= 8).", "model_config.cc:55")
            return False
        self._mode, self._num_cores, self._core_ids, self._clusters = CoreMode.Single, n, [], []
        return True

    def _set_cluster_mode(self, mode: CoreMode, clusters: Sequence[Cluster] | None) -> bool:
        cl = list(ALL_CLUSTERS if clusters is None else clusters)
        if not cl:
            log("Invalid clusters: `clusters` must not be empty.", "model_config.cc:70")
            return False
        if any(c not in ALL_CLUSTERS for c in cl):
            log(f"Invalid clusters: {cl!r} (allowed: Cluster.Cluster0, Cluster.Cluster1).", "model_config.cc:74")
            return False
        self._mode, self._clusters, self._core_ids, self._num_cores = mode, list(dict.fromkeys(cl)), [], 4
        return True

    def set_multi_core_mode(self, clusters: Sequence[Cluster] | None = None) -> bool:
        """Multi-core mode on one of ``clusters`` (default both)."""
        return self._set_cluster_mode(CoreMode.Multi, clusters)

    def set_global4_core_mode(self, clusters: Sequence[Cluster] | None = None) -> bool:
        """Global4 mode on one of ``clusters`` (default both)."""
        return self._set_cluster_mode(CoreMode.Global4, clusters)

    def set_global8_core_mode(self) -> bool:
        """Global8 mode: both clusters, all 8 cores."""
        self._mode, self._clusters, self._core_ids, self._num_cores = CoreMode.Global8, list(ALL_CLUSTERS), [], 8
        return True

    def set_global_core_mode(self, clusters: Sequence[Cluster] | None = None) -> bool:
        """Deprecated alias of :meth:`set_global4_core_mode`."""
        return self.set_global4_core_mode(clusters)

    def set_activation_slots(self, count: int) -> bool:
        """LLM model's activation slot is fixed to 1: only 1 is accepted."""
        if count != 1:
            log("LLM model's activation slot is fixed to 1", "model_config.cc:90", "W")
            return False
        self._activation_slots = 1
        return True

    def set_async_pipeline_enabled(self, enable: bool) -> bool:
        self._async_pipeline = bool(enable)
        return True

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
