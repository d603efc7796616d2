"""Lease table (replica_agent/policy/leases.py)."""

from __future__ import annotations

import pytest

from replica_agent.policy.leases import LeaseTable, LeaseTableFull


def test_grant_consume_release():
    t = LeaseTable(id_prefix="abc")
    lid = t.grant(100, "interactive", 16, now_ms=0.0, ttl_ms=500.0, request_id="r1")
    assert lid.startswith("abc-")
    assert len(t) == 1
    lease = t.get(lid)
    assert lease is not None and lease.expires_ms == 500.0 and lease.max_tokens == 16
    consumed = t.consume(lid)
    assert consumed is lease
    assert len(t) == 0
    assert t.consume(lid) is None  # used once only
    assert not t.release(lid)


def test_release_true_once():
    t = LeaseTable()
    lid = t.grant(10, "c", None, 0.0, 100.0)
    assert t.release(lid)
    assert not t.release(lid)
    assert not t.release("never-granted")


def test_ids_are_unique():
    t = LeaseTable()
    ids = {t.grant(1, "c", 0, 0.0, 10.0) for _ in range(50)}
    assert len(ids) == 50
    assert t.get(next(iter(ids))).max_tokens is None  # 0 means unknown


def test_expire_at_and_after_expiry_only():
    t = LeaseTable()
    a = t.grant(1, "c", None, 0.0, 100.0)
    b = t.grant(1, "c", None, 50.0, 100.0)
    assert t.expire(99.9) == []
    expired = t.expire(100.0)
    assert [x.lease_id for x in expired] == [a]
    assert [x.lease_id for x in t.active()] == [b]
    assert [x.lease_id for x in t.expire(1e9)] == [b]
    assert len(t) == 0


def test_bounded():
    t = LeaseTable(max_leases=2)
    t.grant(1, "c", None, 0.0, 10.0)
    t.grant(1, "c", None, 0.0, 10.0)
    with pytest.raises(LeaseTableFull):
        t.grant(1, "c", None, 0.0, 10.0)
    t.expire(10.0)
    t.grant(1, "c", None, 10.0, 10.0)  # room again


def test_bad_arguments():
    with pytest.raises(ValueError):
        LeaseTable(max_leases=0)
    t = LeaseTable()
    with pytest.raises(ValueError):
        t.grant(-1, "c", None, 0.0, 10.0)
    with pytest.raises(ValueError):
        t.grant(1, "c", None, 0.0, 0.0)
