"""Following a session (runner.proto's StepStream, "Following"): its implied steps computed on
the forward thread and pushed from there, while nothing asks the event loop to act.

    follower = Follower(pool, runner, forwards, holds, preparer, metrics, lock, let_go)
    left = await follower.follow(session_id, implied, deliver, until)   # StepEngine.follow

The first implied step is the one the runner computed ahead (decode_ahead): `follow` claims it
(`claim_ahead_step`) and delivers it, then hands the next ones to the forward thread as one
decode run (decode_run.py), which computes them back to back inside the sequences'
reservations and delivers each from the thread (a push while following). The event loop acts
only where the plan changes: a message or a drain (`until`), another step of the session, a hold,
a spent reservation (renewed by one daemon Step that appends the pending tokens ahead, after
which the run goes on). The run holds the session's lock throughout, as a step decoded ahead
does; the implied step it leaves goes through the engine's `step`.
"""

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pagedkv.client import (
    DaemonUnavailable,
    PagedKVError,
    PoolClient,
    SeqOutput,
    SeqStep,
    StepOutputs,
)
from pagedkv.model_runner.engine.decode_run import DecodeRun
from pagedkv.model_runner.engine.forward_loop import ForwardLoop
from pagedkv.model_runner.engine.holds import SessionHolds
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.preparation import Preparer
from pagedkv.model_runner.engine.sequences import SessionSequences
from pagedkv.model_runner.engine.sessions import SessionEntry
from pagedkv.model_runner.engine.steps import StepNotComputed, implied_step
from pagedkv.model_runner.runner import ModelRunner

# Takes a session's lock (waiting for its other steps), and lets go of it.
Lock = Callable[[str], Awaitable[SessionEntry]]
LetGo = Callable[[str, SessionEntry], None]


class Follower:
    """The step engine's part that follows sessions (module docstring)."""

    def __init__(self, pool: PoolClient, runner: Callable[[], ModelRunner],
                 forwards: ForwardLoop, holds: SessionHolds, preparer: Preparer,
                 metrics: RunnerMetrics | None, lock: Lock, let_go: LetGo) -> None:
        # The daemon's client (its latest free-block count goes with every push).
        self.pool = pool
        # The model runner in use (its block size and positions).
        self._runner = runner
        # The forward thread, which takes decode runs between the prepared steps.
        self.forwards = forwards
        # The daemon's holds on the sessions while their forwards may write.
        self.holds = holds
        # Renews a spent reservation with one daemon Step (Preparer.decode_step).
        self.preparer = preparer
        # The runner's figures (None: not counted); a run's steps count on the forward thread.
        self.metrics = metrics
        # The engine's session lock (StepEngine._lock, StepEngine._let_go).
        self._lock = lock
        self._let_go = let_go

    async def follow(self, session_id: str, implied: Sequence[SeqStep],
                     deliver: Callable[[StepOutputs], None],
                     until: asyncio.Future[Any]) -> list[SeqStep] | None:
        """StepEngine.follow: the implied steps on the forward thread while it can, each
        step's outputs `deliver`ed in order (on the forward thread, the first one here: it must
        be thread-safe), until `until` is done (the step in progress is delivered first).

        Returns the implied step left to `step` once the run stopped; None, having delivered
        nothing, when the step ahead is not there to claim (it failed, or was not taken: a
        reservation ran out). StepNotComputed when a run's forward failed (its step's tokens
        appended in the runner, not computed)."""
        entry = await self._lock(session_id)
        try:
            known = entry.sequences
            first = None if entry.ended or until.done() else claim_ahead_step(known, implied)
            if first is None:
                return None
            known.stepped += 1
            if self.metrics is not None:
                self.metrics.ahead_used(len(first))
            deliver(StepOutputs(first, self.pool.free_blocks))
            going = implied_step(implied, first, ())
            if not going:
                return []
            return await self._run_decodes(entry, going, deliver, until)
        finally:
            self._let_go(session_id, entry)

    async def _run_decodes(self, entry: SessionEntry, implied: list[SeqStep],
                           deliver: Callable[[StepOutputs], None],
                           until: asyncio.Future[Any]) -> list[SeqStep]:
        """[holds the session's lock] The decode run of `implied`, holding the session (renewed
        on the event loop meanwhile); when only a reservation ran out, the daemon Step that
        certifies and reserves again appends the pending tokens (preparation.py) and the run
        goes on. The implied step it leaves."""
        known = entry.sequences
        await self.holds.ensure(known)
        run = self._decode_run(entry, implied, deliver)

        def stop(_: object) -> None:  # the stream's next message, or a drain
            run.stopping = True

        until.add_done_callback(stop)
        holder = asyncio.create_task(self.holds.keep(known))
        try:
            while True:
                await self._take(run)
                if until.done() or not run.spent:
                    return run.implied()
                known.stepped += 1
                # Appended as ahead: a step that comes first (the run stops) claims them.
                try:
                    await self.preparer.decode_step(known, run.implied(), ahead=True)
                except DaemonUnavailable:  # maybe applied: the caller forgets the session
                    raise
                except PagedKVError:  # not applied (a full pool...): `step` meets it itself,
                    return run.implied()  # claiming what a partial call appended ahead
                if until.done():
                    return run.implied()
                run = dataclasses.replace(run, appended=True, over=False)
        finally:
            holder.cancel()
            until.remove_done_callback(stop)

    def _decode_run(self, entry: SessionEntry, implied: list[SeqStep],
                    deliver: Callable[[StepOutputs], None]) -> DecodeRun:
        known, runner = entry.sequences, self._runner()
        assert self.forwards.hold_s is not None, "the engine's forwards check holds"
        return DecodeRun(entry, [r.seq_id for r in implied],
                         [known.known(r.seq_id) for r in implied],
                         [r.token_ids[0] for r in implied], deliver,
                         lambda: self.pool.free_blocks, runner.block_size,
                         runner.max_model_len, self.forwards.hold_s,
                         asyncio.get_running_loop(), self.metrics)

    async def _take(self, run: DecodeRun) -> None:
        """[holds the session's lock and its hold] Let the forward thread take `run` until it
        stops; a forward that failed makes its step StepNotComputed, and a caller cancelled
        meanwhile waits for the step in progress before the hold ends."""
        known = run.known
        self.forwards.follow(run)
        try:
            await asyncio.shield(run.ended)
        except asyncio.CancelledError:  # the stream ended: the step in progress finishes
            run.stopping = True
            await outlive(run.ended)
            with contextlib.suppress(asyncio.CancelledError, PagedKVError):
                await self.holds.end(known)  # else it lapses
            raise
        except Exception as exc:
            await self.holds.end_quietly(known)
            raise StepNotComputed(
                "the implied step's tokens were appended but its forward failed "
                f"({type(exc).__name__}): resend it without token_ids, or release its "
                "sequences") from exc


def claim_ahead_step(known: SessionSequences,
                     implied: Sequence[SeqStep]) -> list[SeqOutput] | None:
    """The results the runner computed ahead for the implied step (each sequence's appended
    token the one it names, with the sampling it kept), now the step's own (SeqState.claim_ahead);
    None, nothing changed, unless every sequence has one."""
    states = [known.get(r.seq_id) for r in implied]
    results = [state.ahead.result for state, r in zip(states, implied, strict=True)
               if state is not None and state.ahead is not None
               and state.ahead.token_id == r.token_ids[0]
               and r.params in (None, state.params)]  # None: the kept one
    if len(results) != len(implied) or any(result is None for result in results):
        return None
    claimed = [state.claim_ahead() for state in states if state is not None]
    return [result for result in claimed if result is not None]


async def outlive(forward: asyncio.Future[Any]) -> None:
    """Wait for `forward` to end, however often the waiter is cancelled (the engine cancels
    `forward` itself when it stops)."""
    while not forward.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({forward})
