"""The pool memory's way back to a restarted daemon without systemd's fd store: a runner keeps
a descriptor of the pool it mapped and hands it, over a unix socket beside its Runner socket,
to the daemon's user only (model_runner/process/pool_keeper.py; the daemon's side is
daemon/memory/pool_keepers.py).

The socket is SOCK_SEQPACKET at `<Runner socket>.pool`, mode 0600. Connecting is the request:
the runner checks the caller's uid (SO_PEERCRED) against the pool file's owner, and sends one
message, POOL_MESSAGE with the descriptor attached (SCM_RIGHTS), or closes without a word.
The daemon takes at most one descriptor a runner, within KEEPER_TIMEOUT_S.
"""

import os
import socket
import struct
from pathlib import Path

# Beside the runner's socket path.
KEEPER_SUFFIX = ".pool"
# The one message a runner sends, with the descriptor attached.
POOL_MESSAGE = b"pagedkv-pool"
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


def take_fd(path: Path, timeout_s: float = KEEPER_TIMEOUT_S) -> int | None:
    """The descriptor the keeper at `path` hands over, owned by the caller; None when it
    sends none (refused, or not a pool message). OSError when it cannot be reached."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
        connection.settimeout(timeout_s)
        connection.connect(str(path))
        message, fds, flags, _ = socket.recv_fds(connection, len(POOL_MESSAGE), 1)
    if flags & socket.MSG_CTRUNC or message != POOL_MESSAGE or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return None
    return fds[0]
