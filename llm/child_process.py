"""One pagedkv process (the daemon or the runner) as a child of the `LLM`.

Readiness is the signal both processes already give systemd: the child gets a datagram socket
of ours as $NOTIFY_SOCKET and is ready when it sends READY=1 (the daemon after its pool and
listeners are up, the runner after the model is loaded and checked against the pool). Its
stderr goes to a log file whose tail explains a failed start. Stopping is SIGTERM (both drain
and clean up: the daemon removes its pool file), SIGKILL if that takes too long.
"""

import contextlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# How long a child may take to exit after SIGTERM (its drain grace and cleanup) before SIGKILL.
STOP_TIMEOUT_S = 30.0
# Bytes of a child's log quoted in an error.
LOG_TAIL_BYTES = 4000
# How often the wait for READY=1 looks whether the child died.
POLL_S = 0.2


class ChildFailed(RuntimeError):
    """A child exited or stayed silent while starting; the message quotes its log."""


@dataclass
class Child:
    """A started child process and what explains it."""

    # "daemon" or "runner": its files' names, and its name in messages.
    name: str
    process: subprocess.Popen[bytes]
    # The child's stderr.
    log_path: Path
    # Our end of its $NOTIFY_SOCKET.
    notify: socket.socket

    def wait_ready(self, timeout_s: float) -> None:
        """Return once the child sent READY=1; ChildFailed if it exits or times out first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                message = self.notify.recv(4096).decode(errors="replace")
            except TimeoutError:
                if self.process.poll() is not None:
                    raise ChildFailed(f"the {self.name} process exited with status "
                                      f"{self.process.returncode} while starting:\n"
                                      f"{self.log_tail()}") from None
                continue
            if "READY=1" in message.split("\n"):
                return
        raise ChildFailed(f"the {self.name} process was not ready within {timeout_s:g} s:\n"
                          f"{self.log_tail()}")

    def log_tail(self) -> str:
        with contextlib.suppress(OSError), self.log_path.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            return log.read().decode(errors="replace")
        return ""

    def stop(self) -> None:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Idempotent."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.notify.close()


def start_child(name: str, command: list[str], folder: Path) -> Child:
    """Start `command` with its notify socket and log in `folder`, named after `name`."""
    notify_path = folder / f"{name}.notify"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        receiver.bind(str(notify_path))
        receiver.settimeout(POLL_S)
        log_path = folder / f"{name}.log"
        env = {**os.environ, "NOTIFY_SOCKET": str(notify_path)}
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=log)
    except BaseException:
        receiver.close()
        raise
    return Child(name, process, log_path, receiver)
