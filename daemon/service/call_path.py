"""How a change reaches the pool: one call at a time, all-or-nothing, its memory work after.

Pool state changes are serialized by one lock and made all-or-nothing by the pool's undo
journal (the session's bookkeeping records its undo there too). A call holds the lock only
while it applies its change and starts the memory work it owes (copy-on-write copies,
zeroing), with no await in between; the work runs on worker threads after the lock is
released, ordered with other calls' work by the blocks it touches (`memory_order.py`), and the
answer leaves only once that work, and earlier work on the blocks the answer hands out, is
complete and synchronized (CUDA): a runner that reads the answer's blocks sees their data, and
a call that touches no block with work in flight waits for no one's copies. The change cannot
be undone once the lock is released, so memory work that fails stops the pool (fail-stop: that
call and every later one get INTERNAL). Calls that do not touch the pool (KeepAlive,
OpenSession) never wait for the lock, and a call renews its session's lease when it arrives
(see `sessions.py`), so one client's slow step cannot expire another's session.

A call reads top to bottom as one context (`CallPath.call`):

    async with calls.call(session_id, hold=..., commits=..., frees=..., record=...) as call:
        result = call.fit(lambda: call.ops.step(call.session, ..., call.work, call.budget))

Entering it renews the lease, takes the lock and makes the call's checks (the session live, no
memory work failed, the caller may commit or free); `call.fit` applies the change all-or-nothing
in the session's model's format (`Formats.fitted`: pages given where it does not fit, a capped
model's cache shed, so the change is a function it may try again), with the pool counting the
blocks of the session's holder groups (`groups`: its number, its tenant's and its model's) and
the tenant's max_blocks checked inside the transaction. Leaving it sets or ends the hold, writes
the crash log's record, starts the memory work, releases the lock and waits for the work the
answer depends on. A call refused with a `PoolError` changed nothing but its lease: the crash
log gets a KeepAlive's record.
"""

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedkv.daemon.core import PoolError
from pagedkv.daemon.service.answer_size import AnswerBudget
from pagedkv.daemon.service.crash_log import CrashLog, Record
from pagedkv.daemon.service.formats import Formats
from pagedkv.daemon.service.holds import NO_HOLD, Hold, apply_hold, check_hold, check_release
from pagedkv.daemon.service.limits import Limits
from pagedkv.daemon.service.memory_order import (
    BlockMemory,
    HostMemory,
    MemoryOrder,
    MemoryWork,
    Pending,
    answer_blocks,
)
from pagedkv.daemon.service.models import Format, Model
from pagedkv.daemon.service.session_ops import SessionOps
from pagedkv.daemon.service.sessions import Session, SessionRegistry
from pagedkv.daemon.service.tenants import Tenants, TenantUsage

T = TypeVar("T")


@dataclass(slots=True)
class Call:
    """One call of one session, inside `CallPath.call`: what its change works on, and what it
    answers."""

    # The session the call names: live, its lease renewed until the call is answered.
    session: Session
    # The operations of the session's model's format on its pool.
    ops: SessionOps
    # The copies and zeroing the change owes pool memory, started once it is applied.
    work: MemoryWork
    # The answer's budget, charged before the pool does the work (answer_size.py).
    budget: AnswerBudget
    # The session's model, whose format the change is fitted into.
    model: Model
    # The call path, whose formats fit the change and whose tenants' max_blocks bound it.
    path: "CallPath"
    # What `fit` returned: the blocks it hands out wait for earlier memory work (None: none).
    answer: Any = None

    def fit(self, change: Callable[[], T]) -> T:
        """Apply `change` all-or-nothing in the session's format, tried again with pages given
        or the model's cache shed where it does not fit (formats.py); its result is the
        call's answer."""
        result = self.path.formats.fitted(self.model, self.work, self.budget,
                                          lambda: self._applied(change))
        self.answer = result
        return result

    def _applied(self, change: Callable[[], T]) -> T:
        """One try of `change`, inside its format's transaction: cache events heard, new
        sequences counted in the session's groups, the tenant's max_blocks checked."""
        fmt, path = self.model.format, self.path
        with fmt.hygiene.watch(self.session, self.work), fmt.pool.holding(
                path.groups(self.session)):
            result = change()
        path.usage.check_blocks(path.tenants.by_name[self.session.tenant])
        return result


class CallPath:
    """The lock, the transaction and the memory work around every change of the pool (see
    the module docstring)."""

    def __init__(self, sessions: SessionRegistry, formats: Formats, tenants: Tenants,
                 usage: TenantUsage, limits: Limits, memory: BlockMemory | None) -> None:
        # The service's records a change reads and keeps in step (PoolService's own).
        self.sessions = sessions
        self.formats = formats
        self.tenants = tenants
        self.usage = usage
        self.limits = limits
        # Format 0's memory, where its calls' memory work runs (tests may swap in a wrapper),
        # and its host tier's (None: it has none).
        self.memory = memory
        self.host_memory: HostMemory | None = None
        # Tenant name -> its holder group number in every format's pool.
        self.tenant_numbers = {name: i for i, name in enumerate(tenants.by_name)}
        # Serializes every change of pool state: held while a call applies its change and
        # starts its memory work, never while the work runs.
        self.lock = asyncio.Lock()
        # Memory work off the event loop, ordered per block; fail-stop (memory_order.py).
        self.memory_order = MemoryOrder()
        # The crash log every applied change is written to (crash_log.py); None: not kept.
        self.log: CrashLog | None = None

    def model_of(self, session: Session) -> Model:
        return self.formats.models.get(session.model)

    def groups(self, session: Session) -> tuple[int, int, int]:
        """The pool's groups of a session's sequences: by session, by tenant, by model."""
        return session.number, self.tenant_numbers[session.tenant], session.model_number

    def tenant_blocks(self, tenant: str) -> int:
        """Blocks the tenant's sessions hold over every format, from the pools' group counts."""
        number = self.tenant_numbers[tenant]
        return sum(fmt.pool.blocks_held(1, number) for fmt in self.formats.models.formats)

    def answer_budget(self) -> AnswerBudget:
        """A fresh budget of max_answer_bytes for one call's answer."""
        models = self.formats.models
        return AnswerBudget.for_pool(self.limits.max_answer_bytes, models.max_num_blocks,
                                     models.formats[0].pool.block_size)

    @asynccontextmanager
    async def call(self, session_id: str, answer: AnswerBudget | None = None, *,
                   commits: bool = False, frees: str = "", hold: Hold = NO_HOLD,
                   record: Callable[[], Record] | None = None) -> AsyncIterator[Call]:
        """One call of the session, under the lock (see the module docstring); no await inside
        (the change and the start of its memory work are one step). `answer`: a budget shared
        with other parts of the answer, else a fresh one. A call that `commits` is refused
        first if the caller may not commit, one that `frees` (the RPC's name) if a runner holds
        the session (holds.py); once applied, the session's hold is set or ended as `hold`
        asks, and `record` (what replays the call) goes to the crash log. Answered once the
        memory work its answer depends on is complete (memory_order.py). The lease is renewed
        on arrival and held until the answer (no expiry of a session with a call in flight);
        refused if the session ended while the call waited, or if memory work failed."""
        check_hold(hold, self.limits)
        session = self.sessions.arrive(session_id)
        try:
            async with self.lock:
                self.sessions.check_live(session)
                self.memory_order.check()
                try:
                    call = self._opened(session, answer, commits, frees)
                    yield call
                    apply_hold(session, hold, self.sessions.now())
                    self.note(record)
                    pending = self._start_answered(call)
                except PoolError:  # refused, nothing changed but the lease's renewal
                    self.note(lambda: ["keep", session_id, [0, False]])
                    raise
            await pending.wait()
        finally:
            self.sessions.depart(session)

    def _opened(self, session: Session, answer: AnswerBudget | None, commits: bool,
                frees: str) -> Call:
        """The call's checks of its caller, then what its change works on."""
        if commits:
            self.tenants.check_commit(session.tenant, session.shared_salt)
        if frees:
            check_release(session, self.sessions.now(), frees)
        return Call(session, self.model_of(session).format.ops, MemoryWork(),
                    answer or self.answer_budget(), self.model_of(session), self)

    def _start_answered(self, call: Call) -> Pending:
        """Start an applied call's memory work; its answer waits for that, and for earlier
        work on the blocks it hands out."""
        fmt = call.model.format
        return self.start_work(fmt, call.work,
                               lambda: answer_blocks(call.answer, fmt.pool.block_size))

    def note(self, record: Callable[[], Record] | None) -> None:
        """Write an applied call's `record` (made only when a crash log is kept) to the crash
        log (under the lock for calls that change the pool)."""
        if self.log is not None and record is not None:
            self.log.write(record(), self.sessions.now())

    def start_work(self, fmt: Format, work: MemoryWork,
                   blocks: Callable[[], Iterable[int]]) -> Pending:
        """Start the memory work of a call on `fmt` (in its view, ordered by page); format 0's
        is `self.memory`, which tests may swap for a wrapper."""
        if fmt.number:
            pending = self.memory_order.start(fmt.memory, work, blocks, fmt.blocks_per_page)
        else:
            pending = self.memory_order.start(self.memory, work, blocks, fmt.blocks_per_page,
                                              self.host_memory)
        if self.log is not None and work.steps and pending.works:
            self.log.started(pending.works[-1])  # its own work is the last one
        return pending
