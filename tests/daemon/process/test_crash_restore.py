"""`restore = "auto"` across a SIGKILL of a real `pagedkvd`: the next daemon (handed the same
pool memory by a supervisor that emulates systemd's fd store) replays the crash log before it
answers: the session under its id, its sequences' tables and committed tokens, the prefix
cache; PoolInfo says the state came from the crash log, so K/V past the committed tokens is
not trusted. With --no-crash-log the next daemon starts cold."""

import signal
import stat

from fd_store_supervisor import FdStoreSupervisor

from pagedkv.client import PoolClient

from pagedkvd_process import short_tmp_dir

ARGS = ("--num-blocks", "16", "--block-size", "4", "--restore", "auto")
PROMPT = list(range(10))


async def test_a_killed_daemon_comes_back_from_its_crash_log() -> None:
    with short_tmp_dir() as folder:
        args = (*ARGS, "--state-dir", str(folder / "state"))
        supervisor = FdStoreSupervisor(folder)
        try:
            with supervisor.start(*args) as first:
                async with await PoolClient.connect(first.unix_target) as client:
                    pool_id = (await client.pool_info()).pool_id
                    log = folder / f"pagedkv-log.{pool_id}"
                    assert stat.S_IMODE(log.stat().st_mode) == 0o600
                    session = await client.open_session("kept", lease_ttl_ms=60_000,
                                                        cache_salt="s", keep_alive=False)
                    blocks = await session.allocate(1, token_ids=PROMPT)
                    await session.commit([1])  # 10 tokens certified: 2 full blocks shareable
                    grown = await session.append(1, token_ids=[10, 11, 12])  # not committed
                    session_id = session.session_id
                    client.forget(session)
                assert supervisor.stop(first, signal.SIGKILL) == -signal.SIGKILL

            with supervisor.start(*args) as second:
                assert '"event": "restored from the crash log' in second.stderr()
                assert not log.exists()  # replayed once
                async with await PoolClient.connect(second.unix_target) as client:
                    info = await client.pool_info()
                    assert info.previous_pool_id == pool_id and info.recovered_from_crash_log
                    again = client.attach(session_id, 4)
                    (table,) = await again.block_tables([1], token_ids=True)
                    assert table.block_ids == grown.block_ids  # its blocks stay its own
                    assert table.num_tokens == 13
                    assert table.num_cached_tokens == 8  # trusted: committed full blocks
                    other = await client.open_session("new", cache_salt="s", keep_alive=False)
                    hit = await other.allocate(1, token_ids=PROMPT[:8])
                    assert hit.num_cached_tokens == 8  # the prefix cache came back
                    assert hit.block_ids == blocks.block_ids[:2]
                assert supervisor.stop(second, signal.SIGKILL) == -signal.SIGKILL

            with supervisor.start(*args, "--no-crash-log") as third:  # turned off: cold
                async with await PoolClient.connect(third.unix_target) as client:
                    info = await client.pool_info()
                    assert not info.recovered_from_crash_log
                    assert (await client.stats()).free_blocks == 16
                assert not list(folder.glob(f"pagedkv-log.{info.pool_id}"))
                assert supervisor.stop(third) == 0

            stale = folder / "pagedkv-log.0123456789abcdef"  # a released pool's
            stale.write_bytes(b"")
            with supervisor.start(*args) as fourth:  # its log in place of the stale one
                async with await PoolClient.connect(fourth.unix_target) as client:
                    pool_id = (await client.pool_info()).pool_id
                assert [path.name for path in folder.glob("pagedkv-log.*")] == [
                    f"pagedkv-log.{pool_id}"]
                assert supervisor.stop(fourth) == 0
            assert not list(folder.glob("pagedkv-log.*"))  # a clean stop: the snapshot wins
        finally:
            supervisor.close()
