"""`restore = "auto"` across real `pagedkvd` processes: a daemon stopped by SIGTERM leaves a
snapshot, the next one (handed the same pool memory by a supervisor that emulates systemd's
fd store, tests/support/fd_store_supervisor.py) restores the sessions, their tables and the
prefix cache before it answers; a daemon of another pool size refuses it and starts cold."""

import stat

import msgpack
import pytest
import zmq
from fd_store_supervisor import FdStoreSupervisor

from pagedkv.client import PoolClient
from pagedkv.client.pool.errors import SessionExpired

from pagedkvd_process import free_tcp_port, short_tmp_dir

ARGS = ("--num-blocks", "8", "--block-size", "4", "--restore", "auto")
PROMPT = list(range(10))


async def test_sessions_and_tables_come_back_and_another_pool_starts_cold() -> None:
    with short_tmp_dir() as folder:
        state = folder / "state"
        supervisor = FdStoreSupervisor(folder)
        try:
            with supervisor.start(*ARGS, "--state-dir", str(state)) as first:
                async with await PoolClient.connect(first.unix_target) as client:
                    session = await client.open_session("kept", lease_ttl_ms=60_000, cache_salt="s",
                                                        keep_alive=False)
                    blocks = await session.allocate(1, token_ids=PROMPT)
                    await session.commit([1])
                    session_id = session.session_id
                    client.forget(session)  # left open, as a client the restart cut off
                assert supervisor.stop(first) == 0
            snapshot = state / "pagedkvd.snapshot"
            assert stat.S_IMODE(snapshot.stat().st_mode) == 0o600

            with supervisor.start(*ARGS, "--state-dir", str(state)) as second:
                assert '"event": "restart snapshot restored"' in second.stderr()
                assert not snapshot.exists()  # applied once
                async with await PoolClient.connect(second.unix_target) as client:
                    again = client.attach(session_id, 4)
                    (table,) = await again.block_tables([1], token_ids=True)
                    assert table.block_ids == blocks.block_ids
                    assert table.token_ids == PROMPT
                    other = await client.open_session("new", cache_salt="s", keep_alive=False)
                    hit = await other.allocate(1, token_ids=PROMPT[:8])
                    assert hit.num_cached_tokens == 8  # the prefix cache came back
                    assert hit.block_ids == blocks.block_ids[:2]
                    forged = client.attach(session_id.replace("-", "x-", 1), 4)
                    with pytest.raises(SessionExpired, match="before a daemon restart"):
                        await forged.block_tables([1])  # an id of another daemon's pool
                assert supervisor.stop(second) == 0
            assert snapshot.exists()

            with supervisor.start("--num-blocks", "16", "--block-size", "4", "--restore",
                                  "auto", "--state-dir", str(state)) as third:
                assert '"event": "restart snapshot refused: starting cold"' in third.stderr()
                assert (state / "pagedkvd.snapshot.refused").exists()
                async with await PoolClient.connect(third.unix_target) as client:
                    assert (await client.stats()).free_blocks == 16  # cold: nothing held
                assert supervisor.stop(third) == 0
        finally:
            supervisor.close()


async def test_the_kv_events_sequence_goes_on_across_a_restored_restart() -> None:
    """A subscriber of the PUB endpoint sees the second daemon's first batch numbered right
    after the first daemon's last, and no AllBlocksCleared."""
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.setsockopt(zmq.RCVTIMEO, 30_000)
    subscriber.bind(endpoint)  # as llm-d's indexer: each daemon connects to it
    with short_tmp_dir() as folder:
        args = (*ARGS, "--state-dir", str(folder / "state"), "--kv-events-endpoint", endpoint,
                "--kv-events-all-salts")
        supervisor = FdStoreSupervisor(folder)
        try:
            batches = []
            for round_ in range(2):
                with supervisor.start(*args) as daemon:
                    async with await PoolClient.connect(daemon.unix_target) as client:
                        session = await client.open_session(f"s{round_}", cache_salt="s",
                                                            keep_alive=False)
                        await session.allocate(1, token_ids=[round_ * 100 + i for i in range(8)])
                        await session.commit([1])
                        _, seq, payload = subscriber.recv_multipart()
                        batches.append((int.from_bytes(seq, "big", signed=True),
                                        msgpack.unpackb(payload)))
                        if round_ == 0:
                            client.forget(session)
                    assert supervisor.stop(daemon) == 0
        finally:
            supervisor.close()
            subscriber.close(linger=0)
            context.term()
    (first_seq, _), (second_seq, second) = batches
    assert second_seq == first_seq + 1
    assert [event["type"] for event in second[1]] == ["BlockStored"]  # no AllBlocksCleared
