"""vllm_npu.mblt.slots: RequestKV bookkeeping and SlotTable save/restore, with recording
dump/load callables standing in for the backend (the slot table only calls them)."""

from __future__ import annotations

import pytest

from vllm_npu.mblt.slots import MbltCacheStateError, RequestKV, SlotTable


class Device:
    """A slot -> KV-ids store: dump returns the ids as one blob, load writes them back."""

    def __init__(self):
        self.kv: dict[tuple[int, int], list[int]] = {}
        self.dumps: list[tuple[int, int]] = []
        self.loads: list[tuple[int, int]] = []

    def dump(self, m, c):
        self.dumps.append((m, c))
        return [bytes(self.kv.get((m, c), []))]

    def load(self, m, c, blobs):
        self.loads.append((m, c))
        self.kv[(m, c)] = list(blobs[0])


def table(dev):
    timings = {"dump": [], "load": []}
    t = SlotTable(dev.dump, dev.load, lambda cid, ms: timings["dump"].append(cid),
                  lambda cid, ms: timings["load"].append(cid))
    return t, timings


def run(dev, kv, start, ids):
    """What the worker does around an infer: write ids at start, then note it."""
    dev.kv[kv.slot] = dev.kv.get(kv.slot, [])[:start] + list(ids)
    kv.note_write(start, list(ids))


def test_save_only_when_resident_and_stale():
    dev = Device()
    t, timings = table(dev)
    a = RequestKV((0, 0))
    t.save(a)  # not bound: nothing to save
    t.bind(a)
    t.save(a)  # bound but empty: nothing to save
    assert dev.dumps == []
    run(dev, a, 0, [1, 2, 3])
    t.save(a)
    assert dev.dumps == [(0, 0)] and a.host == [bytes([1, 2, 3])] and a.host_len == 3
    t.save(a)  # host copy is current: no second dump
    assert t.saves == 1
    run(dev, a, 3, [4])
    t.save(a)  # one more token: stale again
    assert t.saves == 2 and a.host_len == 4 and timings["dump"] == [0, 0]
    t.release(a)
    run(dev, RequestKV((0, 0)), 0, [9])  # another cache's write; a is no longer resident
    a.token_ids.append(5)
    t.save(a)
    assert t.saves == 2


def test_bind_saves_the_previous_holder_and_restores_the_new_one():
    dev = Device()
    t, timings = table(dev)
    a, b = RequestKV((0, 0)), RequestKV((0, 0))
    t.bind(a)
    run(dev, a, 0, [1, 2])
    t.bind(b)  # b is empty: a saved, nothing loaded
    assert t.holder((0, 0)) is b and a.host_len == 2 and dev.loads == []
    run(dev, b, 0, [7, 7, 7])
    t.bind(a)  # b saved, a restored from its own host copy
    assert dev.kv[(0, 0)] == [1, 2] and t.restores == 1 and b.host_len == 3
    assert timings["load"] == [0]
    t.bind(a)  # already the holder: nothing happens
    assert t.restores == 1 and t.saves == 2


def test_restore_of_a_cache_whose_host_copy_is_short_is_refused():
    dev = Device()
    t, _ = table(dev)
    a, b = RequestKV((0, 1), owner="req_id=req-a"), RequestKV((0, 1))
    t.bind(a)
    run(dev, a, 0, [1, 2, 3])
    t.bind(b)
    a.token_ids.extend([4, 5])  # tokens that are neither resident nor saved
    with pytest.raises(MbltCacheStateError, match=r"^Cannot restore 5 cached tokens of req_id=req-a on slot \(model_idx=0, cache_id=1\): "
                                                   r"the host copy holds only 3\.$"):
        t.bind(a)
    never_saved = RequestKV((0, 1), token_ids=[1], owner="snapshot r7@1")
    with pytest.raises(MbltCacheStateError, match=r"^Cannot restore 1 cached tokens of snapshot r7@1 on slot "
                                                   r"\(model_idx=0, cache_id=1\): the host copy holds only 0\.$"):
        t.bind(never_saved)


def test_truncate_keeps_the_host_copy_valid_up_to_the_cut():
    a = RequestKV((0, 0), token_ids=[1, 2, 3, 4], host=[b"x"], host_len=4)
    a.truncate(2)
    assert a.token_ids == [1, 2] and a.host_len == 2
    a.truncate(5)
    assert a.length == 2 and a.host_len == 2


def test_note_write_gap_is_refused_and_overwrite_invalidates_host():
    a = RequestKV((0, 0), token_ids=[1, 2, 3], host=[b"x"], host_len=3, owner="req_id=r1")
    with pytest.raises(MbltCacheStateError,
                       match=r"^Cannot infer from position 4: the cache of req_id=r1 on slot "
                             r"\(model_idx=0, cache_id=0\) holds 3 tokens\.$"):
        a.note_write(4, [9])
    assert a.token_ids == [1, 2, 3]
    a.note_write(1, [8, 9])  # rewrite from position 1
    assert a.token_ids == [1, 8, 9] and a.host_len == 1
    a.note_write(3, [10])  # append at the end
    assert a.token_ids == [1, 8, 9, 10] and a.host_len == 1


def test_release_only_forgets_its_own_slot_and_clear_forgets_all():
    dev = Device()
    t, _ = table(dev)
    a, b = RequestKV((0, 0)), RequestKV((0, 1))
    t.bind(a)
    t.bind(b)
    t.release(RequestKV((0, 0)))  # not the holder: no effect
    assert t.holder((0, 0)) is a
    t.release(a)
    assert t.holder((0, 0)) is None and t.holder((0, 1)) is b
    t.clear()
    assert t.owner == {}
