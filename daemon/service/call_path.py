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

Each call runs in its session's model's format (`Formats.fitted`: pages given where it does
not fit, a capped model's cache shed), with the pool counting the blocks of the session's
holder groups (`groups`: its number, its tenant's and its model's), and its tenant's
max_blocks checked inside the transaction.
"""

import asyncio
from collections.abc import Callable, Iterable
from typing import TypeVar

from pagedkv.daemon.core import PoolError
from pagedkv.daemon.service.answer_size import AnswerBudget
from pagedkv.daemon.service.crash_log import CrashLog, Record
from pagedkv.daemon.service.formats import Formats
from pagedkv.daemon.service.holds import NO_HOLD, Hold, apply_hold, check_hold, check_release
from pagedkv.daemon.service.limits import Limits
from pagedkv.daemon.service.memory_order import MemoryOrder, Pending, answer_blocks
from pagedkv.daemon.service.models import Format, Model
from pagedkv.daemon.service.session_ops import BlockMemory, HostMemory, MemoryWork, SessionOps
from pagedkv.daemon.service.sessions import Session, SessionRegistry
from pagedkv.daemon.service.tenants import Tenants, TenantUsage

T = TypeVar("T")


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

    async def change(self, session_id: str,
                     change: Callable[[Session, SessionOps, MemoryWork, AnswerBudget], T],
                     answer: AnswerBudget | None = None, *, commits: bool = False,
                     frees: str = "", hold: Hold = NO_HOLD,
                     record: Callable[[], Record] | None = None) -> T:
        """Run `change` for the session all-or-nothing, with its memory work and its answer's
        budget (`answer`: one shared with other parts of the answer, else a fresh one), under
        the lock; a change that `commits` is refused first if the caller may not commit, one
        that `frees` (the RPC's name) if a runner holds the session (holds.py); once applied,
        the session's hold is set or ended as `hold` asks, and `record` (what replays the
        call) goes to the crash log. Answered once the memory work its answer depends on is
        complete (memory_order.py)."""
        check_hold(hold, self.limits)

        def apply(session: Session) -> tuple[T, Pending]:
            if commits:
                self.tenants.check_commit(session.tenant, session.shared_salt)
            if frees:
                check_release(session, self.sessions.now(), frees)
            work, model = MemoryWork(), self.model_of(session)
            fmt, budget = model.format, answer or self.answer_budget()

            def body() -> T:
                with fmt.hygiene.watch(session, work), fmt.pool.holding(self.groups(session)):
                    result = change(session, fmt.ops, work, budget)
                self.usage.check_blocks(self.tenants.by_name[session.tenant])
                return result
            result = self.formats.fitted(model, work, budget, body)
            apply_hold(session, hold, self.sessions.now())
            self.note(record)
            bs = fmt.pool.block_size
            return result, self.start_work(fmt, work, lambda: answer_blocks(result, bs))
        return await self.arrived(session_id, apply)

    def note(self, record: Callable[[], Record] | None) -> None:
        """Write an applied call's `record` (made only when a crash log is kept) to the crash
        log (under the lock for calls that change the pool)."""
        if self.log is not None and record is not None:
            self.log.write(record(), self.sessions.now())

    async def arrived(self, session_id: str,
                      apply: Callable[[Session], tuple[T, Pending]]) -> T:
        """`apply` the call to the session it names, under the lock (no await inside: the
        change and the start of its memory work are one step), then wait with the lock
        released for the memory work its answer depends on. The lease is renewed on arrival
        and held until the answer (no expiry of a session with a call in flight); refused if
        the session ended while the call waited, or if memory work failed (fail-stop)."""
        session = self.sessions.arrive(session_id)
        try:
            async with self.lock:
                self.sessions.check_live(session)
                self.memory_order.check()
                try:
                    result, pending = apply(session)
                except PoolError:  # refused, nothing changed but the lease's renewal
                    self.note(lambda: ["keep", session_id, [0, False]])
                    raise
            await pending.wait()
            return result
        finally:
            self.sessions.depart(session)

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
