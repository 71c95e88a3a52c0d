"""The pool memory across a restart without systemd's fd store ($FDSTORE unset: a daemon run
by hand, in a container, under a supervisor with no store): the runners, which map the pool
anyway, keep a descriptor of its file and hand it back (`pagedkv runner --keep-pool`;
process/pool_keeper_socket.py says the protocol).

    # at a clean stop, restore = auto, no fd store:
    leave_for_keepers(state_folder, arena, layout.fd_name(arena.pool_id), runner_targets)
    # at the next start, when the service manager passed nothing:
    handover = PoolHandover(taken_back(state_folder))

At stop, when at least one registered runner's keeper socket exists, the daemon leaves its
pool file in place (`KVMemory.keep_file`, as under the fd store) and records, in the state
folder, the name it would have stored the descriptor under (pool id and layout) and those
sockets. At start, the record is read once (and removed), each keeper is asked for its
descriptor, and what comes back goes through the same `PoolHandover` as the fd store's: the
same layout check and the same `KVMemory.adopt`. Only descriptors of this daemon's user's pool
file of the recorded pool id are kept, one whatever the number of runners; any other is closed.

A CUDA pool is kept this way when it is a VMM allocation (restore = auto): the keeper holds the
descriptor the daemon's memory socket gave it and names its pool id, and the next daemon adopts
it through the same `PoolHandover` (`KVMemory.adopt_vmm`; a descriptor that is no VMM
allocation of the layout is refused by the driver and released). Not kept this way: a crashed
daemon's pool (no record is written; the fd store keeps it), and a CUDA IPC pool (restore =
never: it dies with its daemon).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

from pagedkv.daemon.memory.kv_memory import KVMemory, pool_file_name
from pagedkv.daemon.memory.pool_handover import FD_NAME_PREFIX
from pagedkv.process.log_setup import get_logger
from pagedkv.process.pool_keeper_socket import HandedPool, keeper_path, take_fd

log = get_logger(__name__)

# The record's file in the state folder.
RECORD_NAME = "pool-keepers.json"
# Most keepers recorded: each costs the next start up to KEEPER_TIMEOUT_S when it is stuck.
MAX_KEEPERS = 16
# A pool descriptor's stored name: group 1 its pool id.
_FD_NAME = re.compile(rf"{re.escape(FD_NAME_PREFIX)}\.([0-9a-f]+)\..+")


def leave_for_keepers(folder: Path, arena: KVMemory, fd_name: str,
                      runner_targets: Iterable[str]) -> bool:
    """Keep `arena`'s file at exit for the next daemon and record `fd_name` and the keepers
    of `runner_targets` that listen; False (nothing kept) when none does or for a CUDA IPC
    pool."""
    keepers = sorted({str(path) for target in runner_targets
                      if (path := keeper_path(target)) is not None and path.is_socket()})
    if not keepers or not (arena.shm_path or arena.memory_fd >= 0):
        return False
    record = folder / RECORD_NAME
    partial = record.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"fd_name": fd_name, "keepers": keepers[:MAX_KEEPERS]}, out)
    partial.rename(record)
    if arena.shm_path:  # a VMM allocation lives on the keepers' descriptors
        arena.keep_file()
    log.info("pool file left for the runners to hand back", keepers=keepers[:MAX_KEEPERS],
             shm_path=arena.shm_path or None)
    return True


def taken_back(folder: Path) -> dict[str, list[int]]:
    """The recorded pool's descriptor as the keepers hand it back, by its stored name (what
    `PoolHandover` takes); {} without a record, or when no keeper hands it. The record is
    read once."""
    recorded = _read_record(folder / RECORD_NAME)
    if recorded is None:
        return {}
    fd_name, keepers = recorded
    match = _FD_NAME.fullmatch(fd_name)
    if match is None:
        log.warning("pool keepers' record refused: not a pool's name", fd_name=fd_name)
        return {}
    for keeper in keepers:
        handed = _ask(Path(keeper))
        if handed is None:
            continue
        why_not = _not_ours(handed, match.group(1))
        if not why_not:
            log.info("pool descriptor taken back from a runner", keeper=keeper)
            return {fd_name: [handed.fd]}
        os.close(handed.fd)
        log.warning("a runner's pool descriptor refused", keeper=keeper, reason=why_not)
    log.warning("no runner handed the pool back: starting cold", keepers=keepers)
    return {}


def _read_record(path: Path) -> tuple[str, list[str]] | None:
    """The record's (fd name, keeper sockets), the file removed; None when there is none or
    it is malformed (logged)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    path.unlink()
    try:
        record = json.loads(text)
        fd_name, keepers = record["fd_name"], record["keepers"]
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("pool keepers' record refused", path=str(path), reason=str(exc))
        return None
    if not isinstance(fd_name, str) or not isinstance(keepers, list) or not all(
            isinstance(keeper, str) for keeper in keepers):
        log.warning("pool keepers' record refused: not a name and a list of sockets",
                    path=str(path))
        return None
    return fd_name, keepers[:MAX_KEEPERS]


def _ask(keeper: Path) -> HandedPool | None:
    """The descriptor the runner at `keeper` hands over, or None (logged)."""
    try:
        handed = take_fd(keeper)
    except OSError as exc:  # gone, not a socket, timed out
        log.warning("a runner's pool keeper did not answer", keeper=str(keeper),
                    error=str(exc))
        return None
    if handed is None:
        log.warning("a runner's pool keeper handed nothing", keeper=str(keeper))
    return handed


def _not_ours(handed: HandedPool, pool_id: str) -> str:
    """Why `handed` is not this user's pool file of `pool_id`, or that pool's VMM allocation
    (the driver checks it is one when it is adopted); '' when it is."""
    if handed.memory_id:
        return ("" if handed.memory_id == pool_id else
                f"the descriptor is of pool {handed.memory_id[:64]!r}, not {pool_id}")
    fd = handed.fd
    path = Path(os.readlink(f"/proc/self/fd/{fd}"))
    parsed = pool_file_name(path.name.removesuffix(" (deleted)"))
    if parsed is None or parsed.group(2) != pool_id:
        return f"{path.name} is not the file of pool {pool_id}"
    owner = os.fstat(fd).st_uid
    if owner != os.getuid():
        return f"{path.name} belongs to uid {owner}, not this daemon's {os.getuid()}"
    return ""
