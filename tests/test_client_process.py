"""A real client process killed with SIGKILL mid-run leaks nothing: its lease frees its blocks."""

import asyncio
import os
import signal
import sys

from daemon_harness import running_daemon

# The client: allocate sequences, say READY, then decode steps until killed.
CLIENT_SCRIPT = """
import asyncio, sys
from pagedkv.client import PoolClient

async def main(target):
    client = await PoolClient.connect(target)
    session = await client.open_session("doomed", lease_ttl_ms=400)
    for seq_id in range(6):
        await session.allocate(seq_id, token_ids=list(range(5)))
    print("READY", flush=True)
    while True:
        await session.step(list(range(6)))
        await asyncio.sleep(0.01)

asyncio.run(main(sys.argv[1]))
"""


async def test_killed_client_process_gets_its_blocks_back() -> None:
    async with running_daemon(num_blocks=64, block_size=4) as daemon:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CLIENT_SCRIPT, daemon.unix_target,
            stdout=asyncio.subprocess.PIPE)
        try:
            assert process.stdout is not None
            line = await asyncio.wait_for(process.stdout.readline(), timeout=30)
            assert line.strip() == b"READY"
            await asyncio.sleep(0.3)  # let it step for a while: longer than its lease/3
            assert daemon.pool.stats().used_blocks >= 12
            assert daemon.service.num_sessions == 1
        finally:
            os.kill(process.pid, signal.SIGKILL)
            await process.wait()
        # Lease 0.4 s plus a reaper tick: give it 2 s before calling it a leak.
        for _ in range(40):
            await asyncio.sleep(0.05)
            if daemon.pool.stats().used_blocks == 0:
                break
        assert daemon.pool.stats().used_blocks == 0
        assert daemon.service.num_sessions == 0
        assert daemon.service.lease_expiries_total == 1
        daemon.service.check_invariants()
