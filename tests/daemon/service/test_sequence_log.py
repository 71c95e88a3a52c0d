"""Request ids in the daemon: kept with their sequences (a fork's child inherits its parent's),
named on the debug lines about single sequences and on a lease expiry's line, written only
for calls that succeeded; a bad id refused before anything changes.

Pool: 8 blocks of 4 slots; the log at debug, as JSON lines.
"""

import io
from collections.abc import Iterator

import pytest

from pagedkv.daemon.core import BlockPool, InvalidArgument
from pagedkv.daemon.service.operations import Allocate, Fork, Free
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.process.log_setup import configure

from log_capture import events


@pytest.fixture
def debug_log(restore_root_logger: None) -> Iterator[io.StringIO]:
    stream = io.StringIO()
    configure("debug", "json", stream)
    yield stream


def fields(line: dict[str, object], *names: str) -> tuple[object, ...]:
    return tuple(line[name] for name in names)


async def test_ids_kept_inherited_and_logged_per_sequence(debug_log: io.StringIO) -> None:
    service = PoolService(BlockPool(8, 4), None, pool_id="p")
    session = service.open_session("eng")
    sid = session.session_id
    await service.allocate(sid, Allocate(1, 5, request_id="abc-123"))
    await service.batch(sid, [Fork(1, 2), Allocate(3, 2)])  # 3: no id
    assert session.request_ids == {1: "abc-123", 2: "abc-123"}
    await service.free(sid, Free(1))
    assert session.request_ids == {2: "abc-123"}
    allocated = events(debug_log, "sequence allocated")
    assert [fields(line, "session", "seq_id", "request_id", "num_tokens")
            for line in allocated] == [("eng#1", 1, "abc-123", 5), ("eng#1", 3, "", 2)]
    forked = events(debug_log, "sequence forked")
    assert [fields(line, "seq_id", "parent_seq_id", "request_id") for line in forked] == [
        (2, 1, "abc-123")]
    freed = events(debug_log, "sequence freed")
    # The child shares both of its blocks: none is released.
    assert [fields(line, "seq_id", "request_id", "released_blocks") for line in freed] == [
        (1, "abc-123", 0)]
    service.check_invariants()


@pytest.mark.parametrize("bad", ["x" * 200, "abc\ninjected=1", "a b", "é"])
async def test_a_bad_id_is_refused_naming_request_id_and_changes_nothing(
        debug_log: io.StringIO, bad: str) -> None:
    service = PoolService(BlockPool(8, 4), None, pool_id="p")
    session = service.open_session("eng")
    before = service.pool_stats()
    with pytest.raises(InvalidArgument, match="request_id must be 1 to 128") as refused:
        await service.batch(session.session_id, [Allocate(1, 4), Allocate(2, 4, request_id=bad)])
    assert bad not in str(refused.value)  # never echoed: it may be anything
    assert service.pool_stats() == before and not session.seq_ids and not session.request_ids
    assert events(debug_log, "sequence allocated") == []
    service.check_invariants()


async def test_a_failed_batch_logs_none_of_its_ops_and_keeps_the_ids(
        debug_log: io.StringIO) -> None:
    service = PoolService(BlockPool(8, 4), None, pool_id="p")
    sid = service.open_session("eng").session_id
    await service.allocate(sid, Allocate(1, 4, request_id="r1"))
    session = service.sessions.get(sid)
    with pytest.raises(Exception, match="op 2"):  # the pool has 8 blocks
        await service.batch(sid, [Free(1), Allocate(2, 4, request_id="r2"),
                                  Allocate(3, 64, request_id="r3")])
    assert session.request_ids == {1: "r1"}
    assert [line["request_id"] for line in events(debug_log, "sequence allocated")] == ["r1"]
    assert events(debug_log, "sequence freed") == []


async def test_a_lease_expiry_names_the_requests_it_ended(debug_log: io.StringIO) -> None:
    now = [0.0]
    service = PoolService(BlockPool(64, 4), None, pool_id="p", clock=lambda: now[0])
    sid = service.open_session("eng", lease_ttl_ms=300).session_id
    await service.batch(sid, [Allocate(seq, 1, request_id=f"req-{seq}") for seq in range(10)])
    now[0] += 0.301
    assert await service.expire_due() == 1
    [expired] = events(debug_log, "session expired")
    assert expired["request_ids"] == "req-0,req-1,req-2,req-3,req-4,req-5,req-6,req-7 +2 more"
    assert len(events(debug_log, "sequence freed")) == 10


async def test_at_info_nothing_is_kept_for_the_lines(log_lines: io.StringIO) -> None:
    service = PoolService(BlockPool(8, 4), None, pool_id="p")
    sid = service.open_session("eng").session_id
    await service.allocate(sid, Allocate(1, 4, request_id="r1"))
    assert service.sessions.get(sid).request_ids == {1: "r1"}
    assert events(log_lines, "sequence allocated") == []
    assert service.formats.models.formats[0].ops.sequence_log._lines == []
