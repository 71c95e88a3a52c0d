"""The requests the pool service understands, free of protobuf.

The servicer turns each gRPC request into one of these records; a Batch is a list of them.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Allocate:
    """A new sequence of num_tokens tokens (token ids optional; they enable prefix reuse)."""

    # The client's id for the sequence, unique within its session.
    seq_id: int
    # Prompt tokens; 0 gives an empty block table.
    num_tokens: int
    # Empty, or exactly num_tokens ids.
    token_ids: Sequence[int] = ()
    # Recompute what the pool does not cache rather than restore it from the host tier.
    skip_host_tier: bool = False
    # The id of the client's request it serves, kept and logged with it ("" = none;
    # pagedkv.vocab.request_ids' rule, checked before anything changes).
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class Append:
    """Grow a sequence by num_tokens tokens."""

    # The sequence to grow.
    seq_id: int
    # Tokens added, at least 1.
    num_tokens: int
    # Empty, or exactly num_tokens ids.
    token_ids: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class Fork:
    """A new sequence holding its parent's tokens: sharing every block of it (paged), or a
    copy in a reservation of its own (contiguous)."""

    # The sequence whose tokens the child starts with.
    parent_seq_id: int
    # The new sequence's id.
    child_seq_id: int


@dataclass(frozen=True, slots=True)
class CopyOnWrite:
    """Make one block of a sequence private before the client rewrites it."""

    # The sequence about to write.
    seq_id: int
    # Index into its block table.
    logical_block: int


@dataclass(frozen=True, slots=True)
class Commit:
    """Certify that K/V is written: the pending full blocks it covers become shareable."""

    # The sequences whose K/V the caller's runner has written.
    seq_ids: Sequence[int]
    # Empty (every token each sequence holds), or one count per sequence: the blocks fully
    # inside each sequence's first num_tokens tokens.
    num_tokens: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class Free:
    """Drop a sequence; blocks no one else references go back to the pool."""

    # The sequence to drop.
    seq_id: int


Operation = Allocate | Append | Fork | CopyOnWrite | Commit | Free


def operation_name(op: Operation) -> str:
    """The op's name as the Batch RPC spells it ("copy_on_write"), for error messages."""
    return {Allocate: "allocate", Append: "append", Fork: "fork", CopyOnWrite: "copy_on_write",
            Commit: "commit", Free: "free"}[type(op)]


def seq_id_of(op: Operation) -> int:
    """The sequence an op's result describes (the child, for a fork; 0 for a commit, whose
    result is empty)."""
    match op:
        case Fork():
            return op.child_seq_id
        case Commit():
            return 0
        case _:
            return op.seq_id
