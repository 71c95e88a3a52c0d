"""Why a CPU pool cannot be created: what holds the room in its tmpfs (/dev/shm).

A pool file's pages stay allocated for as long as any process maps the file, even after it is
deleted. The usual holder, when a daemon restarts after a crash, is a runner still mapping the
old daemon's pool: it drops its mapping once it notices the daemon is gone (within about a
second, model_runner/process/server.py), but a daemon started sooner, on a tmpfs sized for one pool,
finds no room. `reserve_failure` says so, with the free space, the pool's size and the
processes this user can see mapping pool files there (the error path only: it reads
/proc/*/maps).
"""

import errno
import os
import re
from pathlib import Path

from pagedkv.vocab.units import format_bytes

# A pool file's name: "<prefix>-<pid of its daemon>-<pool id>.kv" (kv_memory.py).
_POOL_NAME = re.compile(r"^(?P<prefix>.+)-\d+-[0-9a-f]+\.kv$")
_DELETED = " (deleted)"


def reserve_failure(path: Path, nbytes: int, exc: OSError) -> str:
    """The message for a pool file at `path` whose `nbytes` could not be reserved; when the
    tmpfs is full, its free space, the pool's size, the likely holder and how to find it."""
    folder = path.parent
    message = f"cannot reserve {format_bytes(nbytes)} for the KV pool in {folder}: {exc.strerror}"
    if exc.errno != errno.ENOSPC:
        return message
    match = _POOL_NAME.match(path.name)
    prefix = match.group("prefix") if match else path.name
    space = os.statvfs(folder)
    free, total = space.f_bavail * space.f_frsize, space.f_blocks * space.f_frsize
    holders = pool_mappings(folder, prefix)
    seen = "".join(f"; pid {pid} maps {', '.join(names)}" for pid, names in holders.items())
    return (f"{message} ({format_bytes(free)} free of {format_bytes(total)}). The likely "
            "holder is a runner still mapping a previous daemon's pool (its pages stay "
            "allocated while mapped, even deleted)"
            f"{seen or '; none this user can see'}. Find it with `grep -l {prefix} "
            f"/proc/*/maps` or `lsof +L1 {folder}`; a runner unmaps a dead daemon's pool within "
            "seconds (else restart it), or give the tmpfs room for two pools")


def pool_mappings(folder: Path, prefix: str) -> dict[int, list[str]]:
    """Processes this user may inspect that map pool files of `folder`: pid -> the files'
    names (" (deleted)" for a file deleted while mapped)."""
    found: dict[int, list[str]] = {}
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone meanwhile, or another user's
            continue
        names = sorted({name for name in map(_mapped_file, text.splitlines())
                        if name is not None and _is_pool(name, folder, prefix)})
        if names:
            found[int(maps.parent.name)] = [Path(name).name for name in names]
    return found


def _mapped_file(line: str) -> str | None:
    """The path a /proc/<pid>/maps line maps (with " (deleted)"), or None."""
    fields = line.split(maxsplit=5)
    return fields[5] if len(fields) == 6 and fields[5].startswith("/") else None


def _is_pool(name: str, folder: Path, prefix: str) -> bool:
    path = Path(name.removesuffix(_DELETED))
    match = _POOL_NAME.match(path.name)
    return path.parent == folder and match is not None and match.group("prefix") == prefix
