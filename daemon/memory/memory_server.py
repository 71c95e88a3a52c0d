"""The daemon's side of the memory socket (memory/memory_socket.py says the protocol): the
descriptor of the pool memory, handed to each process the runner socket admits.

    server = MemoryServer(memory_socket_path(runner_socket), mode, group)
    await server.start(fd, memory_id)   # the descriptor stays the caller's
    ...
    await server.close()

The policy is the runner socket's (daemon/process/server.py `_bind_runners`): mode 0o600, or
0o660 with the runner group. The socket gets the same mode and group, and each caller is checked
as the kernel recorded it at connect: the daemon's user, root, or a member of the runner group
(primary or supplementary). The check does not rest on the mode: a socket file opened to others
by mistake, or a caller that connected through a descriptor someone passed it, still gets
nothing but a closed connection and a warning.
"""

import asyncio
import os
import socket
from pathlib import Path

from pagedkv.memory.memory_socket import (
    answer_each,
    memory_message,
    peer_groups,
    peer_ids,
    stop_answering,
)
from pagedkv.process.log_setup import HOSTILE_LOG_INTERVAL_S, RateLimitedLog, get_logger
from pagedkv.process.socket_files import bind_unix_socket

log = get_logger(__name__)

# Connections waiting to be answered (runners attach one at a time, a few at once at most).
BACKLOG = 16
# A sequenced packet to a connected peer is queued at once; this bounds a full queue.
SEND_TIMEOUT_S = 1.0


class MemoryServer:
    """Serves one descriptor at `path` to the runner socket's users."""

    def __init__(self, path: Path, mode: int, group: int | None) -> None:
        # The socket's path (`<runner socket>.memory`), mode and group: the runner socket's.
        self.path, self.mode, self.group = path, mode, group
        # The descriptor served (the caller's: not closed here) and the memory id it carries.
        self._fd, self._memory_id = -1, ""
        # The listening socket and the task answering it, once started.
        self._listener: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        # Refusals are logged at most once an interval: a hostile caller cannot flood the log.
        self._refusals = RateLimitedLog(HOSTILE_LOG_INTERVAL_S)

    async def start(self, fd: int, memory_id: str) -> None:
        """Serve `fd` (kept open by the caller until `close`) as the memory `memory_id`."""
        self._fd, self._memory_id = fd, memory_id
        # The runner socket beside it is claimed (no live daemon there): a socket left here is
        # a dead daemon's.
        self.path.unlink(missing_ok=True)
        listener = bind_unix_socket(self.path, self.mode, self.group, socket.SOCK_SEQPACKET)
        listener.setblocking(False)
        self._listener = listener
        self._task = asyncio.create_task(answer_each(listener, self._hand_over))

    async def close(self) -> None:
        """Stop answering and remove the socket."""
        await stop_answering(self._task, self._listener, self.path)

    def allowed(self, connection: socket.socket) -> bool:
        """Whether the caller is one the runner socket admits: this process's user, root, or
        a member of the runner group."""
        _, uid, gid = peer_ids(connection)
        if uid in (os.geteuid(), 0):
            return True
        return self.group is not None and (gid == self.group
                                           or self.group in peer_groups(connection))


    def _hand_over(self, connection: socket.socket) -> None:
        """Send the descriptor to a caller the policy admits; anyone else gets nothing."""
        if not self.allowed(connection):
            count = self._refusals.event()
            if count is not None:
                pid, uid, _ = peer_ids(connection)
                log.warning("memory socket: a caller the runner socket would not admit asked "
                            "for the pool memory", peer_uid=uid, peer_pid=pid, refused=count)
            return
        connection.settimeout(SEND_TIMEOUT_S)
        try:
            socket.send_fds(connection, [memory_message(self._memory_id)], [self._fd])
        except OSError as exc:  # the runner gave up or died
            log.warning("memory socket: the descriptor could not be sent", error=str(exc))
