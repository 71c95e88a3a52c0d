"""The pool memory's way back to a restarted daemon without systemd's fd store: a runner keeps
a descriptor of the pool it mapped and hands it, over a unix socket beside its Runner socket,
to the daemon's user only (model_runner/process/pool_keeper.py; the daemon's side is
daemon/memory/pool_keepers.py).

The socket is SOCK_SEQPACKET at `<Runner socket>.pool`, mode 0600. Connecting is the request:
the runner checks the caller's uid (SO_PEERCRED) against the pool memory's owner (the pool
file's, or for a CUDA VMM allocation the daemon's memory socket's), and sends one message with
the descriptor attached (SCM_RIGHTS), or closes without a word: POOL_MESSAGE for a pool file
(its name says its pool), followed by a space and the pool id for a VMM allocation (nameless).
The daemon takes at most one descriptor a runner, within KEEPER_TIMEOUT_S.
"""

import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

# Beside the runner's socket path.
KEEPER_SUFFIX = ".pool"
# The one message a runner sends, with the descriptor attached.
POOL_MESSAGE = b"pagedkv-pool"
# Bytes the daemon reads: the message and a pool id.
MAX_MESSAGE_BYTES = 128
# How long the daemon waits for one runner's answer (it starts meanwhile: keep it short).
KEEPER_TIMEOUT_S = 2.0
# Only the daemon's user may connect; the uid check is the guard, the mode a second one.
KEEPER_SOCKET_MODE = 0o600


def keeper_path(runner_target: str) -> Path | None:
    """The keeper socket of the runner registered at `runner_target` ("unix:///path" or
    "unix:path"); None for any other target (a runner elsewhere maps no pool file)."""
    if not runner_target.startswith("unix:"):
        return None
    path = runner_target.removeprefix("unix://").removeprefix("unix:")
    return Path(path + KEEPER_SUFFIX) if path else None


def peer_uid(connection: socket.socket) -> int:
    """The connected peer's uid, as the kernel saw it at connect (SO_PEERCRED)."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
    uid: int = struct.unpack("3i", credentials)[1]  # (pid, uid, gid)
    return uid


@dataclass(frozen=True, slots=True)
class HandedPool:
    """A descriptor a keeper handed over."""

    # The descriptor, owned by the taker.
    fd: int
    # The pool id a VMM allocation's message names; "" for a pool file (its name says it).
    memory_id: str


def pool_message(memory_id: str) -> bytes:
    """The message sent with the descriptor of a pool file (`memory_id` "") or of the VMM
    allocation of pool `memory_id`."""
    return POOL_MESSAGE + (b" " + memory_id.encode() if memory_id else b"")


def take_fd(path: Path, timeout_s: float = KEEPER_TIMEOUT_S) -> HandedPool | None:
    """The descriptor the keeper at `path` hands over; None when it sends none (refused, or
    not a pool message). OSError when it cannot be reached."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
        connection.settimeout(timeout_s)
        connection.connect(str(path))
        message, fds, flags, _ = socket.recv_fds(connection, MAX_MESSAGE_BYTES, 1)
    head, _, memory_id = message.partition(b" ")
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or head != POOL_MESSAGE or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return None
    return HandedPool(fds[0], memory_id.decode(errors="replace"))
