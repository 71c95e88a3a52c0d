"""Unix socket files of pagedkv processes (daemon, runner): explicit modes whatever the umask.

Who may connect to a unix socket is decided by the file system: write permission on the socket
file and search permission on every folder above it. Unix callers need no token, so these
modes are the access control, and they must not depend on the umask the daemon was started
with (under `umask 000` a plain bind() makes a socket every local user may connect to). The
socket is therefore bound under a umask that clears every bit `socket_mode` lacks, then
chmod'ed to exactly `socket_mode`; each folder the daemon creates for it gets an explicit
mode too: the owner's rwx, and r-x for the group when the socket grants the group access.
Folders that already exist (systemd's RuntimeDirectory, ./run) keep the mode they have.
A server that accepts on its own binds its socket the same way (`bind_unix_socket`), and a
folder only the daemon's user may enter (`make_private_folder`) is made afresh, never reused
from another user.
"""

import contextlib
import os
import shutil
import socket
import stat
from collections.abc import Iterator
from pathlib import Path


class SocketInUse(RuntimeError):
    """Another live process serves the socket path, or the path is not a socket."""


def folder_mode(socket_mode: int) -> int:
    """Mode of a folder created for a socket of `socket_mode`: owner rwx, group r-x if the
    socket grants the group anything (connecting needs search permission on the folder)."""
    return 0o750 if socket_mode & 0o070 else 0o700


def make_socket_folder(folder: Path, socket_mode: int) -> None:
    """Create `folder` and its missing parents, each with `folder_mode`, whatever the umask."""
    missing = []
    for path in (folder, *folder.parents):
        if path.exists():
            break
        missing.append(path)
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # created meanwhile by someone else
            path.mkdir(mode=folder_mode(socket_mode))
            os.chmod(path, folder_mode(socket_mode))


@contextlib.contextmanager
def socket_umask(socket_mode: int) -> Iterator[None]:
    """A umask under which bind() creates a socket with no bit `socket_mode` lacks. The umask
    is per process: only the bind runs under it, at start, before any client work."""
    previous = os.umask(0o777 & ~socket_mode)
    try:
        yield
    finally:
        os.umask(previous)


def claim_socket_path(path: Path, socket_mode: int) -> None:
    """Make room for a unix socket at `path`: create its folder, remove a dead daemon's socket,
    refuse a live one."""
    make_socket_folder(path.parent, socket_mode)
    if not path.exists():
        return
    if not path.is_socket():
        raise SocketInUse(f"cannot listen on {path}: it exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # nobody listens: left by a daemon that crashed
            return
    raise SocketInUse(f"cannot listen on {path}: another process is serving it")


def bind_unix_socket(path: Path, socket_mode: int, group: int | None = None,
                     kind: socket.SocketKind = socket.SOCK_STREAM) -> socket.socket:
    """A listening unix socket at `path` (claimed first: `claim_socket_path`) with exactly
    `socket_mode`, given to `group` when given (bound with the owner's bits alone, then
    chown'ed, then opened to the group), for a server that accepts on its own rather than
    through grpc (`kind`: SOCK_SEQPACKET for descriptor handovers). PermissionError: this
    process's user is not in `group`."""
    listener = socket.socket(socket.AF_UNIX, kind)
    try:
        with socket_umask(socket_mode if group is None else socket_mode & 0o700):
            listener.bind(str(path))
        if group is not None:
            os.chown(path, -1, group)
        os.chmod(path, socket_mode)
        listener.listen(socket.SOMAXCONN)
    except BaseException:
        listener.close()
        raise
    return listener


def make_private_folder(folder: Path) -> None:
    """A new, empty `folder` only this user may enter (0o700). One this user left behind (a
    daemon that crashed) is replaced; anything else there (a file, a link, another user's
    folder, one made meanwhile) is SocketInUse: its owner could reach what goes inside."""
    try:
        info = folder.lstat()
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise SocketInUse(f"cannot use {folder}: it exists and is not a folder of this user")
        shutil.rmtree(folder)
    try:
        folder.mkdir(mode=0o700)  # never wider, whatever the umask; chmod makes it exact
    except FileExistsError as exc:
        raise SocketInUse(f"cannot use {folder}: another process created it meanwhile") from exc
    os.chmod(folder, 0o700)
