"""One session's operations applied to the block pool, with the session's bookkeeping.

`SessionOps` is the part of the service that touches the pool: it checks ownership, counts and
the quota before the pool acts, turns `NoFit` into `PoolExhausted`, keeps each session's
sequence set and table-entry count in step with the pool, and records in a `MemoryWork` the
copies and zeroing that pool memory owes for the call. Every check runs before the pool is
touched, so a refused op changes nothing.

Pool keys are `(session number, seq_id)`: a seq id of another session is simply not found.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from .core import (
    BatchAppend,
    BlockCopy,
    BlockPool,
    InvalidArgument,
    NoFit,
    SequenceExists,
    SequenceNotFound,
    SeqUpdate,
)
from .operations import (
    Allocate,
    Append,
    CopyOnWrite,
    Fork,
    Free,
    Operation,
    PoolExhausted,
    RequestLimits,
)
from .sessions import Session

if TYPE_CHECKING:
    from .kv_memory import PoolMemoryHandle  # importing it at run time would import torch

Result = TypeVar("Result", SeqUpdate, BatchAppend)


class BlockMemory(Protocol):
    """What the service needs from the pool memory (pagedkv.daemon.kv_memory.KVPoolMemory)."""

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int], /) -> None: ...

    def zero_blocks(self, ids: Sequence[int], /) -> None: ...

    def handle(self) -> "PoolMemoryHandle": ...


@dataclass(slots=True)
class MemoryWork:
    """Copies and zeroing a call owes pool memory, performed in call order once it commits.

    Order matters within a batch: a block freed (and zeroed) by one op may be the copy
    destination of a later one.
    """

    # ("copy", sources, destinations) or ("zero", blocks, []), in the order the pool made them.
    steps: list[tuple[Literal["copy", "zero"], list[int], list[int]]] = field(default_factory=list)

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        if copies:
            self.steps.append(("copy", [c.src for c in copies], [c.dst for c in copies]))

    def zero(self, blocks: list[int]) -> None:
        if blocks:
            self.steps.append(("zero", blocks, []))

    def perform(self, memory: BlockMemory | None) -> None:
        """Do the work in pool memory (nothing to do for a bookkeeping-only pool)."""
        if memory is None:
            return
        for kind, blocks, destinations in self.steps:
            if kind == "copy":
                memory.copy_blocks(blocks, destinations)
            else:
                memory.zero_blocks(blocks)


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _fit(result: Result | NoFit) -> Result:
    """The pool's result, or PoolExhausted saying what was needed and what was free."""
    if isinstance(result, NoFit):
        raise PoolExhausted(f"pool full: the call needs {result.needed} blocks, "
                            f"{result.available} available")
    return result


class SessionOps:
    """Applies operations of any session to one pool (see the module docstring)."""

    def __init__(self, pool: BlockPool, limits: RequestLimits, zero_freed_blocks: bool) -> None:
        self.pool = pool
        self.limits = limits
        # Zero blocks the pool releases with no cached content (defense in depth).
        self.zero_freed_blocks = zero_freed_blocks

    def apply(self, session: Session, op: Operation, work: MemoryWork) -> SeqUpdate:
        """One op for one session: checks first, then the pool, then the session's books."""
        bs = self.pool.block_size
        match op:
            case Allocate(seq_id, num_tokens, token_ids):
                tokens = self._check_tokens(num_tokens, token_ids, minimum=0)
                if seq_id in session.seq_ids:
                    raise SequenceExists(f"sequence {seq_id} already exists in this session")
                self._check_quota(session, _blocks_for(num_tokens, bs))
                update = _fit(self.pool.allocate(session.key(seq_id), num_tokens, tokens,
                                                      salt=session.salt))
                session.seq_ids.add(seq_id)
                if tokens is not None and self.pool.enable_prefix_caching:
                    session.prefix_cache_queries += num_tokens
                    session.prefix_cache_hits += update.num_cached_tokens
            case Append(seq_id, num_tokens, token_ids):
                tokens = self._check_tokens(num_tokens, token_ids, minimum=1)
                key = self.own(session, seq_id)
                old = self.pool.num_tokens(key)
                self._check_quota(session, _blocks_for(old + num_tokens, bs) - _blocks_for(old, bs))
                update = _fit(self.pool.append(key, num_tokens, tokens))
                session.table_entries -= _blocks_for(old, bs)
            case Fork(parent_seq_id, child_seq_id):
                parent = self.own(session, parent_seq_id)
                if child_seq_id in session.seq_ids:
                    raise SequenceExists(f"sequence {child_seq_id} already exists in this session")
                self._check_quota(session, len(self.pool.block_table(parent)))
                update = self.pool.fork(parent, session.key(child_seq_id))
                session.seq_ids.add(child_seq_id)
            case CopyOnWrite(seq_id, logical_block):
                key = self.own(session, seq_id)
                num_blocks = len(self.pool.block_table(key))
                if not 0 <= logical_block < num_blocks:
                    raise InvalidArgument(f"logical_block {logical_block} is outside the "
                                          f"{num_blocks} blocks of sequence {seq_id}")
                update = _fit(self.pool.copy_on_write(key, logical_block))
                session.table_entries -= num_blocks
            case Free(seq_id):
                self.free(session, seq_id, work)
                return SeqUpdate(block_table=[], num_tokens=0)
        session.table_entries += len(update.block_table)
        work.copy(update.copies)
        return update

    def free(self, session: Session, seq_id: int, work: MemoryWork) -> int:
        """Drop one of the session's sequences; returns how many blocks the pool released."""
        key = self.own(session, seq_id)
        entries = len(self.pool.block_table(key))
        released = self.pool.free(key)
        session.seq_ids.discard(seq_id)
        session.table_entries -= entries
        if self.zero_freed_blocks:
            work.zero(released)
        return len(released)

    def step(self, session: Session, seq_ids: Sequence[int], num_tokens: int,
             token_ids: Sequence[int], work: MemoryWork) -> BatchAppend:
        """Append num_tokens tokens to each of many sequences, all-or-nothing; the only
        per-sequence Python work is building the pool keys.

        token_ids may be any sequence numpy reads in one go (a packed protobuf field is).
        """
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
        result = _fit(self.pool.append_batch(keys, num_tokens, tokens))
        # Each copy-on-write replaces an entry; every other changed entry is a new block.
        session.table_entries += len(result.changed_seq_index) - len(result.copies)
        work.copy(result.copies)
        return result

    def _step_entries(self, keys: list[tuple[int, int]], num_tokens: int) -> int:
        """Block-table entries a step would add (only computed under a quota)."""
        bs = self.pool.block_size
        old = np.fromiter((self.pool.num_tokens(k) for k in keys), dtype=np.int64,
                          count=len(keys))
        return int(((old + num_tokens + bs - 1) // bs - (old + bs - 1) // bs).sum())

    def own(self, session: Session, seq_id: int) -> tuple[int, int]:
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
