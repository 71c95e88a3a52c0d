"""`restore = "auto"` across a SIGKILL of a real `pagedkvd`: the next daemon (handed the same
pool memory by a supervisor that emulates systemd's fd store) replays the crash log before it
answers: the session under its id, its sequences' tables and committed tokens, the prefix
cache; PoolInfo says the state came from the crash log, so K/V past the committed tokens is
not trusted. With --no-crash-log the next daemon starts cold."""

import signal
import stat
from pathlib import Path

from fd_store_supervisor import FdStoreSupervisor

from pagedkv.client import PoolClient
from pagedkv.daemon.process.crash_restore import REFUSED, remove_stale_logs

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


def test_stale_logs_go_with_their_files_aside_and_a_refused_one_stays(tmp_path: Path) -> None:
    """A log whose pool has no file here is stale, and so are its checkpoint's file aside and
    its spare (a crash between allocating them and the rename); the daemon's own stay, and a
    refused log set aside for inspection too."""
    live = tmp_path / "pagedkv-1234-aa11.kv"
    live.write_bytes(b"")
    names = ["pagedkv-log.dead1", "pagedkv-log.dead1.new", "pagedkv-log.dead1.spare",
             "pagedkv-log.own2", "pagedkv-log.own2.spare", "pagedkv-log.aa11",
             f"pagedkv-log.gone3{REFUSED}"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    remove_stale_logs(tmp_path, "own2")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [live.name, "pagedkv-log.own2", "pagedkv-log.own2.spare", "pagedkv-log.aa11",
         f"pagedkv-log.gone3{REFUSED}"])
