"""Sequence operations as records: a Session method sends one, `Session.batch` sends many.

    await session.batch([Allocate(1, token_ids=prompt), Fork(1, 2), Append(2, 1)])
"""

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.proto import kvpool_pb2 as pb


def _count(num_tokens: int | None, token_ids: Sequence[int], default: int) -> int:
    """num_tokens defaults to the number of token ids given, else to `default`."""
    return (len(token_ids) or default) if num_tokens is None else num_tokens


@dataclass(frozen=True, slots=True)
class Allocate:
    """A new sequence; token ids (optional) enable prefix reuse."""

    # The new sequence's id, unique in the session.
    seq_id: int
    # Prompt tokens (default: len(token_ids)); 0 gives an empty table.
    num_tokens: int | None = None
    # The prompt's token ids, or empty.
    token_ids: Sequence[int] = ()
    # Take fresh blocks (to compute) past the pool's cached prefix instead of restoring the
    # daemon's host-tier copies (kvpool.proto's "The host-memory tier").
    skip_host_tier: bool = False
    # The id of the client's request it serves, which the daemon keeps and logs with it
    # (kvpool.proto's AllocateRequest.request_id); "" = none.
    request_id: str = ""

    @property
    def token_count(self) -> int:
        """The tokens the sequence gets: num_tokens, or len(token_ids) when it is None."""
        return _count(self.num_tokens, self.token_ids, 0)

    def request(self, session_id: str) -> pb.AllocateRequest:
        return pb.AllocateRequest(session_id=session_id, seq_id=self.seq_id,
                                  num_tokens=self.token_count, token_ids=self.token_ids,
                                  skip_host_tier=self.skip_host_tier,
                                  request_id=self.request_id)

    def batch_op(self) -> pb.BatchOp:
        return pb.BatchOp(allocate=self.request(""))


@dataclass(frozen=True, slots=True)
class Append:
    """Grow a sequence."""

    # The sequence to grow.
    seq_id: int
    # Tokens to add (default: len(token_ids), else 1).
    num_tokens: int | None = None
    # Their ids, or empty.
    token_ids: Sequence[int] = ()

    def request(self, session_id: str) -> pb.AppendRequest:
        return pb.AppendRequest(session_id=session_id, seq_id=self.seq_id,
                                num_tokens=_count(self.num_tokens, self.token_ids, 1),
                                token_ids=self.token_ids)

    def batch_op(self) -> pb.BatchOp:
        return pb.BatchOp(append=self.request(""))


@dataclass(frozen=True, slots=True)
class Fork:
    """A new sequence sharing every block of its parent."""

    # The sequence whose blocks are shared.
    parent_seq_id: int
    # The new sequence's id.
    child_seq_id: int

    def request(self, session_id: str) -> pb.ForkRequest:
        return pb.ForkRequest(session_id=session_id, parent_seq_id=self.parent_seq_id,
                              child_seq_id=self.child_seq_id)

    def batch_op(self) -> pb.BatchOp:
        return pb.BatchOp(fork=self.request(""))


@dataclass(frozen=True, slots=True)
class CopyOnWrite:
    """Make one block of a sequence private before rewriting it."""

    # The sequence about to write.
    seq_id: int
    # Index into its block table.
    logical_block: int

    def request(self, session_id: str) -> pb.CopyOnWriteRequest:
        return pb.CopyOnWriteRequest(session_id=session_id, seq_id=self.seq_id,
                                     logical_block=self.logical_block)

    def batch_op(self) -> pb.BatchOp:
        return pb.BatchOp(copy_on_write=self.request(""))


@dataclass(frozen=True, slots=True)
class Commit:
    """Certify that the K/V of sequences is written: their pending full blocks become shareable
    by later prompts (see kvpool.proto, "pending and committed blocks")."""

    # The sequences whose K/V the runner has written.
    seq_ids: Sequence[int]
    # Empty: every token each holds; else one count per sequence (chunked prefill).
    num_tokens: Sequence[int] = ()

    def request(self, session_id: str) -> pb.CommitRequest:
        return pb.CommitRequest(session_id=session_id, seq_ids=self.seq_ids,
                                num_tokens=self.num_tokens)

    def batch_op(self) -> pb.BatchOp:
        return pb.BatchOp(commit=self.request(""))


@dataclass(frozen=True, slots=True)
class Free:
    """Drop a sequence."""

    # The sequence to drop.
    seq_id: int

    def request(self, session_id: str) -> pb.FreeRequest:
        return pb.FreeRequest(session_id=session_id, seq_id=self.seq_id)

    def batch_op(self) -> pb.BatchOp:
        return pb.BatchOp(free=self.request(""))


Operation = Allocate | Append | Fork | CopyOnWrite | Commit | Free


@dataclass(frozen=True, slots=True)
class Step:
    """Append tokens to several sequences in one call (`Session.step`; `PoolClient.step_many`
    sends several sessions' Steps together)."""

    # Distinct sequences of the session.
    seq_ids: Sequence[int]
    # Empty, or len(seq_ids) * num_tokens ids, sequence-major.
    token_ids: Sequence[int] = ()
    # Tokens appended to every sequence.
    num_tokens: int = 1
    # The caller certifies the K/V of every token the sequences already hold is written: their
    # pending blocks become shareable first (kvpool.proto's StepRequest.commit).
    commit: bool = False
    # Runners only: hold the session this long once applied (kvpool.proto's "Runner holds").
    hold_ms: int = 0
    # Slots held ahead of the appended tokens: each table then covers at least num_tokens +
    # reserve_tokens slots, private to its sequence; later appends into them take no block and
    # change no entry (kvpool.proto's StepRequest.reserve_tokens). 0 reserves nothing new.
    reserve_tokens: int = 0

    def request(self, session_id: str) -> pb.StepRequest:
        return pb.StepRequest(session_id=session_id, seq_ids=self.seq_ids,
                              num_tokens=self.num_tokens, token_ids=self.token_ids,
                              commit=self.commit, hold_ms=self.hold_ms,
                              reserve_tokens=self.reserve_tokens)
