"""`pagedkv serve`'s start-up failing fast, as real processes: a port in use is reported before
any daemon or runner starts, and an unreachable --daemon or --runner in one line naming it."""

import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.process.launch import Launched, start_process

from pagedkvd_process import pagedkvd, short_tmp_dir

# How often the port-in-use test looks for the server's children while it runs.
POLL_S = 0.01
# Generous bounds on a start that fails: a few seconds is expected (5 s is the connect timeout).
EXIT_TIMEOUT_S = 60.0


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_tmp_dir() as path:
        yield path


def serve(folder: Path, *args: str) -> Launched:
    """`pagedkv serve` with `args`, started and not waited for."""
    return start_process("server", [sys.executable, "-m", "pagedkv.cli", "serve",
                                    "--model", "tiny-llama", *args], folder, "")


def children_while_running(server: Launched) -> set[int]:
    """The pids whose parent was `server` at some point before it exited."""
    seen: set[int] = set()
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while server.process.poll() is None and time.monotonic() < deadline:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:  # "pid (comm) state ppid ...": comm may hold spaces, so split after ")"
                fields = stat.read_text().rpartition(")")[2].split()
            except OSError:  # the process went away while listed
                continue
            if int(fields[1]) == server.process.pid:
                seen.add(int(stat.parent.name))
        time.sleep(POLL_S)
    return seen


def one_line(server: Launched) -> str:
    """The server's exit status checked (1), and its only stderr line."""
    assert server.wait_for_exit(EXIT_TIMEOUT_S) == 1, server.stderr()
    lines = server.stderr().splitlines()
    assert len(lines) == 1, server.stderr()
    return lines[0]


def test_a_port_in_use_fails_before_any_child_starts(folder: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        server = serve(folder, "--port", str(port))
        assert children_while_running(server) == set()
        line = one_line(server)
    assert line == (f"pagedkv serve: failed: cannot listen on http://127.0.0.1:{port}: "
                    "Address already in use")


def test_an_unreachable_daemon_is_one_line_naming_it(folder: Path) -> None:
    line = one_line(serve(folder, "--port", "0", "--daemon", "unix:///nonexistent"))
    assert line.startswith("pagedkv serve: failed: cannot open an engine: ")
    assert "no pagedkv daemon answered at unix:///nonexistent" in line


def test_an_unreachable_runner_is_one_line_naming_it(folder: Path) -> None:
    with pagedkvd("--num-blocks", "16") as daemon:
        line = one_line(serve(folder, "--port", "0", "--daemon", daemon.unix_target,
                              "--runner", f"unix://{folder}/no-runner.sock"))
    assert f"no pagedkv runner answered at unix://{folder}/no-runner.sock" in line
