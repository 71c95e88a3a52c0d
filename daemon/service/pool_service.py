"""The pool service: sessions, leases, quotas and tenancy around the block pool.

Every sequence belongs to a session, and the pool keys it `(session number, seq_id)`, so one
session can neither see, extend nor free another's sequences: a seq id of another session is
simply unknown (NOT_FOUND, never "exists elsewhere"). Sessions share prefix-cache blocks only
when they opened with the same non-empty `cache_salt`; by default each session gets a salt of
its own, so sharing is opt-in.

Quota. `max_blocks` (the daemon's `max_blocks_per_session` unless the client asked for less)
bounds the block-table entries over the session's sequences, those a Step reserved ahead
included (reserve_tokens): a block shared by two of its sequences counts twice, a prefix
block shared with another session counts for each. It is thus an upper bound on the
physical blocks the session pins, and it is exact, cheap and independent of what other
sessions do. In a contiguous pool each sequence counts
its whole reservation instead (the pool's `quota_blocks`), which is what it pins. The check
runs before the pool is touched, so a refused call changes nothing.

Block reuse across tenants. A block released by one session may be handed to another with the
old K/V still in it. That is safe without zeroing: the API returns block ids and slots, never
contents; the attention kernels mask every slot past a sequence's length, so stale slots are
never read; and only runners map the pool memory (its handle goes to the runner socket alone,
its file is the daemon's user's and runner_group's: tenants.py). For defense in
depth, `zero_freed_blocks=True` zeroes every block the pool releases with no cached content
(pending blocks included) and every cached block evicted for a new owner. Committed blocks
kept in the prefix cache keep their content on purpose (that is the cache), except that a
session with a private salt drops (and, with zeroing, zeroes) what it left cached when it
ends, since no one else could hit it (`cache_hygiene.py`).

Tenants. Every session belongs to the tenant of the call that opened it (`tenants.py`): the
tenant's cache salts decide the session's namespace, its max_sessions is checked at open, and
its max_blocks (block-table entries over all its sessions, the session quota's measure) after
every change, inside the change's transaction, so a call that would exceed it is undone. A call
that commits (Commit, a Batch with a commit op, a Step with commit) is checked before its
transaction opens: under a salt other tenants share, only a runner or a certifying tenant may
commit (`Tenants.check_commit`).

Runner holds. A runner's call may hold the session while its forward writes the blocks the
call answered (`holds.py`): a Free, CloseSession or Batch free of another caller is then refused
under the lock, before the transaction opens, and the reaper leaves a held session alone.

Stats. GetStats shows any caller the pool's capacity (`capacity`: num_blocks, block_size,
free_blocks) and nothing of other sessions' activity; per-session figures only for the
caller's own session (session ids are credentials, so no RPC lists other sessions). Operators
get every figure from the metrics endpoint.

Models. The pool serves several models (kvpool.proto, "Models and pages"): each session names
one, and its calls run in that model's format (`formats.py`: one block pool per geometry over
the pages it holds, pages moved between formats when a call does not fit; per-model caps).
Pool keys stay (session number, seq_id) in the format's pool; the session's holder groups
are its number, its tenant's and its model's. A model's sleep closes its sessions and drops
its cached blocks (`set_model_state`).

Bounds. Every answer is bounded before it is built: each call carries an `AnswerBudget` that
the call's parts are charged to before the pool does the work (see `answer_size.py`), so a
request that would produce an answer over `max_answer_bytes` is refused with nothing changed.

Concurrency and memory. Pool state changes are serialized by one lock and made all-or-nothing
by the pool's undo journal (the session's bookkeeping records its undo there too). A call holds
the lock only while it applies its change and starts the memory work it owes (copy-on-write
copies, zeroing), with no await in between; the work runs on worker threads after the lock is
released, ordered with other calls' work by the blocks it touches (`memory_order.py`), and the
answer leaves only once that work, and earlier work on the blocks the answer hands out, is
complete and synchronized (CUDA): a runner that reads the answer's blocks sees their data, and
a call that touches no block with work in flight waits for no one's copies. The change cannot
be undone once the lock is released, so memory work that fails stops the pool (fail-stop: that
call and every later one get INTERNAL). Calls that do not touch the pool (KeepAlive,
OpenSession) never wait for the lock, and a call renews its session's lease when it arrives
(see `sessions.py`), so one client's slow step cannot expire another's session.
"""

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from pagedkv.daemon.core import (
    BatchAppend,
    InvalidArgument,
    PoolAllocator,
    PoolError,
    PoolStats,
    PrefixHash,
    SeqUpdate,
)
from pagedkv.daemon.service.answer_size import AnswerBudget
from pagedkv.daemon.service.call_work import check_work, op_work, step_work
from pagedkv.daemon.service.formats import Formats
from pagedkv.daemon.service.holds import (
    NO_HOLD,
    Hold,
    SessionBusy,
    apply_hold,
    check_hold,
    check_release,
)
from pagedkv.daemon.service.limits import Limits
from pagedkv.daemon.service.memory_order import MemoryOrder, Pending, answer_blocks
from pagedkv.daemon.service.models import (
    DEFAULT_MAX_MODELS,
    Format,
    KvShape,
    Model,
    ModelAsleep,
    ModelFigures,
    ModelPolicy,
)
from pagedkv.daemon.service.operations import (
    Allocate,
    Append,
    Commit,
    CopyOnWrite,
    Fork,
    Free,
    Operation,
    operation_name,
)
from pagedkv.daemon.service.request_budget import RequestBudget
from pagedkv.daemon.service.session_ops import BlockMemory, MemoryWork, PoolFull, SessionOps
from pagedkv.daemon.service.sessions import Session, SessionRegistry, SessionStats
from pagedkv.daemon.service.tenants import TenantFigures, Tenants, TenantUsage, trusted_caller
from pagedkv.process.log_setup import get_logger
from pagedkv.vocab.geometry import ModelGeometry

log = get_logger(__name__)

# How often the reaper looks for lapsed leases: a session is freed within this of its expiry.
REAP_INTERVAL_S = 0.1

T = TypeVar("T")


class PoolService:
    """Session-scoped operations on one block pool and its memory; the servicer's domain."""

    def __init__(self, pool: PoolAllocator, memory: BlockMemory | None, *, pool_id: str,
                 default_lease_ttl_ms: int = 10_000, max_lease_ttl_ms: int = 600_000,
                 geometry: ModelGeometry | None = None, zero_freed_blocks: bool = False,
                 limits: Limits | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 tenants: Tenants | None = None, page_bytes: int = 0,
                 model_policies: dict[str, ModelPolicy] | None = None,
                 max_models: int = DEFAULT_MAX_MODELS,
                 prefix_hash: PrefixHash = "sha256") -> None:
        self.pool = pool
        self.memory = memory
        self.pool_id = pool_id
        self.geometry = geometry
        self.limits = limits or Limits()
        self.sessions = SessionRegistry(pool_id, default_lease_ttl_ms=default_lease_ttl_ms,
                                        max_lease_ttl_ms=max_lease_ttl_ms, limits=self.limits,
                                        clock=clock)
        # Who may call, and each tenant's limits and live sessions.
        self.tenants = tenants or Tenants.single(None)
        # The pool counts the blocks each session, each tenant and each model holds
        # (`_groups`), so GetStats and /metrics cost O(sessions), not O(table entries).
        self._tenant_number = {name: i for i, name in enumerate(self.tenants.by_name)}
        # The models, their formats and pages (formats.py); the daemon's own is format 0.
        self.formats = Formats(pool, memory, geometry, limits=self.limits,
                               zero_blocks=zero_freed_blocks, prefix_hash=prefix_hash,
                               page_bytes=page_bytes, policies=model_policies or {},
                               max_models=max_models)
        self.models = self.formats.models
        self._usage = TenantUsage()
        # Serializes every change of pool state: held while a call applies its change and
        # starts its memory work, never while the work runs.
        self._lock = asyncio.Lock()
        # The wire bytes of large requests parsed and not yet answered (the interceptor admits
        # each before parsing it): what calls queued for the lock may hold.
        self.requests = RequestBudget(self.limits.max_queued_request_bytes)
        # Memory work off the event loop, ordered per block; fail-stop (memory_order.py).
        self.memory_order = MemoryOrder()
        self._reaper: asyncio.Task[None] | None = None

    # --------------------------------------------------------------- formats

    def model_of(self, session: Session) -> Model:
        return self.models.get(session.model)

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the lease reaper (idempotent)."""
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever(), name="pagedkv-lease-reaper")

    async def stop(self) -> None:
        """Stop the lease reaper and, once their work is done, the memory workers; sessions
        stay as they are."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        await self.memory_order.close()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            await self.expire_due()

    async def expire_due(self) -> int:
        """Expire every session past its lease with no call in flight; returns how many."""
        expired = 0
        if self.memory_order.failure is not None:
            return 0  # fail-stop: the pool changes no more
        for session in self.sessions.due():
            try:
                async with self._lock:
                    if session not in self.sessions or not self.sessions.is_due(session):
                        continue  # a call or a hold arrived, or it closed, while we waited
                    freed, pending = self._drop_session(session, expired=True)
                await pending.wait()
            except Exception:  # the reaper must outlive any failure of one expiry
                log.exception("lease expiry failed", session=session.label)
                continue
            expired += 1
            log.info("session expired", session=session.label, freed_sequences=freed,
                     lease_ttl_ms=session.lease_ttl_ms)
        return expired

    def _drop_session(self, session: Session, *, expired: bool) -> tuple[int, Pending]:
        """Remove a session and free its sequences, all-or-nothing; returns how many, and the
        memory work to wait for (zeroing). The caller holds the lock."""
        self.memory_order.check()
        work = MemoryWork()
        count = len(session.seq_ids)
        fmt = self.model_of(session).format
        with fmt.pool.transaction() as journal:
            self.sessions.remove(session, expired=expired)
            journal.record(self.sessions.reinstate, session, expired)
            self._usage.remove(session)
            journal.record(self._usage.add, session)
            with fmt.hygiene.watch(session, work):
                for seq_id in list(session.seq_ids):
                    fmt.ops.free(session, seq_id, work)
            fmt.hygiene.session_ended(session, work)
        return count, self._start_work(fmt, work, tuple)

    def _start_work(self, fmt: Format, work: MemoryWork,
                    blocks: Callable[[], Iterable[int]]) -> Pending:
        """Start the memory work of a call on `fmt` (in its view, ordered by page); format 0's
        is `self.memory`, which tests may swap for a wrapper."""
        memory = self.memory if fmt.number == 0 else fmt.memory
        return self.memory_order.start(memory, work, blocks, fmt.blocks_per_page)

    async def _change(self, session_id: str,
                      change: Callable[[Session, SessionOps, MemoryWork, AnswerBudget], T],
                      answer: AnswerBudget | None = None, *, commits: bool = False,
                      frees: str = "", hold: Hold = NO_HOLD) -> T:
        """Run `change` for the session all-or-nothing, with its memory work and its answer's
        budget (`answer`: one shared with other parts of the answer, else a fresh one), under
        the lock; a change that `commits` is refused first if the caller may not commit, one
        that `frees` (the RPC's name) if a runner holds the session (holds.py); once applied,
        the session's hold is set or ended as `hold` asks. Answered once the memory work its
        answer depends on is complete (memory_order.py)."""
        check_hold(hold, self.limits)

        def apply(session: Session) -> tuple[T, Pending]:
            if commits:
                self.tenants.check_commit(session.tenant, session.shared_salt)
            if frees:
                check_release(session, self.sessions.now(), frees)
            work, model = MemoryWork(), self.model_of(session)
            fmt, budget = model.format, answer or self.answer_budget()

            def body() -> T:
                with fmt.hygiene.watch(session, work), fmt.pool.holding(self._groups(session)):
                    result = change(session, fmt.ops, work, budget)
                self._usage.check_blocks(self.tenants.by_name[session.tenant])
                return result
            result = self.formats.fitted(model, work, budget, body)
            apply_hold(session, hold, self.sessions.now())
            bs = self.pool.block_size
            return result, self._start_work(model.format, work,
                                             lambda: answer_blocks(result, bs))
        return await self._arrived(session_id, apply)

    async def _arrived(self, session_id: str,
                       apply: Callable[[Session], tuple[T, Pending]]) -> T:
        """`apply` the call to the session it names, under the lock (no await inside: the
        change and the start of its memory work are one step), then wait with the lock
        released for the memory work its answer depends on. The lease is renewed on arrival
        and held until the answer (no expiry of a session with a call in flight); refused if
        the session ended while the call waited, or if memory work failed (fail-stop)."""
        session = self.sessions.arrive(session_id)
        try:
            async with self._lock:
                self.sessions.check_live(session)
                self.memory_order.check()
                result, pending = apply(session)
            await pending.wait()
            return result
        finally:
            self.sessions.depart(session)

    def answer_budget(self) -> AnswerBudget:
        """A fresh budget of max_answer_bytes for one call's answer."""
        return AnswerBudget.for_pool(self.limits.max_answer_bytes, self.models.max_num_blocks,
                                     self.pool.block_size)

    # -------------------------------------------------------------- sessions

    def open_session(self, client_name: str, lease_ttl_ms: int = 0, max_blocks: int = 0,
                     cache_salt: bytes = b"", model: str = "") -> Session:
        """A session of the calling tenant (checked: its max_sessions and salts) and of
        `model` ("" = the daemon's own; ModelNotFound, ModelAsleep)."""
        tenant = self.tenants.caller_tenant()
        self._usage.check_open(tenant)
        known = self.models.get(model)
        if known.asleep:
            raise ModelAsleep(f"model {known.name!r} is asleep: wake it first "
                              f"(pagedkv model wake {known.name})")
        session = self.sessions.open(client_name, lease_ttl_ms, max_blocks,
                                     tenant.cache_salt(cache_salt), tenant=tenant.name,
                                     shared_salt=tenant.shared_salt(cache_salt),
                                     model=(known.name, known.number, known.salt_tag))
        self._usage.add(session)
        log.info("session opened", session=session.label, lease_ttl_ms=session.lease_ttl_ms,
                 max_blocks=session.max_blocks, shared_cache=bool(cache_salt),
                 tenant=tenant.name)
        return session

    def keep_alive(self, session_id: str, hold: Hold = NO_HOLD) -> int:
        """Renew the lease (every call does), and set or end a runner's hold as `hold` asks;
        returns the lease in ms."""
        check_hold(hold, self.limits)
        session = self.sessions.get(session_id)
        apply_hold(session, hold, self.sessions.now())
        return session.lease_ttl_ms

    async def close_session(self, session_id: str) -> int:
        """Close a session and free its sequences; returns how many were freed."""
        def close(session: Session) -> tuple[int, Pending]:
            check_release(session, self.sessions.now(), "CloseSession")
            freed, pending = self._drop_session(session, expired=False)
            log.info("session closed", session=session.label, freed_sequences=freed)
            return freed, pending
        return await self._arrived(session_id, close)

    # ---------------------------------------------------------------- models

    def register_model(self, name: str, shape: KvShape, runner_target: str = "") -> Model:
        """Register a runner's model (models.py: idempotent for the same geometry). A new
        geometry needs a paged pool and, with memory, per-format views of it."""
        model = self.formats.register(name, shape, runner_target)
        log.info("model registered", model=name, format=model.format.shape.label,
                 runner_target=runner_target)
        return model

    async def set_model_state(self, name: str, asleep: bool) -> Model:
        """Wake a model, or put it to sleep: refused (SessionBusy) while a runner holds one of
        its sessions, else its sessions are closed (their sequences freed, as an expiry does;
        their clients then get NOT_FOUND), its cached blocks dropped, and new sessions of it
        refused until it is woken. Answered once the memory work (zeroing) is done."""
        model = self.models.get(name)
        if not asleep:
            model.asleep = False
            log.info("model woken", model=model.name)
            return model
        async with self._lock:
            self.memory_order.check()
            mine = [s for s in self.sessions if s.model == model.name]
            now = self.sessions.now()
            for session in mine:
                if now < session.hold_until:
                    raise SessionBusy(f"SetModelState refused: a runner holds session "
                                      f"{session.label} of model {model.name!r} for "
                                      f"{max(1, round((session.hold_until - now) * 1000))} ms "
                                      "more; stop its runner's steps, then retry")
            pending = [self._drop_session(session, expired=False)[1] for session in mine]
            fmt, work = model.format, MemoryWork()
            dropped = fmt.hygiene.drop(fmt.hygiene.cached.blocks_of(model.number), work)
            pending.append(self._start_work(fmt, work, tuple))
            model.asleep = True
        for done in pending:
            await done.wait()
        log.info("model asleep", model=model.name, closed_sessions=len(mine),
                 dropped_cached_blocks=len(dropped))
        return model

    @property
    def page_moves_total(self) -> int:
        """Pages given to another format so far."""
        return self.formats.pages.moves_total

    def model_figures(self) -> list[ModelFigures]:
        """Every model's figures now (O(models))."""
        return self.formats.figures()

    # ------------------------------------------------------------ operations

    async def allocate(self, session_id: str, op: Allocate) -> SeqUpdate:
        return await self._single(session_id, op)

    async def append(self, session_id: str, op: Append) -> SeqUpdate:
        return await self._single(session_id, op)

    async def fork(self, session_id: str, op: Fork) -> SeqUpdate:
        return await self._single(session_id, op)

    async def copy_on_write(self, session_id: str, op: CopyOnWrite) -> SeqUpdate:
        return await self._single(session_id, op)

    async def commit(self, session_id: str, op: Commit) -> int:
        """Certify K/V written; returns how many blocks became shareable."""
        check_work(self.limits, op_work(op, self.pool.block_size), "Commit")
        return await self._change(session_id, lambda session, ops, _work, _answer: ops.commit(
            session, op.seq_ids, op.num_tokens), commits=True)

    async def free(self, session_id: str, op: Free) -> int:
        """Drop a sequence; returns how many blocks went back to the pool."""
        return await self._change(session_id, lambda session, ops, work, _answer: ops.free(
            session, op.seq_id, work), frees="Free")

    async def _single(self, session_id: str, op: Operation) -> SeqUpdate:
        check_work(self.limits, op_work(op, self.pool.block_size), operation_name(op))
        return await self._change(session_id, lambda session, ops, work, answer: ops.apply(
            session, op, work, answer))

    async def batch(self, session_id: str, ops: Sequence[Operation],
                    hold: Hold = NO_HOLD) -> list[SeqUpdate]:
        """Apply ops in order, all-or-nothing; one result per op (an empty table for a free
        or a commit). `hold`: a runner's, set or ended once the batch is applied."""
        if not ops:
            raise InvalidArgument("a batch needs at least one op")
        self.check_batch_ops(len(ops))
        check_work(self.limits, (op_work(op, self.pool.block_size) for op in ops), "Batch")
        return await self._change(session_id, lambda session, books, work, answer: [
            self._apply_numbered(session, books, index, op, work, answer)
            for index, op in enumerate(ops)], commits=any(isinstance(op, Commit) for op in ops),
            frees="Batch" if any(isinstance(op, Free) for op in ops) else "", hold=hold)

    def check_batch_ops(self, count: int) -> None:
        """Refuse a Batch of more than max_batch_ops ops; the servicer asks before it
        translates a single op, so an oversized batch costs no translation."""
        self.limits.check_count("ops", count, "max_batch_ops")

    @staticmethod
    def _apply_numbered(session: Session, ops: SessionOps, index: int, op: Operation,
                        work: MemoryWork, answer: AnswerBudget) -> SeqUpdate:
        """Apply one op of a batch; an error says which op failed."""
        try:
            return ops.apply(session, op, work, answer)
        except PoolFull as exc:
            raise PoolFull(f"op {index} ({operation_name(op)}): {exc}", exc.needed,
                           exc.available) from exc
        except PoolError as exc:
            raise type(exc)(f"op {index} ({operation_name(op)}): {exc}") from exc

    async def step(self, session_id: str, seq_ids: Sequence[int], num_tokens: int = 1,
                   token_ids: Sequence[int] = (), *, commit: bool = False,
                   answer: AnswerBudget | None = None, hold_ms: int = 0,
                   reserve_tokens: int = 0) -> BatchAppend:
        """Append num_tokens tokens to each of many sequences at once, all-or-nothing; with
        `commit`, their pending blocks are committed first. `answer`: a StepMany's budget
        (`step_many_budget`), which a failed step gives its charges back to, else its own.
        `hold_ms`: a runner's hold, set once the step is applied (its forward writes the slots
        answered). `reserve_tokens`: slots each table then covers past the tokens (at most
        max_reserve_tokens; kvpool.proto's StepRequest.reserve_tokens)."""
        self.limits.check_count("reserve_tokens (slots reserved per sequence)", reserve_tokens,
                                "max_reserve_tokens")
        check_work(self.limits, step_work(len(seq_ids), num_tokens + reserve_tokens,
                                          self.pool.block_size), "Step")
        answer = answer or self.answer_budget()
        with answer.part():
            return await self._change(session_id, lambda session, ops, work, budget: ops.step(
                session, seq_ids, num_tokens, token_ids, work, budget, commit, reserve_tokens),
                answer,
                commits=commit, hold=Hold(hold_ms))

    def step_many_budget(self, entries: int) -> AnswerBudget:
        """The answer budget a StepMany of `entries` Steps shares, their envelopes charged:
        the call is refused as a whole, before any entry is applied, past max_steps_per_call
        or when the envelopes alone pass max_answer_bytes. Each entry then runs as `step` with
        this budget: it holds the pool alone, and fails alone (one past max_call_work too)."""
        self.limits.check_count("steps", entries, "max_steps_per_call")
        answer = self.answer_budget()
        answer.step_many(entries)
        return answer

    # --------------------------------------------------------------- queries

    async def block_tables(self, session_id: str, seq_ids: Sequence[int],
                           with_token_ids: bool = False, hold_ms: int = 0) -> list[SeqUpdate]:
        """Each sequence's table, length and committed (K/V written) tokens, in request order,
        and `with_token_ids` every token id it holds (what a runner checks a client's history
        against); refused before any table is built if the answer would pass
        max_answer_bytes. `hold_ms`: a runner's hold, set once the tables are read."""
        if not seq_ids:
            raise InvalidArgument("no seq_ids given")
        self.models.own.format.ops.check_seq_ids(seq_ids)
        check_work(self.limits, len(seq_ids), "GetBlockTables")

        def tables(session: Session, ops: SessionOps, _: MemoryWork,
                   answer: AnswerBudget) -> list[SeqUpdate]:
            keys, pool = ops.own_all(session, seq_ids), ops.pool
            for key in keys:
                n = pool.num_tokens(key)
                answer.sequence("GetBlockTables", pool.table_length(key),
                                token_ids=n if with_token_ids else 0)
            return [SeqUpdate(pool.block_table(k), pool.num_tokens(k), pool.committed_tokens(k),
                              token_ids=(pool.token_ids(k) or []) if with_token_ids
                              else None) for k in keys]
        return await self._change(session_id, tables, hold=Hold(hold_ms))

    def pool_stats(self) -> PoolStats:
        """Every pool-wide figure: for the metrics endpoint (operators), not for clients."""
        return self.pool.stats()

    def shows_memory(self) -> bool:
        """Whether the caller gets the pool memory's attach instructions (GetPoolInfo): they
        map every tenant's K/V, so runners (the runner socket) alone do."""
        return trusted_caller()

    def capacity(self) -> tuple[int, int, int]:
        """What any client may see of the pool: num_blocks, block_size, free_blocks."""
        return self.pool.num_blocks, self.pool.block_size, self.free_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation could take now (capacity's third figure), for answers."""
        return self.pool.num_free_blocks

    def free_blocks_for(self, session_id: str) -> int:
        """What answers of a call of this session report as free: blocks of its model's
        format a call could surely get now (Formats.free_blocks); `free_blocks` when the
        session is unknown (the call failed) or the pool has one format."""
        session = self.sessions.peek(session_id)
        if session is None or len(self.models.formats) == 1:
            return self.free_blocks
        return self.formats.free_blocks(self.model_of(session))

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    @property
    def lease_expiries_total(self) -> int:
        return self.sessions.expiries_total

    def stats_of(self, session_id: str) -> SessionStats:
        """One session's figures (renews its lease, like any call naming it)."""
        session = self.sessions.get(session_id)
        pool = self.model_of(session).format.pool
        return SessionStats(
            name=session.label, client_name=session.client_name,
            num_sequences=len(session.seq_ids), block_table_entries=session.table_entries,
            blocks_held=pool.blocks_held(0, session.number), max_blocks=session.max_blocks,
            lease_ttl_ms=session.lease_ttl_ms, prefix_cache_queries=session.prefix_cache_queries,
            prefix_cache_hits=session.prefix_cache_hits, model=session.model)

    def tenant_figures(self) -> list[TenantFigures]:
        """Every tenant's sessions and blocks (over every format), for the metrics endpoint."""
        return self._usage.figures(self.tenants, lambda name: sum(
            fmt.pool.blocks_held(1, self._tenant_number[name]) for fmt in self.models.formats))

    def _groups(self, session: Session) -> tuple[int, int, int]:
        """The pool's groups of a session's sequences: by session, by tenant, by model."""
        return session.number, self._tenant_number[session.tenant], session.model_number

    def _recount_held(self, sessions: Iterable[Session]) -> int:
        """Distinct blocks the sessions' sequences reference, from their tables (checks)."""
        held: set[tuple[int, int]] = set()
        for session in sessions:
            fmt = self.model_of(session).format
            for seq_id in session.seq_ids:
                held.update((fmt.number, b) for b in fmt.pool.held_blocks(session.key(seq_id)))
        return len(held)

    def _check_sessions(self, fmt: Format, sessions: list[Session]) -> None:
        """Assert that `sessions` (those of `fmt`) and fmt's pool agree."""
        live = 0
        for session in sessions:
            keys = [session.key(seq_id) for seq_id in session.seq_ids]
            assert all(k in fmt.pool for k in keys), f"{session.label} lost a sequence"
            entries = sum(fmt.pool.quota_of(k) for k in keys)
            assert entries == session.table_entries, (
                f"{session.label} counts {session.table_entries} quota blocks, holds {entries}")
            assert fmt.pool.blocks_held(0, session.number) == self._recount_held([session]), \
                f"{session.label}: blocks_held differs from a recount"
            live += len(keys)
        assert live == len(fmt.pool), "the pool holds sequences of no live session"

    def check_invariants(self) -> None:
        """Assert the pool's invariants and that sessions and pool agree; for tests."""
        self.formats.pages.check()
        for model in self.models:
            mine = [s for s in self.sessions if s.model == model.name]
            assert model.format.pool.blocks_held(2, model.number) == self._recount_held(mine), \
                f"model {model.name}: used blocks differ from a recount"
        for fmt in self.models.formats:
            fmt.pool.check_invariants()
            mine = [s for s in self.sessions if self.model_of(s).format is fmt]
            self._check_sessions(fmt, mine)
            fmt.hygiene.check({session.number for session in mine})
        by_tenant = {name: set(sessions) for name, sessions in self._usage.sessions.items()
                     if sessions}
        assert by_tenant == {name: {s for s in self.sessions if s.tenant == name}
                             for name in {s.tenant for s in self.sessions}}, \
            "the tenants' session sets disagree with the live sessions"
        for figures in self.tenant_figures():
            assert figures.blocks_held == self._recount_held(by_tenant.get(figures.name, ())), \
                f"tenant {figures.name}: blocks_held differs from a recount"
