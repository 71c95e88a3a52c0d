"""The runner's side of the memory socket: it takes a descriptor only from the runner socket's
owner, and only the one descriptor of the memory its PoolMemory names; anything else is refused
with the reason, and no descriptor is left open."""

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from forked import run_forked

from pagedkv.memory.memory_socket import (
    MemorySocketError,
    memory_message,
    memory_socket_path,
    receive_memory_fd,
    runner_socket_of,
)

from pagedkvd_process import short_tmp_dir

# A user the test may become to serve as someone else (root only).
NOBODY = 65534
MEMORY_ID = "0123abcd"


@pytest.fixture
def runner_socket() -> Iterator[Path]:
    """A runner socket file of this user (the daemon the runner trusts), nobody listening."""
    with short_tmp_dir() as folder:
        path = folder / "runner.sock"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:
            bound.bind(str(path))
        yield path


def _serve_once(path: Path, message: bytes, fds: list[int]) -> threading.Thread:
    """A listener at `path` that answers one connection with `message` and `fds`, then closes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(1)

    def answer() -> None:
        with listener, listener.accept()[0] as connection:
            if message or fds:
                socket.send_fds(connection, [message], fds)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_named_memory_is_received(runner_socket: Path) -> None:
    pool_file = runner_socket.with_name("pool")
    pool_file.write_bytes(b"kv")
    with pool_file.open("rb") as served:
        thread = _serve_once(memory_socket_path(runner_socket), memory_message(MEMORY_ID),
                             [served.fileno()])
        fd = receive_memory_fd(runner_socket, MEMORY_ID)
        thread.join()
    try:
        assert os.path.samestat(os.fstat(fd), pool_file.stat())
    finally:
        os.close(fd)


@pytest.mark.parametrize(("message", "descriptors", "reason"), [
    (b"pagedkv-pool 0123abcd", 1, "is not a memory message"),
    (memory_message("ffff0000"), 1, "the descriptor is of memory 'ffff0000'"),
    (memory_message(MEMORY_ID), 0, "carries 0 descriptors"),
    (memory_message(MEMORY_ID), 2, "carries 2 descriptors"),
    (memory_message(MEMORY_ID), 3, "the answer was cut"),
    (memory_message(MEMORY_ID) + b"x" * 300, 1, "the answer was cut"),
    (b"", 0, "closed without a descriptor"),
])
def test_a_malformed_answer_is_refused_and_its_descriptors_closed(
        runner_socket: Path, message: bytes, descriptors: int, reason: str) -> None:
    with open(os.devnull, "rb") as served:
        before = _open_fds()
        thread = _serve_once(memory_socket_path(runner_socket), message,
                             [served.fileno()] * descriptors)
        with pytest.raises(MemorySocketError, match=reason):
            receive_memory_fd(runner_socket, MEMORY_ID)
        thread.join()
        assert _open_fds() == before  # the listener closed, nothing received kept


@pytest.mark.skipif(os.getuid() != 0, reason="serving as another user needs root")
def test_a_socket_another_user_serves_is_not_trusted(runner_socket: Path) -> None:
    runner_socket.parent.chmod(0o777)  # anyone could bind a name beside the runner socket
    path = memory_socket_path(runner_socket)
    ready_read, ready_write = os.pipe()

    def impostor() -> str:
        """Serve /dev/null as the memory, correctly framed, to whoever asks."""
        with open(os.devnull, "rb") as served:
            thread = _serve_once(path, memory_message(MEMORY_ID), [served.fileno()])
            os.write(ready_write, b"1")
            thread.join()
        return "served"

    answers: list[str] = []
    child = threading.Thread(target=lambda: answers.append(run_forked(impostor, uid=NOBODY)))
    child.start()
    try:
        assert os.read(ready_read, 1) == b"1"
        with pytest.raises(MemorySocketError, match=f"served by uid {NOBODY}, not by the runner "
                           f"socket's owner \\(uid {os.getuid()}\\)"):
            receive_memory_fd(runner_socket, MEMORY_ID)
    finally:
        child.join()
        os.close(ready_read)
        os.close(ready_write)
    assert answers == ["served"]


def test_only_a_unix_daemon_target_names_a_runner_socket() -> None:
    assert runner_socket_of("unix:///run/pagedkv/runner.sock") == Path("/run/pagedkv/runner.sock")
    assert runner_socket_of("unix:run/r.sock") == Path("run/r.sock")
    with pytest.raises(MemorySocketError, match="'localhost:50051' is not a unix socket"):
        runner_socket_of("localhost:50051")
