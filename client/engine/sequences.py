"""One sequence as the client scheduler sees it: the tokens it must hold and what it holds.

A sequence always knows every token it should hold (`tokens`: the prompt, then each generated
token, including one chosen but not yet appended) and how many of them it holds per the runner's
answers (`held`; the daemon may hold fewer until the runner certifies them, once a block:
runner.proto): a step sends the difference. So one mechanism covers a decode (one token), a fork
(the child appends what it holds beyond its parent) and a re-admission after preemption (all of
its tokens, as a new sequence whose committed prefix blocks come from the prefix cache).
"""

from dataclasses import dataclass, field

from pagedkv.client.engine.outputs import FinishReason
from pagedkv.client.pool.runner_client import SeqStep
from pagedkv.client.pool.sampling_params import SamplingParams
from pagedkv.client.pool.step_outputs import SeqOutput
from pagedkv.vocab.blocks import blocks_for


@dataclass(eq=False)
class Seq:
    """One sequence of a request."""

    # Its id in the client's session (unique over the engine's life: never reused).
    seq_id: int
    # The prompt, then every generated token (the newest may not be appended yet).
    tokens: list[int]
    # How many of `tokens` are the prompt.
    prompt_len: int
    # How the runner picks its next token (a parallel sample's own seed; a beam's top-K): sent
    # with its first step (and after a runner restart), then kept by the runner.
    params: SamplingParams
    # Position among the request's outputs.
    index: int = 0
    # The id of the client's request it serves (Request.client_request_id), sent with its
    # first step (and after a runner restart): the runner and the daemon log it.
    request_id: str = ""
    # Whether the daemon holds it, how many tokens it holds (the runner's answers' num_tokens),
    # and how many are computed.
    allocated: bool = False
    held: int = 0
    computed: int = 0
    # The sequence to fork from on its first step (a parallel sample, a beam's extra
    # continuation); None once forked, or for a sequence allocated from its tokens.
    parent: "Seq | None" = None
    # Its last block may be shared with a relative: its next append copies it (one block).
    shares_last_block: bool = False
    # Raw logprob of each generated token, and the top ones when asked.
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_generated(self) -> int:
        """len(generated), without copying the tokens."""
        return len(self.tokens) - self.prompt_len

    @property
    def is_prefilling(self) -> bool:
        """Whether tokens it holds (or will hold once allocated) are not computed yet."""
        if not self.allocated:
            return self.parent is None
        return self.computed < self.held

    def ready(self) -> bool:
        """Whether it can be stepped now: a fork's parent must hold exactly what the child
        inherits, fully computed."""
        parent = self.parent
        if parent is None:
            return True
        return (parent.allocated and parent.computed == parent.held
                and parent.held <= len(self.tokens))

    def prompt_tokens_left(self) -> int:
        """Tokens a prefill still has to compute (all of them before allocation: an upper
        bound, the prefix cache may serve some)."""
        if not self.allocated:
            return len(self.tokens) if self.parent is None else 0
        return self.held - self.computed

    def allocates(self) -> bool:
        """Whether its next step allocates it from its tokens (new, without a parent): the
        one step where the daemon's host tier may serve its prefix."""
        return not self.allocated and self.parent is None

    def step(self, max_compute_tokens: int = 0, decode_ahead: bool = False,
             skip_host_tier: bool = False) -> SeqStep:
        """What to send for it this step (max_compute_tokens: 0 = all; decode_ahead: its next
        step appends the token this one samples; skip_host_tier: when it allocates, recompute
        its prefix rather than restore it from the host tier)."""
        if not self.allocated and self.parent is not None:
            return SeqStep(self.seq_id, self.tokens[self.parent.held:], new_sequence=True,
                           params=self.params, parent_seq_id=self.parent.seq_id,
                           decode_ahead=decode_ahead, request_id=self.request_id)
        if not self.allocated:
            readmitted = len(self.tokens) > self.prompt_len
            return SeqStep(self.seq_id, list(self.tokens), new_sequence=True,
                           max_compute_tokens=max_compute_tokens, params=self.params,
                           num_prompt_tokens=self.prompt_len if readmitted else 0,
                           decode_ahead=decode_ahead, skip_host_tier=skip_host_tier,
                           request_id=self.request_id)
        # The runner keeps the sampling its first step sent.
        return SeqStep(self.seq_id, self.tokens[self.held:], max_compute_tokens=max_compute_tokens,
                       decode_ahead=decode_ahead)

    def blocks_needed(self, block_size: int, forked_from: bool, reservation: int = 0) -> int:
        """An upper bound on the free blocks its step takes (`forked_from`: a child forks from
        it in the same step, so its own append copies the shared last block; `reservation`: the
        blocks a contiguous daemon reserves per sequence, 0 when paged)."""
        if reservation:  # a new sequence or fork takes a reservation, appends fill it
            return 0 if self.allocated else reservation
        if not self.allocated and self.parent is None:
            return blocks_for(len(self.tokens), block_size)
        base = self.parent.held if not self.allocated and self.parent else self.held
        if len(self.tokens) == base:
            return 0
        grow = blocks_for(len(self.tokens), block_size) - blocks_for(base, block_size)
        shared = self.shares_last_block or forked_from or not self.allocated
        return grow + (1 if shared and base % block_size else 0)

    def newly_computed(self, out: SeqOutput) -> int:
        """Tokens whose K/V the step answered by `out` computed for it (before `stepped`
        applies the answer): a new sequence's cached prefix and a fork's inherited tokens were
        not computed by it."""
        if self.allocated:
            before = self.computed
        elif self.parent is not None:
            before = self.parent.computed
        else:
            before = out.num_cached
        return max(0, out.num_computed - before)

    def stepped(self, out: SeqOutput) -> None:
        """A step's answer about it (the token it sampled is for the request to handle)."""
        if not self.allocated and self.parent is not None:
            # Forked without appending: its partial last block is its parent's.
            self.shares_last_block = out.num_tokens == self.parent.held
            self.parent = None
        elif out.num_tokens > self.held:
            self.shares_last_block = False
        self.allocated = True
        self.held = out.num_tokens
        self.computed = out.num_computed

    def record(self, out: SeqOutput, finish: FinishReason | None) -> None:
        """Append the token it sampled (appended to the daemon by its next step)."""
        self.tokens.append(out.token_id)
        self.logprobs.append(out.logprob)
        if out.top_token_ids:
            self.top_logprobs.append(dict(zip(out.top_token_ids, out.top_logprobs, strict=True)))
        self.finish_reason = finish

    def preempted(self) -> None:
        """Freed: it will be re-admitted from its tokens as a new sequence."""
        self.allocated = False
        self.held = self.computed = 0
        self.parent = None
        self.shares_last_block = False
