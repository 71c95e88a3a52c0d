"""A pool file kept for a next daemon: a shared lock on a kept descriptor, which a starting
daemon's cleanup of dead daemons' files respects (`held`).

Whoever keeps a descriptor of a pool file across a daemon restart holds it: the daemon's
descriptor store (daemon/memory/pool_handover.py) and a runner's pool keeper
(model_runner/process/pool_keeper.py, `pagedkv runner --keep-pool`). A lock lasts while any
copy of its open file description does, so a store's copy keeps it after the daemon that
stored it has exited; it goes with the last one.
"""

import fcntl
import os
from pathlib import Path


def hold(fd: int) -> None:
    """Mark the pool file of `fd` as kept for a next daemon."""
    fcntl.flock(fd, fcntl.LOCK_SH)


def held(path: Path) -> bool:
    """Whether a descriptor of the file `path` is kept for a next daemon (`hold`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the lock it took
    return False
