"""Fencing (fence.py): a lapsed hold of a live runner is never released; the daemon kills the
runner first, and frees its blocks once the kernel says it has exited.

The runner here is a real process of its own (a few lines of the bundled client on the runner
socket), so the daemon sees its pid through the gate and may kill it. It holds a session with a
runner Step, then stops itself (SIGSTOP: a stalled runner, not a dead one). The daemon's clock is
the test's, so holds lapse when the test says.
"""

import asyncio
import signal
import sys
from collections.abc import AsyncIterator

import pytest

from pagedkv.client import PoolClient, Session, SessionBusy
from pagedkv.daemon.edge.metrics import PoolCollector

from daemon_harness import Daemon, running_daemon
from hand_clock import HandClock

HOLD_MS = 1000
LEASE_MS = 500

# A runner that holds the session named in argv for HOLD_MS, says so, then stops itself
# ("stop") or exits without ending its hold ("exit").
HOLDER = """
import asyncio, os, signal, sys
from pagedkv.client import PoolClient

async def main(target, session_id, hold_ms, then):
    async with await PoolClient.connect(target) as runner:
        await runner.attach(session_id, 4).step([1], [11], hold_ms=int(hold_ms))
        print("held", flush=True)
        if then == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)

asyncio.run(main(*sys.argv[1:]))
"""




@pytest.fixture
async def daemon(clock: HandClock) -> AsyncIterator[Daemon]:
    async with running_daemon(num_blocks=16, block_size=4, clock=clock) as running:
        yield running
        running.service.check_invariants()


@pytest.fixture
async def app(daemon: Daemon) -> AsyncIterator[Session]:
    """A tenant's session holding sequence 1 (5 tokens: two blocks)."""
    async with await PoolClient.connect(daemon.unix_target) as client:
        session = await client.open_session("tenant-app", lease_ttl_ms=LEASE_MS,
                                             keep_alive=False)
        await session.allocate(1, token_ids=[1, 2, 3, 4, 5])
        yield session


def fence_figures(daemon: Daemon) -> dict[str, float]:
    """The fence's counters on the daemon's /metrics."""
    return {family.name: family.samples[0].value
            for family in PoolCollector(daemon.service).collect()
            if family.name.startswith("pagedkv:runner_fences")}


async def holding_runner(daemon: Daemon, session: Session,
                         then: str) -> asyncio.subprocess.Process:
    """A runner process that has held `session` for HOLD_MS, then stopped or exited."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, daemon.runners_target, session.session_id,
        str(HOLD_MS), then, stdout=asyncio.subprocess.PIPE)
    assert process.stdout is not None
    assert await asyncio.wait_for(process.stdout.readline(), 60) == b"held\n"
    return process


async def stopped(process: asyncio.subprocess.Process) -> None:
    """Wait until the process has stopped itself (state T in /proc)."""
    for _ in range(500):
        with open(f"/proc/{process.pid}/stat") as stat:
            if stat.read().rpartition(")")[2].split()[0] == "T":
                return
        await asyncio.sleep(0.01)
    raise AssertionError("the runner never stopped")


async def test_a_stopped_runner_is_killed_before_its_lapsed_hold_frees_anything(
        daemon: Daemon, clock: HandClock, app: Session) -> None:
    runner = await holding_runner(daemon, app, "stop")
    try:
        await stopped(runner)
        before = daemon.pool.stats()
        with pytest.raises(SessionBusy, match=r"for \d+ ms more"):
            await app.free(1)  # within the hold: no fence
        assert runner.returncode is None
        clock.now += 2 * HOLD_MS / 1000  # lapsed: the runner may still resume and write
        with pytest.raises(SessionBusy, match=r"tenant-app#\d+ stalled past its hold; it is "
                                              r"being stopped \(fenced\)"):
            await app.free(1)
        assert daemon.pool.stats() == before  # nothing freed while it may still write
        assert await asyncio.wait_for(runner.wait(), 10) == -signal.SIGKILL
        assert fence_figures(daemon) == {"pagedkv:runner_fences": 1,
                                         "pagedkv:runner_fences_refused": 0}
        assert await app.free(1) > 0  # its exit is seen: the blocks are free to go
    finally:
        if runner.returncode is None:
            runner.kill()
            await runner.wait()


async def test_the_leases_expiry_fences_a_stopped_runner_too(
        daemon: Daemon, clock: HandClock, app: Session) -> None:
    runner = await holding_runner(daemon, app, "stop")
    await stopped(runner)
    clock.now += 2 * HOLD_MS / 1000  # past the hold and the lease
    assert await daemon.service.expire_due() == 0
    assert await asyncio.wait_for(runner.wait(), 10) == -signal.SIGKILL
    await daemon.service.expire_due()  # unless the daemon's own reaper got there first
    assert daemon.service.sessions.peek(app.session_id) is None
    assert daemon.pool.stats().num_sequences == 0


async def test_a_runners_exit_ends_its_holds_at_once(daemon: Daemon, app: Session) -> None:
    """A runner that crashes (here: exits without end_hold) holds nothing: its client frees
    at once, without waiting for the hold to lapse, and nobody was killed."""
    runner = await holding_runner(daemon, app, "exit")
    assert await asyncio.wait_for(runner.wait(), 30) == 0
    assert await app.free(1) > 0
    assert daemon.service.runner_processes.counts.fenced == 0
