"""Decode steps by the block: a decoding sequence needs the daemon only when it runs out of the
slots it reserved (kvpool.proto's StepRequest.reserve_tokens; vLLM's num_lookahead_tokens).

    blocks = BlockSteps(daemon_steps, session_holds, lambda: model_runner)
    await blocks.decode(known, requests, states, commit)   # one token per sequence

A daemon Step that appends a sequence's tokens also reserves RESERVE_BLOCKS blocks' worth of
slots past them: private to the sequence, their blocks in the table the answer gives
(SeqState.private_end). Until they run out the runner appends each decode token to its own view
only (SeqState.tokens; the daemon holds the first SeqState.held), takes its slot from that table
and writes its K/V in the forward: no daemon call. The step that runs out sends, per sequence,
every token the daemon does not hold yet with its id, then the new one (appending certifies
them: their full blocks are keyed by their content), committing what the daemon held before
(all computed: the Step's commit), and reserves again.

Aligned calls: when one sequence of a step needs a call, every sequence of the step joins it, so
they hold the same number of uncertified tokens afterwards (one Step entry) and run low together:
about one call per RESERVE_BLOCKS * block_size steps whatever their offsets in their blocks. A
session whose sequences have less than LOW_BLOCKS blocks left joins a call other sessions are
making at that moment (the same StepMany, daemon_steps.py).

What stays true. The runner commits only K/V it computed of ids the daemon holds: a Step's
commit covers the tokens the daemon held before it, all computed; reserved slots hold no tokens
and no commit covers them. No forward writes a slot of a committed block: reserved slots lie past
every token the daemon holds. A runner that dies between reserving and certifying leaves reserved
slots and uncertified K/V that nothing commits; its client was told of more tokens than the
daemon holds, and resends them as history to a restarted runner, which appends the ones the
daemon lacks and computes them again (runner.proto). After a gap in the runner's hold (the
client may have freed or re-created its sequences directly) the next step makes a call, whose
answer the runner checks its view against, before it writes anything.
"""

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence

from pagedkv.client import InvalidArgument, PoolExhausted, SeqStep, Step, StepResult
from pagedkv.model_runner.engine.daemon_steps import DaemonSteps
from pagedkv.model_runner.engine.holds import SessionHolds
from pagedkv.model_runner.engine.sequences import Ahead, SeqState, SessionSequences
from pagedkv.model_runner.runner import ModelRunner

# Blocks' worth of slots a Step reserves past each sequence's tokens: the calls a decoding
# sequence makes are about one per RESERVE_BLOCKS * block_size tokens.
RESERVE_BLOCKS = 2
# A sequence with fewer slots left than this many blocks' worth joins a call being made anyway:
# as many as a call reserves, so a session that decoded since its last call joins any other's,
# and the sessions of a merged forward fall into step (one StepMany per reservation).
LOW_BLOCKS = RESERVE_BLOCKS
# A Step reserves only while the pool's free blocks (per the daemon's latest answer) are at least
# this many times the blocks its reservations may take: in a nearly full pool reserved blocks
# would push other sequences out (preemption), so decoding goes back to a Step per token.
ROOM_FACTOR = 2


class BlockSteps:
    """Decode steps of one token per sequence, with a daemon Step only when one is needed."""

    def __init__(self, steps: DaemonSteps, holds: SessionHolds,
                 runner: Callable[[], ModelRunner]) -> None:
        # The runner's daemon Steps, those made at the same moment sent in one StepMany.
        self.steps = steps
        # The runner's holds: how long a call holds the session, and whether its hold ended.
        self.holds = holds
        # The model runner in use (its block size and positions).
        self._runner = runner
        # Most slots a Step reserves: halved each time the daemon refuses a reservation as too
        # large (its max_reserve_tokens; kvpool.proto), which the runner cannot ask for.
        self.max_reserve = 1 << 16

    async def decode(self, known: SessionSequences, requests: Sequence[SeqStep],
                     states: list[SeqState], commit: bool) -> None:
        """Append each request's one token to its sequence (`states`, in request order), in the
        runner's view (decode_in_reservation), and in the daemon if a call is needed
        (decode_with_call). `commit`: a call may commit what the daemon holds of them
        (computed, ids known to be its own)."""
        tokens = [r.token_ids[0] for r in requests]
        if self._needs_call(known, states):
            await self.decode_with_call(known, [r.seq_id for r in requests], states, tokens,
                                        commit)
        else:
            decode_in_reservation(states, tokens)

    async def decode_with_call(self, known: SessionSequences, seq_ids: list[int],
                               states: list[SeqState], tokens: list[int], commit: bool) -> None:
        """A decode step with a daemon Step (a sequence ran out of its reservation, or the hold
        ended): the sequences holding as many uncertified tokens make one Step (aligned: one
        in all, as a rule), which certifies those, appends `tokens` and reserves again. All or
        nothing for the client: if a call fails, a sequence whose Step was applied anyway holds
        its token as appended ahead (Ahead), which the client's resend of the same step
        claims."""
        groups: dict[int, list[int]] = {}  # tokens to append -> indexes of its sequences
        for index, state in enumerate(states):
            groups.setdefault(len(state.uncertified) + 1, []).append(index)
        calls = [self._certify(known, [states[i] for i in group],
                               [seq_ids[i] for i in group], [tokens[i] for i in group],
                               commit) for group in groups.values()]
        # One group (the usual case) is awaited at once: its Step is queued in this event-loop
        # pass, so a session stepped in the same pass sees the burst gathering and joins it.
        outcomes: list[object] = ([await _outcome(calls[0])] if len(calls) == 1 else
                                  await asyncio.gather(*calls, return_exceptions=True))
        failed = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if failed:
            for group, outcome in zip(groups.values(), outcomes, strict=True):
                for index in group if not isinstance(outcome, BaseException) else ():
                    states[index].ahead = states[index].ahead or Ahead(tokens[index])
            raise failed[0]

    def _needs_call(self, known: SessionSequences, states: Sequence[SeqState]) -> bool:
        """A call is needed when a sequence's next token lies past its private slots, or the
        hold ended since the last call (the client may have freed or re-created its sequences
        directly since); a session low on slots joins a call that other sessions are making
        now."""
        if self.holds.ended(known):
            return True
        low = LOW_BLOCKS * self._runner().block_size if self.steps.gathering else 0
        return any(len(state.tokens) + low >= state.private_end for state in states)

    def _reserve(self, state: SeqState) -> int:
        """Slots to reserve past a sequence's next token: RESERVE_BLOCKS blocks' worth, none
        past the model's positions."""
        runner = self._runner()
        room = runner.max_model_len - len(state.tokens) - 1
        return max(0, min(RESERVE_BLOCKS * runner.block_size, room, self.max_reserve))

    async def _certify(self, known: SessionSequences, states: Sequence[SeqState],
                       seq_ids: list[int], tokens: list[int], commit: bool) -> None:
        """One Step for sequences holding as many uncertified tokens each: append those and the
        new token, reserve again, check the answer against the runner's view."""
        count = len(states[0].uncertified) + 1
        ids = [token for state, new in zip(states, tokens, strict=True)
               for token in (*state.uncertified, new)]
        reserve = min(self._reserve(state) for state in states)
        if self.steps.pool.free_blocks < ROOM_FACTOR * (RESERVE_BLOCKS + 1) * len(states):
            reserve = 0
        reply = await self._step(known, Step(seq_ids, ids, count, commit, self.holds.hold_ms,
                                             reserve))
        if reply is None:  # the reservation does not fit: today's Step, one token at a time
            reserve = 0
            reply = await self._step(known, Step(seq_ids, ids, count, commit, self.holds.hold_ms))
            assert reply is not None
        if commit:
            known.clear_due(seq_ids)
        bs = self._runner().block_size
        # Where the runner wrote the uncertified tokens: the daemon must answer the same slots.
        written = [state.slots(state.held, len(state.tokens), bs) for state in states]
        for index, logical, block in zip(reply.changed_seq_index, reply.changed_logical_block,
                                         reply.changed_block_id, strict=True):
            states[index].patch(logical, block)
        copies = [(copy.src, copy.dst) for copy in reply.copies]
        for i, (seq_id, state, token) in enumerate(zip(seq_ids, states, tokens, strict=True)):
            start = state.held
            state.tokens.append(token)
            state.held = len(state.tokens)
            state.private_end = len(state.block_table) * bs if reserve else state.held
            slots = list(reply.slot_mapping[i * count:(i + 1) * count])
            if (reply.num_tokens[i] != state.held
                    or not kept(written[i], slots, copies, bs)
                    or state.slots(start, state.held, bs) != slots):
                known.stale(seq_id)

    async def _step(self, known: SessionSequences, op: Step) -> StepResult | None:
        """The daemon's answer to `op`, or None when its reservation does not fit (the pool or
        the session's quota) or is refused as too large: nothing changed, and the same Step
        without it is the per-token Step of old."""
        sent = known.asking_hold()
        try:
            reply = await self.steps.step(known.session, op)
        except (PoolExhausted, InvalidArgument) as exc:
            if not op.reserve_tokens:
                raise
            if isinstance(exc, InvalidArgument):  # if the Step without it is refused too, it
                self.max_reserve = op.reserve_tokens // 2  # was not the reservation: it fails
            return None
        known.held_at = sent
        return reply


def decode_in_reservation(states: Sequence[SeqState], tokens: Sequence[int]) -> None:
    """A decode step inside the sequences' reservations: each token appended to the runner's
    view only (past SeqState.held); its forward writes the K/V into the next reserved slot."""
    for state, token in zip(states, tokens, strict=True):
        state.tokens.append(token)


async def _outcome(call: Awaitable[None]) -> Exception | None:
    """`call`'s exception, or None, as asyncio.gather(return_exceptions=True) gives it."""
    try:
        await call
    except Exception as exc:
        return exc
    return None


def kept(written: Sequence[int], answered: Sequence[int], copies: Iterable[tuple[int, int]],
         block_size: int) -> bool:
    """Whether the K/V the runner wrote at `written` is where the daemon's answer puts those
    tokens (`answered`, the first len(written)): the same slots, or the same offsets of blocks
    the call copied them to (a shared last block copied before an append: a client's own Fork)."""
    pairs = set(copies)
    return all(w == a or ((w // block_size, a // block_size) in pairs
                          and w % block_size == a % block_size)
               for w, a in zip(written, answered[:len(written)], strict=True))
