"""Start pagedkv processes (the daemon, the runner) as systemd would, and stop them.

    with start_daemon(folder, "--num-blocks", "64") as daemon:   # started, not ready yet
        daemon.wait_for_notification(READY_STATE)                # NoNotification, with its log
        with start_runner(daemon.runners_target, folder, "--random-init", "tiny") as runner:
            runner.wait_for_notification(READY_STATE)
            ...                                                  # talk to runner.unix_target
        assert daemon.stop() == 0                                # SIGTERM, wait, exit status
    # leaving the `with` block kills a process that still runs

Readiness is systemd's own signal (`notify` is the sending side): a datagram socket bound in
the process's folder is passed as NOTIFY_SOCKET, and both processes send READY=1 only once
their pool is allocated or mapped and every listener is up. Their stderr goes to a log in the
same folder, whose tail explains a process that exits, or stays silent, while it is awaited
(or, with log_file=False, to this process's stderr: `pagedkv serve`'s one stream).
Each file is named after the process ("pagedkvd.log", "runner.notify"), so a daemon and its
runner may share a folder. The demo, the tests, the benchmarks and the `LLM` start their
processes through this module. Standard library only: a client program may import it.
"""

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from pagedkv.process.fd_store_host import FdStoreHost
from pagedkv.process.standby import STANDBY_FD_ENV, STANDBY_READY, hand_over
from pagedkv.vocab.paths import (
    DAEMON_RUNNER_SOCKET_NAME,
    DAEMON_SOCKET_NAME,
    RUNNER_SOCKET_NAME,
    socket_target,
)

# `pagedkvd` and `pagedkv runner`, through their modules so this interpreter (the venv's) runs
# them.
DAEMON_COMMAND = (sys.executable, "-m", "pagedkv.daemon")
RUNNER_COMMAND = (sys.executable, "-m", "pagedkv.model_runner")
READY_STATE = "READY=1"
# Generous: importing torch and grpc takes a few seconds on a loaded 2-core machine.
START_TIMEOUT_S = 60.0
# How long a process may take to exit after a signal (its drain grace and cleanup) before SIGKILL.
STOP_TIMEOUT_S = 30.0
# Bytes of a process's log quoted in an error.
LOG_TAIL_BYTES = 4000
# How long one wait on the notify socket lasts before checking that the process still runs.
_POLL_S = 0.2


class NoNotification(RuntimeError):
    """The process exited, or the time ran out, before it sent the awaited state; the message
    quotes the tail of its log."""


@dataclass
class Launched:
    """One started process, and what its starter inspects. Leaving its `with` block kills it if
    it still runs."""

    # Its name in messages and of its files: "pagedkvd", "runner".
    name: str
    process: subprocess.Popen[bytes]
    # Folder of its notify socket and log (and the daemon's pool file when `--shm-dir` names it).
    workdir: Path
    # gRPC target of its unix socket.
    unix_target: str
    # The notify socket systemd would own; messages arrive here.
    notify_socket: socket.socket
    # Every sd_notify message received so far, in order.
    notifications: list[str] = field(default_factory=list)
    # The descriptor store its notify socket feeds (FDSTORE=1 ...), when its starter keeps
    # one for it (fd_store_host.py); None: descriptors sent are closed unread.
    fd_store: FdStoreHost | None = None
    # A standby start's end of its hand-over socket (process/standby.py): it says
    # STANDBY_READY there, then waits for the store's descriptors; None: a plain start.
    standby: socket.socket | None = None

    @property
    def runners_target(self) -> str:
        """A daemon's runner socket (start_daemon puts it in workdir): where runners connect."""
        return socket_target(self.workdir / DAEMON_RUNNER_SOCKET_NAME)

    @property
    def log_path(self) -> Path:
        """Its stderr."""
        return self.workdir / f"{self.name}.log"

    def wait_for_notification(self, state: str, timeout: float = START_TIMEOUT_S) -> str:
        """Block until a message holding `state` (e.g. READY_STATE) arrives; return it.
        NoNotification as soon as the process exits, or once `timeout` seconds have passed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                message = self.receive()
            except TimeoutError:
                if self.process.poll() is not None:
                    raise NoNotification(
                        f"the {self.name} process exited with status {self.process.returncode} "
                        f"before it sent {state}:\n{log_tail(self.log_path)}") from None
                continue
            if state in message.split("\n"):
                return message
        raise NoNotification(f"the {self.name} process sent no {state} within {timeout:g} s:\n"
                             f"{log_tail(self.log_path)}")

    def receive(self) -> str:
        """The next message (TimeoutError past the socket's poll), recorded in
        `notifications`, its store commands applied when a store is kept."""
        if self.fd_store is not None:
            message = self.fd_store.receive(self.notify_socket)
        else:
            message = self.notify_socket.recv(4096).decode(errors="replace")
        self.notifications.append(message)
        return message

    def wait_for_standby(self, timeout: float = START_TIMEOUT_S) -> None:
        """Block until a standby start says it is ready to adopt (everything imported, no pool
        touched); NoNotification as soon as it exits or stays silent past `timeout`."""
        assert self.standby is not None, "only a standby start waits to adopt"
        deadline = time.monotonic() + timeout
        self.standby.settimeout(_POLL_S)
        while time.monotonic() < deadline:
            try:
                said = self.standby.recv(64)
            except TimeoutError:
                if self.process.poll() is None:
                    continue
                said = b""
            if said == STANDBY_READY:
                return
            raise NoNotification(f"the standby {self.name} process ended before it was ready "
                                 f"to adopt:\n{log_tail(self.log_path)}")
        raise NoNotification(f"the standby {self.name} process was not ready to adopt within "
                             f"{timeout:g} s:\n{log_tail(self.log_path)}")

    def hand_over(self) -> None:
        """Give a ready standby start the store's descriptors (as a restart would receive
        them) once the process it replaces has exited and been drained; it then adopts them."""
        assert self.standby is not None and self.fd_store is not None, \
            "only a standby start with a store receives its descriptors"
        hand_over(self.standby, self.fd_store.names(), self.fd_store.fds())
        self.standby.close()
        self.standby = None

    def drain(self) -> None:
        """Receive every message waiting on the notify socket (once the process exited: the
        store commands it sent last, such as FDSTOREREMOVE at exit); none waits."""
        self.notify_socket.setblocking(False)
        try:
            with contextlib.suppress(BlockingIOError):
                while True:
                    self.receive()
        finally:
            self.notify_socket.settimeout(_POLL_S)

    def pool_files(self) -> list[Path]:
        """The daemon's CPU pool files in workdir (none once it stopped cleanly)."""
        return sorted(self.workdir.glob("pagedkv-*.kv"))

    def stderr(self) -> str:
        """Its whole log."""
        return self.log_path.read_text(errors="replace")

    def send(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    def wait_for_exit(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """Wait for the process to exit, SIGKILL it if it outlives `timeout`; its exit status."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        """Signal the process unless it has exited, wait for it (SIGKILL after STOP_TIMEOUT_S),
        close the notify socket; return its exit status. Idempotent."""
        if self.process.poll() is None:
            self.send(sig)
        code = self.wait_for_exit()
        if self.standby is not None:
            self.standby.close()
        if self.fd_store is not None and self.notify_socket.fileno() >= 0:
            self.drain()
        self.notify_socket.close()
        return code

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop(signal.SIGKILL)


def start_process(name: str, command: list[str], folder: Path, unix_target: str,
                  env: dict[str, str] | None = None, log_file: bool = True,
                  fd_store: FdStoreHost | None = None, standby: bool = False) -> Launched:
    """Start `command` with its notify socket (NAME.notify) and its stderr (NAME.log; with
    log_file=False, this process's stderr) in `folder`, which must be short: unix socket paths
    are limited to ~107 bytes; with `fd_store`, as a unit with a descriptor store (it receives
    the stored descriptors and $FDSTORE). `standby` (with `fd_store`): the next process of a
    unit whose current one still runs: its own notify socket, its log appended to, no stored
    descriptor now; they come through `hand_over` (process/standby.py). Returns at once; the
    caller waits for READY_STATE (a standby: `wait_for_standby` first) and stops it."""
    assert fd_store is not None or not standby, "a standby start adopts a store's descriptors"
    notify_path = _standby_notify_path(folder, name) if standby else folder / f"{name}.notify"
    notify_path.unlink(missing_ok=True)  # a process restarted in the same folder
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ours, theirs = socket.socketpair() if standby else (None, None)
    try:
        receiver.bind(str(notify_path))
        receiver.settimeout(_POLL_S)
        environment = {**os.environ, "NOTIFY_SOCKET": str(notify_path), **(env or {})}
        # A descriptor store ($FDSTORE) is this process's unit's: the child's notify socket is
        # ours, which keeps descriptors only with `fd_store`.
        environment.pop("FDSTORE", None)
        environment.pop(STANDBY_FD_ENV, None)
        pass_fds: list[int] = []
        if fd_store is not None:
            environment |= fd_store.env(passed=not standby)
        if theirs is not None:
            environment[STANDBY_FD_ENV] = str(theirs.fileno())
            pass_fds = [theirs.fileno()]
        elif fd_store is not None:
            command, pass_fds = fd_store.exec_command(command), fd_store.fds()
        with (folder / f"{name}.log").open("ab" if standby else "wb") if log_file \
                else contextlib.nullcontext() as log:
            process = subprocess.Popen(
                command, env=environment, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=log, pass_fds=pass_fds)
    except BaseException:
        receiver.close()
        if ours is not None:
            ours.close()
        raise
    finally:
        if theirs is not None:
            theirs.close()
    return Launched(name, process, folder, unix_target, receiver, fd_store=fd_store,
                    standby=ours)


def _standby_notify_path(folder: Path, name: str) -> Path:
    """A notify socket path in `folder` no process of `name` uses: the current one keeps its
    own until it exits (a name as short as NAME.notify's plus 5, for the folder's bound)."""
    while True:
        path = folder / f"{name}.{secrets.token_hex(2)}.notify"
        if not path.exists():
            return path


def start_daemon(folder: Path, *args: str, listen_path: Path | None = None,
                 env: dict[str, str] | None = None, log_file: bool = True,
                 fd_store: FdStoreHost | None = None, standby: bool = False) -> Launched:
    """`pagedkvd` with `args`, logging JSON; its files in `folder`, its public socket there
    too (pagedkvd.sock) unless `listen_path` names another, its runner socket there always
    (`runners_target`). Its pool file goes where `--shm-dir` says (/dev/shm by default).
    `standby`: start_process's."""
    command, unix_target = daemon_command(folder, *args, listen_path=listen_path)
    return start_process("pagedkvd", command, folder, unix_target, env, log_file, fd_store,
                         standby)


def daemon_command(folder: Path, *args: str,
                   listen_path: Path | None = None) -> tuple[list[str], str]:
    """`start_daemon`'s command line, and the gRPC target of its public socket."""
    unix_target = socket_target(listen_path or folder / DAEMON_SOCKET_NAME)
    return [*DAEMON_COMMAND, "--listen", unix_target, "--runner-socket",
            str(folder / DAEMON_RUNNER_SOCKET_NAME), "--log-format", "json", *args], unix_target


def start_runner(daemon_target: str, folder: Path, *args: str, listen: str | None = None,
                 env: dict[str, str] | None = None, log_file: bool = True) -> Launched:
    """`pagedkv runner` on the daemon whose runner socket is `daemon_target` (a daemon's
    `runners_target`) with `args` (its model source at least), logging JSON; its files in
    `folder`, its socket there too (pagedkv-runner.sock) unless `listen` names another."""
    unix_target = listen or socket_target(folder / RUNNER_SOCKET_NAME)
    return start_process("runner", [*RUNNER_COMMAND, "--daemon", daemon_target, "--listen",
                                    unix_target, "--log-format", "json", *args],
                         folder, unix_target, env, log_file)


def log_tail(path: Path) -> str:
    """The last LOG_TAIL_BYTES of the log at `path` ("" if there is none)."""
    with contextlib.suppress(OSError), path.open("rb") as log:
        log.seek(max(0, log.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
        return log.read().decode(errors="replace")
    return ""


def free_tcp_port() -> int:
    """A loopback port nobody listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
