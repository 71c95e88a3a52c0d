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

Tenants. Every session belongs to the tenant of the call that opened it (`tenants.py`,
`session_life.py`); the tenant's max_blocks (block-table entries over all its sessions, the
session quota's measure) is checked after every change, inside its transaction, so a call that
would exceed it is undone. A call that commits (Commit, a Batch with a commit op, a Step with
commit) is checked before its transaction opens: under a salt other tenants share, only a
runner or a certifying tenant may commit (`Tenants.check_commit`).

Runner holds. A runner's call may hold the session while its forward writes the blocks the
call answered (`holds.py`): a Free, CloseSession or Batch free of another caller is then refused
under the lock, before the transaction opens, and the reaper leaves a held session alone.

Bounds. Every answer is bounded before it is built: each call carries an `AnswerBudget` that
the call's parts are charged to before the pool does the work (see `answer_size.py`), so a
request that would produce an answer over `max_answer_bytes` is refused with nothing changed.

`PoolService` is the facade the servicer calls. Its parts: `call_path.py` (one lock, each
change all-or-nothing, its memory work after the lock, fail-stop), `session_life.py` (open,
renew, close, the lease reaper), `model_ops.py` (models' registration, sleep and wake; a
session's calls run in its model's format) and `figures.py` (GetStats shows a caller only the
pool's capacity and its own session's figures; operators read every figure from /metrics).
"""

import time
from collections.abc import Callable, Sequence

from pagedkv.daemon.core import (
    BatchAppend,
    BlockPool,
    InvalidArgument,
    PoolStats,
    PrefixHash,
    SeqUpdate,
)
from pagedkv.daemon.core.host_tier import HostTier
from pagedkv.daemon.service.answer_size import AnswerBudget
from pagedkv.daemon.service.call_path import CallPath
from pagedkv.daemon.service.call_work import check_work, op_work, step_work
from pagedkv.daemon.service.crash_log import op_record, plain
from pagedkv.daemon.service.fence import RunnerProcesses
from pagedkv.daemon.service.figures import ServiceFigures
from pagedkv.daemon.service.formats import Formats
from pagedkv.daemon.service.holds import NO_HOLD, Hold
from pagedkv.daemon.service.limits import Limits
from pagedkv.daemon.service.memory_order import BlockMemory, HostMemory
from pagedkv.daemon.service.model_ops import ModelOps
from pagedkv.daemon.service.models import (
    DEFAULT_MAX_MODELS,
    KvShape,
    Model,
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
from pagedkv.daemon.service.session_life import SessionLife
from pagedkv.daemon.service.sessions import Session, SessionRegistry, SessionStats
from pagedkv.daemon.service.tenants import TenantFigures, Tenants, TenantUsage, trusted_caller
from pagedkv.vocab.geometry import ModelGeometry


class PoolService:
    """Session-scoped operations on one block pool and its memory; the servicer's domain
    (a facade over the parts the module docstring names)."""

    def __init__(self, pool: BlockPool, memory: BlockMemory | None, *, pool_id: str,
                 default_lease_ttl_ms: int = 10_000, max_lease_ttl_ms: int = 600_000,
                 geometry: ModelGeometry | None = None, zero_freed_blocks: bool = False,
                 limits: Limits | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 tenants: Tenants | None = None, page_bytes: int = 0,
                 model_policies: dict[str, ModelPolicy] | None = None,
                 max_models: int = DEFAULT_MAX_MODELS,
                 prefix_hash: PrefixHash = "sha256", lends_pages: bool = True) -> None:
        """`lends_pages` False: `pool` gives none of its pages to other formats (the contiguous
        baseline, demo/contiguous), so no model's reserve is parked and no other geometry
        registers."""
        self.pool = pool
        self.pool_id = pool_id
        # The pool id whose state and memory this service took over across a restart
        # (service_image.restore_service), "" when it started cold: PoolInfo.previous_pool_id.
        self.previous_pool_id = ""
        # Whether that state came from the crash log (log_replay.py) rather than a snapshot:
        # sequences' blocks past their committed tokens are not trusted
        # (PoolInfo.recovered_from_crash_log).
        self.recovered_from_crash_log = False
        # The KV events' seq the next batch gets: 0 cold, the previous run's next one when
        # restored (subscribers see the sequence go on); the stopping daemon's, once its
        # event sink has closed (what the restart image keeps).
        self.event_seq = 0
        # Restored from the crash log with KV events numbered (maybe published) for a change
        # the log lost, or an AllBlocksCleared owed for a dropped batch: the first batch is an
        # AllBlocksCleared on every model's topic (daemon/process/server.py).
        self.events_cleared_at_start = False
        self.geometry = geometry
        self.limits = limits or Limits()
        self.sessions = SessionRegistry(pool_id, default_lease_ttl_ms=default_lease_ttl_ms,
                                        max_lease_ttl_ms=max_lease_ttl_ms, limits=self.limits,
                                        clock=clock)
        # Who may call, and each tenant's limits and live sessions.
        self.tenants = tenants or Tenants.single(None)
        # The models, their formats and pages (formats.py); the daemon's own is format 0.
        self.formats = Formats(pool, memory, geometry, limits=self.limits,
                               zero_blocks=zero_freed_blocks, prefix_hash=prefix_hash,
                               page_bytes=page_bytes, policies=model_policies or {},
                               max_models=max_models, lends_pages=lends_pages)
        self.models = self.formats.models
        # Format 0's host tier (`attach_host_tier`), and its copies' bytes per second, measured
        # at start (PoolInfo.host_copy_bytes_per_s); None and 0: the daemon has none.
        self.host_tier: HostTier | None = None
        self.host_copy_rate = 0
        self._usage = TenantUsage()
        # The lock, the transaction and the memory work around every change.
        self.calls = CallPath(self.sessions, self.formats, self.tenants, self._usage,
                              self.limits, memory)
        # The memory work in flight, fail-stop (memory_order.py; the daemon watches it).
        self.memory_order = self.calls.memory_order
        # Sessions' opening, renewal, close and expiry (the lease reaper).
        self.life = SessionLife(self.calls)
        # Models' registration, sleep and wake.
        self.model_ops = ModelOps(self.calls, self.life)
        # Sessions' and tenants' figures, and the checks that recount them.
        self.figures = ServiceFigures(self.calls)
        # The wire bytes of large requests parsed and not yet answered (the interceptor admits
        # each before parsing it): what calls queued for the lock may hold.
        self.requests = RequestBudget(self.limits.max_queued_request_bytes)
        # The processes connected to the runner socket (the gate notes them), which the
        # daemon stops when a hold of theirs lapses while its blocks are needed (fence.py).
        self.runner_processes = RunnerProcesses()

    def attach_host_tier(self, memory: HostMemory | None, num_slots: int = 0,
                         copy_rate: int = 0) -> None:
        """Give the daemon's own model a host tier (kvpool.proto, "The host-memory tier") of
        `memory`'s slots, or of `num_slots` with no memory (bookkeeping only, for tests and
        benchmarks of the pool alone), its copies measured at `copy_rate` bytes per second.
        Before any session exists."""
        self.host_tier = self.formats.attach_host_tier(memory.num_slots if memory else num_slots)
        self.calls.host_memory = memory
        self.host_copy_rate = copy_rate

    @property
    def memory(self) -> BlockMemory | None:
        """Format 0's memory (the daemon's own model's); tests may swap in a wrapper."""
        return self.calls.memory

    @memory.setter
    def memory(self, memory: BlockMemory | None) -> None:
        self.calls.memory = memory

    def model_of(self, session: Session) -> Model:
        return self.calls.model_of(session)

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the lease reaper (idempotent)."""
        await self.life.start()

    async def stop(self) -> None:
        """Stop the lease reaper and, once their work is done, the memory workers; sessions
        stay as they are."""
        await self.life.stop()
        await self.memory_order.close()
        self.runner_processes.close()

    async def expire_due(self) -> int:
        """Expire every session past its lease with no call in flight; returns how many."""
        return await self.life.expire_due()

    def answer_budget(self) -> AnswerBudget:
        """A fresh budget of max_answer_bytes for one call's answer."""
        return self.calls.answer_budget()

    # -------------------------------------------------------------- sessions

    def open_session(self, client_name: str, lease_ttl_ms: int = 0, max_blocks: int = 0,
                     cache_salt: bytes = b"", model: str = "") -> Session:
        """A session of the calling tenant and of `model` (session_life.py)."""
        session = self.life.open(client_name, lease_ttl_ms, max_blocks, cache_salt, model)
        self.calls.note(lambda: ["open", client_name, lease_ttl_ms, max_blocks, cache_salt, model,
                         session.session_id.rsplit("-", 1)[1]])
        return session

    def keep_alive(self, session_id: str, hold: Hold = NO_HOLD) -> int:
        """Renew the lease, and set or end a runner's hold; returns the lease in ms."""
        lease_ms = self.life.keep_alive(session_id, hold)
        self.calls.note(lambda: ["keep", session_id, [hold.hold_ms, hold.end]])
        return lease_ms

    async def close_session(self, session_id: str) -> int:
        """Close a session and free its sequences; returns how many were freed."""
        return await self.life.close(session_id)

    # ---------------------------------------------------------------- models

    def register_model(self, name: str, shape: KvShape, runner_target: str = "") -> Model:
        """Register a runner's model (model_ops.py)."""
        model = self.model_ops.register(name, shape, runner_target)
        self.calls.note(lambda: ["register", name, [shape.num_layers, shape.num_kv_heads,
                                                    shape.head_dim, shape.dtype], runner_target])
        return model

    async def set_model_state(self, name: str, asleep: bool) -> Model:
        """Wake a model, or put it to sleep (model_ops.py)."""
        return await self.model_ops.set_state(name, asleep)

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
        async with self.calls.call(session_id, commits=True,
                                   record=lambda: ["op", session_id, op_record(op)]) as call:
            blocks = call.fit(lambda: call.ops.commit(call.session, op.seq_ids, op.num_tokens))
        return blocks

    async def free(self, session_id: str, op: Free) -> int:
        """Drop a sequence; returns how many blocks went back to the pool."""
        async with self.calls.call(session_id, frees="Free",
                                   record=lambda: ["op", session_id, op_record(op)]) as call:
            blocks = call.fit(lambda: call.ops.free(call.session, op.seq_id, call.work))
        return blocks

    async def _single(self, session_id: str, op: Operation) -> SeqUpdate:
        check_work(self.limits, op_work(op, self.pool.block_size), operation_name(op))
        async with self.calls.call(session_id,
                                   record=lambda: ["op", session_id, op_record(op)]) as call:
            update = call.fit(lambda: call.ops.apply(call.session, op, call.work, call.budget))
        return update

    async def batch(self, session_id: str, ops: Sequence[Operation],
                    hold: Hold = NO_HOLD) -> list[SeqUpdate]:
        """Apply ops in order, all-or-nothing; one result per op (an empty table for a free
        or a commit). `hold`: a runner's, set or ended once the batch is applied."""
        if not ops:
            raise InvalidArgument("a batch needs at least one op")
        self.check_batch_ops(len(ops))
        check_work(self.limits, (op_work(op, self.pool.block_size) for op in ops), "Batch")
        commits = any(isinstance(op, Commit) for op in ops)
        frees = "Batch" if any(isinstance(op, Free) for op in ops) else ""
        record = lambda: ["batch", session_id, [op_record(op) for op in ops],  # noqa: E731
                          [hold.hold_ms, hold.end]]
        async with self.calls.call(session_id, commits=commits, frees=frees, hold=hold,
                                   record=record) as call:
            updates = call.fit(lambda: call.ops.apply_all(call.session, ops, call.work,
                                                          call.budget))
        return updates

    def check_batch_ops(self, count: int) -> None:
        """Refuse a Batch of more than max_batch_ops ops; the servicer asks before it
        translates a single op, so an oversized batch costs no translation."""
        self.limits.check_count("ops", count, "max_batch_ops")

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
        record = lambda: ["step", session_id, plain(seq_ids), num_tokens,  # noqa: E731
                          plain(token_ids), commit, hold_ms, reserve_tokens]
        with answer.part():
            async with self.calls.call(session_id, answer, commits=commit, hold=Hold(hold_ms),
                                       record=record) as call:
                appended = call.fit(lambda: call.ops.step(
                    call.session, seq_ids, num_tokens, token_ids, call.work, call.budget,
                    commit, reserve_tokens))
        return appended

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
        record = (lambda: ["tables", session_id, plain(seq_ids), hold_ms]) if hold_ms else None
        async with self.calls.call(session_id, hold=Hold(hold_ms), record=record) as call:
            tables = call.fit(lambda: call.ops.tables(call.session, seq_ids, with_token_ids,
                                                      call.budget))
        return tables

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
        """What answers of a call of this session report as free (figures.py)."""
        return self.figures.free_blocks_for(session_id)

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    @property
    def lease_expiries_total(self) -> int:
        return self.sessions.expiries_total

    def stats_of(self, session_id: str) -> SessionStats:
        """One session's figures (renews its lease, like any call naming it)."""
        return self.figures.stats_of(session_id)

    def tenant_figures(self) -> list[TenantFigures]:
        """Every tenant's sessions and blocks (over every format), for the metrics endpoint."""
        return self.figures.tenant_figures()

    def check_invariants(self) -> None:
        """Assert the pool's invariants and that sessions and pool agree; for tests."""
        self.figures.check_invariants()
