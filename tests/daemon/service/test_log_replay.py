"""A service's crash log replayed into a fresh service gives the state its applied calls left:
random calls, a "crash" (the service dropped without a stop, the log's bytes kept), a replay,
and every session, table, reference count and cached key as in the original; leases gain the
gap. A log whose block copies were not done, a torn tail, a record that does not replay and a
log of another memory are handled as the module says."""

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.daemon.core import BlockPool, PoolError
from pagedkv.daemon.service.crash_log import frame, log_path, read_log
from pagedkv.daemon.service.errors import SessionBusy
from pagedkv.daemon.service.fence import FenceCounts, RunnerProcess
from pagedkv.daemon.service.log_replay import open_log, replay_log
from pagedkv.daemon.service.models import KvShape
from pagedkv.daemon.service.operations import (
    Allocate,
    Append,
    Commit,
    CopyOnWrite,
    Fork,
    Free,
    Operation,
)
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.service_image import NotKept, service_image
from pagedkv.daemon.service.tenants import DEFAULT_TENANT, Caller, calling_as
from pagedkv.vocab.geometry import TINY_CPU_GEOMETRY

from hand_clock import HandClock

_seq = st.integers(0, 3)
_ops = st.one_of(
    st.builds(lambda q, n: Allocate(q, n, [7] * n), _seq, st.integers(0, 7)),
    st.builds(Allocate, _seq, st.integers(0, 5), st.just(())),
    st.builds(Append, _seq, st.integers(1, 4)),
    st.builds(Fork, _seq, _seq),
    st.builds(CopyOnWrite, _seq, st.integers(0, 2)),
    st.builds(lambda q: Commit([q]), _seq),
    st.builds(Free, _seq),
)
# One step of a script: (what, which session, an op, a number).
_steps = st.tuples(st.sampled_from(["op", "batch", "step", "open", "close", "keep", "wait",
                                    "expire"]),
                   st.integers(0, 2), _ops, st.integers(1, 3))


def make_service(pool_id: str, clock: HandClock) -> PoolService:
    return PoolService(BlockPool(16, 2), None, pool_id=pool_id, clock=clock)


def comparable(service: PoolService) -> dict[str, Any]:
    """The service's image as the snapshot file reads it, less what differs by design: the
    pool id of the run, and the leases (checked apart)."""
    image = msgpack.unpackb(msgpack.packb(service_image(service), use_bin_type=True),
                            raw=False, strict_map_key=False)
    del image["pool_id"]
    for session in image["sessions"]:
        del session["lease_left_s"]
    return image


async def run_step(service: PoolService, clock: HandClock, sids: list[str],
                   step: tuple[str, int, Operation, int]) -> None:
    """One random call; refusals are part of the script (they change nothing)."""
    what, index, op, n = step
    sid = sids[index % len(sids)]
    as_tenant = calling_as(Caller(service.tenants.by_name[DEFAULT_TENANT]))
    with contextlib.suppress(PoolError), as_tenant if n == 2 else contextlib.nullcontext():
        if what == "op":
            await getattr(service, type(op).__name__.lower().replace("copyonwrite",
                                                                     "copy_on_write"))(sid, op)
        elif what == "batch":
            await service.batch(sid, [op, Append(op.seq_id if hasattr(op, "seq_id") else 0, n)])
        elif what == "step":
            session = service.sessions.peek(sid)
            seq_ids = sorted(session.seq_ids) if session else [0]
            await service.step(sid, seq_ids or [0], n, commit=n == 3, reserve_tokens=n - 1)
        elif what == "open":
            sids.append(service.open_session(f"c{n}", lease_ttl_ms=500 * n,
                                             cache_salt=b"shared" if n > 1 else b"")
                        .session_id)
        elif what == "close":
            await service.close_session(sid)
        elif what == "keep":
            service.keep_alive(sid)
        elif what == "wait":
            clock.advance(300 * n)
        else:
            await service.expire_due()


async def outcome(service: PoolService, session_id: str, op: Allocate) -> object:
    """The answer, or the refusal's type and message."""
    try:
        return await service.allocate(session_id, op)
    except PoolError as exc:
        return type(exc), str(exc)


async def crashed_and_replayed(service: PoolService, path: Path, clock: HandClock,
                               gap_ms: float = 0) -> PoolService:
    """The next daemon's service, from the log's bytes alone (no stop of `service`)."""
    clock.advance(gap_ms)
    again = make_service("next", clock)
    await replay_log(again, path, adopted_from=service.pool_id)
    again.check_invariants()
    return again


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(_steps, max_size=30), st.sampled_from([1 << 20, 3000]))
async def test_a_replayed_log_gives_the_state_the_calls_left(
        tmp_path: Path, script: list[tuple[str, int, Operation, int]], max_bytes: int) -> None:
    clock = HandClock()
    service = make_service("first", clock)
    sids = [service.open_session("a", max_blocks=12).session_id]
    path = log_path(tmp_path, f"first{len(script)}-{max_bytes}")
    open_log(service, path, max_bytes)  # small max_bytes: checkpoints along the way
    for step in script:
        await run_step(service, clock, sids, step)
    before = {s.session_id: s.deadline for s in service.sessions}
    again = await crashed_and_replayed(service, path, clock, gap_ms=2000)
    assert comparable(again) == comparable(service)
    assert again.recovered_from_crash_log and again.previous_pool_id == "first"
    for session in again.sessions:  # the gap is added: 2 s and the time since the last call
        assert session.deadline >= before[session.session_id] + 2.0
    # Both go on alike: the same prompt finds the same cached prefix and the same blocks.
    live = next((s for s in service.sessions if not service.sessions.is_due(s)), None)
    if live is not None:  # (the original's leases have not gained the gap)
        prompt = Allocate(9, 6, [7] * 6)
        assert await outcome(again, live.session_id, prompt) == await outcome(
            service, live.session_id, prompt)


async def test_the_log_is_bounded_by_checkpoints(tmp_path: Path) -> None:
    clock = HandClock()
    service = make_service("first", clock)
    sid = service.open_session("a").session_id
    path = log_path(tmp_path, "first")
    crash_log = open_log(service, path, max_bytes=4000)
    for seq_id in range(40):
        await service.allocate(sid, Allocate(seq_id % 6, 2, [seq_id, 1]))
        await service.free(sid, Free(seq_id % 6))
    assert crash_log.size <= 4000 and path.stat().st_size == 4000  # the file is the bound
    assert path.stat().st_mode & 0o777 == 0o600
    again = await crashed_and_replayed(service, path, clock)
    assert comparable(again) == comparable(service)


async def test_memory_work_not_known_done_refuses_the_log(tmp_path: Path) -> None:
    clock = HandClock()
    service = make_service("first", clock)
    service.memory = Recorder()  # the calls' copies run (and are recorded)
    sid = service.open_session("a").session_id
    path = log_path(tmp_path, "first")
    crash_log = open_log(service, path, max_bytes=1 << 20)
    await service.allocate(sid, Allocate(0, 3, [1, 2, 3]))
    await service.fork(sid, Fork(0, 1))
    await service.append(sid, Append(1, 1))  # copy-on-write of the shared partial block
    assert service.memory.copies and not crash_log.working
    await crashed_and_replayed(service, path, clock)  # every copy known done
    work: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    crash_log.started(work)  # a copy started, then the crash before it was done
    with pytest.raises(NotKept, match=r"1 memory works .* were in flight at the crash"):
        await replay_log(make_service("next", clock), path, adopted_from="first")
    work.set_result(None)
    await asyncio.sleep(0)  # its done callback
    await crashed_and_replayed(service, path, clock)


class Recorder:
    """Pool memory that records the copies asked of it."""

    def __init__(self) -> None:
        self.copies: list[tuple[list[int], list[int]]] = []

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int], /) -> None:
        self.copies.append((list(src), list(dst)))

    def zero_blocks(self, ids: Sequence[int], /) -> None:
        pass

    def synchronize(self) -> None:
        pass


async def test_a_torn_tail_ends_the_log_and_a_bad_record_refuses_it(tmp_path: Path) -> None:
    clock = HandClock()
    service = make_service("first", clock)
    sid = service.open_session("a").session_id
    path = log_path(tmp_path, "first")
    crash_log = open_log(service, path, max_bytes=1 << 20)
    await service.allocate(sid, Allocate(0, 3, [1, 2, 3]))
    with path.open("r+b") as torn:  # a record cut by the crash
        torn.seek(crash_log.size)
        torn.write(frame(["op", clock(), None, sid, ["Free", 0]])[:-3])
    assert len(list(read_log(path))) == 2  # the base (the session in it), the allocate
    again = await crashed_and_replayed(service, path, clock)
    assert again.pool.block_table((1, 0)) == service.pool.block_table((1, 0))
    with path.open("r+b") as bad:
        bad.seek(crash_log.size)
        bad.write(frame(["op", clock(), None, sid, ["Free", 5]]))
    with pytest.raises(NotKept, match=r"record 2 \(op\) does not replay"):
        await replay_log(make_service("next", clock), path, adopted_from="first")
    with pytest.raises(NotKept, match="snapshot is of pool first"):
        await replay_log(make_service("next", clock), path, adopted_from="other")


async def test_a_state_the_base_cannot_keep_stops_the_log(tmp_path: Path) -> None:
    clock = HandClock()
    service = make_service("first", clock)
    path = log_path(tmp_path, "first")
    crash_log = open_log(service, path, max_bytes=1 << 20)
    crash_log.stop("a test's reason")
    assert not path.exists()
    service.open_session("a")  # written nowhere, refused nothing
    assert crash_log.number == 0


def models_service(pool_id: str, clock: HandClock) -> PoolService:
    return PoolService(BlockPool(16, 4, blocks_per_page=2), None, pool_id=pool_id,
                       geometry=TINY_CPU_GEOMETRY, page_bytes=16384, clock=clock)


async def test_models_registered_put_to_sleep_and_woken_replay(tmp_path: Path) -> None:
    clock = HandClock()
    service = models_service("first", clock)
    path = log_path(tmp_path, "first")
    open_log(service, path, max_bytes=1 << 20)
    service.register_model("half", KvShape(1, 2, 64, "float32"))
    service.register_model("other", KvShape(2, 2, 64, "float32"), "unix:///r.sock")
    half = service.open_session("h", model="half").session_id
    await service.allocate(half, Allocate(0, 9, list(range(9))))
    await service.commit(half, Commit([0]))
    other = service.open_session("o", model="other").session_id
    await service.allocate(other, Allocate(0, 5, list(range(5))))
    await service.set_model_state("other", asleep=True)
    await service.set_model_state("other", asleep=False)
    again = models_service("next", clock)
    await replay_log(again, path, adopted_from="first")
    again.check_invariants()
    assert comparable(again) == comparable(service)
    assert [m.name for m in again.models] == [m.name for m in service.models]


async def test_a_bound_too_small_for_the_base_keeps_no_log(tmp_path: Path) -> None:
    clock = HandClock()
    service = make_service("first", clock)
    with pytest.raises(NotKept, match="over half of crash_log_bytes=100: raise"):
        open_log(service, log_path(tmp_path, "first"), max_bytes=100)
    assert service.calls.log is None


async def test_runner_holds_replay_with_their_runner_alive_and_not_when_it_exited(
        tmp_path: Path) -> None:
    clock = HandClock()
    service = make_service("first", clock)
    path = log_path(tmp_path, "first")
    open_log(service, path, max_bytes=1 << 20)
    tenant = service.tenants.by_name[DEFAULT_TENANT]
    children, sids = [], []
    try:
        for name in ("held", "gone"):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            children.append(child)
            runner = Caller(tenant, True, RunnerProcess(child.pid, os.pidfd_open(child.pid),
                                                        FenceCounts()))
            sid = service.open_session(name).session_id
            sids.append(sid)
            with calling_as(runner):  # a runner's step, holding the session for its forward
                await service.batch(sid, [Allocate(0, 3, [1, 2, 3])])
                await service.step(sid, [0], 1, [4], hold_ms=1000)
        children[1].kill()  # this runner exits with the daemon: its hold goes with it
        children[1].wait()
        again = await crashed_and_replayed(service, path, clock)
        client = Caller(tenant)
        with calling_as(client), pytest.raises(SessionBusy, match="for 1000 ms more"):
            await again.close_session(sids[0])
        with calling_as(client):
            assert await again.close_session(sids[1]) == 1
        await again.stop()
    finally:
        for child in children:
            child.kill()
            child.wait()
