"""The daemon's memory socket: how a runner gets the descriptor of pool memory it cannot open by
name, a CUDA VMM allocation (PoolMemory kind "cuda_vmm"; memory/cuda_vmm.py), over a unix socket
beside the daemon's runner socket. The daemon serves it (`MemorySocket`); a runner takes the
descriptor (`receive_memory_fd`) and maps it (memory/attach.py).

The socket is SOCK_SEQPACKET at `<runner socket>.memory`, with the runner socket's mode and
group: whoever may act as a runner may map the K/V, nobody else. Connecting is the request. The
daemon checks the caller's credentials as the kernel recorded them at connect (SO_PEERCRED, and
SO_PEERGROUPS for the runner group) against the runner socket's policy, the mode being a second
guard: the daemon's own user, root, or, with a runner group, a member of it. Then it sends one
message, MEMORY_MESSAGE, a space and the memory's id, with the descriptor attached (SCM_RIGHTS),
or closes without a word.

A runner trusts the socket only when the process listening there is the runner socket's owner
(the daemon's user, whom the runner already trusts with the K/V), and maps the descriptor only
when the message names the memory id its PoolMemory names.
"""

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path

# Beside the daemon's runner socket.
MEMORY_SUFFIX = ".memory"
# The message a daemon sends, before a space and the memory id, with the descriptor attached.
MEMORY_MESSAGE = b"pagedkv-memory"
# Bytes a runner reads: a longer message is malformed (its tail would be cut).
MAX_MESSAGE_BYTES = 256
# How long a runner waits for the daemon's answer.
RECEIVE_TIMEOUT_S = 5.0
# SO_PEERGROUPS (Linux 4.13, asm-generic/socket.h): the peer's groups at connect; Python names
# it from 3.14 only.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
# Groups read from SO_PEERGROUPS: CPython's getsockopt reads at most 1024 bytes. A caller in
# more groups is refused unless its uid alone admits it.
MAX_PEER_GROUPS = 256


class MemorySocketError(ValueError):
    """The memory socket is not to be trusted, or sent no descriptor or another one."""


def memory_socket_path(runner_socket: Path) -> Path:
    """The memory socket of the daemon whose runner socket is `runner_socket`."""
    return runner_socket.with_name(runner_socket.name + MEMORY_SUFFIX)


def runner_socket_of(daemon_target: str) -> Path:
    """The runner socket a runner connects to at `daemon_target` ("unix:///path" or
    "unix:path"); MemorySocketError for another target (only a co-located runner maps memory)."""
    path = daemon_target.removeprefix("unix://").removeprefix("unix:")
    if not daemon_target.startswith("unix:") or not path:
        raise MemorySocketError(f"the daemon target {daemon_target!r} is not a unix socket: a "
                                "CUDA VMM pool is handed over its runner socket's memory socket")
    return Path(path)


def memory_message(memory_id: str) -> bytes:
    """The message sent with the descriptor of the memory `memory_id`."""
    return MEMORY_MESSAGE + b" " + memory_id.encode()


def peer_ids(connection: socket.socket) -> tuple[int, int, int]:
    """The connected peer's (pid, uid, gid), as the kernel saw them at connect (SO_PEERCRED)."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", credentials)
    return pid, uid, gid


def peer_groups(connection: socket.socket) -> frozenset[int]:
    """The connected peer's supplementary groups at connect (SO_PEERGROUPS); empty when it has
    more than MAX_PEER_GROUPS."""
    with contextlib.suppress(OSError):  # ERANGE: more groups than the buffer holds
        raw = connection.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * MAX_PEER_GROUPS)
        return frozenset(struct.unpack(f"{len(raw) // 4}I", raw))
    return frozenset()


def receive_memory_fd(runner_socket: Path, memory_id: str,
                      timeout_s: float = RECEIVE_TIMEOUT_S) -> int:
    """The descriptor of the memory `memory_id`, from the memory socket beside `runner_socket`,
    owned by the caller. MemorySocketError, no descriptor kept, when the socket's listener is
    not the runner socket's owner or the answer is not that memory's one descriptor; OSError
    when the socket cannot be reached."""
    path = memory_socket_path(runner_socket)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
        connection.settimeout(timeout_s)
        connection.connect(str(path))
        _, server_uid, _ = peer_ids(connection)
        owner = runner_socket.stat().st_uid
        if server_uid != owner:
            raise MemorySocketError(f"{path} is served by uid {server_uid}, not by the runner "
                                    f"socket's owner (uid {owner}): not the daemon's")
        message, fds, flags, _ = socket.recv_fds(connection, MAX_MESSAGE_BYTES, 2)
    why_not = _malformed(message, fds, flags, memory_id)
    if why_not:
        for fd in fds:
            os.close(fd)
        raise MemorySocketError(f"{path}: {why_not}")
    return fds[0]


def _malformed(message: bytes, fds: list[int], flags: int, memory_id: str) -> str:
    """Why an answer is not memory `memory_id`'s one descriptor; "" when it is."""
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        return "the answer was cut (too long, or more than one descriptor)"
    if not message and not fds:
        return "the daemon closed without a descriptor (this process may not map its memory)"
    head, _, named = message.partition(b" ")
    if head != MEMORY_MESSAGE:
        return f"the answer {message[:32]!r} is not a memory message"
    if named != memory_id.encode():
        return (f"the descriptor is of memory {named[:64].decode(errors='replace')!r}, the pool "
                f"names {memory_id!r}")
    if len(fds) != 1:
        return f"the answer carries {len(fds)} descriptors, not one"
    return ""


async def answer_each(listener: socket.socket, hand_over: Callable[[socket.socket], None]) -> None:
    """Answer every connection to `listener` (a non-blocking SOCK_SEQPACKET socket) once, with
    `hand_over`, then close it: the loop of a descriptor socket's server (the daemon's memory
    socket, a runner's pool keeper), until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        connection, _ = await loop.sock_accept(listener)
        with connection:
            hand_over(connection)


async def stop_answering(task: asyncio.Task[None] | None, listener: socket.socket | None,
                         path: Path) -> None:
    """Cancel a server's `answer_each` task, close its listener and remove its socket file."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if listener is not None:
        listener.close()
        path.unlink(missing_ok=True)
