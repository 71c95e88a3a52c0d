"""The work one call may ask of the pool, counted from its request before it waits for the lock.

The answer budget (`answer_size.py`) bounds what a call builds, but not what it does: a Batch
of 1,024 Commits naming 4,096 sequences each answers a few kilobytes, yet held the pool lock for
0.85 s (every seq id is checked, looked up and walked), and every other call waited behind it.
So each call's work is bounded too, by `max_call_work` items, where an item is what costs the
pool a unit of Python work:

- each op of a Batch (a StepMany's entries hold the pool one at a time: each is counted as
  a Step of its own, and one over the limit fails alone);
- each seq id a Commit, Step or GetBlockTables names;
- each block the tokens an op adds may fill (ceil(tokens / block_size) + 1 per sequence: the
  blocks it takes, keys and hashes, and a copy-on-write of its last one); a Step's reserved
  slots count as tokens (ceil((tokens + reserve_tokens) / block_size) + 1).

The count comes from the request alone, before the call waits for the lock, and a call over it
is refused with INVALID_ARGUMENT naming the limit: nothing changes and no other call waits for
it. What a call does beyond its request is bounded elsewhere: the tables its answer returns by
the answer budget, what a Commit walks by the blocks filled since its sequences' last commit
(each block is committed once), what a Free releases by the session's quota.
"""

from collections.abc import Iterable

from pagedkv.daemon.core import InvalidArgument
from pagedkv.daemon.service.limits import Limits
from pagedkv.daemon.service.operations import Allocate, Append, Commit, Operation
from pagedkv.vocab.blocks import blocks_for


def op_work(op: Operation, block_size: int) -> int:
    """Items of one Batch op (see the module docstring)."""
    match op:
        case Allocate(_, num_tokens, _) | Append(_, num_tokens, _):
            return 1 + blocks_for(num_tokens, block_size) + 1
        case Commit(seq_ids, _):
            return 1 + len(seq_ids)
        case _:
            return 1


def step_work(num_seqs: int, num_tokens: int, block_size: int) -> int:
    """Items of one Step (or one StepMany entry): each sequence named, and the blocks its tokens
    may fill."""
    return 1 + num_seqs * (1 + blocks_for(num_tokens, block_size) + 1)


def check_work(limits: Limits, items: int | Iterable[int], what: str) -> None:
    """Refuse a call of more than max_call_work items (INVALID_ARGUMENT), before the lock."""
    total = items if isinstance(items, int) else sum(items)
    if total > limits.max_call_work:
        raise InvalidArgument(f"{what}: the call names or adds {total} items (ops, seq ids and "
                              "blocks of new tokens); the limit is "
                              f"max_call_work={limits.max_call_work}: split it into smaller calls")
