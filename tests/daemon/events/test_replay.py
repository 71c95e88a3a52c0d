"""Replay answers bounded (daemon/events/replay.py): the buffer and the replay cursor alone, then
a real sending thread (sender.py) on loopback, flooded by a pyzmq DEALER that sends 3,000
replay requests and reads nothing, while a legitimate DEALER asks for a replay."""

import queue
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import zmq

from pagedkv.daemon.events import replay
from pagedkv.daemon.events.replay import (
    MAX_ANSWERS_PER_CLIENT,
    ReplayAnswer,
    ReplayBuffer,
    SnapshotAnswer,
)
from pagedkv.daemon.events.sender import STOP, EventSettings, Outgoing, Sender
from pagedkv.daemon.events.sink import StoredBlock
from pagedkv.daemon.events.wire import END_SEQ, BlockStored, decode_batch, seq_bytes, seq_of

BLOCK = 16
# Batches buffered, each a chain of this many blocks (about 3 KB encoded): one answer is
# several MB, more than the flooder's socket and kernel buffers take.
BATCHES, BLOCKS_PER_BATCH = 2000, 50
FLOOD = 3000
# How long a test waits for the thread before it fails (a guard, not a timing assertion).
WAIT_S = 10.0


def test_the_buffer_keeps_the_last_batches_by_seq() -> None:
    buffer = ReplayBuffer(3)
    assert (buffer.start, buffer.end) == (0, 0)
    for seq in range(5):
        buffer.append(seq, b"%d" % seq)
    assert (buffer.start, buffer.end) == (2, 5)
    assert [buffer.payload(seq) for seq in range(2, 5)] == [b"2", b"3", b"4"]
    with pytest.raises(AssertionError, match="not buffered"):
        buffer.payload(1)
    with pytest.raises(AssertionError, match="consecutive"):
        buffer.append(7, b"7")


def drain(answer: ReplayAnswer, buffer: ReplayBuffer, steps: int) -> list[int]:
    """The seqs of `steps` messages the answer sends (END_SEQ's: -1)."""
    seqs = []
    for _ in range(steps):
        message = answer.message(buffer)
        assert message is not None
        seqs.append(seq_of(message[0]))
        answer.sent()
    return seqs


def test_a_replay_is_a_cursor_that_skips_what_the_buffer_dropped() -> None:
    """The answer copies nothing: its end is fixed at the request, and batches the buffer
    drops before the cursor reaches them are skipped (the seq gap says so)."""
    buffer = ReplayBuffer(4)
    for seq in range(6):
        buffer.append(seq, b"x")
    answer = ReplayAnswer(0, buffer.end)  # from before the buffer: what is left
    assert drain(answer, buffer, 2) == [2, 3]
    for seq in range(6, 9):  # the buffer moves on to 5..8 meanwhile
        buffer.append(seq, b"x")
    assert drain(answer, buffer, 2) == [5, -1]  # 4 was dropped; 6.. came after the request
    assert answer.message(buffer) is None and answer.done


def test_a_snapshot_holds_one_slice_and_asks_for_the_next() -> None:
    asked: list[SnapshotAnswer] = []
    answer = SnapshotAnswer(asked.append)
    assert answer.message(ReplayBuffer(1)) is None and asked == [answer]
    assert answer.message(ReplayBuffer(1)) is None and asked == [answer]  # asked once


def chain(seq: int) -> tuple[StoredBlock, ...]:
    """A batch's blocks: a chain, with large token ids (a few KB encoded)."""
    first = seq * BLOCKS_PER_BATCH
    return tuple(StoredBlock(first + i, first + i - 1 if i else None,
                             tuple(range(50_000 + i, 50_000 + i + BLOCK)), None)
                 for i in range(BLOCKS_PER_BATCH))


def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "the sending thread did not get there"
        time.sleep(0.005)


@contextmanager
def full_sender() -> Iterator[Sender]:
    """A sending thread on loopback whose buffer holds BATCHES batches."""
    inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
    sender = Sender(EventSettings("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", BATCHES, 100_000,
                                  "t/", BLOCK), inbox, lambda answer: None)
    sender.start()
    try:
        for seq in range(BATCHES):
            inbox.put(Outgoing(seq, 0.0, "m", chain(seq)))
        until(lambda: sender.sent == BATCHES)
        yield sender
    finally:
        inbox.put(STOP)
        sender.join(WAIT_S)


@contextmanager
def dealer(sender: Sender, **options: int) -> Iterator[zmq.Socket[bytes]]:
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    for option, value in options.items():
        socket.setsockopt(getattr(zmq, option), value)
    address = sender.addresses[1]
    assert address is not None
    socket.connect(address)
    try:
        yield socket
    finally:
        context.destroy(linger=0)


@contextmanager
def flooder(sender: Sender) -> Iterator[zmq.Socket[bytes]]:
    """A DEALER that sends FLOOD replay-from-0 requests and reads nothing (room for one
    message, a 4 KB kernel buffer)."""
    with dealer(sender, RCVHWM=1, RCVBUF=4096, SNDHWM=FLOOD) as socket:
        for _ in range(FLOOD):
            socket.send_multipart([b"", seq_bytes(0)])
        answers = sender.answers
        assert answers is not None
        until(lambda: answers.refused + answers.queued + answers.dropped >= FLOOD - 3)
        yield socket


def replay_from(socket: zmq.Socket[bytes], start: int) -> list[list[bytes]]:
    socket.send_multipart([b"", seq_bytes(start)])
    messages: list[list[bytes]] = []
    while not messages or messages[-1][-1]:
        assert socket.poll(int(WAIT_S * 1000)), "no answer"
        _, *frames = socket.recv_multipart()
        messages.append(frames)
    return messages


def test_a_replay_flood_is_bounded_and_a_legitimate_replay_is_answered() -> None:
    """The flooder gets MAX_ANSWERS_PER_CLIENT answers queued, the rest refused; a legitimate
    client's replay is answered in full meanwhile (before: it queued behind every flooding
    answer, each waiting STALL_S for a client that never reads)."""
    with full_sender() as sender, flooder(sender), dealer(sender) as client:
        answers = sender.answers
        assert answers is not None
        assert answers.queued <= MAX_ANSWERS_PER_CLIENT
        # The flooder's last few requests may still be on their way to the sending thread.
        until(lambda: answers.refused >= FLOOD - MAX_ANSWERS_PER_CLIENT)
        assert answers.queued <= MAX_ANSWERS_PER_CLIENT
        messages = replay_from(client, 0)
        assert [seq_of(seq) for seq, _ in messages] == [*range(BATCHES), -1]
        assert messages[-1] == [END_SEQ, b""]
        event = decode_batch(messages[7][1]).events[0]
        assert isinstance(event, BlockStored)
        assert event.block_hashes == tuple(range(7 * BLOCKS_PER_BATCH, 8 * BLOCKS_PER_BATCH))


def test_a_client_that_does_not_read_is_dropped_with_its_answers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once it has had no room for STALL_S, every answer it had queued is freed; what it then
    reads ends short of its answers' end markers."""
    monkeypatch.setattr(replay, "STALL_S", 0.2)
    with full_sender() as sender, flooder(sender) as socket:
        answers = sender.answers
        assert answers is not None
        until(lambda: answers.dropped == 1)
        assert answers.queued == 0
        ends = 0
        while socket.poll(200):
            ends += socket.recv_multipart()[1] == END_SEQ
        assert ends < MAX_ANSWERS_PER_CLIENT
