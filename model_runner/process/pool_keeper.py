"""The runner's side of the pool handover without systemd (`pagedkv runner --keep-pool`): it
keeps a descriptor of the pool file it mapped and hands it back to a restarting daemon of the
file's owner (process/pool_keeper_socket.py says the protocol; daemon/memory/pool_keepers.py
takes it).

    keeper = PoolKeeper(Path(listen_path + ".pool"))
    await keeper.start()
    keeper.keep(handle)            # on every attach: the descriptor of the memory now mapped
    ...
    await keeper.close()

Trust, as the fd store's: only the pool file's owner (the daemon's user, which created it)
gets the descriptor; a runner never receives one, it opens the file its daemon named in the
handle it mapped. The descriptor pins the memory while the daemon is away (the runner unmaps
it meanwhile), so /dev/shm must have room for a second pool when the next daemon cannot adopt
this one: it is released as soon as the runner maps another pool.
"""

import asyncio
import contextlib
import os
import socket
from pathlib import Path

from pagedkv.memory import PoolMemoryHandle
from pagedkv.process.log_setup import get_logger
from pagedkv.process.pool_keeper_socket import KEEPER_SOCKET_MODE, POOL_MESSAGE, peer_uid

log = get_logger(__name__)

# Connections waiting to be answered (one daemon restarts at a time).
BACKLOG = 4
# A sequenced packet to a connected peer is queued at once; this bounds a full queue.
SEND_TIMEOUT_S = 1.0


class PoolKeeper:
    """A descriptor of the mapped pool file, handed to its owner on request."""

    def __init__(self, path: Path) -> None:
        # The keeper socket's path (beside the Runner socket).
        self.path = path
        # The pool file's descriptor (read-only: it only pins and names the file), or None.
        self._fd: int | None = None
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
        self._task = asyncio.create_task(self._answer())

    def keep(self, handle: PoolMemoryHandle) -> None:
        """Hold the file `handle` maps instead of the one held so far (a CUDA pool: nothing)."""
        fd = (os.open(handle.shm_path, os.O_RDONLY | os.O_CLOEXEC)
              if handle.kind == "shm" else None)
        self._drop()
        self._fd = fd

    def _drop(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    async def close(self) -> None:
        """Stop answering, remove the socket, drop the descriptor."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._listener is not None:
            self._listener.close()
            self.path.unlink(missing_ok=True)
        self._drop()

    async def _answer(self) -> None:
        assert self._listener is not None, "started"
        loop = asyncio.get_running_loop()
        while True:
            connection, _ = await loop.sock_accept(self._listener)
            with connection:
                self._hand_over(connection)

    def _hand_over(self, connection: socket.socket) -> None:
        """Send the descriptor to the pool file's owner; anyone else gets nothing."""
        uid = peer_uid(connection)
        if self._fd is None:
            log.info("pool handover asked, no pool file held", peer_uid=uid)
            return
        owner = os.fstat(self._fd).st_uid
        if uid != owner:
            log.warning("pool handover refused: the caller is not the pool file's owner",
                        peer_uid=uid, owner_uid=owner)
            return
        connection.settimeout(SEND_TIMEOUT_S)
        try:
            socket.send_fds(connection, [POOL_MESSAGE], [self._fd])
        except OSError as exc:  # the daemon gave up (its own timeout) or died
            log.warning("pool handover failed", error=str(exc))
            return
        log.info("pool descriptor handed back to the daemon", peer_uid=uid)
