"""What a client's step is made of, as the runner's step engine sees it: the sequences asked
for, the two ways a step is refused before anything changes, and the one way it fails after its
daemon calls were applied. What each sequence got is the client's own record (SeqOutput, in a
StepOutputs), built here and sent as it is."""

from dataclasses import dataclass

from pagedkv.client import SamplingParams


class InvalidStep(ValueError):
    """A client's step is malformed (mapped to INVALID_ARGUMENT); nothing was changed."""


class UnknownSequence(RuntimeError):
    """An existing sequence the runner has never seen and cannot read back, or whose sampling
    it does not keep: the client must resend it with its history and sampling
    (FAILED_PRECONDITION); nothing was changed."""


class StepNotComputed(RuntimeError):
    """A client's step failed after its daemon calls were applied (its forward failed): its
    sequences hold the step's tokens, in the daemon and in the runner, not computed (ABORTED,
    cause "StepNotComputed"). Resend the step without token_ids, every sequence as an existing
    one, to compute them; or release them. Never resend it as it was: it would append twice."""


@dataclass(frozen=True, slots=True)
class History:
    """What a sequence holds, sent by a client to a runner that does not know it (restart)."""

    # Every token the sequence holds in the daemon.
    token_ids: tuple[int, ...]
    # How many are the prompt.
    prompt_len: int
    # How many leading tokens have their K/V written, per the client: never believed (the
    # runner computes from the daemon's committed count), only checked to be in range.
    num_computed: int


@dataclass(frozen=True, slots=True)
class SeqRequest:
    """One sequence of a client's step."""

    # The client's id of the sequence in its KVPool session.
    seq_id: int
    # A new sequence: its prompt is token_ids (allocated by the runner), or with a parent_seq_id
    # a fork the runner makes that token_ids are appended to; else an existing sequence that
    # token_ids are appended to.
    new_sequence: bool
    # Tokens to add: a prompt, a decode token, more prompt; may be empty (go on computing).
    token_ids: tuple[int, ...]
    # Most tokens to compute in this step; 0 = everything not yet computed.
    max_compute_tokens: int
    # How to pick the next token once the sequence is fully computed: sent with the sequence's
    # first step and kept by the runner (SeqState.params); None = the kept one.
    params: SamplingParams | None
    # The parent of a fork the runner makes (new_sequence), or of a sequence the client forked
    # itself (its first step): the child inherits the parent's token history.
    parent_seq_id: int | None = None
    # For the first step after a runner restart: what the sequence holds.
    history: History | None = None
    # A new sequence without a parent: how many leading token_ids are the prompt (the rest were
    # generated before a preemption); 0 = all.
    num_prompt_tokens: int = 0
    # The client's next step appends the token this step samples (or releases the sequence):
    # the runner may append it and compute that step ahead (runner.proto's decode_ahead).
    decode_ahead: bool = False

