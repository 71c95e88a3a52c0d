"""A step's outputs as one packed answer (runner.proto's RunnerStepResponse) and back: every
field of every sequence survives, the answer is one message of packed arrays, and an answer
whose arrays disagree is refused naming the field."""

import pytest

from pagedkv.client import SeqOutput, StepOutputs
from pagedkv.proto import runner_pb2 as rpb

OUTPUTS = StepOutputs([
    SeqOutput(7, 40, 39, 16, sampled=True, token_id=5, logprob=-0.5,
              top_token_ids=(5, 9), top_logprobs=(-0.5, -1.5)),
    SeqOutput(8, 120, 64, 0, sampled=False),  # a chunked prefill going on
    SeqOutput(9, 41, 40, 0, sampled=True, token_id=2, logprob=-0.25, finished=True),
    SeqOutput(2**64 - 1, 12, 11, 0, sampled=True, token_id=3, finished=True,
              constraint_ended=True, top_token_ids=(3,), top_logprobs=(-0.125,)),
], free_blocks=321)


def test_every_field_of_every_sequence_goes_through_the_packed_answer() -> None:
    message = OUTPUTS.message()
    back = StepOutputs.from_message(rpb.RunnerStepResponse.FromString(
        message.SerializeToString()))
    assert list(back) == list(OUTPUTS) and back.free_blocks == 321
    # One message of arrays: an entry per sequence, the top logprobs flat.
    assert list(message.seq_ids) == [7, 8, 9, 2**64 - 1]
    assert list(message.outcomes) == [rpb.OUTCOME_SAMPLED, rpb.OUTCOME_NOT_SAMPLED,
                                      rpb.OUTCOME_FINISHED, rpb.OUTCOME_CONSTRAINT_ENDED]
    assert list(message.top_counts) == [2, 0, 0, 1]
    assert list(message.top_token_ids) == [5, 9, 3]


def test_an_empty_answer_is_empty() -> None:
    back = StepOutputs.from_message(StepOutputs([], 4).message())
    assert len(back) == 0 and back.free_blocks == 4


@pytest.mark.parametrize(("field", "named"), [("num_tokens", "num_tokens"),
                                              ("outcomes", "outcomes"),
                                              ("top_token_ids", "top_counts")])
def test_an_answer_whose_arrays_disagree_is_refused_naming_the_field(field: str,
                                                                     named: str) -> None:
    message = OUTPUTS.message()
    getattr(message, field).pop()
    with pytest.raises(ValueError, match=named):
        StepOutputs.from_message(message)
