"""Calls whose answer was lost: the retry rules of kvpool.proto, as the bundled client runs them.

A call that ends in UNAVAILABLE, DEADLINE_EXCEEDED or CANCELLED (`LOST`) may or may not have
been applied. `Session` then reads the state back with GetBlockTables and decides from it
(kvpool.proto, "Retry rules"), once the lost call has ended:

- allocate: the sequence NOT_FOUND -> not applied: send it again; found with the requested
  num_tokens -> applied: the answer is rebuilt from the table (slots follow from it, and the
  table's num_cached_tokens is the Allocate's); found with another length -> unknown.
- step: every sequence at its length before the step -> not applied: send it again; every one at
  that length plus the step's tokens -> applied: the answer is rebuilt (slots from the tables;
  as changed entries every entry the step's tokens and reservation touch, a superset of those
  that changed; no copies: the daemon made them before it answered). The lengths before the
  step come from the session's record of its sequences (`SequenceLengths`, kept from every
  answer it received): a sequence changed by someone else (a runner under this session) leaves
  the outcome unknown.
- free: NOT_FOUND -> applied (the released-block count was in the lost answer: 0); found ->
  not applied: send it again.
- step_many (`PoolClient.step_many`): each entry read back as its session's lost step.

When the outcome is unknown, or the attempts run out, the lost call's error is raised (`recover`
runs these rules). Read-backs the daemon does not answer during `RetryPolicy.outage_s` are not
counted as attempts: a daemon restarted with `restore = "auto"` keeps the session, and the
read-back after the gap decides as above. `RetryPolicy` says how often to try;
`PoolClient(retry=None)` turns all this off.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from pagedkv.client.pool.errors import (
    Cancelled,
    DaemonUnavailable,
    DeadlineExceeded,
    PagedKVError,
)
from pagedkv.client.pool.types import SequenceBlocks, StepResult
from pagedkv.vocab.blocks import blocks_for, slots_of

T = TypeVar("T")

log = logging.getLogger(__name__)

# The errors after which a call may or may not have been applied, and the client reads back.
LOST = (DaemonUnavailable, DeadlineExceeded, Cancelled)
# The longest pause between two read-backs.
MAX_BACKOFF_S = 1.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How the client recovers a call whose answer was lost."""

    # Tries in all, the first call included: each later one reads the state back and, if the
    # call was not applied, sends it again. 1 turns recovery off.
    attempts: int = 3
    # Pause before the first read-back, in seconds; doubled before each later one, up to
    # MAX_BACKOFF_S.
    backoff_s: float = 0.05
    # Seconds during which read-backs the daemon does not answer (DaemonUnavailable: it is
    # away, e.g. restarting) are not counted in `attempts`: a daemon restarted with
    # restore = "auto" keeps the session, so the read-back then decides. 0: every one counts.
    outage_s: float = 0.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff_s < 0 or self.outage_s < 0:
            raise ValueError(f"need attempts >= 1, backoff_s >= 0 and outage_s >= 0, got "
                             f"{self.attempts}, {self.backoff_s} and {self.outage_s}")


@dataclass(frozen=True, slots=True)
class Applied(Generic[T]):
    """The lost call was applied; its answer, rebuilt from the state read back."""

    # What the call would have returned.
    answer: T


@dataclass(frozen=True, slots=True)
class NotApplied:
    """The lost call changed nothing: it may be sent again."""


@dataclass(frozen=True, slots=True)
class Unknown:
    """The state read back fits neither outcome (another party changed the sequences)."""

    # What did not fit, for the log.
    reason: str


Outcome = Applied[T] | NotApplied | Unknown


class SequenceLengths:
    """Each sequence's token count as the session's last answer about it said."""

    def __init__(self) -> None:
        # seq id -> num_tokens.
        self._lengths: dict[int, int] = {}

    def set(self, seq_id: int, num_tokens: int) -> None:
        self._lengths[seq_id] = num_tokens

    def set_many(self, seq_ids: Sequence[int], num_tokens: Sequence[int]) -> None:
        self._lengths.update(zip(seq_ids, num_tokens, strict=True))

    def forget(self, seq_id: int) -> None:
        self._lengths.pop(seq_id, None)

    def of(self, seq_ids: Sequence[int]) -> list[int] | None:
        """The lengths of all of `seq_ids`, or None if one is not known."""
        lengths = self._lengths
        if not all(seq_id in lengths for seq_id in seq_ids):
            return None
        return [lengths[seq_id] for seq_id in seq_ids]


async def recover(policy: RetryPolicy | None, lost: PagedKVError,
                  send: Callable[[], Awaitable[T]],
                  read_back: Callable[[], Awaitable[Outcome[T]]]) -> T:
    """What `send()`, whose answer was `lost`, did: after the policy's backoff, read back;
    applied: its rebuilt answer; not applied: send again (itself recovered the same way, within
    the policy's attempts); unknown, or out of attempts: raise the lost call's error."""
    if policy is None or policy.attempts == 1:
        raise lost
    delay, tries = policy.backoff_s, policy.attempts - 1
    outage_until = time.monotonic() + policy.outage_s
    while tries:
        await asyncio.sleep(delay)
        delay = min(2 * delay, MAX_BACKOFF_S)
        try:
            outcome = await read_back()
        except DaemonUnavailable as exc:  # away: within outage_s, not an attempt
            lost = exc
            if time.monotonic() >= outage_until:
                tries -= 1
            continue
        except LOST as exc:
            lost, tries = exc, tries - 1
            continue
        tries -= 1
        if isinstance(outcome, Applied):
            return outcome.answer
        if isinstance(outcome, Unknown):
            log.warning("pagedkv: cannot tell whether a lost call was applied: %s",
                        outcome.reason)
            break
        try:
            return await send()
        except LOST as exc:
            lost = exc
    raise lost


def allocate_outcome(table: SequenceBlocks | None, num_tokens: int,
                     block_size: int) -> Outcome[SequenceBlocks]:
    """What a lost Allocate of `num_tokens` did, from the sequence read back (None: NOT_FOUND)."""
    if table is None:
        return NotApplied()
    if table.num_tokens != num_tokens:
        return Unknown(f"sequence {table.seq_id} holds {table.num_tokens} tokens, the lost "
                       f"allocate asked for {num_tokens}")
    return Applied(SequenceBlocks(table.seq_id, table.block_ids, num_tokens,
                                  table.num_cached_tokens,
                                  slots_of(table.block_ids, 0, num_tokens, block_size), []))


def step_outcome(tables: Sequence[SequenceBlocks], before: Sequence[int], num_tokens: int,
                 block_size: int, reserve_tokens: int = 0) -> Outcome[StepResult]:
    """What a lost Step of `num_tokens` tokens per sequence (reserving `reserve_tokens` slots
    ahead) did, from the tables read back and the sequences' lengths before it."""
    after = [table.num_tokens for table in tables]
    if after == list(before):
        return NotApplied()
    if after != [count + num_tokens for count in before]:
        return Unknown(f"lengths {after} are neither {list(before)} nor those plus {num_tokens}")
    slots: list[int] = []
    index: list[int] = []
    logical: list[int] = []
    blocks: list[int] = []
    for i, (table, start) in enumerate(zip(tables, before, strict=True)):
        stop = start + num_tokens
        slots += slots_of(table.block_ids, start, stop, block_size)
        # The table covers the step's tokens; a reservation reaches further, up to its end.
        reach = min(len(table.block_ids), blocks_for(stop + reserve_tokens, block_size))
        touched = range(start // block_size, reach)
        index += [i] * len(touched)
        logical += touched
        blocks += [table.block_ids[lb] for lb in touched]
    return Applied(StepResult(slots, index, logical, blocks, [], after))


def free_outcome(table: SequenceBlocks | None) -> Outcome[int]:
    """What a lost Free did, from the sequence read back (None: NOT_FOUND)."""
    return Applied(0) if table is None else NotApplied()
