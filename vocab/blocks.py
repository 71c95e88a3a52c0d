"""Block arithmetic every side of the pool shares: how many blocks hold n tokens, where a token's
K/V lives, and how a block table takes an entry a call changed.

A sequence's block table maps logical block i (its tokens i*B .. i*B+B-1, B the block size) to a
physical block; the K/V of the token at position p lives in slot table[p // B] * B + p % B of
the pool. A table is ceil(n / B) entries long for n tokens, or longer where the sequence
reserved slots ahead (kvpool.proto's StepRequest.reserve_tokens); a call changes entries (a
copy-on-write copy replaced one) or appends them past the table's end, in logical order.

`ceil_div` and `blocks_for` take plain ints and, unchanged, whole numpy arrays or torch tensors
of counts (anything with `-` and `//`), so the vectorised core and the kernels' checks use them
too.
"""

from collections.abc import Sequence
from typing import Protocol, TypeVar

Count = TypeVar("Count", bound="Whole")


class Whole(Protocol):
    """Integers, or arrays of them: what ceiling division needs."""

    def __neg__(self: Count) -> Count: ...

    def __floordiv__(self: Count, other: int, /) -> Count: ...


def ceil_div(value: Count, divisor: int) -> Count:
    """ceil(value / divisor) for value >= 0, divisor > 0, in integers (floats would round)."""
    return -(-value // divisor)


def blocks_for(num_tokens: Count, block_size: int) -> Count:
    """Blocks that hold `num_tokens` tokens: the length of their sequence's block table."""
    return ceil_div(num_tokens, block_size)


def slot_of(table: Sequence[int], position: int, block_size: int) -> int:
    """The pool slot of the token at `position` of a sequence with this block table."""
    return table[position // block_size] * block_size + position % block_size


def slots_of(table: Sequence[int], start: int, stop: int, block_size: int) -> list[int]:
    """The pool slots of positions start..stop-1 of a sequence with this block table: one range
    per block, not a division per position (a runner checks a reservation's 32 slots for each
    of its sequences at every renewal, and a prompt's every slot)."""
    slots: list[int] = []
    position = start
    while position < stop:
        block, offset = divmod(position, block_size)
        run = min(stop - position, block_size - offset)
        first = table[block] * block_size + offset
        slots.extend(range(first, first + run))
        position += run
    return slots


def patch_table(table: list[int], logical: int, block: int) -> None:
    """Apply one entry a call changed: `block` replaces entry `logical` (a copy-on-write copy),
    or is appended as the new last block when `logical` is past the table's end (the changes of
    one call come in logical order, so it is the next entry)."""
    if logical < len(table):
        table[logical] = block
    else:
        table.append(block)
