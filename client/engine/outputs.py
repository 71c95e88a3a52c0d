"""What a request returns: vLLM's `RequestOutput` / `CompletionOutput` shape, token ids first;
and what each engine step did (`StepRecord`, for reports and plots).

The engine fills token ids; the offline `LLM` API adds text through the model's tokenizer.
"""

from dataclasses import dataclass, field
from typing import Literal

# "stop": a stop (or end-of-sequence) token was generated, and is the last output token;
# "length": max_tokens were generated, or beam search ended at its length limit.
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One output sequence of a request."""

    # Position among the request's outputs (parallel samples: the sample's index).
    index: int
    token_ids: tuple[int, ...]
    # Sum of the raw logprobs of token_ids.
    cumulative_logprob: float
    # Per generated token, its raw logprob; None when the request asked no logprobs.
    logprobs: tuple[float, ...] | None
    # Per generated token, the top-k {token id: logprob} asked with `logprobs=k` (k > 0).
    top_logprobs: tuple[dict[int, float], ...] | None
    # None while the sequence is still generating.
    finish_reason: FinishReason | None
    # Beam search: the hypothesis' score, sum(logprobs) / length ** length_penalty.
    score: float | None = None
    # Decoded text (the LLM API fills it; the engine deals in token ids).
    text: str = ""


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's state: its outputs so far, or the final ones when `finished`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens, of them served by the prefix cache (first admission of the first
    # sequence), and tokens generated over every sequence of the request.
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    # Times the request was preempted (its sequences freed and recomputed later).
    num_preemptions: int = 0
    # The prompt's text, when it came as text (LLM API).
    prompt: str | None = None
    # Seconds from arrival to the first generated token, and to the end (None until then).
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step did, for reports and plots (`Engine.observers`)."""

    # Seconds since the engine started.
    time_s: float
    # Sequences stepped, tokens sent to compute (an upper bound for prefills), tokens sampled.
    num_seqs: int
    num_tokens: int
    num_sampled: int
    # Requests running and waiting after the step, and the pool's free blocks.
    running_seqs: int
    waiting: int
    free_blocks: int
    # The client's own time on this step (planning and handling answers), seconds.
    schedule_s: float
