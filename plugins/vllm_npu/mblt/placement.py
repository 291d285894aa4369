"""Where MXQ model instances go: target strings, devices per instance, and each instance's
``ModelConfig``.

Facts (reference §4 "Targets", "Backend creation"): canonical targets are ``"d:c:k"`` cores
(single core mode) or ``"d:c"`` clusters (every other mode), ``d`` the device number, ``c`` the
cluster and ``k`` the core within it. An Aries card has 2 clusters x 4 cores; a Regulus has 1 x 1
and supports only ``auto`` and ``single``. Without explicit targets, ``single`` uses every core
of every ``dev_no`` device and the other modes every cluster. Explicit targets must cover exactly
the ``dev_no`` devices. ``global8`` needs both clusters of each device.

Instance ``i`` runs on ``dev_no[i % len(dev_no)]`` (round-robin over the cards).

Our choice beyond the reference: in single core mode, a device that hosts one instance gives it
all of that device's target cores (the vendor's behaviour); a device that hosts several gives
each its own core, round-robin over the device's target cores, so that instances do not ask for
the same cores. Legacy target forms (``"c:k"``, bare cluster ints) are not accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CORE_MODES",
    "DeviceTopology",
    "MbltTargetError",
    "Placement",
    "make_slot_config",
    "parse_cluster_target",
    "parse_core_target",
    "resolve_targets",
    "slot_cores",
    "slot_devices",
    "topology_for",
]

#: Core modes a backend accepts (qbruntime ``ModelConfig`` setters of the same names).
CORE_MODES: tuple[str, ...] = ("auto", "single", "multi", "global4", "global8")


class MbltTargetError(ValueError):
    """A target string, core mode or device set that cannot be placed."""


@dataclass(frozen=True)
class DeviceTopology:
    """Clusters per device and cores per cluster of one accelerator family."""

    clusters: int
    cores_per_cluster: int


_ARIES = DeviceTopology(clusters=2, cores_per_cluster=4)
_REGULUS = DeviceTopology(clusters=1, cores_per_cluster=1)


def topology_for(device_name: str) -> DeviceTopology:
    """The topology of a qbruntime device name: ``regulus*`` is 1x1, everything else (``aries``,
    ``aries-rb``, ``auto``) is Aries' 2 clusters x 4 cores."""
    return _REGULUS if device_name.startswith("regulus") else _ARIES


def _parse_ints(text: str, n: int, form: str) -> tuple[int, ...]:
    parts = text.split(":") if isinstance(text, str) else []
    if len(parts) != n or not all(p.strip().isdigit() for p in parts):
        raise MbltTargetError(f"target {text!r} is not a canonical {form} string")
    return tuple(int(p) for p in parts)


def parse_core_target(text: str) -> tuple[int, int, int]:
    """``"d:c:k"`` -> ``(d, c, k)``.

    Raises:
        MbltTargetError: not three non-negative integers separated by ``:``.
    """
    d, c, k = _parse_ints(text, 3, '"d:c:k" core')
    return d, c, k


def parse_cluster_target(text: str) -> tuple[int, int]:
    """``"d:c"`` -> ``(d, c)``.

    Raises:
        MbltTargetError: not two non-negative integers separated by ``:``.
    """
    d, c = _parse_ints(text, 2, '"d:c" cluster')
    return d, c


@dataclass(frozen=True)
class Placement:
    """Resolved targets: ``cores`` (``(d, c, k)``, single mode) or ``clusters`` (``(d, c)``,
    every other mode), in a stable order; ``devices`` is ``dev_no`` in its given order."""

    devices: tuple[int, ...]
    core_mode: str
    cores: tuple[tuple[int, int, int], ...] = ()
    clusters: tuple[tuple[int, int], ...] = ()

    def cores_for(self, dev: int) -> tuple[tuple[int, int], ...]:
        """``(cluster, core)`` targets on device ``dev``."""
        return tuple((c, k) for d, c, k in self.cores if d == dev)

    def clusters_for(self, dev: int) -> tuple[int, ...]:
        """Cluster targets on device ``dev``."""
        return tuple(c for d, c in self.clusters if d == dev)


def resolve_targets(
    dev_no: Sequence[int],
    core_mode: str,
    target_cores: Sequence[str] | None,
    target_clusters: Sequence[str] | None,
    device_name: str,
) -> Placement:
    """Resolve a layout's targets into a :class:`Placement`.

    ``target_cores`` is read in ``single`` mode only and ``target_clusters`` in the other
    modes; giving the other kind is an error rather than silently ignored.

    Raises:
        MbltTargetError: unknown core mode; the wrong kind of targets for the mode; a target
            that does not parse or is outside the device topology; a duplicated target; explicit
            targets whose device set differs from ``dev_no``; ``global8`` without both clusters
            of a device; a mode other than auto/single on a Regulus.
    """
    if core_mode not in CORE_MODES:
        raise MbltTargetError(f"core_mode={core_mode!r} is not one of {', '.join(CORE_MODES)}")
    topo = topology_for(device_name)
    if topo is _REGULUS and core_mode not in ("auto", "single"):
        raise MbltTargetError(
            f"core_mode={core_mode!r} is not supported on device {device_name!r}; "
            "Regulus supports auto and single only"
        )
    devices = tuple(dev_no)
    single = core_mode == "single"
    wrong, wrong_name = (target_clusters, "target_clusters") if single else (
        target_cores, "target_cores")
    if wrong is not None:
        raise MbltTargetError(
            f"{wrong_name}={list(wrong)!r} cannot be used with core_mode={core_mode!r}; use "
            f"{'target_cores' if single else 'target_clusters'}"
        )
    explicit = target_cores if single else target_clusters
    if explicit is None:
        if single:
            cores = tuple((d, c, k) for d in devices for c in range(topo.clusters)
                          for k in range(topo.cores_per_cluster))
            return Placement(devices, core_mode, cores=cores)
        clusters = tuple((d, c) for d in devices for c in range(topo.clusters))
        placement = Placement(devices, core_mode, clusters=clusters)
    else:
        parsed = [parse_core_target(t) if single else parse_cluster_target(t) for t in explicit]
        for text, target in zip(explicit, parsed):
            c = target[1]
            if c >= topo.clusters or (single and target[2] >= topo.cores_per_cluster):
                raise MbltTargetError(
                    f"target {text!r} is outside a {device_name!r} device "
                    f"({topo.clusters} clusters x {topo.cores_per_cluster} cores)"
                )
        if len(set(parsed)) != len(parsed):
            raise MbltTargetError(f"targets {list(explicit)!r} contain a duplicate")
        target_devs = sorted({t[0] for t in parsed})
        if target_devs != sorted(set(devices)):
            raise MbltTargetError(
                f"target device set {target_devs} does not match dev_no {list(devices)}"
            )
        ordered = tuple(sorted(parsed))
        if single:
            return Placement(devices, core_mode, cores=ordered)  # type: ignore[arg-type]
        placement = Placement(devices, core_mode, clusters=ordered)  # type: ignore[arg-type]
    if core_mode == "global8":
        for d in devices:
            got = list(placement.clusters_for(d))
            if len(got) != topo.clusters:
                raise MbltTargetError(
                    f"core_mode='global8' requires both clusters for device {d}; "
                    f"got clusters {got}"
                )
    return placement


def slot_devices(dev_no: Sequence[int], n_models: int) -> list[int]:
    """Device of each instance ``0..n_models-1``: ``dev_no[i % len(dev_no)]``."""
    return [dev_no[i % len(dev_no)] for i in range(n_models)]


def slot_cores(placement: Placement, dev: int, index_on_dev: int,
               n_on_dev: int) -> tuple[tuple[int, int], ...]:
    """Single-mode ``(cluster, core)`` targets of the ``index_on_dev``-th of ``n_on_dev``
    instances on device ``dev``: all the device's cores when it is alone, else one core,
    round-robin."""
    cores = placement.cores_for(dev)
    if n_on_dev <= 1:
        return cores
    return (cores[index_on_dev % len(cores)],)


def make_slot_config(runtime: Any, placement: Placement, dev: int, index_on_dev: int,
                     n_on_dev: int) -> Any:
    """A fresh ``runtime.ModelConfig`` for one instance, restricted to device ``dev``.

    auto -> ``set_auto_core_mode()``; single -> ``set_single_core_mode(None, [CoreId...])``
    (see :func:`slot_cores`); multi / global4 -> ``set_multi_core_mode([Cluster...])`` /
    ``set_global4_core_mode([Cluster...])`` with the device's clusters; global8 ->
    ``set_global8_core_mode()``.

    Raises:
        MbltTargetError: a setter returned False (qbruntime's refusal of that core selection).
    """
    mc = runtime.ModelConfig()
    mode = placement.core_mode
    if mode == "auto":
        ok = mc.set_auto_core_mode()
        what: object = None
    elif mode == "single":
        what = slot_cores(placement, dev, index_on_dev, n_on_dev)
        core_ids = [runtime.CoreId(getattr(runtime.Cluster, f"Cluster{c}"),
                                   getattr(runtime.Core, f"Core{k}")) for c, k in what]
        ok = mc.set_single_core_mode(None, core_ids)
    elif mode in ("multi", "global4"):
        what = placement.clusters_for(dev)
        clusters = [getattr(runtime.Cluster, f"Cluster{c}") for c in what]
        setter = mc.set_multi_core_mode if mode == "multi" else mc.set_global4_core_mode
        ok = setter(clusters)
    else:
        ok = mc.set_global8_core_mode()
        what = None
    if ok is False:
        raise MbltTargetError(
            f"qbruntime refused core_mode={mode!r} on device {dev} (targets {what!r})"
        )
    return mc
