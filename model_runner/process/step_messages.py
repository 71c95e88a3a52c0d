"""runner.proto's step messages as the client's own records, and back: what the Step call and
the StepStream messages (and pushes) share. A request's sequences become SeqSteps (their
sampling checked here); a step's StepOutputs become its packed answer by their own
`message()` (client/pool/step_outputs.py)."""

from collections.abc import Awaitable, Callable, Sequence

from pagedkv.client import History, SamplingParams, SeqStep, StepOutputs, StructuredOutputs
from pagedkv.model_runner.engine.steps import InvalidStep
from pagedkv.proto import runner_pb2 as rpb

# StepEngine.step, behind whatever gate the server puts before it.
StepFunction = Callable[[str, Sequence[SeqStep], Sequence[int]], Awaitable[StepOutputs]]

# max_tokens of a request that set none: more than any sequence generates.
NO_LIMIT = 2**31 - 1


def sampling_params(message: rpb.SamplingParams) -> SamplingParams:
    """`message` as SamplingParams (ValueError if invalid), read once per sequence (the runner
    keeps it): proto3 zeros mean "off" (temperature 0 = greedy; logprobs < 0 = none)."""
    return SamplingParams(
        temperature=message.temperature, top_k=message.top_k,
        top_p=message.top_p if 0 < message.top_p <= 1 else 1.0, min_p=message.min_p,
        repetition_penalty=message.repetition_penalty or 1.0,
        presence_penalty=message.presence_penalty, frequency_penalty=message.frequency_penalty,
        seed=message.seed if message.has_seed else None,
        logprobs=message.logprobs if message.logprobs >= 0 else None,
        stop_token_ids=tuple(message.stop_token_ids), max_tokens=message.max_tokens or NO_LIMIT,
        min_tokens=message.min_tokens,
        structured_outputs=(structured_outputs(message.structured_outputs)
                            if message.HasField("structured_outputs") else None))


def structured_outputs(message: rpb.StructuredOutputs) -> StructuredOutputs:
    """`message` as StructuredOutputs; ValueError naming the field (`structured_outputs.json`
    for json_schema: the client's name) when it sets none or a bad value."""
    field = message.WhichOneof("constraint")
    if field is None:
        raise ValueError("structured_outputs sets no constraint (json_schema, regex, choice, "
                         "grammar or json_object)")
    if field == "choice":
        return StructuredOutputs(choice=tuple(message.choice.choices))
    if field == "json_object":
        return StructuredOutputs(json_object=message.json_object)
    return StructuredOutputs(**{"json" if field == "json_schema" else field:
                                getattr(message, field)})


def seq_request(message: rpb.SequenceStep) -> SeqStep:
    history = None
    if message.HasField("history"):
        history = History(tuple(message.history.token_ids), message.history.prompt_len,
                          message.history.num_computed)
    params = None
    if message.HasField("sampling"):
        try:
            params = sampling_params(message.sampling)
        except ValueError as exc:
            raise InvalidStep(f"sequence {message.seq_id}: {exc}") from None
    return SeqStep(message.seq_id, tuple(message.token_ids), message.new_sequence,
                   message.max_compute_tokens, params,
                   message.parent_seq_id if message.has_parent else None, history,
                   message.num_prompt_tokens, message.decode_ahead, _skip_host_tier(message),
                   message.request_id)


def _skip_host_tier(message: rpb.SequenceStep) -> bool:
    """skip_host_tier as the runner acts on it: only a new sequence without a parent has an
    Allocate to carry it to the daemon (a fork's child shares its parent's blocks, an existing
    sequence only appends), so on any other sequence it is ignored, not refused, as
    runner.proto words it ("A new sequence without a parent")."""
    return message.skip_host_tier and message.new_sequence and not message.has_parent
