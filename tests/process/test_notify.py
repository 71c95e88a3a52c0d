"""sd_notify against real AF_UNIX datagram sockets: path form, abstract form, no-op cases."""

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.process.notify import notify, watchdog_interval_s


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket bound to a path, as systemd's notify socket is."""
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(2.0)
        yield sock, path


def test_sends_states_as_one_newline_joined_datagram(
    receiver: tuple[socket.socket, str],
) -> None:
    sock, path = receiver
    assert notify("READY=1", "STATUS=serving", env={"NOTIFY_SOCKET": path})
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_abstract_namespace_form() -> None:
    name = f"pagedkv-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2.0)
        assert notify("WATCHDOG=1", env={"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(4096) == b"WATCHDOG=1"


@pytest.mark.parametrize("value", ["", "vsock:2:1234", "relative/path"])
def test_unset_or_unknown_socket_is_a_no_op(value: str) -> None:
    assert not notify("READY=1", env={"NOTIFY_SOCKET": value})


def test_missing_socket_file_is_reported_not_raised(tmp_path: Path) -> None:
    assert not notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "absent.sock")})


def test_no_states_sends_nothing(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    assert not notify(env={"NOTIFY_SOCKET": path})
    sock.settimeout(0.05)
    with pytest.raises(TimeoutError):
        sock.recv(4096)


def test_watchdog_interval_is_half_the_period_for_our_pid() -> None:
    env = {"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval_s(env) == 1.5
    assert watchdog_interval_s({"WATCHDOG_USEC": "200000"}) == 0.1


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"WATCHDOG_USEC": "0"},
        {"WATCHDOG_USEC": "abc"},
        {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"},
        {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "x"},
    ],
)
def test_no_watchdog_when_unset_or_for_another_process(env: dict[str, str]) -> None:
    assert watchdog_interval_s(env) is None
