"""A crash log replayed into a fresh service: the state the crashed daemon's applied calls
left (crash_log.py).

The base image is restored (`service_image.restore_service`, on the memory it names), then each
record is applied through the same service methods, as the same caller, at the time it ran
(the registry's clock set to it) and with the same new session ids, with no memory work (the
bytes are in the adopted memory already). A record that fails on replay means the log does not
describe this state: refused. So is a log whose memory work was not all done at the crash (a
copy's destination, a freed block to zero: their bytes are unknown). Leases and holds then gain
the gap since the last record, as a snapshot's do.

KV events go on from the seq the sink last told the log (each batch's SEQ record, written when
it is numbered, before it may be published), so no seq is used twice. Events numbered after
the last call's record describe a change the log lost (the call in progress at the crash):
subscribers may have them, so the restored daemon's first batch is an AllBlocksCleared on each
model's topic, as it is when the crashed daemon owed one for a dropped batch.

What a crash does not let the daemon trust is left to the runners: every sequence keeps its
blocks, uncommitted ones included, and `committed_tokens` says how far its K/V is certified
(written before its commit). A runner told that the pool was recovered from the crash log
(`PoolInfo.recovered_from_crash_log`) recomputes each sequence past its committed tokens into
the same slots. Uncommitted blocks are never shared, so no other sequence reads them; and
they stay their sequence's, so a surviving runner's forward still writing them at the crash
writes into no one else's blocks.
"""

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedkv.daemon.core import PoolError
from pagedkv.daemon.service.crash_log import (
    DONE,
    SEQ,
    WORK,
    CrashLog,
    NotLogged,
    read_log,
    record_op,
    same_seq_ids,
)
from pagedkv.daemon.service.fence import RunnerProcess
from pagedkv.daemon.service.holds import NO_HOLD, Hold
from pagedkv.daemon.service.models import KvShape
from pagedkv.daemon.service.operations import operation_name
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.service_image import NotKept, restore_service, service_image
from pagedkv.daemon.service.tenants import Caller, calling_as


class _Clock:
    """The time a replayed call ran by."""

    def __init__(self, now: float) -> None:
        # Seconds on the crashed daemon's monotonic clock.
        self.now = now

    def __call__(self) -> float:
        return self.now


def open_log(service: PoolService, path: Path, max_bytes: int) -> CrashLog:
    """Start `service`'s crash log at `path`, its base the state now; NotKept: a state the log
    cannot keep (its base is a restart image)."""
    def image() -> tuple[Any, float]:
        try:
            return service_image(service, calls_in_flight=True), service.sessions.now()
        except NotKept as exc:
            raise NotLogged(str(exc)) from exc
    crash_log = CrashLog(path, max_bytes, image, event_seq=service.event_seq,
                         events_owed=service.events_cleared_at_start)
    try:
        crash_log.start()
    except NotLogged as exc:
        raise NotKept(str(exc)) from exc
    service.calls.log = crash_log
    return crash_log


async def replay_log(service: PoolService, path: Path, adopted_from: str) -> int:
    """Put the state the log at `path` describes into the fresh `service`, whose memory is the
    pool `adopted_from` names; returns how many calls were replayed. NotKept: the log is not
    this memory's, has no base, does not replay, or its copies were not all done."""
    records = read_log(path)
    base = next(records, None)
    if not isinstance(base, dict) or "base" not in base:
        raise NotKept(f"the crash log {path} has no base")
    clock, registry = _Clock(base["time"]), service.sessions
    real_clock = registry.set_clock(clock)
    # Sessions the crashed run opened have its pool id in theirs.
    pool_id, registry.pool_id = registry.pool_id, adopted_from
    memory, service.memory = service.memory, None  # the bytes are in the adopted memory
    try:
        restore_service(service, base["base"], adopted_from)
        working, number = set(base["working"]), 0
        events = _Events(base.get("event_seq", 0), base.get("events_owed", False))
        step_seq_ids: dict[str, list[int]] = {}
        processes: dict[tuple[int, int], RunnerProcess | None] = {}
        for record in records:
            if record[0] in (WORK, DONE):
                (working.add if record[0] == WORK else working.discard)(record[1])
                continue
            if record[0] == SEQ:
                events.numbered(record[1], record[2])
                continue
            events.past_last_call = False
            number += 1
            clock.now = record[1]
            same_seq_ids(step_seq_ids, record, writing=False)
            await _replay(service, record, processes, number)
        if working:
            raise NotKept(f"{len(working)} memory works (copies, zeroing) were in flight at "
                          "the crash: the bytes they write are unknown")
    finally:
        registry.set_clock(real_clock)
        registry.pool_id = pool_id
        service.memory = memory
    _add_gap(service, real_clock() - clock.now)
    service.recovered_from_crash_log = True
    service.event_seq = events.next_seq
    service.events_cleared_at_start = events.owed or events.past_last_call
    return number


class _Events:
    """The KV events' state the log's records leave (module docstring)."""

    def __init__(self, next_seq: int, owed: bool) -> None:
        # The seq of the next batch, and whether an AllBlocksCleared was owed, as last logged.
        self.next_seq = next_seq
        self.owed = owed
        # Whether a batch was numbered after the last call's record (its change is lost).
        self.past_last_call = False

    def numbered(self, next_seq: int, owed: bool) -> None:
        self.next_seq, self.owed, self.past_last_call = next_seq, owed, True


async def _replay(service: PoolService, record: list[Any],
                  processes: dict[tuple[int, int], RunnerProcess | None], number: int) -> None:
    """Apply one record as its caller; NotKept naming it when it fails."""
    kind, _time, caller, *args = record
    process = None
    if caller is not None and caller[2] is not None:
        identity = (caller[2][0], caller[2][1])
        if identity not in processes:
            processes[identity] = service.runner_processes.adopt(*identity)
        process = processes[identity]
    try:
        with _calling(service, caller, process):
            await _apply(service, kind, args, process is not None)
    except (PoolError, KeyError, TypeError, ValueError) as exc:
        raise NotKept(f"crash log record {number} ({kind}) does not replay: {exc}") from exc


@contextlib.contextmanager
def _calling(service: PoolService, caller: list[Any] | None,
             process: RunnerProcess | None) -> Iterator[None]:
    if caller is None:  # the daemon's own code
        yield
        return
    tenant, runner, _identity = caller
    with calling_as(Caller(service.tenants.by_name[tenant], runner, process)):
        yield


async def _apply(service: PoolService, kind: str, args: list[Any], holder: bool) -> None:
    """One call as the service method takes it. A hold of a runner that has exited is not
    replayed: it writes nothing more (as a snapshot's restore drops it)."""
    def hold(fields: list[Any]) -> Hold:
        return Hold(fields[0], fields[1]) if holder else NO_HOLD
    if kind == "open":
        *opened, secret = args
        service.sessions.new_secret = lambda: secret
        service.open_session(*opened)
    elif kind == "keep":
        service.keep_alive(args[0], hold(args[1]))
    elif kind == "op":
        op = record_op(args[1])
        await getattr(service, operation_name(op))(args[0], op)
    elif kind == "batch":
        await service.batch(args[0], [record_op(op) for op in args[1]], hold(args[2]))
    elif kind == "step":
        session_id, seq_ids, num_tokens, token_ids, commit, hold_ms, reserve = args
        await service.step(session_id, seq_ids, num_tokens, token_ids, commit=commit,
                           hold_ms=hold_ms if holder else 0, reserve_tokens=reserve)
    elif kind == "tables":
        await service.block_tables(args[0], args[1], hold_ms=args[2] if holder else 0)
    elif kind == "close":
        await service.close_session(args[0])
    elif kind == "expire":
        await service.life.expire(args[0])
    elif kind == "register":
        service.register_model(args[0], KvShape(*args[1]), args[2])
    elif kind == "model_state":
        await service.set_model_state(args[0], args[1])
    else:
        raise ValueError(f"unknown record kind {kind!r}")


def _add_gap(service: PoolService, gap: float) -> None:
    """Leases and holds run on from the restore for the time they had left at the crash."""
    for session in service.sessions:
        session.deadline += gap
        for process in session.holds:
            session.holds[process] += gap
