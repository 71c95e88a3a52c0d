"""Bounds on a runner step's answer, checked against the request before the step changes anything.

A step's answer (runner.proto's RunnerStepResponse) holds an entry per sequence of the request in
each of its packed arrays, and as many top token ids and logprobs as each sequence asked
(`logprobs`, up to the vocabulary) in its two flat ones. So its size follows from the request
and the sampling the runner keeps for its sequences, and the step engine checks it first: a
sequence asking for more than `max_logprobs` is INVALID_ARGUMENT, and a step whose answer could
pass `max_answer_bytes` is RESOURCE_EXHAUSTED (cause `AnswerTooLarge`), both before any daemon
call. No step is then applied at the daemon and its answer refused by the client's size check
(which left the client without its tokens and the daemon holding every sequence).

The bound follows proto3's encoding, as the daemon's answer_size.py: a field is a tag byte and its
value (a varint of at most 10 bytes, 5 for a uint32; a float of 4); a packed repeated field is
a tag, a length and its values; a message inside another is a tag, a length and its fields.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from pagedkv.client import AnswerTooLarge, SeqStep
from pagedkv.model_runner.engine.steps import InvalidStep
from pagedkv.proto.limits import DEFAULT_ANSWER_BYTES, MAX_MESSAGE_BYTES

# vLLM's default max_logprobs: enough for beam search's candidates and for scoring.
DEFAULT_MAX_LOGPROBS = 20

_U32, _U64, _FLOAT = 5, 10, 4
# An int32 varint: 5 bytes, but 10 for a negative one (-1: a token not sampled).
_I32 = 10
# The answer's packed arrays (seq_ids, num_tokens, num_computed_tokens, num_cached_tokens,
# outcomes, token_ids, logprobs, top_counts, top_token_ids, top_logprobs): each a tag and a
# length when not empty.
PACKED_FIELDS = 10
# One sequence's entries: seq_id, num_tokens, num_computed_tokens, num_cached_tokens, its
# outcome (an enum of one byte), token_id, logprob, top_count.
OUTPUT_FIXED = _U64 + 3 * _U32 + 1 + _I32 + _FLOAT + _U32
# One top logprob: its token id and its logprob.
PER_LOGPROB = _I32 + _FLOAT
# The answer's own fields: free_blocks, and each packed array's tag and length.
ANSWER_FIXED = (1 + _U32) + PACKED_FIELDS * (1 + _U32)
# What a RunnerStreamResponse adds around the answer: its step_id, and the answer's tag and
# length (a failed step's code, cause and message replace the answer, in a few hundred bytes).
STREAM_ENVELOPE = (1 + _U64) + (1 + _U32)


def output_bytes(logprobs: int) -> int:
    """Most encoded bytes of one sequence's entries with `logprobs` top logprobs."""
    return OUTPUT_FIXED + max(logprobs, 0) * PER_LOGPROB


@dataclass(frozen=True, slots=True)
class AnswerLimits:
    """What one step may ask for, so that its answer stays within what clients receive."""

    # Most top logprobs one sequence may ask for (SamplingParams.logprobs).
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # Most encoded bytes of one step's answer; the default fits gRPC's default receive limit
    # (4 MiB), which stock clients keep. At most MAX_MESSAGE_BYTES (what the runner sends) less
    # STREAM_ENVELOPE: on a StepStream the answer travels inside a RunnerStreamResponse.
    max_answer_bytes: int = DEFAULT_ANSWER_BYTES

    def __post_init__(self) -> None:
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        least = ANSWER_FIXED + output_bytes(self.max_logprobs)
        most = MAX_MESSAGE_BYTES - STREAM_ENVELOPE
        if not least <= self.max_answer_bytes <= most:
            raise ValueError(f"max_answer_bytes must be in [{least}, {most}] (one "
                             f"sequence with max_logprobs={self.max_logprobs} must fit), got "
                             f"{self.max_answer_bytes}")

    def check(self, requests: Sequence[SeqStep]) -> None:
        """InvalidStep for a sequence asking more than max_logprobs; AnswerTooLarge when the
        answer could pass max_answer_bytes. `requests` carry every sequence's sampling, the
        kept ones included (SessionSequences.with_params). Nothing is read or changed."""
        total = ANSWER_FIXED
        for request in requests:
            logprobs = (request.params.logprobs if request.params is not None else None) or 0
            if logprobs > self.max_logprobs:
                raise InvalidStep(f"sequence {request.seq_id}: logprobs={logprobs} is over the "
                                  f"runner's max_logprobs={self.max_logprobs}")
            total += output_bytes(logprobs)
        if total > self.max_answer_bytes:
            raise AnswerTooLarge(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the answer to {len(requests)} sequences could take up to {total} bytes; "
                f"the limit is max_answer_bytes={self.max_answer_bytes}: send fewer sequences "
                "per step, or ask for fewer logprobs")
