"""One session's operations applied to the block pool, with the session's bookkeeping.

`SessionOps` is the part of the service that touches the pool: it checks ownership, counts,
the session's caps (sequences, quota) and the answer's size before the pool acts, turns `NoFit`
into `PoolExhausted`, keeps each session's sequence set and table-entry count in step with the
pool, and records in a `MemoryWork` the copies and zeroing that pool memory owes for the call.
Every check runs before the pool is touched, so a refused op changes nothing; the session's
bookkeeping is changed through the pool's journal, so a transaction that fails later (a later
op of a Batch, the tenant's max_blocks) undoes it together with the pool. The memory work runs
once the transaction has succeeded (`memory_order.py`).

Pool keys are `(session number, seq_id)`: a seq id of another session is simply not found.
"""

import contextlib
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import numpy as np

from pagedkv.daemon.core import (
    BatchAppend,
    BlockPool,
    InvalidArgument,
    Journal,
    NoFit,
    PoolError,
    SequenceExists,
    SequenceNotFound,
    SeqUpdate,
)
from pagedkv.daemon.core.validation import check_logical_block
from pagedkv.daemon.service.answer_size import AnswerBudget
from pagedkv.daemon.service.errors import LimitExceeded, PoolExhausted, PoolFull
from pagedkv.daemon.service.limits import Limits
from pagedkv.daemon.service.memory_order import MemoryWork
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
from pagedkv.daemon.service.sequence_log import SequenceLog, check
from pagedkv.daemon.service.sessions import Session
from pagedkv.vocab.blocks import blocks_for

Result = TypeVar("Result", SeqUpdate, BatchAppend)


def _nothing(_blocks: list[int] | None = None) -> None:
    """No one listens (a pool with no model records)."""


class SessionOps:
    """Applies operations of any session to one pool (see the module docstring)."""

    def __init__(self, pool: BlockPool, limits: Limits, zero_freed_blocks: bool) -> None:
        self.pool = pool
        self.limits = limits
        # Zero blocks the pool releases with no cached content (defense in depth).
        self.zero_freed_blocks = zero_freed_blocks
        # Where session bookkeeping records its undo (the pool's, inside its transactions).
        self._journal: Journal = pool.journal
        # Each sequence's request id, and the debug lines about single sequences.
        self.sequence_log = SequenceLog(pool.journal)
        # Told of cached blocks a prefix hit took back into use (ModelCache.left).
        self.revived: Callable[[list[int]], None] = _nothing
        # Hands the cache events the pool queued to their listeners (CacheHygiene.drain),
        # after every pool operation, before the call records memory work of its own.
        self.drain: Callable[[], None] = _nothing

    def _fit(self, result: Result | NoFit) -> Result:
        """The pool's result once its cache events are drained, or PoolFull saying what was
        needed and what was free."""
        self.drain()
        if isinstance(result, NoFit):
            raise PoolFull(f"pool full: the call needs {result.needed} blocks, "
                           f"{result.available} available", result.needed, result.available)
        return result

    def apply(self, session: Session, op: Operation, work: MemoryWork,
              answer: AnswerBudget) -> SeqUpdate:
        """One op for one session: checks first (the answer's size among them), then the pool,
        then the session's books."""
        bs, quota = self.pool.block_size, self.pool.quota_blocks
        match op:
            case Allocate(seq_id, num_tokens, token_ids, skip_host_tier, request_id):
                check(request_id)
                tokens = self._check_tokens(num_tokens, token_ids, minimum=0)
                self._check_new_seq(session, seq_id)
                charge = quota(num_tokens)
                self._check_quota(session, charge)
                answer.sequence("allocate", blocks_for(num_tokens, bs), slots=num_tokens)
                update = self._fit(self.pool.allocate(session.key(seq_id), num_tokens, tokens,
                                                 salt=session.salt_tag + session.salt,
                                                 use_host_tier=not skip_host_tier))
                if update.num_cached_tokens:  # revived cached blocks are held now
                    self.revived(update.block_table[:update.num_cached_tokens // bs])
                self._add_seq(session, seq_id)
                self.sequence_log.allocated(session, seq_id, request_id, num_tokens,
                                            update.num_cached_tokens)
                if tokens is not None and self.pool.enable_prefix_caching:
                    self._count_prefix(session, num_tokens, update.num_cached_tokens)
            case Append():
                key, tokens, charge = self._checked_append(session, op, answer, 0)
                update = self._fit(self.pool.append(key, op.num_tokens, tokens))
            case Fork(parent_seq_id, child_seq_id):
                parent = self.own(session, parent_seq_id)
                self._check_new_seq(session, child_seq_id)
                held = self.pool.num_tokens(parent)
                charge = quota(held)
                self._check_quota(session, charge)
                answer.sequence("fork", blocks_for(held, bs),
                                copies=self.pool.fork_copies(held))
                update = self._fit(self.pool.fork(parent, session.key(child_seq_id)))
                self._add_seq(session, child_seq_id)
                self.sequence_log.forked(session, parent_seq_id, child_seq_id)
            case CopyOnWrite(seq_id, logical_block):
                key = self.own(session, seq_id)
                num_blocks = blocks_for(self.pool.num_tokens(key), bs)  # those holding tokens
                check_logical_block(logical_block, num_blocks, seq_id)  # names the client's id
                answer.sequence("copy_on_write", self.pool.table_length(key), copies=1)
                update = self._fit(self.pool.copy_on_write(key, logical_block))
                charge = 0  # a copy replaces a table entry
            case Commit(seq_ids, num_tokens):
                answer.sequence("commit", 0)
                self.commit(session, seq_ids, num_tokens)
                return SeqUpdate(block_table=[], num_tokens=0)
            case Free(seq_id):
                answer.sequence("free", 0)
                self.free(session, seq_id, work)
                return SeqUpdate(block_table=[], num_tokens=0)
        self._add_entries(session, charge)
        work.copy(update.copies)
        return update

    def _checked_append(self, session: Session, op: Append, answer: AnswerBudget,
                        charged: int) -> tuple[tuple[int, int], Sequence[int] | None, int]:
        """An Append's checks, `charged` being what the run's earlier Appends add to the
        session's quota charge; its pool key, token ids (None: none sent) and charge."""
        tokens = self._check_tokens(op.num_tokens, op.token_ids, minimum=1)
        key = self.own(session, op.seq_id)
        pool, total = self.pool, self.pool.num_tokens(key) + op.num_tokens
        # A reservation may cover the new tokens: the charge is what the table grows by.
        charge = max(0, pool.quota_blocks(total) - pool.quota_of(key))
        self._check_quota(session, charged + charge)
        answer.sequence("append", max(blocks_for(total, pool.block_size),
                                      pool.table_length(key)), slots=op.num_tokens, copies=1)
        return key, tokens, charge

    def apply_all(self, session: Session, ops: Sequence[Operation], work: MemoryWork,
                  answer: AnswerBudget) -> list[SeqUpdate]:
        """A Batch's ops in order (inside the caller's transaction); an error says which op
        failed. Consecutive Appends that one vectorized append applies as they would be one
        by one go to the pool together (`_apply_appends`): a runner's release certifies
        every sequence's decoded tokens in one Batch."""
        updates: list[SeqUpdate] = []
        start = 0
        while start < len(ops):
            run = _append_run(ops, start)
            if len(run) > 1:
                updates.extend(self._apply_appends(session, start, run, work, answer))
                start += len(run)
                continue
            with _numbered(f"op {start} ({operation_name(ops[start])})"):
                updates.append(self.apply(session, ops[start], work, answer))
            start += 1
        return updates

    def _apply_appends(self, session: Session, first: int, run: list[Append],
                       work: MemoryWork, answer: AnswerBudget) -> list[SeqUpdate]:
        """A run of Appends (`_append_run`), ops `first`... of a Batch: each op's checks in
        order, then one pool append, all or none. The same changes and answers as one by one;
        a pool too full for them names the run."""
        keys, ids, charged = [], [], 0
        for index, op in enumerate(run, first):
            with _numbered(f"op {index} (Append)"):
                key, tokens, charge = self._checked_append(session, op, answer, charged)
            keys.append(key)
            charged += charge
            if tokens is not None:
                ids.append(tokens)
        with _numbered(f"ops {first}-{first + len(run) - 1} (Append)"):  # ids checked there
            result = self._fit(self.pool.append_batch(keys, run[0].num_tokens, ids or None))
        self._add_entries(session, charged)
        work.copy(result.copies)
        return self._each(keys, run[0].num_tokens, result)

    def _each(self, keys: list[tuple[int, int]], num_tokens: int,
              result: BatchAppend) -> list[SeqUpdate]:
        """Each sequence's answer to a batched append, as its own `append` would give it."""
        copies = {}
        if result.copies:  # a copy's destination is the changed entry of its sequence
            index_of = dict(zip(result.changed_block_id.tolist(),
                                result.changed_seq_index.tolist(), strict=True))
            copies = {index_of[copy.dst]: copy for copy in result.copies}
        slots = result.slot_mapping.reshape(len(keys), num_tokens).tolist()
        pool = self.pool
        return [SeqUpdate(pool.block_table(key), pool.num_tokens(key), 0, slots[index],
                          [copies[index]] if index in copies else [])
                for index, key in enumerate(keys)]

    def free(self, session: Session, seq_id: int, work: MemoryWork) -> int:
        """Drop one of the session's sequences; returns how many blocks the pool released."""
        key = self.own(session, seq_id)
        charge = self.pool.quota_of(key)  # reserved entries included
        released = self.pool.free(key)
        self.drain()
        session.seq_ids.discard(seq_id)
        self._journal.record(session.seq_ids.add, seq_id)
        self._add_entries(session, -charge)
        if self.zero_freed_blocks:
            work.zero(released)
        self.sequence_log.freed(session, seq_id, len(released))
        return len(released)

    def commit(self, session: Session, seq_ids: Sequence[int],
               num_tokens: Sequence[int] = ()) -> int:
        """Certify the K/V of the session's sequences written (all their tokens, or the first
        num_tokens[i] of seq_ids[i]); returns how many blocks became shareable."""
        if not len(seq_ids):
            raise InvalidArgument("a commit needs at least one seq_id")
        self.check_seq_ids(seq_ids)
        if len(num_tokens) and len(num_tokens) != len(seq_ids):
            raise InvalidArgument(f"{len(num_tokens)} num_tokens given for {len(seq_ids)} "
                                  "seq_ids; send one per sequence or none")
        keys = self.own_all(session, seq_ids)
        committed = self.pool.commit(keys, num_tokens if len(num_tokens) else None)
        self.drain()
        return committed

    def _add_seq(self, session: Session, seq_id: int) -> None:
        session.seq_ids.add(seq_id)
        self._journal.record(session.seq_ids.discard, seq_id)

    def _add_entries(self, session: Session, delta: int) -> None:
        session.table_entries += delta
        self._journal.record(_shift_entries, session, -delta)

    def _count_prefix(self, session: Session, queries: int, hits: int) -> None:
        session.prefix_cache_queries += queries
        session.prefix_cache_hits += hits
        self._journal.record(_shift_prefix, session, -queries, -hits)

    def step(self, session: Session, seq_ids: Sequence[int], num_tokens: int,
             token_ids: Sequence[int], work: MemoryWork, answer: AnswerBudget,
             commit: bool = False, reserve_tokens: int = 0) -> BatchAppend:
        """Append num_tokens tokens to each of many sequences, all-or-nothing; the only
        per-sequence Python work is building the pool keys. With `commit`, the sequences'
        pending blocks are committed first (the caller certifies their K/V written). Each
        table then covers `reserve_tokens` slots past the tokens (the blocks that takes are
        charged to the quota and answered as changed entries).

        token_ids may be any sequence numpy reads in one go (a packed protobuf field is).
        """
        count = len(seq_ids)
        if count == 0:
            raise InvalidArgument("a step needs at least one seq_id")
        self.check_seq_ids(seq_ids)
        ids = self._check_tokens(num_tokens, token_ids, minimum=1, seqs=count)
        tokens = None if ids is None else np.asarray(ids, dtype=np.int64)
        keys = self.own_all(session, seq_ids)
        self._check_step_quota(session, keys, num_tokens, reserve_tokens)
        answer.step(count, num_tokens, self.pool.block_size, reserve_tokens)
        if commit:
            self.pool.commit(keys)
            self.drain()
        result = self._fit(self.pool.append_batch(keys, num_tokens, tokens, reserve_tokens))
        self._add_entries(session, result.charged_blocks)
        work.copy(result.copies)
        return result

    def tables(self, session: Session, seq_ids: Sequence[int], with_token_ids: bool,
               answer: AnswerBudget) -> list[SeqUpdate]:
        """Each of the session's sequences' table, length, committed tokens and, if asked,
        token ids, in request order; the answer charged for them all before any is built."""
        keys, pool = self.own_all(session, seq_ids), self.pool
        for key in keys:
            answer.sequence("GetBlockTables", pool.table_length(key),
                            token_ids=pool.num_tokens(key) if with_token_ids else 0)
        return [SeqUpdate(pool.block_table(k), pool.num_tokens(k), pool.committed_tokens(k),
                          token_ids=(pool.token_ids(k) or []) if with_token_ids else None)
                for k in keys]

    def check_seq_ids(self, seq_ids: Sequence[int]) -> None:
        """At most max_seq_ids seq ids, all distinct (a repeated id would only repeat work and
        answer)."""
        self.limits.check_count("seq_ids", len(seq_ids), "max_seq_ids")
        if len(set(seq_ids)) != len(seq_ids):
            repeated = next(s for s, n in Counter(seq_ids).items() if n > 1)
            raise InvalidArgument(f"seq id {repeated} appears more than once; seq ids in one "
                                  "request must be distinct")

    def own_all(self, session: Session, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Pool keys of many of the session's sequences (one set operation, not a loop)."""
        if not session.seq_ids.issuperset(seq_ids):
            unknown = sorted(set(seq_ids) - session.seq_ids)
            raise SequenceNotFound(f"sequences not found in this session: {unknown[:8]}")
        number = session.number
        return [(number, seq_id) for seq_id in seq_ids]

    def _check_step_quota(self, session: Session, keys: list[tuple[int, int]],
                          num_tokens: int, reserve: int) -> None:
        """The quota check of a step reserving `reserve` slots; the exact count (a Python loop
        over the sequences) only when the cheap bound does not fit: no sequence's charge grows
        by more than that of one whose last block is full and which reserved nothing (paged:
        ceil((num_tokens + reserve) / B) new blocks; contiguous: 0)."""
        quota, bs, reach = self.pool.quota_blocks, self.pool.block_size, num_tokens + reserve
        bound = len(keys) * (quota(bs + reach) - quota(bs))
        if session.table_entries + bound > session.max_blocks:
            self._check_quota(session, self._step_charge(keys, reach))

    def _step_charge(self, keys: list[tuple[int, int]], reach: int) -> int:
        """What a step would add to the session's quota charge, its tokens and reservation
        taking `reach` slots past each sequence's tokens (a reservation may cover them)."""
        pool = self.pool
        return sum(max(0, pool.quota_blocks(pool.num_tokens(key) + reach) - pool.quota_of(key))
                   for key in keys)

    def own(self, session: Session, seq_id: int) -> tuple[int, int]:
        """The pool key of one of the session's sequences; others' are simply not found."""
        if seq_id not in session.seq_ids:
            raise SequenceNotFound(f"sequence {seq_id} not found in this session")
        return session.key(seq_id)

    def _check_tokens(self, num_tokens: int, token_ids: Sequence[int], *, minimum: int,
                      seqs: int | None = None) -> Sequence[int] | None:
        """`num_tokens` (at least `minimum`) for one sequence, or for each of `seqs` (a step),
        at most max_tokens in all; their ids, exactly that many, or None when none are sent."""
        if num_tokens < minimum:
            raise InvalidArgument(f"num_tokens must be >= {minimum}, got {num_tokens}")
        total = num_tokens * (seqs or 1)
        self.limits.check_count("tokens", total, "max_tokens")
        if not len(token_ids):
            return None
        if len(token_ids) != total:
            given = (f"num_tokens={num_tokens}; send exactly num_tokens ids" if seqs is None
                     else f"{seqs} sequences of {num_tokens} tokens; send exactly that many")
            raise InvalidArgument(f"{len(token_ids)} token_ids given for {given} or none")
        return token_ids

    def _check_new_seq(self, session: Session, seq_id: int) -> None:
        """A new sequence's id is free in the session, and the session has room for one more."""
        if seq_id in session.seq_ids:
            raise SequenceExists(f"sequence {seq_id} already exists in this session")
        cap = self.limits.max_seqs_per_session
        if len(session.seq_ids) >= cap:
            raise LimitExceeded(f"the session holds {len(session.seq_ids)} sequences; the limit "
                                f"is max_seqs_per_session={cap}")

    def _check_quota(self, session: Session, new_entries: int) -> None:
        if session.table_entries + new_entries > session.max_blocks:
            left = session.max_blocks - session.table_entries
            raise PoolExhausted(f"session quota: the call needs {new_entries} more blocks, "
                                f"{left} of max_blocks={session.max_blocks} left")


def _append_run(ops: Sequence[Operation], start: int) -> list[Append]:
    """The Appends from ops[start] on that one vectorized append applies as one by one: in a
    row, of one num_tokens, all with token ids or all without, no sequence twice (a second
    Append would see the first's)."""
    run: list[Append] = []
    seen: set[int] = set()
    for op in itertools.islice(ops, start, None):
        if not isinstance(op, Append) or op.seq_id in seen or (run and (
                op.num_tokens != run[0].num_tokens
                or bool(len(op.token_ids)) != bool(len(run[0].token_ids)))):
            break
        run.append(op)
        seen.add(op.seq_id)
    return run


@contextlib.contextmanager
def _numbered(label: str) -> Iterator[None]:
    """Errors of a Batch's op (or run of ops) name it: `label` first."""
    try:
        yield
    except PoolFull as exc:
        raise PoolFull(f"{label}: {exc}", exc.needed, exc.available) from exc
    except PoolError as exc:
        raise type(exc)(f"{label}: {exc}") from exc


# Undo functions of SessionOps' bookkeeping (module level: the journal holds them by reference).
def _shift_entries(session: Session, delta: int) -> None:
    session.table_entries += delta


def _shift_prefix(session: Session, queries: int, hits: int) -> None:
    session.prefix_cache_queries += queries
    session.prefix_cache_hits += hits
