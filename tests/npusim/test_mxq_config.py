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


def test_activation_slots_and_async_pipeline():
    mc = qb.ModelConfig()
    assert mc.get_activation_slots() == 1 and mc.set_activation_slots(2) is False and mc.get_activation_slots() == 1
    assert mc.set_async_pipeline_enabled(True) is True and mc.get_async_pipeline_enabled() is True
