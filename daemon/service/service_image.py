"""The service's state as plain data, for a daemon restart: the models' pools and the
sessions that own their sequences, and back into a fresh service on the same pool memory.

What is kept: every model, its format's pool (`core/pool_image.py`: tables, refcounts, the
prefix cache, the host tier's index, holder figures), whose the cached blocks and host copies
are (private-salt sessions', models'), and which format holds each page (models_image.py);
the host tier's copy rate; and each session whole (its id, number,
client name, tenant, salts, quota, sequences, request ids, figures) with the lease time it had
left: a restored lease runs that long from the restore, so the restart's gap is added to it.
Session ids keep the pool id of the daemon run that issued them: the restored registry holds
them under those ids, so their owners go on naming them, while an id the previous run never
issued, or one of another daemon's pool, is refused exactly as before (sessions.py). New
sessions take numbers past the restored ones. The expired ids remembered, and the expiry
counter, go too.

Runner holds are kept by the runner's process, named by pid and start time (read while the
stopping daemon's pidfd pins it): a runner keeps running through the restart and may still
write the session's blocks, so the restored session stays held for the time its hold had
left, and a lapsed hold's runner is fenced as before. The next daemon takes a pidfd for the pid
and keeps the hold only if that process started at the same time (`RunnerProcesses.adopt`):
a runner that exited, or a pid now another process's, holds nothing. Holds of the daemon's
own code end with it. Take the image while the runners' pidfds are open (before
`PoolService.stop`).

What is not kept, and so makes `service_image` refuse (the daemon then writes no snapshot and
the next one starts cold): a session with a call in flight. (A contiguous pool is never imaged:
the daemon refuses `restore` with it, demo/contiguous/allocator.py's `CANNOT`.)

Restored only onto the memory the image describes: `restore_service` is told which pool the
memory it maps came from (`adopted_from`, the previous run's pool id) and refuses any other;
a host tier's index only onto the host memory adopted from the one the image names (the
service's host memory knows what it was adopted from), never onto new slots, whose bytes are
not the copies the index names. It refuses another tenant numbering too (the pools' holder
groups are by tenant number).
"""

from typing import Any

from pagedkv.daemon.core import PoolError
from pagedkv.daemon.core.pool_image import Image
from pagedkv.daemon.service.models_image import models_image, restore_models
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.sessions import Session

# The Session fields kept as they are (the lease's deadline is kept as what was left of it).
_SESSION_FIELDS = ("session_id", "number", "client_name", "lease_ttl_ms", "max_blocks",
                   "salt", "shared_salt", "tenant", "model", "model_number", "salt_tag",
                   "table_entries", "prefix_cache_queries", "prefix_cache_hits")


class NotKept(Exception):
    """A state the snapshot cannot keep, or an image this service must not take; the
    message says why. Not a PoolError: it never reaches a client (the daemon starts cold)."""


def service_image(service: PoolService, *, calls_in_flight: bool = False) -> Image:
    """`service`'s state as plain data (see the module). NotKept: a state it cannot keep.
    `calls_in_flight`: taken under the pool lock between two calls' changes (a crash log's
    base, crash_log.py), so a session's call in flight is no reason to refuse."""
    now = service.sessions.now()
    sessions = []
    for session in service.sessions:
        if session.in_flight and not calls_in_flight:
            raise NotKept(f"session {session.label} has a call in flight")
        kept: dict[str, Any] = {name: getattr(session, name) for name in _SESSION_FIELDS}
        kept["holds"] = _holds_image(session, now)
        kept["lease_left_s"] = max(0.0, session.deadline - now)
        kept["seq_ids"] = sorted(session.seq_ids)
        kept["request_ids"] = list(session.request_ids.items())
        sessions.append(kept)
    registry = service.sessions
    host = service.calls.host_memory
    return {"pool_id": service.pool_id, "models": models_image(service.formats),
            "host_id": "" if host is None else host.memory_id,
            "host_copy_rate": service.host_copy_rate, "sessions": sessions,
            "tenant_numbers": list(service.calls.tenant_numbers.items()),
            "expired": registry.expired_ids(), "expiries_total": registry.expiries_total,
            "event_seq": service.event_seq}


def restore_service(service: PoolService, image: Image, adopted_from: str) -> None:
    """Put `image` into `service`, fresh (no session, no model but its own), whose pool memory
    is the one pool `adopted_from` named. NotKept: the image is of other pool or host memory,
    another tenant numbering, other models or another pool geometry (what differs is named);
    nothing changed when the memory or the numbering differ, else the caller builds a new
    service."""
    if image["pool_id"] != adopted_from:
        raise NotKept(f"the snapshot is of pool {image['pool_id']}, the memory mapped is "
                      f"{'pool ' + adopted_from if adopted_from else 'new'}")
    host = service.calls.host_memory
    host_from = "" if host is None else host.adopted_from
    if image["host_id"] != host_from:
        raise NotKept(f"the snapshot's host tier is memory {image['host_id'] or 'none'}, the "
                      f"host memory mapped is {'memory ' + host_from if host_from else 'new'}")
    numbers = dict(image["tenant_numbers"])
    if numbers != service.calls.tenant_numbers:
        raise NotKept(f"tenants numbered {numbers} in the snapshot, "
                      f"{service.calls.tenant_numbers} now")
    assert not len(service.sessions), "a snapshot restored into a service with sessions"
    try:
        restore_models(service.formats, image["models"])
    except PoolError as exc:
        raise NotKept(str(exc)) from exc
    service.host_copy_rate = image["host_copy_rate"]
    now = service.sessions.now()
    for kept in image["sessions"]:
        session = Session(**{name: kept[name] for name in _SESSION_FIELDS},
                          deadline=now + kept["lease_left_s"],
                          seq_ids=set(kept["seq_ids"]), request_ids=dict(kept["request_ids"]))
        for pid, start, left_s in kept["holds"]:
            process = service.runner_processes.adopt(pid, start)
            if process is not None:  # else it has exited: it writes nothing more
                session.holds[process] = now + left_s
        service.sessions.readmit(session)
        service.calls.usage.add(session)
    service.sessions.remember_expired(image["expired"], image["expiries_total"])
    service.event_seq = image["event_seq"]
    service.previous_pool_id = adopted_from


def _holds_image(session: Session, now: float) -> list[tuple[int, int, float]]:
    """The session's runner holds as (pid, start time, time left): those of runners still
    running (a lapsed one's too, left 0: its runner is fenced when the blocks are needed).
    The daemon's own code's holds end with the daemon."""
    kept = []
    for process, until in session.holds.items():
        identity = None if process is None else process.identity()
        if identity is not None:
            kept.append((*identity, max(0.0, until - now)))
    return kept
