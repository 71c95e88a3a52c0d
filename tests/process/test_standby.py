"""A planned restart's standby (process/standby.py) with real processes: it starts while the
store's descriptors are still the current process's, opens descriptors of its own (its
imports), says it is ready, and receives the stored descriptors at 3, 4, ... as a restart gets
them (LISTEN_FDS / LISTEN_FDNAMES / LISTEN_PID, read by `listened_fds`); given up, it ends."""

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.process.fd_store import store_fds
from pagedkv.process.fd_store_host import FdStoreHost
from pagedkv.process.launch import READY_STATE, NoNotification, start_process

# A standby as the daemon's CLI runs it: placeholders first, then "imports" that open files
# (they must not land on 3, 4, ...), then the hand-over; then what a restarted child does.
CHILD = """
from pagedkv.process.standby import Standby
standby = Standby.from_env()
imports = [open("/dev/null") for _ in range(4)]
standby.wait_for_adoption()
from pagedkv.process.fd_store import listened_fds
from pagedkv.process.notify import notify
import os
for name, fds in sorted(listened_fds().items()):
    for fd in fds:
        os.write(fd, name.encode())
notify("READY=1")
"""


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[tuple[FdStoreHost, list[tuple[int, int]]]]:
    """A store holding two pipes' write ends ("alpha", "beta"), and the pipes."""
    path = str(tmp_path / "notify.sock")
    store = FdStoreHost()
    pipes = [os.pipe() for _ in range(2)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(path)
        receiver.settimeout(2.0)
        for name, (_, write_end) in zip(("alpha", "beta"), pipes, strict=True):
            assert store_fds(name, [write_end], env={"NOTIFY_SOCKET": path})
            store.receive(receiver)
    yield store, pipes
    store.close()
    for fd in (end for pipe in pipes for end in pipe):
        os.close(fd)


def test_a_standby_adopts_the_stored_descriptors_after_the_hand_over(
        tmp_path: Path, stored: tuple[FdStoreHost, list[tuple[int, int]]]) -> None:
    store, pipes = stored
    with start_process("child", [sys.executable, "-c", CHILD], tmp_path, "unused",
                       fd_store=store, standby=True) as child:
        child.wait_for_standby()
        assert child.notifications == []  # nothing adopted, nothing said before the hand-over
        child.hand_over()
        child.wait_for_notification(READY_STATE)
        assert child.wait_for_exit() == 0, child.stderr()
    assert os.read(pipes[0][0], 5) == b"alpha"  # at 3, LISTEN_PID its own
    assert os.read(pipes[1][0], 4) == b"beta"   # at 4


def test_a_standby_given_up_ends_without_adopting(
        tmp_path: Path, stored: tuple[FdStoreHost, list[tuple[int, int]]]) -> None:
    store, _ = stored
    with start_process("child", [sys.executable, "-c", CHILD], tmp_path, "unused",
                       fd_store=store, standby=True) as child:
        child.wait_for_standby()
        assert child.standby is not None
        child.standby.close()  # the supervisor gave the upgrade up
        with pytest.raises(NoNotification, match="given up before the hand-over"):
            child.wait_for_notification(READY_STATE)
        assert child.wait_for_exit() == 1
