"""Upper bounds on the encoded size of answers, charged before each answer is built.

An answer's size grows with the request (tokens, ops, seq ids) and with the state (the length
of the block tables it returns). `AnswerBudget` is charged, before the work that produces each
part of an answer, with an upper bound of that part's protobuf encoding, and refuses the call
(`AnswerTooLarge`, RESOURCE_EXHAUSTED, nothing changed) once the total would pass
`max_answer_bytes`. So no call builds an answer the client could not receive, and no call does
work (or holds memory) for an answer that would be refused anyway.

The bounds follow proto3's encoding: a varint takes 7 bits per byte; a packed repeated field is
a tag, a length and its varints; a message inside another is a tag, a length and its fields.
Block ids and logical block indexes are below the pool's block count (a table never holds a
block twice); slots are below num_blocks x block_size.
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from pagedkv.daemon.service.errors import AnswerTooLarge
from pagedkv.vocab.blocks import blocks_for, ceil_div
from pagedkv.vocab.causes import MESSAGE_BYTES

# Largest varint of a uint32 length or count, and of a uint64.
_U32 = 5
_U64 = 10
# A packed repeated field's tag and length.
_PACKED = 1 + _U32
# One SequenceBlocks inside a repeated field: its tag and length, seq_id, num_tokens,
# num_cached_tokens, and the headers of block_ids and slot_mapping.
SEQUENCE_FIXED = (1 + _U32) + (1 + _U64) + 2 * (1 + _U32) + 2 * _PACKED
# A StepResponse's seven packed fields' headers.
STEP_FIXED = 7 * _PACKED
# A failed StepMany entry's cause takes at most these many bytes (its message MESSAGE_BYTES).
ENTRY_CAUSE_BYTES = 32
# One StepManyResult around its StepResponse: its tag and length, code, cause, message, the
# StepResponse's tag and length and its free_blocks (charged for every entry, failed or not,
# before any is applied); then the StepManyResponse's own free_blocks.
STEP_MANY_ENTRY = ((1 + _U32) + (1 + _U32) + (2 + ENTRY_CAUSE_BYTES) + (3 + MESSAGE_BYTES)
                   + (1 + _U32) + (1 + _U32))
STEP_MANY_FIXED = 1 + _U32
# A StepStreamResponse around its StepManyResponse: call_id, and the StepManyResponse's tag and
# length (a refused message's code, cause and message are far below any max_answer_bytes).
STEP_STREAM_FIXED = (1 + _U64) + (1 + _U32)


def varint_bytes(value: int) -> int:
    """Bytes of `value` (>= 0) as a protobuf varint."""
    return max(1, ceil_div(value.bit_length(), 7))


@dataclass(slots=True)
class AnswerBudget:
    """What one call's answer may still take; charged part by part before it is built."""

    # The cap: max_answer_bytes.
    limit: int
    # Varint bytes of the largest block id (also bounds a logical block index).
    block_bytes: int
    # Varint bytes of the largest slot.
    slot_bytes: int
    # Bytes charged so far.
    used: int = 0

    @classmethod
    def for_pool(cls, limit: int, num_blocks: int, block_size: int) -> "AnswerBudget":
        return cls(limit, varint_bytes(num_blocks - 1), varint_bytes(num_blocks * block_size - 1))

    def step_many(self, entries: int) -> None:
        """A StepManyResponse's envelope for `entries` entries (each entry's Step answer is
        charged when the entry is applied)."""
        self.charge(STEP_MANY_FIXED + entries * STEP_MANY_ENTRY, "StepMany")

    def step_stream(self) -> None:
        """A StepStreamResponse's envelope around a StepMany's answer."""
        self.charge(STEP_STREAM_FIXED, "StepStream")

    @contextlib.contextmanager
    def part(self) -> Iterator[None]:
        """A part of the answer that may fail alone (a StepMany entry): if it raises, its
        charges are given back, since its answer is then a status, charged with the envelope."""
        used = self.used
        try:
            yield
        except Exception:
            self.used = used
            raise

    def charge(self, nbytes: int, what: str) -> None:
        """Add `nbytes` for `what`; AnswerTooLarge if the answer would pass the limit."""
        if self.used + nbytes > self.limit:
            raise AnswerTooLarge(f"{what}: the answer would take up to {self.used + nbytes} "
                                 f"bytes; the limit is max_answer_bytes={self.limit}")
        self.used += nbytes

    def sequence(self, what: str, blocks: int, slots: int = 0, copies: int = 0,
                 token_ids: int = 0) -> None:
        """One SequenceBlocks: a table of `blocks` entries, `slots` slots, `copies` copies and
        `token_ids` token ids (int64: up to ten bytes each, in a packed field of their own)."""
        copy_bytes = 2 + 2 * (1 + self.block_bytes)  # tag, length, src and dst
        id_bytes = _PACKED + token_ids * _U64 if token_ids else 0
        self.charge(SEQUENCE_FIXED + blocks * self.block_bytes + slots * self.slot_bytes
                    + copies * copy_bytes + id_bytes, what)

    def step(self, num_seqs: int, num_tokens: int, block_size: int, reserve: int = 0) -> None:
        """A StepResponse for `num_tokens` tokens appended to each of `num_seqs` sequences,
        which then reserve `reserve` slots past them: at most ceil((num_tokens + reserve) /
        block_size) new blocks and one copy-on-write per sequence."""
        changed = num_seqs * (blocks_for(num_tokens + reserve, block_size) + 1)
        entry = varint_bytes(max(num_seqs - 1, 0)) + 2 * self.block_bytes
        self.charge(STEP_FIXED + num_seqs * num_tokens * self.slot_bytes + changed * entry
                    + num_seqs * 2 * self.block_bytes + num_seqs * _U32, "step")
