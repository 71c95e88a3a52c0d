"""Leases end to end: a client process killed with SIGKILL leaks nothing, keep-alive holds.

The one lease test against a running daemon, its lease reaper and real time; the lease rules
themselves (renewal, expiry, the error a late call gets) are checked on a fake clock in
tests/daemon/service/test_sessions.py.
"""

import asyncio
import os
import signal
import sys

import grpc
import pytest

from pagedkv.client import PoolClient, SessionExpired

from daemon_harness import Daemon, running_daemon

# Every session's lease here; the reaper runs every 100 ms. Long enough that a loaded 2-core
# machine (the daemon and this client share one event loop) never starves a KeepAlive past it.
LEASE_MS = 2000

# The client: allocate sequences, fork one (shared blocks), say READY, then decode steps until
# killed.
CLIENT_SCRIPT = f"""
import asyncio, sys
from pagedkv.client import PoolClient

async def main(target):
    client = await PoolClient.connect(target)
    session = await client.open_session("doomed", lease_ttl_ms={LEASE_MS})
    for seq_id in range(6):
        await session.allocate(seq_id, token_ids=list(range(5)))
    await session.fork(0, 6)
    print("READY", flush=True)
    while True:
        await session.step(list(range(7)))
        await asyncio.sleep({LEASE_MS / 20_000})  # a few steps in all: the pool stays roomy

asyncio.run(main(sys.argv[1]))
"""


def labels(daemon: Daemon) -> list[str]:
    return [session.label for session in daemon.service.sessions]


async def run_and_kill_a_client(daemon: Daemon) -> None:
    """Start the client process, let it step for a while, SIGKILL it."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT_SCRIPT, daemon.unix_target, stdout=asyncio.subprocess.PIPE)
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), timeout=30)
        assert line.strip() == b"READY"
        await asyncio.sleep(LEASE_MS / 1000 / 2)  # let it step a while: past its lease/3
        assert daemon.pool.stats().used_blocks >= 12
        assert "doomed#3" in labels(daemon)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        await process.wait()


async def test_a_killed_client_gets_its_blocks_back_and_a_kept_lease_survives() -> None:
    async with running_daemon(num_blocks=64, block_size=4) as daemon, \
            await PoolClient.connect(daemon.unix_target) as client:
        kept = await client.open_session("kept", lease_ttl_ms=LEASE_MS)  # background KeepAlive
        lapsing = await client.open_session("lapsing", lease_ttl_ms=LEASE_MS, keep_alive=False)
        await kept.allocate(1, 4)
        await lapsing.allocate(1, 4)
        await run_and_kill_a_client(daemon)
        # The lease plus a reaper tick: give it 5 leases before calling it a leak.
        for _ in range(5 * LEASE_MS // 50):
            await asyncio.sleep(0.05)
            if daemon.service.num_sessions == 1:
                break
        assert labels(daemon) == ["kept#1"]
        assert daemon.service.lease_expiries_total == 2
        assert daemon.pool.stats().used_blocks == 1  # only kept's block
        daemon.service.check_invariants()
        # Silent for many leases, yet alive: its KeepAlive ran in the background.
        assert (await kept.append(1)).num_tokens == 5
        with pytest.raises(SessionExpired, match="expired") as failure:
            await lapsing.append(1)
        assert failure.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert await lapsing.close() == 0
        assert await kept.close() == 1
