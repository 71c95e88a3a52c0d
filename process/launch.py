"""Start pagedkv processes (the daemon, the runner) as systemd would, and stop them.

    with start_daemon(folder, "--num-blocks", "64") as daemon:     # returns once READY=1 came
        with start_runner(daemon.unix_target, folder, "--random-init", "tiny") as runner:
            ...                                                  # talk to runner.unix_target
        assert daemon.stop() == 0                                # SIGTERM, wait, exit status

Readiness is systemd's own signal (`notify` is the sending side): a datagram socket bound in
the process's folder is passed as NOTIFY_SOCKET, and both processes send READY=1 only once
their pool is allocated or mapped and every listener is up. Their stderr goes to stderr.log in
the same folder, so a failed start can be shown. `make demo` and the tests start processes
through this module. Standard library only: a client program may import it.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# `pagedkv serve` (pagedkvd) and `pagedkv runner`, through their modules so this interpreter
# (the venv's) runs them.
DAEMON_COMMAND = (sys.executable, "-m", "pagedkv.daemon.cli", "serve")
RUNNER_COMMAND = (sys.executable, "-m", "pagedkv.model_runner")
# Generous: importing torch and grpc takes a few seconds on a loaded 2-core machine.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
# How long one wait on the notify socket lasts before checking that the process still runs.
_POLL_S = 0.2


class NoNotification(RuntimeError):
    """The process exited, or the time ran out, before it sent the awaited state; the message
    holds its stderr."""


@dataclass
class Launched:
    """One daemon or runner process, and what its starter inspects."""

    process: subprocess.Popen[bytes]
    # Folder of the notify socket and stderr.log (and the daemon's pool file and socket, when
    # it is told to put them there).
    workdir: Path
    # gRPC target of its unix socket.
    unix_target: str
    # The notify socket systemd would own; messages arrive here.
    notify_socket: socket.socket
    # Every sd_notify message received so far, in order.
    notifications: list[str] = field(default_factory=list)

    def wait_for_notification(self, state: str, timeout: float = START_TIMEOUT_S) -> str:
        """Block until a message holding `state` (e.g. "READY=1") arrives; return it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                message = self.notify_socket.recv(4096).decode()
            except TimeoutError:
                if self.process.poll() is not None:
                    raise NoNotification(f"process exited ({self.process.returncode}) before "
                                         f"{state}:\n{self.stderr()}") from None
                continue
            self.notifications.append(message)
            if state in message.split("\n"):
                return message
        raise NoNotification(f"no {state} within {timeout} s:\n{self.stderr()}")

    def pool_files(self) -> list[Path]:
        """The daemon's CPU pool files in workdir (none once it stopped cleanly)."""
        return sorted(self.workdir.glob("pagedkv-*.kv"))

    def stderr(self) -> str:
        return (self.workdir / "stderr.log").read_text(errors="replace")

    def send(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        """Signal the process, wait for it, and return its exit status."""
        self.send(sig)
        return self.process.wait(STOP_TIMEOUT_S)


@contextlib.contextmanager
def launched(command: Sequence[str], folder: Path, unix_target: str,
             env: dict[str, str] | None = None, wait_ready: bool = True) -> Iterator[Launched]:
    """Run `command` with a notify socket in `folder`; wait for READY=1 unless told not to
    (a process expected to refuse to start). Killed on exit if it still runs."""
    with contextlib.ExitStack() as stack:
        notify_path = folder / "notify.sock"
        notify_path.unlink(missing_ok=True)  # a process restarted in the same folder
        receiver = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))
        receiver.bind(str(notify_path))
        receiver.settimeout(_POLL_S)
        environment = {**os.environ, "NOTIFY_SOCKET": str(notify_path), **(env or {})}
        with (folder / "stderr.log").open("wb") as stderr:
            process = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL,
                                       stderr=stderr)
        stack.callback(_reap, process)
        started = Launched(process, folder, unix_target, receiver)
        if wait_ready:
            started.wait_for_notification("READY=1")
        yield started


@contextlib.contextmanager
def start_daemon(folder: Path, *args: str, listen_path: Path | None = None,
                 env: dict[str, str] | None = None, wait_ready: bool = True) -> Iterator[Launched]:
    """`pagedkvd` with `args`, logging JSON; its pool file, notify socket, stderr.log and (unless
    `listen_path` names another) its socket in `folder`, which must be short: unix socket paths
    are limited to ~107 bytes."""
    unix_target = f"unix://{listen_path or folder / 'pagedkvd.sock'}"
    command = [*DAEMON_COMMAND, "--listen", unix_target, "--shm-dir", str(folder),
               "--log-format", "json", *args]
    with launched(command, folder, unix_target, env, wait_ready) as daemon:
        yield daemon


@contextlib.contextmanager
def start_runner(daemon_target: str, folder: Path, *args: str, listen: str | None = None,
                 wait_ready: bool = True) -> Iterator[Launched]:
    """`pagedkv runner` on the daemon at `daemon_target` with `args` (its model source at
    least), logging JSON; its notify socket, stderr.log and (unless `listen` names another) its
    socket in `folder`, which must not be the daemon's (each has its own notify socket)."""
    unix_target = listen or f"unix://{folder / 'runner.sock'}"
    command = [*RUNNER_COMMAND, "--daemon", daemon_target, "--listen", unix_target,
               "--log-format", "json", *args]
    with launched(command, folder, unix_target, None, wait_ready) as runner:
        yield runner


def free_tcp_port() -> int:
    """A loopback port nobody listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _reap(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(STOP_TIMEOUT_S)
