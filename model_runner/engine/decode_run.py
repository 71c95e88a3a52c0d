"""A followed session's decode steps, computed back to back by the forward thread (issue 35).

    run = DecodeRun(session, states, pending, deliver, ...)
    forwards.follow(run)       # the forward thread takes the session's implied steps from now
    await run.ended            # it stopped: run.implied() is the step left to the event loop

While a session is followed (runner.proto's StepStream, "Following") and every sequence of its
implied step has its next slot by reservation (reservations.py), that step needs no daemon call
and nothing of the event loop: the forward thread appends each sequence's sampled token to the
runner's view (SeqState.tokens, as a decode step inside its reservation does), writes its K/V
into the sequence's next reserved slot, samples, and hands the step's outputs to the stream
from the thread (which packs its answer there and wakes the event loop once per step). Other
sessions' steps join the same forwards (forward_loop.py). A finished sequence (a stop token,
max_tokens, max_model_len: judged by the sampler on the thread) drops out of the next step, its
token never appended, as from the implied step.

The run stops before a step, having changed nothing for it, when the event loop must act: a stop
asked (the client's next message, a drain: the step in progress is pushed first), another user
of the session (a Step call, the idle end of a hold), a sequence whose next token lies past its
reserved slots (a daemon Step certifies and reserves again), a hold ended (the client may have
changed its sequences directly) or one that may lapse before the forward ends (holds.py: no
forward writes blocks whose hold may have lapsed), or no sequence left. Its pending tokens are
then the implied step the stream takes through the engine's step, as before. The session's lock
is held for the whole run, so no other step of the session touches its states meanwhile.
"""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv.client import SeqOutput, SeqStep, StepOutputs
from pagedkv.model_runner.engine import step_log
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.sampling import Pick, SamplingRow
from pagedkv.model_runner.engine.sequences import SeqState, SessionSequences
from pagedkv.model_runner.engine.sessions import SessionEntry
from pagedkv.model_runner.runner import SequenceChunk
from pagedkv.vocab.blocks import slot_of


def seq_output(seq_id: int, state: SeqState, pick: Pick | None, max_model_len: int) -> SeqOutput:
    """What a step did to one sequence (`pick`: its sampled token, if it sampled)."""
    if pick is None:
        return SeqOutput(seq_id, len(state.tokens), state.num_computed, state.num_cached,
                         sampled=False)
    # A sequence that holds max_model_len tokens has no position for its sampled token.
    full = len(state.tokens) >= max_model_len
    return SeqOutput(seq_id, len(state.tokens), state.num_computed, state.num_cached, True,
                     pick.token_id, pick.logprob, pick.top_token_ids, pick.top_logprobs,
                     pick.finished or full, pick.constraint_ended)


def sampling_row(state: SeqState) -> SamplingRow:
    """How to sample the sequence's next token: its kept sampling, prompt and generated tokens."""
    assert state.params is not None, "kept before the forward (keep_params)"
    return SamplingRow(state.params, state.tokens[:state.prompt_len],
                       state.tokens[state.prompt_len:], state.grammar)


@dataclass
class DecodeRun:
    """One followed session's decode steps on the forward thread (module docstring)."""

    # The session's entry: its lock is held by the run's owner; `users` counts those waiting.
    entry: SessionEntry
    # The followed sequences, in the implied step's order, their states, and the token each
    # sampled last (the next step appends it).
    seq_ids: list[int]
    states: list[SeqState]
    pending: list[int]
    # Called on the forward thread with each step's outputs, in order (thread-safe).
    deliver: Callable[[StepOutputs], None]
    # The pool's free blocks per the daemon's latest answer (each answer carries it).
    free_blocks: Callable[[], int]
    block_size: int
    max_model_len: int
    # How long a hold lasts from the runner's call (holds.py).
    hold_s: float
    loop: asyncio.AbstractEventLoop
    # Counts each step as a client step decoded ahead is counted (a step, its tokens computed
    # ahead and used), from the forward thread (prometheus' figures are thread-safe).
    metrics: RunnerMetrics | None = None
    # Set on the event loop once the forward thread stops the run (or fails it).
    ended: asyncio.Future[None] = field(init=False)
    # Set by the event loop: stop before the next step (that in progress is delivered first).
    stopping: bool = False
    # Set by the forward thread once it stopped: the run takes no more forwards.
    over: bool = False
    # The pending tokens are appended already, as ahead (SeqState.ahead: a daemon Step renewed
    # the reservations and appended them), not computed: the next step computes them without
    # appending (a step of the event loop that comes first claims them instead).
    appended: bool = False
    # When the step in progress was taken (monotonic seconds): its duration, step to push.
    taken_at: float = 0.0

    def __post_init__(self) -> None:
        self.ended = self.loop.create_future()

    @property
    def known(self) -> SessionSequences:
        return self.entry.sequences

    @property
    def spent(self) -> bool:
        """Whether it stopped only because a sequence's reservation ran out (the event loop
        renews it with a daemon Step and the run goes on)."""
        return (not self.stopping and self.entry.users == 1 and bool(self.states)
                and any(len(state.tokens) >= state.private_end for state in self.states))

    def implied(self) -> list[SeqStep]:
        """The implied step left to the event loop: each sequence going on, its pending token
        appended, with its kept sampling, decode_ahead again."""
        return [SeqStep(seq_id, (token,), params=state.params, decode_ahead=True)
                for seq_id, state, token in zip(self.seq_ids, self.states, self.pending,
                                                strict=True)]

    # ------------------------------------------------------------- forward thread

    def decode_followed(self, forward_s: float) -> list[SequenceChunk] | None:
        """[forward thread] A decode step while following: the next step's chunks, its tokens
        appended to the runner's view (inside the reservations, as decode_in_reservation does);
        None (the run over, nothing changed) when the event loop must act first."""
        if self.over:
            return None
        if not self._may_go_on(forward_s):
            self.finish(None)
            return None
        self.taken_at = time.monotonic()
        chunks = []
        for state, token in zip(self.states, self.pending, strict=True):
            if self.appended:
                state.claim_ahead()  # not computed: this step computes it
            else:
                state.tokens.append(token)
            position = len(state.tokens) - 1
            chunks.append(SequenceChunk((token,), position,
                                        [slot_of(state.block_table, position, self.block_size)],
                                        state.block_table))
        self.appended = False
        return chunks

    def _may_go_on(self, forward_s: float) -> bool:
        """Whether the next step is the forward thread's: nothing asks the event loop, every
        sequence's next slot lies past its committed tokens and inside what the daemon gave it
        (its tokens, or its reservation: check_writes' rule), and the session's hold outlives
        a forward twice as long as the last one."""
        known = self.known
        if self.stopping or not self.states or self.entry.users > 1:
            return False
        if known.held_at + self.hold_s <= time.monotonic() + 2 * forward_s:
            return False  # ended (-inf), or stale: the event loop renews it or fails the step
        last = 1 if self.appended else 0
        return all(state.committed <= len(state.tokens) - last
                   < max(state.held, state.private_end) for state in self.states)

    def advance(self, picks: list[Pick]) -> None:
        """[forward thread] The step is computed: record it, deliver its outputs, and drop the
        sequences it finished from the next step."""
        outputs, going = [], []
        for seq_id, state, pick in zip(self.seq_ids, self.states, picks, strict=True):
            state.num_computed = len(state.tokens)
            output = seq_output(seq_id, state, pick, self.max_model_len)
            outputs.append(output)
            if not output.finished:
                going.append((seq_id, state, output.token_id))
        self.seq_ids = [seq_id for seq_id, _, _ in going]
        self.states = [state for _, state, _ in going]
        self.pending = [token for _, _, token in going]
        self.deliver(StepOutputs(outputs, self.free_blocks()))
        step_log.finished(self.known, outputs)
        if self.metrics is not None:
            self.metrics.step(time.monotonic() - self.taken_at)
            self.metrics.ahead_computed(len(outputs))
            self.metrics.ahead_used(len(outputs))

    def finish(self, error: BaseException | None) -> None:
        """[forward thread, or the event loop when it stops] No more forwards: the run ends,
        failed with `error` (its step's tokens appended, not computed) if set."""
        if self.over:
            return
        self.over = True
        if self.loop.is_running() and not _on_loop(self.loop):
            self.loop.call_soon_threadsafe(self._end, error)
        else:
            self._end(error)

    def _end(self, error: BaseException | None) -> None:
        if self.ended.done():
            return
        if error is None:
            self.ended.set_result(None)
        else:
            self.ended.set_exception(error)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether this thread runs `loop`."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
