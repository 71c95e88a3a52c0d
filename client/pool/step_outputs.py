"""What a runner step did to its sequences, on both sides of the wire: a `SeqOutput` per
sequence, in a `StepOutputs`, and their one packed message (runner.proto's RunnerStepResponse:
each field of every sequence in one packed array, the top logprobs flat with a count per
sequence), so an answer to a forward is one message however many sequences it carries. A
runner's push may carry several steps of a followed session (a lagging stream's steps merged
into one message): `steps` splits it back into them."""

from collections.abc import Iterator, Sequence
from itertools import accumulate, pairwise
from typing import NamedTuple, Self, overload

from pagedkv.proto import runner_pb2 as rpb


class SeqOutput(NamedTuple):
    """What a step did to one sequence (an entry of runner.proto's RunnerStepResponse): the one
    record on both sides of the wire, built by the runner's forward loop and read by the
    client. Immutable; a named tuple rather than a frozen dataclass because one is made per
    sequence per step on both sides (on the forward thread too), and a frozen dataclass's
    __init__ (one object.__setattr__ a field) costs about 1.6 us against 0.2 us."""

    seq_id: int
    # Tokens held, and how many of them are computed.
    num_tokens: int
    num_computed: int
    # Prompt tokens the prefix cache served (new sequences).
    num_cached: int
    # Whether token_id holds a sampled token (not while a chunked prefill goes on).
    sampled: bool
    token_id: int = -1
    # Raw log-probability of the sampled token, and the top ones when asked.
    logprob: float = 0.0
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    # A stop token was sampled, or max_tokens were generated, or the model's positions are full,
    # or the structured output is complete (constraint_ended).
    finished: bool = False
    # The sampled token completed the sequence's structured output: finish reason "stop".
    constraint_ended: bool = False

    @property
    def outcome(self) -> "rpb.Outcome.ValueType":
        """The sampled / finished / constraint_ended flags as the answer's one enum."""
        if self.constraint_ended:
            return rpb.OUTCOME_CONSTRAINT_ENDED
        if self.finished:
            return rpb.OUTCOME_FINISHED
        return rpb.OUTCOME_SAMPLED if self.sampled else rpb.OUTCOME_NOT_SAMPLED


class StepOutputs(Sequence[SeqOutput]):
    """A step's outputs, one per requested sequence in request order, and the pool's free
    blocks per the runner's latest daemon answer (what a scheduler admits by)."""

    def __init__(self, outputs: Sequence[SeqOutput], free_blocks: int) -> None:
        self._outputs = tuple(outputs)
        self.free_blocks = free_blocks

    @overload
    def __getitem__(self, index: int) -> SeqOutput: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[SeqOutput]: ...
    def __getitem__(self, index: int | slice) -> SeqOutput | Sequence[SeqOutput]:
        return self._outputs[index]

    def __len__(self) -> int:
        return len(self._outputs)

    def __iter__(self) -> Iterator[SeqOutput]:
        return iter(self._outputs)

    def steps(self) -> list["StepOutputs"]:
        """The steps a push carries, in order (runner.proto's RunnerStepResponse: a push merges
        the steps the stream had not sent yet). A step names each sequence once, and a followed
        session's next step names some of the previous step's sequences in the same order, so
        a step begins at each entry whose seq_id the step so far already holds. Each step has
        the push's free_blocks (the latest). [self] for a single step (every other answer)."""
        bounds, seen = [0], set[int]()
        for index, output in enumerate(self._outputs):
            if output.seq_id in seen:
                bounds.append(index)
                seen.clear()
            seen.add(output.seq_id)
        if len(bounds) == 1:
            return [self]
        bounds.append(len(self._outputs))
        return [StepOutputs(self._outputs[start:end], self.free_blocks)
                for start, end in pairwise(bounds)]

    def message(self) -> rpb.RunnerStepResponse:
        """The packed answer: one array per field, an entry per sequence."""
        outs = self._outputs
        if not outs:
            return rpb.RunnerStepResponse(free_blocks=self.free_blocks)
        # One column per field, in one pass (the fields in SeqOutput's order).
        (seq_ids, num_tokens, num_computed, num_cached, _, token_ids, logprobs, top_ids,
         top_lps, _, _) = zip(*outs, strict=True)
        return rpb.RunnerStepResponse(
            free_blocks=self.free_blocks, seq_ids=seq_ids, num_tokens=num_tokens,
            num_computed_tokens=num_computed, num_cached_tokens=num_cached,
            outcomes=[o.outcome for o in outs], token_ids=token_ids, logprobs=logprobs,
            top_counts=[len(ids) for ids in top_ids],
            top_token_ids=[t for ids in top_ids for t in ids],
            top_logprobs=[p for lps in top_lps for p in lps])

    @classmethod
    def from_message(cls, m: rpb.RunnerStepResponse) -> Self:
        """A packed answer's outputs; ValueError naming the field when its arrays disagree (a
        runner answers them as one table, so that is never its answer)."""
        count = len(m.seq_ids)
        for name in ("num_tokens", "num_computed_tokens", "num_cached_tokens", "outcomes",
                     "token_ids", "logprobs", "top_counts"):
            if len(getattr(m, name)) != count:
                raise ValueError(f"a runner answer holds {len(getattr(m, name))} {name} for "
                                 f"{count} seq_ids")
        ends = list(accumulate(m.top_counts, initial=0))
        if not ends[-1] == len(m.top_token_ids) == len(m.top_logprobs):
            raise ValueError(f"a runner answer's top_counts add up to {ends[-1]}, but it holds "
                             f"{len(m.top_token_ids)} top_token_ids and {len(m.top_logprobs)} "
                             "top_logprobs")
        top_ids, top_lps = list(m.top_token_ids), list(m.top_logprobs)
        outcomes = m.outcomes
        return cls([SeqOutput(seq_id, n, computed, cached, outcome != rpb.OUTCOME_NOT_SAMPLED,
                              token, logprob, tuple(top_ids[start:end]),
                              tuple(top_lps[start:end]),
                              outcome >= rpb.OUTCOME_FINISHED,
                              outcome == rpb.OUTCOME_CONSTRAINT_ENDED)
                    for seq_id, n, computed, cached, outcome, token, logprob, start, end
                    in zip(m.seq_ids, m.num_tokens, m.num_computed_tokens, m.num_cached_tokens,
                           outcomes, m.token_ids, m.logprobs, ends[:-1], ends[1:], strict=True)],
                   m.free_blocks)
