"""A planned restart's next process, started before the current one stops: it imports
everything, says it is ready, and only then is the current one stopped; once that one has
exited (its snapshot written, its descriptors stored), the stored descriptors are handed to the
standby, which goes on as if it had been started with them.

    # the starter (launch.py, for its supervisor: llm/supervisor.py)
    child = start_daemon(folder, ..., fd_store=store, standby=True)
    child.wait_for_standby()            # imported, no pool touched
    old.stop(); old.drain()             # the store now holds what the old one left
    child.hand_over()                   # SCM_RIGHTS over the socketpair
    child.wait_for_notification(READY_STATE)

    # the standby process (daemon/process/cli.py), before it imports anything heavy
    standby = Standby.from_env()        # None: a plain start
    ... imports ...
    standby.wait_for_adoption()         # the descriptors at 3, 4, ... with $LISTEN_FDS

Descriptors arrive as `fd_store.listened_fds` reads them, so the standby takes the same path as
a restart: one message on a socketpair (its end's number in $PAGEDKV_STANDBY_FD), the names
joined by ":" after "FDS=" as its bytes, the descriptors as SCM_RIGHTS; the standby moves them
to 3, 4, ... (kept free from its start by placeholders, which its imports cannot take) and sets
$LISTEN_FDS, $LISTEN_FDNAMES and $LISTEN_PID. "FDS=" alone is a store with nothing in it; a
socket closed unread (the upgrade given up) ends the standby. Standard library only.
"""

import os
import socket
from typing import Self

# The standby's end of its hand-over socket.
STANDBY_FD_ENV = "PAGEDKV_STANDBY_FD"
# What the standby sends once everything is imported.
STANDBY_READY = b"STANDBY=1"
# The hand-over message's prefix (never empty: a stream socket sends no empty message).
_FDS_PREFIX = b"FDS="
# Set by the starter: the store's bound (FileDescriptorStoreMax=), how many descriptors come.
_FD_STORE_ENV = "FDSTORE"
_LISTEN_FDS_START = 3
# The descriptors of one message arrive with at most this many names' bytes.
_MAX_MESSAGE_BYTES = 65536


def hand_over(sock: socket.socket, names: list[str], fds: list[int]) -> None:
    """The starter's side: the store's descriptors and their names, in order, in one message."""
    socket.send_fds(sock, [_FDS_PREFIX + ":".join(names).encode()], fds)


class Standby:
    """A standby process's side of the hand-over: the placeholders at 3, 4, ... and the
    socket."""

    def __init__(self, sock: socket.socket, placeholders: list[int]) -> None:
        # The hand-over socket (moved above the placeholders' range).
        self.sock = sock
        # /dev/null descriptors holding 3, 4, ... for the store's descriptors.
        self.placeholders = placeholders

    @classmethod
    def from_env(cls) -> Self | None:
        """The standby's hand-over, taken from the environment (unset then), its placeholders
        in place: call before imports open descriptors. None without $PAGEDKV_STANDBY_FD."""
        value = os.environ.pop(STANDBY_FD_ENV, None)
        if value is None:
            return None
        if not value.isdigit():
            raise ValueError(f"{STANDBY_FD_ENV} is a descriptor number, got {value!r}")
        count = int(os.environ.get(_FD_STORE_ENV, "0") or "0")
        slots = range(_LISTEN_FDS_START, _LISTEN_FDS_START + count)
        fd = int(value)
        if fd in slots:  # out of the way of the descriptors to come
            moved = os.dup(fd)
            while moved in slots:
                moved = os.dup(fd)
            fd = moved
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)
        placeholders = []
        for slot in slots:
            null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            if null != slot:
                os.dup2(null, slot, inheritable=False)
                os.close(null)
            placeholders.append(slot)
        return cls(sock, placeholders)

    def wait_for_adoption(self) -> None:
        """Say STANDBY_READY, wait for the store's descriptors, put them at 3, 4, ... with the
        $LISTEN_* variables set; SystemExit when the starter gave up (socket closed)."""
        self.sock.sendall(STANDBY_READY)
        data, fds, _, _ = socket.recv_fds(self.sock, _MAX_MESSAGE_BYTES, len(self.placeholders))
        self.sock.close()
        if not data.startswith(_FDS_PREFIX):
            for fd in fds:
                os.close(fd)
            raise SystemExit("standby: the upgrade was given up before the hand-over")
        names = data.removeprefix(_FDS_PREFIX).decode().split(":") if fds else []
        for index, fd in enumerate(fds):
            os.dup2(fd, _LISTEN_FDS_START + index, inheritable=False)
            os.close(fd)
        for slot in self.placeholders[len(fds):]:
            os.close(slot)
        if fds:
            os.environ |= {"LISTEN_FDS": str(len(fds)), "LISTEN_FDNAMES": ":".join(names),
                           "LISTEN_PID": str(os.getpid())}
