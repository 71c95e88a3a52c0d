"""What a test sees of a `pagedkv serve` with its own children: their pids, its /health, and a
bounded wait for a condition on them (tests/server/test_recovery.py, test_daemon_upgrade.py)."""

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from pagedkv.process.launch import Launched

DAEMON_MODULE = b"pagedkv.daemon"
# How long a test waits for a process to start, exit or be restarted (a loaded machine).
WAIT_S = 60.0


def children(server: Launched, module: bytes) -> list[int]:
    """The pids of the server's children running `module` (any thread's: a supervisor's thread
    starts the restarted ones)."""
    found = []
    for listing in Path(f"/proc/{server.process.pid}/task").glob("*/children"):
        for child in listing.read_text().split():
            if module in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                found.append(int(child))
    return found


def wait_for(condition_name: str, check: Callable[[], bool]) -> None:
    """Return once `check()` holds; AssertionError naming it past WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"never: {condition_name}"
        time.sleep(0.02)


def health(port: int) -> tuple[int, str]:
    """/health's status and body."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
