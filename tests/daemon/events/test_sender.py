"""The sending thread's PUB in connect mode (daemon/events/sender.py): the daemon connects to a
subscriber's bound SUB (llm-d's indexer binds), a real pyzmq SUB on loopback.

ZMQ's slow joiner: a connecting PUB drops what it sends before the subscriber's subscription
has come back over the new connection, so a daemon that publishes at once loses its first
batches. The thread holds them until the first subscription arrives (CONNECT_WAIT_S at most).
"""

import queue
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from pagedkv.daemon.events import sender as sender_module
from pagedkv.daemon.events.sender import STOP, EventSettings, Outgoing, Sender
from pagedkv.daemon.events.sink import StoredBlock
from pagedkv.daemon.events.wire import BlockStored, decode_batch, seq_of
from pagedkv.process.launch import free_tcp_port

# How long a test waits for a batch before it fails (a guard, not a timing assertion).
WAIT_S = 10.0


@contextmanager
def connecting_sender(endpoint: str) -> Iterator[tuple[Sender, "queue.SimpleQueue[object]"]]:
    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    sender = Sender(EventSettings(endpoint, None, 100, 1000, "t/", 2), inbox, lambda answer: None)
    sender.start()
    try:
        yield sender, inbox
    finally:
        inbox.put(STOP)
        sender.join(WAIT_S)


def batch(seq: int) -> Outgoing:
    return Outgoing(seq, 0.0, "m", (StoredBlock(seq, None, (seq, seq), None),))


def test_a_connected_pub_holds_the_first_batches_until_the_subscriber_subscribed() -> None:
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.subscribe(b"")
    port = free_tcp_port()
    sub.bind(f"tcp://127.0.0.1:{port}")
    try:
        # Published the moment the thread starts: before the connection is made.
        with connecting_sender(f"tcp://127.0.0.1:{port}") as (_, inbox):
            for seq in range(3):
                inbox.put(batch(seq))
            received = []
            for _ in range(3):
                assert sub.poll(int(WAIT_S * 1000)), "a batch was lost"
                topic, seq, payload = sub.recv_multipart()
                event = decode_batch(payload).events[0]
                assert isinstance(event, BlockStored)
                received.append((topic, seq_of(seq), event.block_hashes))
            assert received == [(b"t/m", seq, (seq,)) for seq in range(3)]
    finally:
        context.destroy(linger=0)


def test_with_no_subscriber_the_batches_go_out_after_the_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody bound at the endpoint: the thread stops holding after CONNECT_WAIT_S (and
    warns), so the replay buffer and the counts move on."""
    monkeypatch.setattr(sender_module, "CONNECT_WAIT_S", 0.05)
    with connecting_sender(f"tcp://127.0.0.1:{free_tcp_port()}") as (sender, inbox):
        for seq in range(3):
            inbox.put(batch(seq))
        deadline = time.monotonic() + WAIT_S
        while sender.sent < 3:
            assert time.monotonic() < deadline, "the batches were never published"
            time.sleep(0.005)
