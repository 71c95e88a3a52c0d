"""systemd's file descriptor store protocol: storing over a real datagram socket, receiving
from the socket activation variables."""

import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.process.fd_store import (
    check_fd_name,
    listened_fds,
    remove_fds,
    store_enabled,
    store_fds,
)


def test_store_sends_the_name_and_the_descriptor_as_scm_rights(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(path)
        receiver.settimeout(2.0)
        read_end, write_end = os.pipe()
        assert store_fds("pool", [write_end], env={"NOTIFY_SOCKET": path})
        message, fds, _, _ = socket.recv_fds(receiver, 4096, 4)
        assert message == b"FDSTORE=1\nFDNAME=pool"
        os.write(fds[0], b"kept")  # the service manager's duplicate writes into the same pipe
        assert os.read(read_end, 4) == b"kept"
        assert remove_fds("pool", env={"NOTIFY_SOCKET": path})
        assert receiver.recv(4096) == b"FDSTOREREMOVE=1\nFDNAME=pool"
        for fd in (read_end, write_end, *fds):
            os.close(fd)


def test_names_systemd_refuses_are_refused() -> None:
    assert check_fd_name("pagedkv-pool.ab.8x64") == "pagedkv-pool.ab.8x64"
    for bad in ("", "a:b", "tab\there", "x" * 256):
        with pytest.raises(ValueError, match="name"):
            check_fd_name(bad)


def test_store_enabled_only_with_a_positive_fdstore() -> None:
    assert store_enabled({"FDSTORE": "8"})
    assert not store_enabled({}) and not store_enabled({"FDSTORE": "0"})


@pytest.fixture
def fd_3() -> Iterator[None]:
    """A pipe at descriptor 3 (socket activation's first), whatever was there put back after."""
    saved = fcntl.fcntl(3, fcntl.F_DUPFD_CLOEXEC, 10) if _is_open(3) else None
    read_end, write_end = os.pipe()
    os.dup2(read_end, 3)
    try:
        yield
    finally:
        if saved is None:
            os.close(3)
        else:
            os.dup2(saved, 3, inheritable=False)
            os.close(saved)
        for fd in (read_end, write_end):
            os.close(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.mark.usefixtures("fd_3")
def test_listened_fds_are_taken_once_and_only_for_this_pid() -> None:
    pid = str(os.getpid())
    env = {"LISTEN_FDS": "1", "LISTEN_PID": pid, "LISTEN_FDNAMES": "pool"}
    assert listened_fds(env) == {"pool": [3]}
    assert env == {} and not os.get_inheritable(3)
    assert listened_fds(env) == {}
    other = {"LISTEN_FDS": "1", "LISTEN_PID": str(os.getpid() + 1)}
    assert listened_fds(other) == {} and other == {}
    with pytest.raises(ValueError, match="LISTEN_FDNAMES names 2"):
        listened_fds({"LISTEN_FDS": "1", "LISTEN_PID": pid, "LISTEN_FDNAMES": "a:b"})
