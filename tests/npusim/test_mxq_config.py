"""npusim.mxq.ModelConfig: defaults, the accepted setter forms, invalid requests return False."""

from __future__ import annotations

import npusim.mxq as qb

C0, C1 = qb.Cluster.Cluster0, qb.Cluster.Cluster1


def _cid(cl, co):
    return qb.CoreId(cl, co)


def test_defaults():
    mc = qb.ModelConfig()
    assert mc.get_core_mode() == qb.CoreMode.Auto
    assert mc.get_core_allocation_policy() == qb.CoreAllocationPolicy.Manual
    assert mc.get_core_ids() == [] and mc.get_clusters() == []
    assert qb.ModelConfig(2).get_core_mode() == qb.CoreMode.Single and qb.ModelConfig(2).get_num_cores() == 2


def test_single_core_forms():
    ids = [_cid(C1, qb.Core.Core2), _cid(C0, qb.Core.Core1)]
    for call in (lambda mc: mc.set_single_core_mode(None, ids), lambda mc: mc.set_single_core_mode(ids),
                 lambda mc: mc.set_single_core_mode(core_ids=ids)):
        mc = qb.ModelConfig()
        assert call(mc) is True
        assert mc.get_core_mode() == qb.CoreMode.Single and mc.get_core_ids() == sorted(ids)
    mc = qb.ModelConfig()
    assert mc.set_single_core_mode(3) is True and mc.get_num_cores() == 3


def test_single_core_with_global_core_is_refused(glog):
    mc = qb.ModelConfig()
    assert mc.set_single_core_mode(None, [_cid(C0, qb.Core.GlobalCore)]) is False
    assert glog() == ["Invalid core ID: `Core::GlobalCore` cannot be used in single-core mode."]
    assert mc.get_core_mode() == qb.CoreMode.Auto


def test_cluster_modes(glog):
    mc = qb.ModelConfig()
    assert mc.set_multi_core_mode([C1]) is True
    assert (mc.get_core_mode(), mc.get_clusters()) == (qb.CoreMode.Multi, [C1])
    assert mc.set_global4_core_mode([C0, C1]) is True and mc.get_core_mode() == qb.CoreMode.Global4
    assert mc.set_global8_core_mode() is True and mc.get_core_mode() == qb.CoreMode.Global8
    assert mc.set_multi_core_mode([]) is False
    assert glog() == ["Invalid clusters: `clusters` must not be empty."]
    assert mc.get_core_mode() == qb.CoreMode.Global8
    assert mc.set_auto_core_mode() is True and mc.get_core_mode() == qb.CoreMode.Auto


def test_activation_slots_and_async_pipeline(glog):
    mc = qb.ModelConfig()
    """As the real ModelConfig (checked against the qbruntime 1.5.0 wheel): -1 until set; each
    core-mode setter derives 2 per target core or cluster (global8: 2), auto resets to -1."""
    assert mc.get_activation_slots() == -1
    assert mc.set_activation_slots(5) is None and mc.get_activation_slots() == 5
    assert mc.set_activation_slots(0) is None and mc.get_activation_slots() == 0
    mc.set_activation_slots(-1)
    assert glog() == ["Invalid activation slot num: -1. Must be >= 0."] and mc.get_activation_slots() == 0
    c0 = qb.Cluster.Cluster0
    mc.set_single_core_mode(None, [qb.CoreId(c0, qb.Core.Core0), qb.CoreId(c0, qb.Core.Core2), qb.CoreId(c0, qb.Core.Core3)])
    assert mc.get_activation_slots() == 6
    mc.set_multi_core_mode([c0])
    assert mc.get_activation_slots() == 2
    mc.set_global4_core_mode()
    assert mc.get_activation_slots() == 4
    mc.set_activation_slots(7)
    mc.set_single_core_mode(3)  # the deprecated form leaves it
    assert mc.get_activation_slots() == 7
    glog()
    mc.set_global8_core_mode()
    assert mc.get_activation_slots() == 2
    mc.set_auto_core_mode()
    assert mc.get_activation_slots() == -1
    assert qb.ModelConfig(3).get_activation_slots() == 1
    glog()
    assert mc.set_async_pipeline_enabled(True) is None and mc.get_async_pipeline_enabled() is True
