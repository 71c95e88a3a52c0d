"""The runner's side of the pool handover without systemd (`pagedkv runner --keep-pool`): it
keeps a descriptor of the pool file it mapped and hands it back to a restarting daemon of the
file's owner (process/pool_keeper_socket.py says the protocol; daemon/memory/pool_keepers.py
takes it).

    keeper = PoolKeeper(Path(listen_path + ".pool"))
    await keeper.start()
    keeper.keep(handle, daemon)    # on every attach: the descriptor of the memory now mapped
    ...
    await keeper.close()

Trust, as the fd store's: only the pool memory's owner (the daemon's user: the pool file's
owner, or for a CUDA VMM pool the user serving the daemon's memory socket) gets the descriptor.
A runner holds a pool file's descriptor because it opened the file its daemon named in the
handle it mapped, a VMM pool's because the daemon's memory socket handed it over. The
descriptor pins the memory while the daemon is away (the runner unmaps it meanwhile), so
/dev/shm (or the device) must have room for a second pool when the next daemon cannot adopt
this one: it is released as soon as the runner maps another pool.
"""

import asyncio
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from pagedkv.memory import PoolMemoryHandle
from pagedkv.memory.memory_socket import (
    answer_each,
    receive_memory_fd,
    runner_socket_of,
    stop_answering,
)
from pagedkv.memory.pool_files import hold
from pagedkv.process.log_setup import get_logger
from pagedkv.process.pool_keeper_socket import KEEPER_SOCKET_MODE, peer_uid, pool_message

log = get_logger(__name__)

# Connections waiting to be answered (one daemon restarts at a time).
BACKLOG = 4
# A sequenced packet to a connected peer is queued at once; this bounds a full queue.
SEND_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class _Kept:
    """The descriptor kept, and whom it is handed to."""

    # The descriptor (a pool file's read-only: it only pins and names the file).
    fd: int
    # The memory's owner, the only uid it is handed to.
    owner: int
    # A VMM pool's id, sent with it; "" for a pool file.
    memory_id: str


class PoolKeeper:
    """A descriptor of the mapped pool file, handed to its owner on request."""

    def __init__(self, path: Path) -> None:
        # The keeper socket's path (beside the Runner socket).
        self.path = path
        # The descriptor of the memory mapped, or None.
        self._kept: _Kept | None = None
        # The listening socket and the task answering it, once started.
        self._listener: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen on `path` (a stale socket of a dead runner there is replaced)."""
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.setblocking(False)
        listener.bind(str(self.path))
        os.chmod(self.path, KEEPER_SOCKET_MODE)
        listener.listen(BACKLOG)
        self._listener = listener
        self._task = asyncio.create_task(answer_each(listener, self._hand_over))

    def keep(self, handle: PoolMemoryHandle, daemon_target: str) -> None:
        """Hold the memory `handle` maps instead of the one held so far: its file, or a VMM
        pool's descriptor from the memory socket beside `daemon_target` (a CUDA IPC pool:
        nothing, it dies with its daemon)."""
        kept = None
        if handle.kind == "shm":
            fd = os.open(handle.shm_path, os.O_RDONLY | os.O_CLOEXEC)
            hold(fd)  # another daemon's start leaves the file while this keeps it
            kept = _Kept(fd, os.fstat(fd).st_uid, "")
        elif handle.kind == "cuda_vmm":  # the socket's server is the runner socket's owner
            runner_socket = runner_socket_of(daemon_target)
            fd = receive_memory_fd(runner_socket, handle.memory_id)
            kept = _Kept(fd, runner_socket.stat().st_uid, handle.memory_id)
        self._drop()
        self._kept = kept

    def _drop(self) -> None:
        if self._kept is not None:
            os.close(self._kept.fd)
            self._kept = None

    async def close(self) -> None:
        """Stop answering, remove the socket, drop the descriptor."""
        await stop_answering(self._task, self._listener, self.path)
        self._drop()


    def _hand_over(self, connection: socket.socket) -> None:
        """Send the descriptor to the pool memory's owner; anyone else gets nothing."""
        uid, kept = peer_uid(connection), self._kept
        if kept is None:
            log.info("pool handover asked, no pool memory held", peer_uid=uid)
            return
        if uid != kept.owner:
            log.warning("pool handover refused: the caller is not the pool memory's owner",
                        peer_uid=uid, owner_uid=kept.owner)
            return
        connection.settimeout(SEND_TIMEOUT_S)
        try:
            socket.send_fds(connection, [pool_message(kept.memory_id)], [kept.fd])
        except OSError as exc:  # the daemon gave up (its own timeout) or died
            log.warning("pool handover failed", error=str(exc))
            return
        log.info("pool descriptor handed back to the daemon", peer_uid=uid)
