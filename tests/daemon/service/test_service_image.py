"""A service restored from its image, on the same pool memory, answers as the original: the
sessions under their ids, their tables, figures and leases (extended by the gap), the prefix
cache; ids of another daemon stay refused; another memory, or a state it cannot keep, is
refused with the reason named."""

import contextlib
import os
import signal
import subprocess
import sys

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.daemon.core import (
    BlockPool,
    InvalidArgument,
    PoolError,
    SequenceExists,
    SequenceNotFound,
)
from pagedkv.daemon.service.errors import PoolExhausted, SessionBusy, SessionExpired
from pagedkv.daemon.service.fence import FenceCounts, RunnerProcess
from pagedkv.daemon.service.operations import Allocate, Append, Commit, Fork, Free, Operation
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.service_image import NotKept, restore_service, service_image
from pagedkv.daemon.service.tenants import DEFAULT_TENANT, Caller, calling_as

from hand_clock import HandClock

_seq = st.integers(0, 4)
_ops = st.one_of(
    st.builds(lambda q, n: Allocate(q, n, [7] * n), _seq, st.integers(0, 9)),
    st.builds(Allocate, _seq, st.integers(0, 5), st.just(())),
    st.builds(Append, _seq, st.integers(1, 5)),
    st.builds(Fork, _seq, _seq),
    st.builds(lambda q: Commit([q]), _seq),
    st.builds(Free, _seq),
)


def make_service(pool_id: str, clock: HandClock, host_slots: int = 4) -> PoolService:
    service = PoolService(BlockPool(12, 2), None, pool_id=pool_id, clock=clock)
    service.attach_host_tier(None, host_slots)
    return service


def restarted(service: PoolService, clock: HandClock) -> PoolService:
    """The next daemon's service, with `service`'s image read back as a snapshot reads it."""
    image = msgpack.unpackb(msgpack.packb(service_image(service), use_bin_type=True),
                            raw=False, strict_map_key=False)
    again = make_service("next", clock)
    restore_service(again, image, adopted_from=service.pool_id)
    again.check_invariants()
    return again


async def answers(service: PoolService) -> object:
    """What clients and operators can ask: every session's stats and tables, pool figures."""
    tables = {}
    for session in service.sessions:
        seq_ids = sorted(session.seq_ids)
        if seq_ids:
            tables[session.session_id] = await service.block_tables(session.session_id, seq_ids,
                                                                    with_token_ids=True)
    stats = {s.session_id: service.stats_of(s.session_id) for s in service.sessions}
    return service.pool_stats(), tables, stats, service.tenant_figures()


async def outcome(service: PoolService, session_id: str, op: Allocate) -> object:
    """The answer, or the refusal's type and message."""
    try:
        return await service.allocate(session_id, op)
    except PoolError as exc:
        return type(exc), str(exc)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(_ops, min_size=1, max_size=3)),
                max_size=20), st.integers(0, 2))
async def test_a_restored_service_answers_as_the_original(
        script: list[tuple[int, list[Operation]]], closed: int) -> None:
    clock = HandClock()
    service = make_service("first", clock)
    sids = [service.open_session("a", max_blocks=10).session_id,
            service.open_session("b", cache_salt=b"s").session_id,
            service.open_session("c", cache_salt=b"s").session_id]
    for index, ops in script:
        with contextlib.suppress(InvalidArgument, SequenceNotFound, SequenceExists,
                                 PoolExhausted):
            await service.batch(sids[index], ops)
    await service.close_session(sids[closed])
    again = restarted(service, clock)
    assert await answers(again) == await answers(service)
    # Both go on alike: the same prompt finds the same cached prefix, the same blocks.
    prompt = Allocate(9, 6, [7] * 6)
    live = sids[(closed + 1) % 3]
    assert await outcome(again, live, prompt) == await outcome(service, live, prompt)
    again.check_invariants()


async def test_leases_are_extended_by_the_gap_and_ids_stay_credentials() -> None:
    clock = HandClock()
    service = make_service("first", clock)
    sid = service.open_session("a", lease_ttl_ms=1000).session_id
    await service.allocate(sid, Allocate(0, 3, [1, 2, 3]))
    clock.advance(400)  # 600 ms of the lease left at the stop
    image = service_image(service)
    clock.advance(5000)  # the restart's gap
    again = make_service("next", clock)
    restore_service(again, image, adopted_from="first")
    clock.advance(500)
    assert again.keep_alive(sid) == 1000  # alive: 600 ms ran from the restore
    assert await again.expire_due() == 0
    foreign = sid.replace("first-", "other-", 1)
    with pytest.raises(SessionExpired, match="before a daemon restart"):
        again.keep_alive(foreign)
    newcomer = again.open_session("d")
    assert newcomer.number > again.sessions.peek(sid).number  # type: ignore[union-attr]
    assert newcomer.session_id.startswith("next-")


def test_another_memory_or_geometry_is_refused_and_changes_nothing() -> None:
    clock = HandClock()
    service = make_service("first", clock)
    service.open_session("a")
    image = service_image(service)
    fresh = make_service("next", clock)
    with pytest.raises(NotKept, match="snapshot is of pool first, the memory mapped is new"):
        restore_service(fresh, image, adopted_from="")
    other = PoolService(BlockPool(16, 2), None, pool_id="next", clock=clock)
    other.attach_host_tier(None, 4)
    with pytest.raises(NotKept, match="num_blocks 12 != 16"):
        restore_service(other, image, adopted_from="first")
    for untouched in (fresh, other):
        assert not len(untouched.sessions)
        assert untouched.pool_stats().used_blocks == untouched.pool_stats().num_sequences == 0


def runner_process() -> tuple[subprocess.Popen[bytes], RunnerProcess]:
    """A process standing for a runner that keeps running through the restart."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return child, RunnerProcess(child.pid, os.pidfd_open(child.pid), FenceCounts())


async def client_close(service: PoolService, session_id: str) -> int:
    """CloseSession as a client calls it (a runner's hold refuses it)."""
    with calling_as(Caller(service.tenants.by_name[DEFAULT_TENANT])):
        return await service.close_session(session_id)


async def test_a_runners_hold_survives_the_restart_and_its_fence_still_works() -> None:
    clock = HandClock()
    service = make_service("first", clock)
    sids = [service.open_session(name).session_id for name in ("held", "gone", "reused")]
    children = []
    for sid in sids:
        child, process = runner_process()
        children.append(child)
        service.sessions.peek(sid).holds[process] = clock() + 1.0  # type: ignore[union-attr]
    image = msgpack.unpackb(msgpack.packb(service_image(service), use_bin_type=True),
                            raw=False, strict_map_key=False)
    await service.stop()  # the old daemon's pidfds closed
    try:
        children[1].kill()  # this runner exits during the restart: its hold goes with it
        children[1].wait()
        reused = next(s for s in image["sessions"] if s["session_id"] == sids[2])
        reused["holds"] = [(pid, start + 1, left) for pid, start, left in reused["holds"]]
        again = make_service("next", clock)
        restore_service(again, image, adopted_from="first")
        again.check_invariants()
        with pytest.raises(SessionBusy, match="for 1000 ms more"):
            await client_close(again, sids[0])
        assert await client_close(again, sids[1]) == 0  # its runner has exited
        assert await client_close(again, sids[2]) == 0  # that pid started at another time
        clock.advance(1500)  # the hold lapses while its runner still runs: fenced
        with pytest.raises(SessionBusy, match="stalled past its hold"):
            await client_close(again, sids[0])
        assert children[0].wait(timeout=30) == -signal.SIGKILL
        assert await client_close(again, sids[0]) == 0
        await again.stop()
    finally:
        for child in children:
            child.kill()
            child.wait()
