"""The pool service: sessions, leases, quotas and tenancy around the block pool.

Every sequence belongs to a session, and the pool keys it `(session number, seq_id)`, so one
session can neither see, extend nor free another's sequences: a seq id of another session is
simply unknown (NOT_FOUND, never "exists elsewhere"). Sessions share prefix-cache blocks only
when they opened with the same non-empty `cache_salt`; by default each session gets a salt of
its own, so sharing is opt-in.

Quota. `max_blocks` bounds the block-table entries over the session's sequences: a block shared
by two of its sequences counts twice, a prefix block shared with another session counts for
each. It is thus an upper bound on the physical blocks the session pins, and it is exact,
cheap and independent of what other sessions do. The check runs before the pool is touched,
so a refused call changes nothing.

Block reuse across tenants. A block released by one session may be handed to another with the
old K/V still in it. That is safe without zeroing: the API returns block ids and slots, never
contents; the attention kernels mask every slot past a sequence's length, so stale slots are
never read; and only the trusted runner on this host maps the pool memory. For defense in
depth, `zero_freed_blocks=True` zeroes every block the pool releases with no cached content.
Blocks kept in the prefix cache keep their content on purpose (that is the cache) and are
handed out again unzeroed when evicted; run without prefix caching where that matters.

Copy-on-write copies are done in pool memory before a call returns; in a Batch they run (in
order, with any zeroing) only once every op has succeeded, so a rolled-back batch never
touches memory.
"""

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
import numpy.typing as npt

from .core import (
    BatchAppend,
    BlockCopy,
    BlockPool,
    InvalidArgument,
    NoFit,
    PoolError,
    PoolStats,
    SequenceExists,
    SequenceNotFound,
    SeqUpdate,
)
from .geometry import ModelGeometry
from .logging import get_logger
from .operations import (
    Allocate,
    Append,
    CopyOnWrite,
    Fork,
    Free,
    Operation,
    PoolExhausted,
    RequestLimits,
    operation_name,
)
from .sessions import Session, SessionRegistry, SessionStats

if TYPE_CHECKING:
    from .kv_memory import PoolMemoryHandle  # importing it at run time would import torch

log = get_logger(__name__)

# How often the reaper looks for lapsed leases: a session is freed within this of its expiry.
REAP_INTERVAL_S = 0.1


class BlockMemory(Protocol):
    """What the service needs from the pool memory (pagedkv.daemon.kv_memory.KVPoolMemory)."""

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int], /) -> None: ...

    def zero_blocks(self, ids: Sequence[int], /) -> None: ...

    def handle(self) -> "PoolMemoryHandle": ...


@dataclass(slots=True)
class _MemoryWork:
    """Copies and zeroing a call owes pool memory, performed in call order once it commits."""

    # ("copy", sources, destinations) or ("zero", blocks, []), in the order the pool made them.
    steps: list[tuple[Literal["copy", "zero"], list[int], list[int]]] = field(default_factory=list)

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        if copies:
            self.steps.append(("copy", [c.src for c in copies], [c.dst for c in copies]))

    def zero(self, blocks: list[int]) -> None:
        if blocks:
            self.steps.append(("zero", blocks, []))


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class PoolService:
    """Session-scoped operations on one block pool and its memory; the servicer's domain."""

    def __init__(self, pool: BlockPool, memory: BlockMemory | None, *, pool_id: str,
                 default_lease_ttl_ms: int = 10_000, max_lease_ttl_ms: int = 600_000,
                 geometry: ModelGeometry | None = None, zero_freed_blocks: bool = False,
                 limits: RequestLimits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.memory = memory
        self.pool_id = pool_id
        self.geometry = geometry
        self.zero_freed_blocks = zero_freed_blocks
        self.limits = limits or RequestLimits()
        self.sessions = SessionRegistry(pool_id, default_lease_ttl_ms=default_lease_ttl_ms,
                                        max_lease_ttl_ms=max_lease_ttl_ms,
                                        on_expire=self._on_expire, clock=clock)
        self._reaper: asyncio.Task[None] | None = None

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the lease reaper (idempotent)."""
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever(), name="pagedkv-lease-reaper")

    async def stop(self) -> None:
        """Stop the lease reaper; sessions stay as they are."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            try:
                self.sessions.expire_due()
            except Exception:  # the reaper must outlive any bug in one expiry
                log.exception("lease reaper failed")

    def _on_expire(self, session: Session) -> None:
        freed = self._drop_session(session)
        log.info("session expired", session=session.label, freed_sequences=freed,
                 lease_ttl_ms=session.lease_ttl_ms)

    def _drop_session(self, session: Session) -> int:
        """Free every sequence of a session that is gone; returns how many."""
        work = _MemoryWork()
        count = len(session.seq_ids)
        for seq_id in list(session.seq_ids):
            self._free(session, seq_id, work)
        self._perform(work)
        return count

    # -------------------------------------------------------------- sessions

    def open_session(self, client_name: str, lease_ttl_ms: int = 0, max_blocks: int = 0,
                     cache_salt: bytes = b"") -> Session:
        session = self.sessions.open(client_name, lease_ttl_ms, max_blocks, cache_salt)
        log.info("session opened", session=session.label, lease_ttl_ms=session.lease_ttl_ms,
                 max_blocks=max_blocks, shared_cache=bool(cache_salt))
        return session

    def keep_alive(self, session_id: str) -> int:
        """Renew the lease (every call does); returns the lease in ms."""
        return self.sessions.get(session_id).lease_ttl_ms

    def close_session(self, session_id: str) -> int:
        """Close a session and free its sequences; returns how many were freed."""
        session = self.sessions.close(session_id)
        freed = self._drop_session(session)
        log.info("session closed", session=session.label, freed_sequences=freed)
        return freed

    # ------------------------------------------------------------ operations

    def allocate(self, session_id: str, op: Allocate) -> SeqUpdate:
        return self._single(session_id, op)

    def append(self, session_id: str, op: Append) -> SeqUpdate:
        return self._single(session_id, op)

    def fork(self, session_id: str, op: Fork) -> SeqUpdate:
        return self._single(session_id, op)

    def copy_on_write(self, session_id: str, op: CopyOnWrite) -> SeqUpdate:
        return self._single(session_id, op)

    def free(self, session_id: str, op: Free) -> int:
        """Drop a sequence; returns how many blocks went back to the pool."""
        session = self.sessions.get(session_id)
        work = _MemoryWork()
        released = self._free(session, op.seq_id, work)
        self._perform(work)
        return released

    def _single(self, session_id: str, op: Operation) -> SeqUpdate:
        """One op: the pool does it all-or-nothing, and the session changes only after."""
        session = self.sessions.get(session_id)
        work = _MemoryWork()
        update = self._apply(session, op, work)
        self._perform(work)
        return update

    def batch(self, session_id: str, ops: Sequence[Operation]) -> list[SeqUpdate]:
        """Apply ops in order, all-or-nothing; one result per op (an empty table for a free)."""
        session = self.sessions.get(session_id)
        if not ops:
            raise InvalidArgument("a batch needs at least one op")
        self.limits.check_count("ops", len(ops), self.limits.max_batch_ops)
        saved = session.usage()
        work = _MemoryWork()
        results = []
        try:
            with self.pool.atomic():
                for index, op in enumerate(ops):
                    results.append(self._apply_numbered(session, index, op, work))
        except BaseException:
            session.restore(saved)
            raise
        self._perform(work)
        return results

    def _apply_numbered(self, session: Session, index: int, op: Operation,
                        work: _MemoryWork) -> SeqUpdate:
        """Apply one op of a batch; an error says which op failed."""
        try:
            return self._apply(session, op, work)
        except PoolError as exc:
            raise type(exc)(f"op {index} ({operation_name(op)}): {exc}") from exc

    def _apply(self, session: Session, op: Operation, work: _MemoryWork) -> SeqUpdate:
        bs = self.pool.block_size
        match op:
            case Allocate(seq_id, num_tokens, token_ids):
                tokens = self._check_tokens(num_tokens, token_ids, minimum=0)
                if seq_id in session.seq_ids:
                    raise SequenceExists(f"sequence {seq_id} already exists in this session")
                self._check_quota(session, _blocks_for(num_tokens, bs))
                update = self._fit(self.pool.allocate(session.key(seq_id), num_tokens, tokens,
                                                      salt=session.salt))
                session.seq_ids.add(seq_id)
                if tokens is not None and self.pool.enable_prefix_caching:
                    session.prefix_cache_queries += num_tokens
                    session.prefix_cache_hits += update.num_cached_tokens
            case Append(seq_id, num_tokens, token_ids):
                tokens = self._check_tokens(num_tokens, token_ids, minimum=1)
                key = self._own(session, seq_id)
                old = self.pool.num_tokens(key)
                self._check_quota(session, _blocks_for(old + num_tokens, bs) - _blocks_for(old, bs))
                update = self._fit(self.pool.append(key, num_tokens, tokens))
                session.table_entries -= _blocks_for(old, bs)
            case Fork(parent_seq_id, child_seq_id):
                parent = self._own(session, parent_seq_id)
                if child_seq_id in session.seq_ids:
                    raise SequenceExists(f"sequence {child_seq_id} already exists in this session")
                self._check_quota(session, len(self.pool.block_table(parent)))
                update = self.pool.fork(parent, session.key(child_seq_id))
                session.seq_ids.add(child_seq_id)
            case CopyOnWrite(seq_id, logical_block):
                key = self._own(session, seq_id)
                num_blocks = len(self.pool.block_table(key))
                if not 0 <= logical_block < num_blocks:
                    raise InvalidArgument(f"logical_block {logical_block} is outside the "
                                          f"{num_blocks} blocks of sequence {seq_id}")
                update = self._fit(self.pool.copy_on_write(key, logical_block))
                session.table_entries -= num_blocks
            case Free(seq_id):
                self._free(session, seq_id, work)
                return SeqUpdate(block_table=[], num_tokens=0)
        session.table_entries += len(update.block_table)
        work.copy(update.copies)
        return update

    def _free(self, session: Session, seq_id: int, work: _MemoryWork) -> int:
        key = self._own(session, seq_id)
        entries = len(self.pool.block_table(key))
        released = self.pool.free(key)
        session.seq_ids.discard(seq_id)
        session.table_entries -= entries
        if self.zero_freed_blocks:
            work.zero(released)
        return len(released)

    def step(self, session_id: str, seq_ids: Sequence[int], num_tokens: int = 1,
             token_ids: Sequence[int] = ()) -> BatchAppend:
        """Append num_tokens tokens to each of many sequences at once, all-or-nothing.

        token_ids may be any sequence numpy reads in one go (a packed protobuf field is).
        """
        session = self.sessions.get(session_id)
        count = len(seq_ids)
        if count == 0:
            raise InvalidArgument("a step needs at least one seq_id")
        self.limits.check_count("seq_ids", count, self.limits.max_seq_ids)
        if num_tokens < 1:
            raise InvalidArgument(f"num_tokens must be >= 1, got {num_tokens}")
        self.limits.check_count("tokens", count * num_tokens, self.limits.max_tokens)
        tokens: npt.NDArray[np.int64] | None = None
        if len(token_ids):
            if len(token_ids) != count * num_tokens:
                raise InvalidArgument(f"{len(token_ids)} token_ids given for {count} sequences "
                                      f"of {num_tokens} tokens; send exactly that many or none")
            tokens = np.asarray(token_ids, dtype=np.int64)
        if not session.seq_ids.issuperset(seq_ids):
            unknown = sorted(set(seq_ids) - session.seq_ids)
            raise SequenceNotFound(f"sequences not found in this session: {unknown[:8]}")
        number = session.number
        keys = [(number, seq_id) for seq_id in seq_ids]
        if session.max_blocks:
            self._check_quota(session, self._step_entries(keys, num_tokens))
        result = self.pool.append_batch(keys, num_tokens, tokens)
        if isinstance(result, NoFit):
            raise PoolExhausted(self._no_fit_message(result))
        # Each copy-on-write replaces an entry; every other changed entry is a new block.
        session.table_entries += len(result.changed_seq_index) - len(result.copies)
        work = _MemoryWork()
        work.copy(result.copies)
        self._perform(work)
        return result

    def _step_entries(self, keys: list[tuple[int, int]], num_tokens: int) -> int:
        """Block-table entries a step would add (only computed under a quota)."""
        bs = self.pool.block_size
        old = np.fromiter((self.pool.num_tokens(k) for k in keys), dtype=np.int64,
                          count=len(keys))
        return int(((old + num_tokens + bs - 1) // bs - (old + bs - 1) // bs).sum())

    # --------------------------------------------------------------- queries

    def block_tables(self, session_id: str, seq_ids: Sequence[int]) -> list[SeqUpdate]:
        """Each sequence's table and length, in request order."""
        session = self.sessions.get(session_id)
        if not seq_ids:
            raise InvalidArgument("no seq_ids given")
        self.limits.check_count("seq_ids", len(seq_ids), self.limits.max_seq_ids)
        keys = [self._own(session, seq_id) for seq_id in seq_ids]
        return [SeqUpdate(self.pool.block_table(k), self.pool.num_tokens(k)) for k in keys]

    def pool_stats(self) -> PoolStats:
        return self.pool.stats()

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    @property
    def lease_expiries_total(self) -> int:
        return self.sessions.expiries_total

    def session_stats(self) -> dict[str, SessionStats]:
        """Every live session's figures, keyed by label (never by the secret id)."""
        return {s.label: self._stats_of(s) for s in self.sessions}

    def stats_of(self, session_id: str) -> SessionStats:
        """One session's figures (renews its lease, like any call naming it)."""
        return self._stats_of(self.sessions.get(session_id))

    def _stats_of(self, session: Session) -> SessionStats:
        held: set[int] = set()
        for seq_id in session.seq_ids:
            held.update(self.pool.block_table(session.key(seq_id)))
        return SessionStats(
            name=session.label, client_name=session.client_name,
            num_sequences=len(session.seq_ids), block_table_entries=session.table_entries,
            blocks_held=len(held), max_blocks=session.max_blocks,
            lease_ttl_ms=session.lease_ttl_ms, prefix_cache_queries=session.prefix_cache_queries,
            prefix_cache_hits=session.prefix_cache_hits)

    def check_invariants(self) -> None:
        """Assert the pool's invariants and that sessions and pool agree; for tests."""
        self.pool.check_invariants()
        live = 0
        for session in self.sessions:
            keys = [session.key(seq_id) for seq_id in session.seq_ids]
            assert all(k in self.pool for k in keys), f"{session.label} lost a sequence"
            entries = sum(len(self.pool.block_table(k)) for k in keys)
            assert entries == session.table_entries, (
                f"{session.label} counts {session.table_entries} table entries, holds {entries}")
            live += len(keys)
        assert live == len(self.pool), "the pool holds sequences of no live session"

    # --------------------------------------------------------------- helpers

    def _own(self, session: Session, seq_id: int) -> tuple[int, int]:
        """The pool key of one of the session's sequences; others' are simply not found."""
        if seq_id not in session.seq_ids:
            raise SequenceNotFound(f"sequence {seq_id} not found in this session")
        return session.key(seq_id)

    def _check_tokens(self, num_tokens: int, token_ids: Sequence[int],
                      *, minimum: int) -> Sequence[int] | None:
        if num_tokens < minimum:
            raise InvalidArgument(f"num_tokens must be >= {minimum}, got {num_tokens}")
        self.limits.check_count("tokens", num_tokens, self.limits.max_tokens)
        if not len(token_ids):
            return None
        if len(token_ids) != num_tokens:
            raise InvalidArgument(f"{len(token_ids)} token_ids given for num_tokens={num_tokens}; "
                                  "send exactly num_tokens ids or none")
        return token_ids

    def _check_quota(self, session: Session, new_entries: int) -> None:
        if session.max_blocks and session.table_entries + new_entries > session.max_blocks:
            left = session.max_blocks - session.table_entries
            raise PoolExhausted(f"session quota: the call needs {new_entries} more blocks, "
                                f"{left} of max_blocks={session.max_blocks} left")

    def _fit(self, result: SeqUpdate | NoFit) -> SeqUpdate:
        if isinstance(result, NoFit):
            raise PoolExhausted(self._no_fit_message(result))
        return result

    @staticmethod
    def _no_fit_message(no_fit: NoFit) -> str:
        return f"pool full: the call needs {no_fit.needed} blocks, {no_fit.available} available"

    def _perform(self, work: _MemoryWork) -> None:
        if self.memory is None:
            return
        for kind, blocks, destinations in work.steps:
            if kind == "copy":
                self.memory.copy_blocks(blocks, destinations)
            else:
                self.memory.zero_blocks(blocks)
