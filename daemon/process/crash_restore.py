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
"""

from pagedkv.daemon.memory.kv_memory import KVPoolMemory
from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.service.crash_log import log_path
from pagedkv.daemon.service.log_replay import open_log, replay_log
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.service_image import NotKept
from pagedkv.process.log_setup import get_logger

log = get_logger(__name__)


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
    if not path.exists():
        log.info("no crash log: starting cold", path=str(path))
        return False
    try:
        calls = await replay_log(service, path, adopted)
        service.check_invariants()
    except (NotKept, AssertionError, KeyError, TypeError, ValueError, OSError) as exc:
        aside = path.with_name(path.name + ".refused")
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
    try:
        open_log(service, log_path(config.shm_dir, service.pool_id), config.crash_log_bytes)
    except (NotKept, OSError) as exc:
        log.warning("no crash log: a crash starts cold", reason=str(exc))


def end_crash_log(service: PoolService) -> None:
    """A clean stop, its snapshot written: the log goes (the snapshot wins)."""
    if service.calls.log is not None:
        service.calls.log.stop()
