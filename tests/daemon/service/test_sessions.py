"""SessionRegistry: ids, leases on a fake clock, and why a missing session is missing."""

import grpc
import pytest

from pagedkv.daemon.core import InvalidArgument
from pagedkv.daemon.edge.status import cause_of
from pagedkv.daemon.service import sessions as sessions_module
from pagedkv.daemon.service.errors import SessionExpired, SessionNotFound
from pagedkv.daemon.service.sessions import SessionRegistry

from hand_clock import HandClock


@pytest.fixture
def registry(clock: HandClock) -> SessionRegistry:
    return SessionRegistry("pool1", default_lease_ttl_ms=1000, max_lease_ttl_ms=5000,
                           clock=clock)


def test_ids_embed_pool_and_number_and_are_unguessable(registry: SessionRegistry) -> None:
    a = registry.open("a", 0, 0, b"")
    b = registry.open("b", 0, 0, b"")
    assert a.session_id.startswith("pool1-1-") and b.session_id.startswith("pool1-2-")
    assert (a.number, b.number) == (1, 2)
    assert a.session_id.split("-")[2] != b.session_id.split("-")[2]
    assert len(a.session_id.split("-")[2]) == 16
    assert a.label == "a#1"
    assert a.key(7) == (1, 7)
    assert registry.get(a.session_id) is a
    assert len(registry) == 2


def test_lease_default_and_clamp(registry: SessionRegistry) -> None:
    assert registry.open("x", 0, 0, b"").lease_ttl_ms == 1000
    assert registry.open("x", 300, 0, b"").lease_ttl_ms == 300
    assert registry.open("x", 999_999, 0, b"").lease_ttl_ms == 5000


def test_negative_lease_or_quota_refused(registry: SessionRegistry) -> None:
    with pytest.raises(InvalidArgument, match="must not be negative"):
        registry.open("x", -1, 0, b"")
    with pytest.raises(InvalidArgument, match="must not be negative"):
        registry.open("x", 0, -5, b"")
    assert len(registry) == 0


def test_salts_default_unique_and_client_salts_namespaced(registry: SessionRegistry) -> None:
    a, b = registry.open("a", 0, 0, b""), registry.open("b", 0, 0, b"")
    c, d = registry.open("c", 0, 0, b"team"), registry.open("d", 0, 0, b"team")
    assert a.salt != b.salt
    assert c.salt == d.salt == b"client:team"
    # A client cannot pick a salt equal to another session's default one.
    e = registry.open("e", 0, 0, a.salt)
    assert e.salt != a.salt


def test_every_call_renews_the_lease_and_a_lapsed_one_is_never_revived(
        registry: SessionRegistry, clock: HandClock) -> None:
    """The lease rules on a fake clock; tests/client/pool/test_client_process.py runs the real
    reaper."""
    session = registry.open("a", 1000, 0, b"")
    for _ in range(5):
        clock.now += 0.9  # just inside the lease each time
        assert registry.get(session.session_id) is session
    assert registry.due() == []
    clock.now += 1.001
    assert registry.due() == [session]
    with pytest.raises(SessionExpired, match="expired") as failure:  # refused before reaping
        registry.get(session.session_id)
    assert cause_of(failure.value).code == grpc.StatusCode.FAILED_PRECONDITION.name
    registry.remove(session, expired=True)  # the reaper's part
    assert registry.expiries_total == 1 and session not in registry
    with pytest.raises(SessionExpired, match="expired"):
        registry.get(session.session_id)


def test_a_call_in_flight_holds_the_lease_from_arrival_to_departure(
        registry: SessionRegistry, clock: HandClock) -> None:
    session = registry.open("a", 1000, 0, b"")
    clock.now += 0.9
    assert registry.arrive(session.session_id) is session  # renewed on arrival
    clock.now += 5.0  # the call waits behind other clients' work, far past its lease
    assert registry.due() == []
    registry.depart(session)  # the lease runs from the end of the call
    clock.now += 0.9
    assert registry.due() == []
    clock.now += 0.2
    assert registry.due() == [session]


def test_missing_sessions_say_why(registry: SessionRegistry) -> None:
    with pytest.raises(SessionNotFound, match="unknown session"):
        registry.get("pool1-9-0123456789abcdef")
    with pytest.raises(SessionNotFound):
        registry.get("garbage")
    with pytest.raises(InvalidArgument, match="empty"):
        registry.get("")
    with pytest.raises(SessionExpired, match="before a daemon restart"):
        registry.get("oldpool-3-0123456789abcdef")


def test_removed_session_is_unknown_until_reinstated(registry: SessionRegistry) -> None:
    session = registry.open("a", 0, 0, b"")
    registry.remove(session, expired=False)  # closed
    with pytest.raises(SessionNotFound):
        registry.get(session.session_id)
    with pytest.raises(SessionNotFound):
        registry.check_live(session)
    assert registry.expiries_total == 0
    registry.reinstate(session, False)  # a close whose memory work failed is undone
    assert registry.get(session.session_id) is session


def test_expired_ids_remembered_within_a_bound(registry: SessionRegistry, clock: HandClock,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessions_module, "REMEMBERED_EXPIRED_IDS", 2)
    ids = [registry.open(str(i), 1000, 0, b"").session_id for i in range(3)]
    clock.now += 2
    for session in registry.due():
        registry.remove(session, expired=True)
    assert registry.expiries_total == 3
    with pytest.raises(SessionNotFound):  # the oldest was forgotten
        registry.get(ids[0])
    for session_id in ids[1:]:
        with pytest.raises(SessionExpired):
            registry.get(session_id)


def test_bad_lease_configuration() -> None:
    with pytest.raises(ValueError, match="default_lease_ttl_ms"):
        SessionRegistry("p", default_lease_ttl_ms=0, max_lease_ttl_ms=10)
    with pytest.raises(ValueError, match="default_lease_ttl_ms"):
        SessionRegistry("p", default_lease_ttl_ms=20, max_lease_ttl_ms=10)
