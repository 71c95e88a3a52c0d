"""The service manager's side of systemd's file descriptor store, for the children a pagedkv
process starts itself (`pagedkv serve`'s daemon; the tests' supervisor): what process/fd_store.py
speaks to, kept here when there is no systemd between the two.

    store = FdStoreHost(max_fds=8)                  # FileDescriptorStoreMax=8
    child = start_daemon(folder, ..., fd_store=store)   # $FDSTORE, the stored fds at 3, 4, ...
    child.wait_for_notification(READY_STATE)         # store messages applied on the way
    ... child exits; child.drain() applies what it sent last; start it again the same way ...
    store.close()                                    # the unit stopped: the store's fds closed

The protocol, as systemd's: a datagram on the child's notify socket with "FDSTORE=1" and
"FDNAME=<name>" and descriptors attached as SCM_RIGHTS stores them under that name (the host
keeps its own copies, received with the message); "FDSTOREREMOVE=1" with "FDNAME=<name>"
closes every descriptor of that name. Past `max_fds` a message's descriptors are closed, not
stored (systemd's FileDescriptorStoreMax= refusal), as are those of any other message. A
(re)start execs the child with the stored descriptors at 3, 4, ... in the order stored,
$LISTEN_FDS their count, $LISTEN_FDNAMES their names joined by ":", and $LISTEN_PID the child's
own pid, set by a small exec shim (`exec_command`) as systemd sets it between fork and exec.
"""

import os
import socket
import sys

from pagedkv.process.fd_store import (
    FD_STORE_ENV,
    LISTEN_FDNAMES_ENV,
    LISTEN_FDS_ENV,
    LISTEN_FDS_START,
    LISTEN_PID_ENV,
)

# FileDescriptorStoreMax= of pagedkv's units (the daemon stores one pool, two for a moment
# while an adopted pool changes its name).
DEFAULT_MAX_FDS = 8
# Execs argv[2:] with the descriptors listed in argv[1] moved to 3, 4, ... and $LISTEN_PID set
# to its own pid, which exec keeps.
_EXEC_SHIM = f"""
import fcntl, os, sys
fds = [int(fd) for fd in sys.argv[1].split(",") if fd]
high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1000) for fd in fds]
for fd in fds:
    os.close(fd)
for index, fd in enumerate(high):
    os.dup2(fd, {LISTEN_FDS_START} + index)
    os.close(fd)
os.environ["{LISTEN_PID_ENV}"] = str(os.getpid())
os.execv(sys.argv[2], sys.argv[2:])
"""


class FdStoreHost:
    """The descriptors one child stored, kept across its restarts (FileDescriptorStoreMax=
    `max_fds`), handed to each new start."""

    def __init__(self, max_fds: int = DEFAULT_MAX_FDS) -> None:
        if max_fds < 1:
            raise ValueError(f"a descriptor store keeps at least 1 descriptor, got {max_fds}")
        # FileDescriptorStoreMax=: descriptors beyond it are refused (closed).
        self.max_fds = max_fds
        # The store: (name, descriptor) in the order stored; the descriptors are this
        # process's, close-on-exec (a start passes them explicitly).
        self.stored: list[tuple[str, int]] = []

    def names(self) -> list[str]:
        """The stored descriptors' names, in order (one per descriptor)."""
        return [name for name, _ in self.stored]

    def fds(self) -> list[int]:
        """The stored descriptors, in the order the child receives them."""
        return [fd for _, fd in self.stored]

    def env(self, passed: bool = True) -> dict[str, str]:
        """The child's store variables: $FDSTORE always, $LISTEN_FDS and $LISTEN_FDNAMES when
        something is stored and `passed` ($LISTEN_PID is the exec shim's; a standby start
        receives them later: process/standby.py)."""
        env = {FD_STORE_ENV: str(self.max_fds)}
        if self.stored and passed:
            env |= {LISTEN_FDS_ENV: str(len(self.stored)),
                    LISTEN_FDNAMES_ENV: ":".join(self.names())}
        return env

    def exec_command(self, command: list[str]) -> list[str]:
        """`command` behind the shim that moves the stored descriptors (passed with
        `pass_fds=fds()`) to 3, 4, ... and sets $LISTEN_PID; `command` itself when none is
        stored."""
        if not self.stored:
            return command
        return [sys.executable, "-c", _EXEC_SHIM, ",".join(map(str, self.fds())), *command]

    def receive(self, notify_socket: socket.socket) -> str:
        """One message from the child's notify socket (its timeout applies: TimeoutError), its
        store commands applied; the message's text."""
        data, ancillary, _, _ = notify_socket.recvmsg(4096, socket.CMSG_SPACE(self.max_fds * 4))
        fds = [fd for level, kind, payload in ancillary
               if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
               for fd in _unpack_fds(payload)]
        message = data.decode(errors="replace")
        self.apply(dict(line.split("=", 1) for line in message.split("\n") if "=" in line), fds)
        return message

    def apply(self, fields: dict[str, str], fds: list[int]) -> None:
        """FDSTORE=1 keeps `fds` under FDNAME (default "stored", systemd's) while the store has
        room for all of them; FDSTOREREMOVE=1 closes FDNAME's; descriptors not kept are
        closed."""
        name = fields.get("FDNAME", "stored")
        if fields.get("FDSTORE") == "1" and fds and len(self.stored) + len(fds) <= self.max_fds:
            for fd in fds:
                os.set_inheritable(fd, False)
            self.stored += [(name, fd) for fd in fds]
            return
        for fd in fds:  # systemd closes descriptors it does not keep
            os.close(fd)
        if fields.get("FDSTOREREMOVE") == "1":
            for _, fd in [entry for entry in self.stored if entry[0] == name]:
                os.close(fd)
            self.stored = [entry for entry in self.stored if entry[0] != name]

    def close(self) -> None:
        """Close every stored descriptor (the unit stopped, without
        FileDescriptorStorePreserve). Idempotent."""
        for _, fd in self.stored:
            os.close(fd)
        self.stored.clear()


def _unpack_fds(payload: bytes) -> list[int]:
    """The descriptors of one SCM_RIGHTS payload (native ints; a truncated tail is dropped)."""
    usable = len(payload) - len(payload) % 4
    return [int.from_bytes(payload[i:i + 4], sys.byteorder) for i in range(0, usable, 4)]
