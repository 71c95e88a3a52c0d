"""The pool client through a daemon restart with `restore = "auto"`: real `pagedkvd` processes
under a supervisor that emulates systemd's fd store (tests/support/fd_store_supervisor.py). A
call sent while the daemon is away gets UNAVAILABLE; with `RetryPolicy.outage_s` its read-backs
go on through the gap, and once the restored daemon answers, the retry rules decide (here: not
applied, so it is sent again) and the session goes on."""

import asyncio

import pytest
from fd_store_supervisor import FdStoreSupervisor

from pagedkv.client import PoolClient, RetryPolicy

from pagedkvd_process import short_tmp_dir

ARGS = ("--num-blocks", "8", "--block-size", "4", "--restore", "auto")
PROMPT = list(range(10))


async def test_a_call_lost_in_the_gap_is_read_back_and_sent_again_after_the_restart() -> None:
    with short_tmp_dir() as folder:
        args = (*ARGS, "--state-dir", str(folder / "state"))
        supervisor = FdStoreSupervisor(folder)
        daemons = [supervisor.start(*args)]
        try:
            async with await PoolClient.connect(
                    daemons[0].unix_target, retry=RetryPolicy(outage_s=60.0)) as client:
                session = await client.open_session("kept", lease_ttl_ms=60_000,
                                                    keep_alive=False)
                await session.allocate(1, token_ids=PROMPT)
                assert supervisor.stop(daemons[0]) == 0
                lost = asyncio.create_task(session.allocate(2, token_ids=PROMPT[:4]))
                await asyncio.sleep(0.5)  # its first try met no daemon
                assert not lost.done()
                daemons.append(supervisor.start(*args))
                blocks = await lost
                assert blocks.num_cached_tokens == 0  # nothing committed: a fresh sequence
                tables = await session.block_tables([1, 2])
                assert [table.num_tokens for table in tables] == [10, 4]
                assert supervisor.stop(daemons[1]) == 0
        finally:
            for daemon in daemons:
                daemon.stop()
            supervisor.close()


def test_a_negative_outage_is_refused() -> None:
    with pytest.raises(ValueError, match="outage_s >= 0"):
        RetryPolicy(outage_s=-1.0)
