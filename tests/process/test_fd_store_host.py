"""The descriptor store a pagedkv process keeps for its children (process/fd_store_host.py), fed
by the sending side (process/fd_store.py) over a real datagram socket, and a real child started
with what it stored: descriptors at 3, 4, ... with LISTEN_FDS / LISTEN_FDNAMES / LISTEN_PID."""

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.process.fd_store import remove_fds, store_fds
from pagedkv.process.fd_store_host import FdStoreHost
from pagedkv.process.launch import READY_STATE, start_process

# A child that reads its passed descriptors as a daemon does, writes each one's name into it,
# stores the first again under a new name, and says READY=1.
CHILD = """
from pagedkv.process.fd_store import listened_fds, store_fds
from pagedkv.process.notify import notify
import os
for name, fds in sorted(listened_fds().items()):
    for fd in fds:
        os.write(fd, name.encode())
store_fds("again", [3])
notify("READY=1")
"""


@pytest.fixture
def channel(tmp_path: Path) -> Iterator[tuple[socket.socket, dict[str, str]]]:
    """A notify socket (the host's end) and the environment that sends into it."""
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(path)
        receiver.settimeout(2.0)
        yield receiver, {"NOTIFY_SOCKET": path}


def pipe_pair() -> tuple[int, int]:
    read_end, write_end = os.pipe()
    return read_end, write_end


def test_stores_by_name_and_removes_every_descriptor_of_a_name(
        channel: tuple[socket.socket, dict[str, str]]) -> None:
    receiver, env = channel
    store = FdStoreHost(max_fds=4)
    pipes = [pipe_pair() for _ in range(3)]
    try:
        assert store_fds("pool", [pipes[0][1], pipes[1][1]], env=env)
        assert store.receive(receiver) == "FDSTORE=1\nFDNAME=pool"
        assert store_fds("other", [pipes[2][1]], env=env)
        store.receive(receiver)
        assert store.names() == ["pool", "pool", "other"]
        os.write(store.fds()[0], b"kept")  # the store's own copy of the sender's descriptor
        assert os.read(pipes[0][0], 4) == b"kept"
        assert store.env() == {"FDSTORE": "4", "LISTEN_FDS": "3",
                               "LISTEN_FDNAMES": "pool:pool:other"}

        kept = store.fds()
        assert remove_fds("pool", env=env)
        store.receive(receiver)
        assert store.names() == ["other"]
        for fd in kept[:2]:  # closed by the removal
            with pytest.raises(OSError):
                os.fstat(fd)
    finally:
        store.close()
        for fd in (end for pipe in pipes for end in pipe):
            os.close(fd)
    assert store.names() == [] and store.env() == {"FDSTORE": "4"}


def test_descriptors_past_the_bound_are_closed_not_stored(
        channel: tuple[socket.socket, dict[str, str]]) -> None:
    receiver, env = channel
    store = FdStoreHost(max_fds=2)
    pipes = [pipe_pair() for _ in range(3)]
    try:
        assert store_fds("first", [pipes[0][1]], env=env)
        store.receive(receiver)
        assert store_fds("too-many", [pipes[1][1], pipes[2][1]], env=env)  # 3 > 2: refused
        store.receive(receiver)
        assert store.names() == ["first"]
        os.close(pipes[1][1])
        assert os.read(pipes[1][0], 1) == b""  # the store closed its copy: no writer is left
    finally:
        store.close()
        for fd in (pipes[0][0], pipes[0][1], pipes[1][0], pipes[2][0], pipes[2][1]):
            os.close(fd)


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FdStoreHost(max_fds=0)


def test_a_restarted_child_gets_the_stored_descriptors_by_name(
        tmp_path: Path, channel: tuple[socket.socket, dict[str, str]]) -> None:
    receiver, env = channel
    store = FdStoreHost()
    pipes = [pipe_pair() for _ in range(2)]
    try:
        for name, (_, write_end) in zip(("alpha", "beta"), pipes, strict=True):
            assert store_fds(name, [write_end], env=env)
            store.receive(receiver)
        with start_process("child", [sys.executable, "-c", CHILD], tmp_path, "unused",
                           fd_store=store) as child:
            child.wait_for_notification(READY_STATE)
            assert child.wait_for_exit() == 0
        assert os.read(pipes[0][0], 5) == b"alpha"  # at 3, LISTEN_PID its own
        assert os.read(pipes[1][0], 4) == b"beta"   # at 4
        assert store.names() == ["alpha", "beta", "again"]
    finally:
        store.close()
        for fd in (end for pipe in pipes for end in pipe):
            os.close(fd)
