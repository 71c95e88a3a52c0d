"""KV events across SIGKILLs of a real `pagedkvd` restored from its crash log (restore = auto,
under a supervisor that emulates systemd's fd store), seen by a real subscriber (pyzmq and
msgpack): the sequence goes on from the last batch the log knows was numbered, with no
AllBlocksCleared when every numbered batch's change was logged; when a batch was numbered
(so maybe published) for a call whose record the crash lost, the next daemon's first batch is
an AllBlocksCleared, numbered after it."""

import signal
import struct
import zlib
from pathlib import Path
from typing import Any

import msgpack
import zmq
from fd_store_supervisor import FdStoreSupervisor

from pagedkv.client import PoolClient
from pagedkv.daemon.service.crash_log import SEQ, frame

from pagedkvd_process import free_tcp_port, short_tmp_dir

ARGS = ("--num-blocks", "16", "--block-size", "4", "--restore", "auto", "--kv-events-all-salts")
RECEIVE_MS = 30_000


async def test_the_kv_events_sequence_goes_on_after_a_crash_restore() -> None:
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    replay = f"tcp://127.0.0.1:{free_tcp_port()}"
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.setsockopt(zmq.RCVTIMEO, RECEIVE_MS)
    subscriber.bind(endpoint)  # as llm-d's indexer: each daemon connects to it
    with short_tmp_dir() as folder:
        args = (*ARGS, "--state-dir", str(folder / "state"), "--kv-events-endpoint", endpoint,
                "--kv-events-replay-endpoint", replay)
        supervisor = FdStoreSupervisor(folder)
        try:
            with supervisor.start(*args) as first:
                first_seq, _ = await _store(first.unix_target, subscriber, 0)
                pool_id = await _pool_id(first.unix_target)
                assert supervisor.stop(first, signal.SIGKILL) == -signal.SIGKILL

            with supervisor.start(*args) as second:
                assert '"event": "restored from the crash log' in second.stderr()
                second_seq, events = await _store(second.unix_target, subscriber, 1)
                pool_id = await _pool_id(second.unix_target)
                assert supervisor.stop(second, signal.SIGKILL) == -signal.SIGKILL
            # Every batch's change was logged: the sequence goes on, no AllBlocksCleared.
            assert second_seq == first_seq + 1
            assert [event["type"] for event in events] == ["BlockStored"]

            # A crash between a batch's numbering (second_seq + 1) and its call's record.
            _append(folder / f"pagedkv-log.{pool_id}", [SEQ, second_seq + 2, False])
            with supervisor.start(*args) as third:
                assert '"event": "restored from the crash log' in third.stderr()
                third_seq, events = await _store(third.unix_target, subscriber, 2)
                # PUB drops what goes out before the subscription reaches it: ask the replay
                # endpoint for the daemon's first batch (sent before the one just received).
                (seq, cleared), *_ = _replayed(context, replay, second_seq + 2)
                assert supervisor.stop(third) == 0
        finally:
            supervisor.close()
            subscriber.close(linger=0)
            context.term()
    assert seq == second_seq + 2  # never second_seq + 1 again: it may have been published
    assert [event["type"] for event in cleared] == ["AllBlocksCleared"]
    assert third_seq == second_seq + 3 and [event["type"] for event in events] == ["BlockStored"]


async def _store(target: str, subscriber: zmq.Socket[bytes],
                 round_: int) -> tuple[int, list[Any]]:
    """Commit one block of a new session's sequence: the seq and events of the BlockStored
    batch the subscriber receives (an AllBlocksCleared before it skipped)."""
    async with await PoolClient.connect(target) as client:
        session = await client.open_session(f"s{round_}", cache_salt="s", keep_alive=False,
                                            lease_ttl_ms=60_000)
        await session.allocate(1, token_ids=[round_ * 100 + i for i in range(8)])
        await session.commit([1])
        client.forget(session)
    while True:
        _, seq, payload = subscriber.recv_multipart()
        events = msgpack.unpackb(payload)[1]
        if [event["type"] for event in events] != ["AllBlocksCleared"]:
            return int.from_bytes(seq, "big", signed=True), events


async def _pool_id(target: str) -> str:
    async with await PoolClient.connect(target) as client:
        return (await client.pool_info()).pool_id


def _append(log: Path, record: list[Any]) -> None:
    """Write `record` after the log's last frame (its frames: length, CRC-32, payload; zeros
    after the last)."""
    header = struct.Struct("<II")
    with log.open("r+b") as file:
        data = file.read()
        at = 0
        while True:
            size, crc = header.unpack_from(data, at)
            if not size:
                break
            assert zlib.crc32(data[at + header.size:at + header.size + size]) == crc
            at += header.size + size
        file.seek(at)
        file.write(frame(record))


def _replayed(context: zmq.Context[zmq.Socket[bytes]], replay: str,
              start: int) -> list[tuple[int, list[Any]]]:
    """The batches the replay endpoint sends from seq `start` on: (seq, events)."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, RECEIVE_MS)
    dealer.connect(replay)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        batches = []
        while True:
            _, seq, payload = dealer.recv_multipart()
            if not payload:
                return batches
            batches.append((int.from_bytes(seq, "big", signed=True),
                            msgpack.unpackb(payload)[1]))
    finally:
        dealer.close(linger=0)
