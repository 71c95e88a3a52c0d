"""A test supervisor that emulates systemd's file descriptor store (these machines have no
systemd), speaking its documented protocol exactly:

- the notify socket is a unix datagram socket ($NOTIFY_SOCKET); a message "FDSTORE=1" with
  "FDNAME=<name>" and descriptors attached as SCM_RIGHTS stores them under that name (the
  supervisor keeps its own duplicates), "FDSTOREREMOVE=1" with "FDNAME=<name>" closes every
  descriptor of that name; $FDSTORE tells the service the store's size (systemd v254+);
- a (re)start execs the service with the stored descriptors at 3, 4, ... in the order stored,
  $LISTEN_FDS their count, $LISTEN_FDNAMES their names joined by ":", and $LISTEN_PID the
  service's own pid (set by a small exec shim, as systemd sets it between fork and exec).

    supervisor = FdStoreSupervisor(folder)
    with supervisor.start("--num-blocks", "8") as daemon:   # READY=1 received
        ...
        assert supervisor.stop(daemon) == 0                 # SIGTERM; store messages read
    with supervisor.start("--num-blocks", "8") as daemon:   # gets the stored descriptors
        ...
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from pagedkv.process.launch import READY_STATE, START_TIMEOUT_S, Launched, daemon_command

# Size of the emulated store (FileDescriptorStoreMax=).
FD_STORE_MAX = 8
# Execs argv[2:] with the descriptors listed in argv[1] moved to 3, 4, ... and $LISTEN_PID set
# to its own pid, which exec keeps.
_EXEC_SHIM = """
import fcntl, os, sys
fds = [int(fd) for fd in sys.argv[1].split(",") if fd]
high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1000) for fd in fds]
for fd in fds:
    os.close(fd)
for index, fd in enumerate(high):
    os.dup2(fd, 3 + index)
    os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.argv[2], sys.argv[2:])
"""


def restoring_daemon_args(config: str, folder: Path) -> tuple[str, ...]:
    """A small daemon of `config` that writes its snapshot at SIGTERM and restores it at start
    (its state folder in `folder`)."""
    return ("--model-config", config, "--num-blocks", "64", "--restore", "auto",
            "--state-dir", str(folder / "state"))


class FdStoreSupervisor:
    """Starts `pagedkvd` in `folder` as a unit with FileDescriptorStoreMax=FD_STORE_MAX would be
    started, and keeps what it stores across its restarts."""

    def __init__(self, folder: Path) -> None:
        # The folder of the daemon's sockets, log and pool file (its --shm-dir).
        self.folder = folder
        # The store: (name, descriptor) in the order stored.
        self.stored: list[tuple[str, int]] = []

    def start(self, *args: str) -> Launched:
        """Start the daemon with `args` and the store's descriptors; return once READY=1."""
        command, unix_target = daemon_command(self.folder, "--shm-dir", str(self.folder), *args)
        notify_path = self.folder / "pagedkvd.notify"
        notify_path.unlink(missing_ok=True)
        receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        receiver.bind(str(notify_path))
        receiver.settimeout(0.2)
        fds = [fd for _, fd in self.stored]
        env = {**os.environ, "NOTIFY_SOCKET": str(notify_path), "FDSTORE": str(FD_STORE_MAX)}
        if fds:
            env |= {"LISTEN_FDS": str(len(fds)),
                    "LISTEN_FDNAMES": ":".join(name for name, _ in self.stored)}
        with (self.folder / "pagedkvd.log").open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-c", _EXEC_SHIM, ",".join(map(str, fds)), *command], env=env,
                pass_fds=fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        daemon = Launched("pagedkvd", process, self.folder, unix_target, receiver)
        try:
            self.wait_for(daemon, READY_STATE)
        except BaseException:
            daemon.stop(signal.SIGKILL)
            raise
        return daemon

    def wait_for(self, daemon: Launched, state: str, timeout: float = START_TIMEOUT_S) -> str:
        """Handle the daemon's messages until one holds `state`; AssertionError with its log if
        it exits or the time runs out first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self._receive(daemon)
            if message is not None and state in message.split("\n"):
                return message
            if message is None and daemon.process.poll() is not None:
                break
        raise AssertionError(f"pagedkvd sent no {state}:\n{daemon.stderr()}")

    def stop(self, daemon: Launched, sig: signal.Signals = signal.SIGTERM) -> int:
        """Signal the daemon, wait for its exit, then handle what it sent; its exit status."""
        daemon.send(sig)
        code = daemon.wait_for_exit()
        while self._receive(daemon) is not None:
            pass
        daemon.notify_socket.close()
        return code

    def names(self) -> list[str]:
        return [name for name, _ in self.stored]

    def close(self) -> None:
        """Close the store's descriptors (a unit stopped without FileDescriptorStorePreserve)."""
        for _, fd in self.stored:
            os.close(fd)
        self.stored.clear()

    def _receive(self, daemon: Launched) -> str | None:
        """One message, its store commands applied; None when none came within the poll."""
        try:
            data, ancillary, _, _ = daemon.notify_socket.recvmsg(
                4096, socket.CMSG_SPACE(FD_STORE_MAX * 4))
        except TimeoutError:
            return None
        fds = [fd for level, kind, payload in ancillary
               if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
               for fd in _unpack_fds(payload)]
        message = data.decode()
        daemon.notifications.append(message)
        self._apply(dict(line.split("=", 1) for line in message.split("\n") if "=" in line), fds)
        return message

    def _apply(self, fields: dict[str, str], fds: list[int]) -> None:
        """FDSTORE=1 keeps `fds` under FDNAME; FDSTOREREMOVE=1 closes FDNAME's; others close."""
        name = fields.get("FDNAME", "stored")
        if fields.get("FDSTORE") == "1" and len(self.stored) + len(fds) <= FD_STORE_MAX:
            self.stored += [(name, fd) for fd in fds]
            return
        for fd in fds:  # systemd closes descriptors it does not keep
            os.close(fd)
        if fields.get("FDSTOREREMOVE") == "1":
            for _, fd in [entry for entry in self.stored if entry[0] == name]:
                os.close(fd)
            self.stored = [entry for entry in self.stored if entry[0] != name]


def _unpack_fds(payload: bytes) -> list[int]:
    usable = len(payload) - len(payload) % 4
    return [int.from_bytes(payload[i:i + 4], sys.byteorder) for i in range(0, usable, 4)]
