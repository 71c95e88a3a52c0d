"""The crash log at the daemon's start and stop (restore = "auto" with crash_log on).

At start, when no snapshot was restored (a graceful stop's snapshot always wins: the daemon
that wrote it removed its log), the log of the pool whose memory the daemon adopted
(`log_path(shm_dir, adopted_from)`) is replayed into the fresh service
(daemon/service/log_replay.py), then `check_invariants`. A log that does not replay (another
memory, a failed record, memory work in flight at the crash, a failed check) is set aside
(`<name>.refused`, 0600 as it was) with one log line, and the daemon starts cold. A log
replayed or refused is never read again.

Then, with or without a restore, the daemon's own log starts (`log_path(shm_dir, pool_id)`),
its base the state it starts with, and at a clean stop, once the snapshot is written, it is
removed. A state its base cannot keep (a contiguous pool) keeps no log: said in one line.

Bounded in tmpfs: a log whose pool has no pool file in shm_dir any more (its memory was
released: another layout, a cold start) is removed when the next daemon starts its own, and
only the latest refused log is kept aside. Daemons sharing shm_dir keep each other's logs:
their pool files are there (a CPU daemon's; a CUDA daemon removes no other log).
"""

from pathlib import Path

from pagedkv.daemon.memory.kv_memory import KVPoolMemory, pool_file_name
from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.service.crash_log import ASIDE_SUFFIX, LOG_PREFIX, SPARE_SUFFIX, log_path
from pagedkv.daemon.service.log_replay import open_log, replay_log
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.service_image import NotKept
from pagedkv.process.log_setup import get_logger

log = get_logger(__name__)

# What a refused log's name ends with.
REFUSED = ".refused"


def keeps_log(config: DaemonConfig) -> bool:
    return config.restore == "auto" and config.crash_log


async def replay_crash_log(config: DaemonConfig, service: PoolService,
                           memory: KVPoolMemory) -> bool:
    """Replay the adopted pool's crash log into the fresh `service`; whether it did. When it
    did not after touching `service`, the caller must build a new one (logged why)."""
    adopted = memory.arena.adopted_from
    if not keeps_log(config) or not adopted:
        return False
    path = log_path(config.shm_dir, adopted)
    for suffix in (ASIDE_SUFFIX, SPARE_SUFFIX):  # the crashed log's next files: never read
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    if not path.exists():
        log.info("no crash log: starting cold", path=str(path))
        return False
    try:
        calls = await replay_log(service, path, adopted)
        service.check_invariants()
    except (NotKept, AssertionError, KeyError, TypeError, ValueError, OSError) as exc:
        for earlier in config.shm_dir.glob(f"{LOG_PREFIX}*{REFUSED}"):
            earlier.unlink(missing_ok=True)  # one set aside at a time: tmpfs is memory
        aside = path.with_name(path.name + REFUSED)
        path.replace(aside)
        log.warning("crash log refused: starting cold", reason=str(exc), set_aside=str(aside))
        return False
    path.unlink()
    log.warning("restored from the crash log: blocks past each sequence's committed tokens "
                "are not trusted", calls=calls, sessions=len(service.sessions),
                adopted_from=adopted)
    return True


def start_crash_log(config: DaemonConfig, service: PoolService) -> None:
    """Start the daemon's own crash log, its base the state now (before any call)."""
    if not keeps_log(config):
        return
    if config.device == "cpu":  # a CUDA pool has no file naming it in shm_dir
        remove_stale_logs(config.shm_dir, service.pool_id)
    try:
        open_log(service, log_path(config.shm_dir, service.pool_id), config.crash_log_bytes)
    except (NotKept, OSError) as exc:
        log.warning("no crash log: a crash starts cold", reason=str(exc))


def remove_stale_logs(shm_dir: Path, own: str) -> None:
    """Remove the logs of pools with no pool file in `shm_dir` (the daemon's `own` aside)."""
    pools = {match.group(2) for path in shm_dir.iterdir()
             if (match := pool_file_name(path.name))}
    for path in shm_dir.glob(f"{LOG_PREFIX}*"):
        # A log's files aside (its checkpoint's, its spare) go with it; a refused one stays.
        pool_id = path.name.removeprefix(LOG_PREFIX).removesuffix(ASIDE_SUFFIX)
        pool_id = pool_id.removesuffix(SPARE_SUFFIX)
        if pool_id.isalnum() and pool_id != own and pool_id not in pools:
            path.unlink(missing_ok=True)
            log.info("removed a stale crash log", path=str(path))


def end_crash_log(service: PoolService) -> None:
    """A clean stop, its snapshot written: the log goes (the snapshot wins)."""
    if service.calls.log is not None:
        service.calls.log.stop()
