"""The daemon's sessions and tables across a restart (`restore = "auto"`).

At stop, once SIGTERM's drain has let in-flight calls finish, `state_image` takes the
service's image (daemon/service/service_image.py: runner holds are named by the runners'
processes, so before the service's stop closes their pidfds), and once the service has
stopped and its memory work is done, `keep_state` writes it into the snapshot file
(snapshot_file.py) in the state folder. At start, before any listener is bound,
`restore_state` reads it back into the fresh service, only when the pool memory the daemon
maps is the memory the snapshot describes (adopted from the previous run through systemd's fd
store: daemon/memory/pool_handover.py) and its identity (geometry, block count, page size,
dtype, allocator, prefix hash) is this daemon's, then runs `check_invariants` over it. Anything
else (another version, identity or memory, a corrupted file, a failed check) is logged with
the reason, the snapshot is set aside (`<name>.refused`) and the daemon starts cold: the
caller builds a new service. A snapshot applied is removed, so it is never applied twice.

A host tier is kept the same way: its slots' memory is handed over as the pool's (adopted
when its layout matches), its index is in the image, and it is restored only onto the host
memory the snapshot names (service_image.py). Not written (the next daemon then starts cold,
said in one log line): when the pool's memory work failed (fail-stop: the contents of the pool
and of the host slots are unknown), or when the service holds what the image cannot keep (a
call in flight).
"""

import os
from pathlib import Path
from typing import Any

from pagedkv.daemon.core.pool_image import Image
from pagedkv.daemon.memory.kv_memory import KVPoolMemory
from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.process.snapshot_file import (
    SnapshotRefused,
    read_snapshot,
    set_aside,
    write_snapshot,
)
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.service_image import NotKept, restore_service, service_image
from pagedkv.process.log_setup import get_logger
from pagedkv.vocab.geometry import ModelGeometry

log = get_logger(__name__)

# The snapshot's file name in the state folder.
SNAPSHOT_NAME = "pagedkvd.snapshot"
# systemd's StateDirectory= variable.
STATE_DIR_VARIABLE = "STATE_DIRECTORY"


def state_dir(config: DaemonConfig) -> Path:
    """The folder the snapshot lives in: the setting, else systemd's StateDirectory, else
    ./state; created 0700 when missing (the daemon's own)."""
    first = os.environ.get(STATE_DIR_VARIABLE, "").split(":")[0]
    folder = config.state_dir or (Path(first) if first else Path.cwd() / "state")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def pool_identity(config: DaemonConfig, geometry: ModelGeometry, dtype: str,
                  service: PoolService) -> dict[str, Any]:
    """What a snapshot is of: a pool of this geometry, size, layout, hashing and zeroing."""
    return {"model": geometry.name, "num_layers": geometry.num_layers,
            "num_kv_heads": geometry.num_kv_heads, "head_dim": geometry.head_dim,
            "dtype": dtype, "num_blocks": service.pool.num_blocks,
            "block_size": config.block_size, "page_size": config.page_size,
            "allocator": config.allocator, "prefix_hash": config.prefix_hash,
            "prefix_caching": config.enable_prefix_caching,
            # A daemon that zeroes freed blocks trusts that free blocks hold no one's K/V.
            "zero_freed_blocks": config.zero_freed_blocks}


def state_image(config: DaemonConfig, service: PoolService) -> Image | None:
    """The service's image to keep (restore = "auto"), taken once the calls have drained and
    before `PoolService.stop` closes the runners' pidfds (holds name their runner); None when
    there is none to keep (logged)."""
    if config.restore != "auto":
        return None
    why_not = _why_not_kept(service)
    if not why_not:
        try:
            return service_image(service)
        except NotKept as exc:
            why_not = str(exc)
    log.warning("no restart snapshot written: the next daemon starts cold", reason=why_not)
    return None


def keep_state(config: DaemonConfig, service: PoolService, identity: dict[str, Any],
               image: Image | None) -> None:
    """Write `image` for the next daemon, once the service has stopped and its memory work
    is done, unless that work failed (then the memory's contents are unknown: logged)."""
    if image is None:
        return
    why_not = _why_not_kept(service)
    if why_not:
        log.warning("no restart snapshot written: the next daemon starts cold", reason=why_not)
        return
    path = state_dir(config) / SNAPSHOT_NAME
    write_snapshot(path, identity, image)
    log.info("restart snapshot written", path=str(path), sessions=len(image["sessions"]),
             bytes=path.stat().st_size)


def restore_state(config: DaemonConfig, service: PoolService, memory: KVPoolMemory,
                  identity: dict[str, Any]) -> bool:
    """Restore the snapshot into the fresh `service` (restore = "auto"); whether it did. When
    it did not after touching `service`, the caller must build a new one (returns False after
    logging why, the snapshot set aside)."""
    if config.restore != "auto":
        return False
    path = state_dir(config) / SNAPSHOT_NAME
    if not path.exists():
        log.info("no restart snapshot: starting cold", path=str(path))
        return False
    try:
        restore_service(service, read_snapshot(path, identity), memory.arena.adopted_from)
        service.check_invariants()
    except (SnapshotRefused, NotKept, AssertionError, KeyError, TypeError, ValueError) as exc:
        aside = set_aside(path)
        log.warning("restart snapshot refused: starting cold", reason=str(exc),
                    set_aside=str(aside))
        return False
    path.unlink()
    log.info("restart snapshot restored", sessions=len(service.sessions),
             sequences=len(service.pool), adopted_from=memory.arena.adopted_from)
    return True


def _why_not_kept(service: PoolService) -> str:
    """Why the daemon's state cannot be kept now; '' when it can."""
    if service.memory_order.failed.is_set():
        return "the pool's memory work failed: its contents are unknown"
    return ""
