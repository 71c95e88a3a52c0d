"""Sampling parameters travel once per sequence (issue 18): with its first step, kept by the
runner with the sequence, left out of every later step.

- the wire: proto3 zeros mean "off" (logprobs -1 is none, 0 the sampled token's only); a step
  without `sampling` reads as "the kept one"; an invalid one is InvalidStep naming the sequence;
- the client: a sequence's first step carries its sampling, later steps do not (a decode step's
  SequenceStep shrinks to its id and token), a resend after a runner restart carries it again;
- the runner's table: `with_params` fills in the kept sampling, refuses (UnknownSequence, nothing
  changed) a known sequence it keeps none for, and the sampling goes with the sequence.
"""

import pytest

from pagedkv.client import History, SamplingParams, SeqStep, StructuredOutputs
from pagedkv.client.engine.runner_link import with_history
from pagedkv.client.engine.sequences import Seq
from pagedkv.client.pool.step_outputs import SeqOutput
from pagedkv.model_runner.engine.sequences import SeqState, SessionSequences
from pagedkv.model_runner.engine.steps import InvalidStep, UnknownSequence
from pagedkv.model_runner.process.step_messages import NO_LIMIT, sampling_params, seq_request
from pagedkv.proto import runner_pb2 as rpb

TOP_K = SamplingParams(temperature=0.75, top_k=5, seed=3, stop_token_ids=(4, 5), max_tokens=9,
                       logprobs=2)


@pytest.mark.parametrize(("message", "expected"), [
    (rpb.SamplingParams(), SamplingParams(temperature=0.0, logprobs=0, max_tokens=NO_LIMIT)),
    (rpb.SamplingParams(temperature=0.75, top_k=5, top_p=0.5, min_p=0.125, seed=3, has_seed=True,
                        logprobs=2, stop_token_ids=[4, 5], max_tokens=9,
                        repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=-1.25),
     SamplingParams(temperature=0.75, top_k=5, top_p=0.5, min_p=0.125, seed=3, logprobs=2,
                    stop_token_ids=(4, 5), max_tokens=9, repetition_penalty=1.25,
                    presence_penalty=0.5, frequency_penalty=-1.25)),
    (rpb.SamplingParams(temperature=1.0, top_p=0.0, logprobs=-1, max_tokens=1),
     SamplingParams(temperature=1.0, top_p=1.0, logprobs=None, max_tokens=1)),
])
def test_wire_values_become_sampling_params(message: rpb.SamplingParams,
                                            expected: SamplingParams) -> None:
    assert sampling_params(message) == expected


def test_the_client_record_reads_back_as_it_was_sent() -> None:
    """SeqStep.message and the servicer's reading agree on every field."""
    sent = SeqStep(7, [1, 2], new_sequence=True, params=TOP_K)
    assert seq_request(sent.message()).params == TOP_K
    penalized = SamplingParams(presence_penalty=-2.0, frequency_penalty=0.75, max_tokens=4)
    assert seq_request(SeqStep(7, [1], True, params=penalized).message()).params == penalized
    assert seq_request(SeqStep(7, [3]).message()).params is None


@pytest.mark.parametrize("constraint", [
    StructuredOutputs(json='{"type": "object"}'), StructuredOutputs(regex="a+"),
    StructuredOutputs(choice=("yes", 'say "no"')), StructuredOutputs(grammar='root ::= "a"'),
    StructuredOutputs(json_object=True)])
def test_min_tokens_and_each_constraint_travel(constraint: StructuredOutputs) -> None:
    sent = SamplingParams(max_tokens=9, min_tokens=3, structured_outputs=constraint)
    assert seq_request(SeqStep(7, [1], True, params=sent).message()).params == sent


@pytest.mark.parametrize(("sampling", "reason"), [
    (rpb.SamplingParams(max_tokens=4, min_tokens=5), r"min_tokens must be in \[0, max_tokens=4\]"),
    (rpb.SamplingParams(structured_outputs=rpb.StructuredOutputs()),
     "structured_outputs sets no constraint"),
    (rpb.SamplingParams(structured_outputs=rpb.StructuredOutputs(json_object=False)),
     "structured_outputs needs exactly one"),
    (rpb.SamplingParams(structured_outputs=rpb.StructuredOutputs(json_schema="{")),
     "structured_outputs.json is not valid JSON"),
    (rpb.SamplingParams(structured_outputs=rpb.StructuredOutputs(regex="a" * 70000)),
     "structured_outputs.regex must be a non-empty string of at most 65536"),
    (rpb.SamplingParams(structured_outputs=rpb.StructuredOutputs(choice=rpb.Choices())),
     "structured_outputs.choice must be 1 to 256"),
])
def test_a_bad_constraint_is_refused_naming_the_field(sampling: rpb.SamplingParams,
                                                      reason: str) -> None:
    with pytest.raises(InvalidStep, match=f"sequence 12: {reason}"):
        seq_request(rpb.SequenceStep(seq_id=12, sampling=sampling))


def test_an_invalid_sampling_is_refused_naming_the_sequence() -> None:
    bad = rpb.SequenceStep(seq_id=12, sampling=rpb.SamplingParams(temperature=-1.0))
    with pytest.raises(InvalidStep, match="sequence 12: temperature must be >= 0"):
        seq_request(bad)
    infinite = rpb.SequenceStep(seq_id=13, sampling=rpb.SamplingParams(temperature=float("inf")))
    with pytest.raises(InvalidStep, match="sequence 13: temperature must be finite"):
        seq_request(infinite)
    for name in ("presence_penalty", "frequency_penalty"):
        penalty = rpb.SequenceStep(seq_id=14, sampling=rpb.SamplingParams(**{name: 3.0}))
        with pytest.raises(InvalidStep, match=rf"sequence 14: {name} must be in \[-2, 2\]"):
            seq_request(penalty)


def test_a_decode_step_sends_the_sampling_only_with_the_first_step() -> None:
    """The first step carries the sampling; a decode step is the id and the token: the bytes a
    sampled sequence's decode step costs on the wire, before and after issue 18."""
    seq = Seq(1, [5, 6, 7], 3, TOP_K)
    first = seq.step().message()
    assert first.HasField("sampling") and first.sampling.top_k == 5
    seq.stepped(SeqOutput(1, 3, 3, 0, True, 9, -0.5, (9, 8), (-0.5, -1.0), False))
    seq.record(SeqOutput(1, 3, 3, 0, True, 9, -0.5, (9, 8), (-0.5, -1.0), False), None)
    decode = seq.step().message()
    assert not decode.HasField("sampling")
    assert list(decode.token_ids) == [9]
    every_step = rpb.SequenceStep()
    every_step.CopyFrom(decode)
    every_step.sampling.CopyFrom(first.sampling)  # what each decode step sent before
    assert decode.ByteSize() == 5  # seq_id, token_ids
    assert every_step.ByteSize() == 36


def test_a_resend_after_a_runner_restart_carries_the_sampling_again() -> None:
    seq = Seq(1, [5, 6, 7, 9], 3, TOP_K, allocated=True, held=3, computed=3)
    (resent,) = with_history([seq], [seq.step()])
    assert resent.params == TOP_K
    assert resent.history == History([5, 6, 7], 3, 3)
    fresh = Seq(2, [5, 6], 2, TOP_K)  # new: its step carries the sampling already
    assert with_history([fresh], [fresh.step()])[0].params == TOP_K


def known_with(seq_id: int, params: SamplingParams | None) -> SessionSequences:
    known = SessionSequences()
    known.put(seq_id, SeqState([1, 2, 3], 3, 3, [0], params=params))
    return known


def test_the_runner_fills_in_the_kept_sampling() -> None:
    known = known_with(4, TOP_K)
    (request,) = known.with_params([SeqStep(4, (9,), False, 0, None)])
    assert request.params == TOP_K
    greedy = SamplingParams(temperature=0.0)
    (changed,) = known.with_params([SeqStep(4, (9,), False, 0, greedy)])
    assert changed.params == greedy  # sent again: it replaces the kept one once kept
    known.keep_params([changed], [known.seqs[4]], {})
    assert known.seqs[4].params == greedy


def test_a_known_sequence_without_kept_sampling_is_refused_and_nothing_changes() -> None:
    """A sequence learnt by a step that then failed keeps no sampling: the step is refused
    naming it, and the client resends it with its history and sampling."""
    known = known_with(4, TOP_K)
    known.put(5, SeqState([1, 2], 2, 2, [1]))
    before = {seq_id: (state.params, list(state.tokens)) for seq_id, state in known.seqs.items()}
    requests = [SeqStep(4, (9,), False, 0, None), SeqStep(5, (9,), False, 0, None)]
    with pytest.raises(UnknownSequence, match=r"sequence 5: .* resend it with its history and "
                                              r"sampling"):
        known.with_params(requests)
    assert {seq_id: (state.params, state.tokens) for seq_id, state in known.seqs.items()} == before


def test_an_unknown_sequence_is_left_to_the_daemon_read_back() -> None:
    """The preparer asks the daemon about it first (another session's is NOT_FOUND), and the
    sampling goes with a released sequence."""
    known = known_with(4, TOP_K)
    known.drop([4])
    (request,) = known.with_params([SeqStep(4, (9,), False, 0, None)])
    assert request.params is None and not known.seqs
