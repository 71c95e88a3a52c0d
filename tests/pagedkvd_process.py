"""Runs the real `pagedkvd` (and `pagedkv runner`) as subprocesses for tests, as systemd would.

    with pagedkvd("--num-blocks", "64") as daemon:      # returns once READY=1 arrived
        ... talk to daemon.unix_target ...
        with pagedkv_runner(daemon, "--random-init", "tiny") as runner:
            ... talk to runner.unix_target ...
        assert daemon.stop() == 0                        # SIGTERM, wait, exit status

Everything the daemon creates (socket, pool file, notify socket, stderr.log) lives in one
short private folder: unix socket paths are limited to ~107 bytes, and /dev/shm stays
untouched. Readiness is
systemd's own signal: the harness binds a datagram socket and passes it as NOTIFY_SOCKET.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# The daemon as `pagedkv serve`, through the module so the venv's interpreter is used.
COMMAND = [sys.executable, "-m", "pagedkv.daemon.cli", "serve"]
# The runner as `pagedkv runner`.
RUNNER_COMMAND = [sys.executable, "-m", "pagedkv.model_runner"]
# Generous: importing torch and grpc takes a few seconds on a loaded 2-core machine.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


@dataclass
class Pagedkvd:
    """One daemon (or runner) process and what a test inspects."""

    process: subprocess.Popen[bytes]
    # Folder of the pool file, the notify socket, stderr.log and (by default) the socket.
    workdir: Path
    # gRPC target of the daemon's unix socket.
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
                    raise AssertionError(f"process exited ({self.process.returncode}) before "
                                         f"{state}:\n{self.stderr()}") from None
                continue
            self.notifications.append(message)
            if state in message.split("\n"):
                return message
        raise AssertionError(f"no {state} within {timeout} s:\n{self.stderr()}")

    def pool_files(self) -> list[Path]:
        return sorted(self.workdir.glob("pagedkv-*.kv"))

    def stderr(self) -> str:
        return (self.workdir / "stderr.log").read_text(errors="replace")

    def send(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        """Signal the daemon, wait for it, and return its exit status."""
        self.send(sig)
        return self.process.wait(STOP_TIMEOUT_S)


def free_tcp_port() -> int:
    """A loopback port nobody listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def short_tmp_dir() -> Iterator[Path]:
    """A fresh folder with a short path (pytest's tmp_path is too long for unix sockets)."""
    folder = Path(tempfile.mkdtemp(prefix="pkvd-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def pagedkvd(*args: str, env: dict[str, str] | None = None, wait_ready: bool = True,
             workdir: Path | None = None, listen_path: Path | None = None) -> Iterator[Pagedkvd]:
    """Start `pagedkvd` with `args`, its files in `workdir` (default: a private folder) and its
    socket at `listen_path` (default: in workdir). Killed on exit if the test did not stop it.
    With wait_ready=False, return at once (for daemons expected to refuse to start)."""
    with contextlib.ExitStack() as stack:
        folder = workdir or stack.enter_context(short_tmp_dir())
        unix_target = f"unix://{listen_path or folder / 'pagedkvd.sock'}"
        yield stack.enter_context(_process(
            [*COMMAND, "--listen", unix_target, "--shm-dir", str(folder), "--log-format", "json",
             *args], folder, unix_target, env, wait_ready))


@contextmanager
def pagedkv_runner(daemon: Pagedkvd, *args: str, wait_ready: bool = True,
                   listen: str | None = None) -> Iterator[Pagedkvd]:
    """Start `pagedkv runner` next to `daemon` with `args` (its model source at least); its
    stderr.log (and socket, unless `listen` names one) in a private folder."""
    with short_tmp_dir() as folder:
        unix_target = listen or f"unix://{folder / 'runner.sock'}"
        with _process([*RUNNER_COMMAND, "--daemon", daemon.unix_target, "--listen", unix_target,
                       "--log-format", "json", *args], folder, unix_target, None,
                      wait_ready) as runner:
            yield runner


@contextmanager
def _process(command: list[str], folder: Path, unix_target: str, env: dict[str, str] | None,
             wait_ready: bool) -> Iterator[Pagedkvd]:
    """Run `command` with a notify socket in `folder`; wait for READY=1 unless told not to."""
    with contextlib.ExitStack() as stack:
        notify_path = folder / "notify.sock"
        notify_path.unlink(missing_ok=True)  # a process restarted in the same folder
        receiver = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))
        receiver.bind(str(notify_path))
        receiver.settimeout(0.2)
        environment = {**os.environ, "NOTIFY_SOCKET": str(notify_path), **(env or {})}
        with (folder / "stderr.log").open("wb") as stderr:
            process = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL,
                                       stderr=stderr)
        stack.callback(_reap, process)
        started = Pagedkvd(process, folder, unix_target, receiver)
        if wait_ready:
            started.wait_for_notification("READY=1")
        yield started


def _reap(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(STOP_TIMEOUT_S)
