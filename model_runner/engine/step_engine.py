"""The runner's step engine: clients' steps in, one merged forward pass, sampled tokens out.

    engine = StepEngine(pool_client, model_runner)
    await engine.start()
    outcome = await engine.step(session_id, [SeqStep(7, prompt, True, params=params)])

A step goes through three stages:
1. prepare (`Preparer`, on the event loop, as soon as the step arrives): validate it (a bad step
   fails alone, before the pool changes), read back sequences the runner does not know, then at
   most one daemon call under the client's session: for a batch of single decode tokens none
   while they fit in the slots the last Step reserved, else a `Step` (certifying the tokens
   decoded into them, committing what the daemon held, reserving again: reservations.py), else
   one `Batch` of Fork ops (parallel samples, beams), then Allocate/Append ops. The answers are
   the only source of block tables and slots; the chunks to compute follow from them.
2. forward (`ForwardLoop`, on one worker thread, one at a time, so two steps' writes never
   interleave): every prepared step waiting is packed into one forward pass, then each sequence
   that is fully computed samples its next token. A step that arrives while a forward runs is
   prepared meanwhile: its daemon round trip overlaps that forward.
3. finish (on the loop): free the sequences the client released, answer. The blocks a prefill
   computed are committed by the session's next daemon call (its Step or Batch: decode blocks
   are committed by the next Step too), or with the end of the hold if no call comes first
   (holds.py); a step so makes one daemon call before its forward and none after it.

A decode token is produced one of four ways, each one named method:
1. a client step with a daemon call (`BlockSteps.decode_with_call`, from `Preparer.decode_step`):
   a sequence ran out of its reserved slots, so one Step certifies the tokens decoded into
   them, appends the new one and reserves again;
2. a client step inside the reservation (`decode_in_reservation`): the token is appended to the
   runner's view only, and the forward writes its K/V into the next reserved slot;
3. a claimed ahead result (`SeqState.claim_ahead`): the client's step names the token the runner
   appended ahead (`_decode_ahead`, by way 1 or 2), and is answered from that forward;
4. a push while following (`DecodeRun.decode_followed`, on the forward thread): a followed
   session's implied steps, computed back to back inside the reservations and pushed.

Decode ahead (runner.proto's `decode_ahead`, vLLM v1's async scheduling): when a client marks a
sequence whose step sampled a token that does not finish it, the runner keeps the session's lock
after answering and takes the client's next step itself: it appends the sampled tokens (a daemon
Step only once a reservation), then a forward computes them, while the answer travels and the
client plans. The client's next step names the same tokens and is answered from those results
(`Ahead`); the lock keeps every other step of the session, and so every release, behind that
forward.

Following (runner.proto's StepStream, "Following"; `follow`, following.py): once the step
computed ahead is claimed, a followed session's implied steps go to the forward thread as one
decode run (decode_run.py), pushed from there; the event loop acts only where the plan changes.

No release before the forward: a step whose caller is cancelled (its client gone) keeps the
session's lock until its forward is done, so no release through the runner frees blocks that a
queued or running forward still writes (blocks another session could get meanwhile). Nor does
the client itself, or its lease: every daemon call that precedes a forward holds the session for
`hold_ms` (kvpool.proto's "Runner holds": the daemon refuses the client's own Free and
CloseSession, SessionBusy, and expires no held session), `_run` renews the hold while the
forward waits and runs, and the hold ends (`end_hold`) once no forward of the session is left:
in the Batch that frees released sequences (else a KeepAlive), after a cancelled step's forward,
before a failed step answers, and once the session is idle (holds.py). A hold not ended (the
runner died) lapses hold_ms after its last renewal. A step whose daemon calls were applied but
whose forward failed answers StepNotComputed (runner.proto's retry rules), never "nothing
changed".
"""

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.client import (
    NotFound,
    PagedKVError,
    PoolClient,
    SeqOutput,
    SeqStep,
    SequenceNotFound,
    SessionExpired,
    StepOutputs,
)
from pagedkv.model_runner.engine import step_log
from pagedkv.model_runner.engine.answer_limits import AnswerLimits
from pagedkv.model_runner.engine.finishing import finish_step
from pagedkv.model_runner.engine.following import Follower, outlive
from pagedkv.model_runner.engine.forward_loop import ForwardLoop, Prepared
from pagedkv.model_runner.engine.grammar import Grammars
from pagedkv.model_runner.engine.holds import DEFAULT_HOLD_MS, SessionHolds
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.preparation import Preparer
from pagedkv.model_runner.engine.sampling import Sampler
from pagedkv.model_runner.engine.sequences import SessionSequences, checking
from pagedkv.model_runner.engine.sessions import SessionEntry, SessionTable
from pagedkv.model_runner.engine.step_checks import check_writes
from pagedkv.model_runner.engine.steps import InvalidStep, StepNotComputed, implied_step
from pagedkv.model_runner.runner import ModelRunner
from pagedkv.process.lifecycle import cancel


class StepEngine:
    """Merges concurrent client steps into forward passes over one model and one pool."""

    def __init__(self, pool: PoolClient, runner: ModelRunner, *, sampler: Sampler | None = None,
                 max_batch_tokens: int = 8192, metrics: RunnerMetrics | None = None,
                 hold_ms: int = DEFAULT_HOLD_MS,
                 answer_limits: AnswerLimits | None = None, model: str | None = None,
                 tokenizer: str | None = None) -> None:
        self.pool = pool
        # The name the runner registered its model under: a step on a session of another model
        # is refused before anything changes (its blocks are of another format, its prefixes
        # another model's K/V). None: no check (an in-process engine on its caller's sessions).
        self.model = model
        # What one step may ask for (logprobs, its answer's size), checked once its sequences'
        # kept sampling is known, before anything changes; None: no bound (an in-process caller,
        # whose answers travel in no message).
        self.answer_limits = answer_limits
        # The model runner (replaced by the server when the daemon restarts).
        self.runner = runner
        # Structured outputs' grammars, compiled for the tokenizer's folder (None: refused).
        self.grammars = Grammars(tokenizer, vocab_size=runner.vocab_size,
                                 eos_token_ids=runner.eos_token_ids)
        self.metrics = metrics
        self.forwards = ForwardLoop(lambda: self.runner, sampler or Sampler(),
                                    max_batch_tokens=max_batch_tokens, metrics=metrics,
                                    hold_ms=hold_ms)
        # Each client session's sequences and lock, forgotten when the session ends.
        self.sessions = SessionTable()
        # The daemon's holds on the sessions while their forwards may write (hold_ms each).
        self.holds = SessionHolds(self.sessions, hold_ms=hold_ms)
        self.preparer = Preparer(pool, lambda: self.runner, metrics, holds=self.holds)
        # Whether each session's sequences are checked whenever its lock goes (CHECK_ENV).
        self.check_sequences = checking(os.environ)
        # Follows sessions: their implied steps on the forward thread (following.py).
        self.follower = Follower(pool, lambda: self.runner, self.forwards, self.holds,
                                 self.preparer, metrics, self._lock, self._let_go)
        # Steps being decoded ahead (each holds its session's lock).
        self._ahead_tasks: set[asyncio.Task[None]] = set()
        # Forwards of cancelled steps, waited for before their session's lock goes.
        self._orphans: set[asyncio.Future[list[SeqOutput]]] = set()

    async def start(self) -> None:
        await self.forwards.start()

    async def stop(self) -> None:
        """Stop computing; then no forward writes any more, and every hold ends."""
        await cancel(*self._ahead_tasks)
        await self.forwards.stop()
        for forward in self._orphans:  # the loop is gone: nothing writes any more
            forward.cancel()
        await self.holds.stop()
        self.grammars.close()

    def forget_all(self) -> None:
        """Drop every session's state (the daemon restarted: its pool and sessions are gone)."""
        self.sessions.forget_all()

    async def follow(self, session_id: str, implied: Sequence[SeqStep],
                     deliver: Callable[[StepOutputs], None],
                     until: asyncio.Future[Any]) -> list[SeqStep] | None:
        """Take the followed session's implied steps (runner.proto's "Following") on the
        forward thread while it can, each step's outputs `deliver`ed, until `until` is done:
        Follower.follow (following.py)."""
        return await self.follower.follow(session_id, implied, deliver, until)

    # ---------------------------------------------------------------- the step

    async def step(self, session_id: str, requests: Sequence[SeqStep],
                   release: Sequence[int] = ()) -> StepOutputs:
        """Compute one client step; `release` names sequences to free after it."""
        self.preparer.validate(requests, release)
        started = time.monotonic()
        compiled = await self.grammars.compile(requests)  # before anything changes
        entry = await self._lock(session_id)
        handed_off = False
        try:
            known = entry.sequences
            known.stepped += 1
            try:
                await self._check_model(session_id, entry)
                requests = known.with_params(requests)  # the sampling kept for the rest
                if self.answer_limits is not None:
                    self.answer_limits.check(requests)
                prepared = await self.preparer.prepare(session_id, known, requests)
                known.keep_params(requests, prepared.states, compiled)
                step_log.admitted(known, requests)
                for index in prepared.claimed:  # their results, if any, are prepared.ready
                    prepared.states[index].claim_ahead()
                results = (await self._run(prepared, known) if prepared.chunks
                           else self.forwards.results(prepared, {}))
                step_log.finished(known, results)
                await finish_step(known, prepared, release, self.holds, self.runner.block_size)
            except Exception as exc:
                step_log.failed(known, requests, exc)
                entry.ended = entry.ended or _session_gone(exc)
                if not entry.ended:  # no forward of the session is left: the client may free
                    await self.holds.end_quietly(known)
                raise
            if self.metrics is not None:
                self.metrics.step(time.monotonic() - started)
                self.metrics.ahead_used(len(prepared.ready))
            ahead = implied_step(requests, results, release)
            if ahead:  # the lock goes with the task, which releases it
                task = asyncio.create_task(self._decode_ahead(session_id, entry, ahead))
                self._ahead_tasks.add(task)
                task.add_done_callback(self._ahead_tasks.discard)
                handed_off = True
            return StepOutputs(results, self.pool.free_blocks)
        finally:
            if not handed_off:
                self._let_go(session_id, entry)

    async def _check_model(self, session_id: str, entry: SessionEntry) -> None:
        """[holds the session's lock] InvalidStep if the session holds another model's K/V
        than this runner computes. Its model is the daemon's word (GetStats under the session),
        never the client's, asked once per session (the session table keeps it)."""
        if self.model is None:
            return
        model = self.sessions.model(session_id)
        if model is None:
            handle = entry.sequences.attach(self.pool, session_id, self.runner.block_size)
            stats = (await handle.stats()).session
            assert stats is not None, "GetStats under a session answers its figures"
            model = stats.model
            self.sessions.learn_model(session_id, model)
        if model != self.model:
            raise InvalidStep(f"the session holds model {model!r}'s K/V and this runner "
                              f"computes model {self.model!r}: step it on a runner of "
                              f"{model!r} (RunnerInfo.model_name)")

    async def _lock(self, session_id: str) -> SessionEntry:
        """The session's entry, its lock taken (after the session's other steps)."""
        entry = self.sessions.enter(session_id)
        try:
            await entry.lock.acquire()
        except BaseException:
            self.sessions.leave(session_id, entry)
            raise
        return entry

    def _let_go(self, session_id: str, entry: SessionEntry) -> None:
        """Let go of the session's lock (no forward of it is left): its hold ends once idle.
        Checking (sequences.CHECK_ENV), its sequences' states are checked first."""
        try:
            if self.check_sequences:
                entry.sequences.check(self.runner.block_size)
        finally:
            entry.lock.release()
            self.sessions.leave(session_id, entry)
            self.holds.after_step(session_id, entry)

    async def _run(self, prepared: Prepared, known: SessionSequences) -> list[SeqOutput]:
        """A prepared step's forward and results, holding the session (its blocks and its
        lease) meanwhile: a step whose daemon calls did not just hold it (it made none) holds it
        first. Its daemon calls are applied: a forward that fails makes it StepNotComputed, and
        a caller cancelled meanwhile waits for the forward (which may be writing the session's
        blocks) before the hold ends and the lock goes."""
        check_writes(prepared)
        await self.holds.ensure(known)
        prepared.held_since = lambda: known.held_at
        holder = asyncio.create_task(self.holds.keep(known))
        forward = asyncio.ensure_future(self.forwards.compute(prepared))
        try:
            return await asyncio.shield(forward)
        except asyncio.CancelledError:
            self._orphans.add(forward)
            try:
                await outlive(forward)
            finally:
                self._orphans.discard(forward)
            holder.cancel()
            with contextlib.suppress(asyncio.CancelledError, PagedKVError):
                await self.holds.end(known)  # else it lapses
            raise
        except Exception as exc:
            raise StepNotComputed(
                f"the step's tokens were appended but its forward failed ({type(exc).__name__}):"
                " resend it without token_ids, every sequence as an existing one, or release "
                "its sequences") from exc
        finally:
            holder.cancel()

    # ------------------------------------------------------------ decode ahead

    async def _decode_ahead(self, session_id: str, entry: SessionEntry,
                            requests: Sequence[SeqStep]) -> None:
        """[holds the session's lock; releases it] Take the client's next step: append the
        tokens in the daemon, compute them, keep the results for the step that names them.

        A failure changes nothing the client's own step cannot redo: a daemon Step either
        appended every token (each recorded as ahead) or none, and a token appended but not
        computed is computed by the client's step."""
        known = entry.sequences
        known.stepped += 1
        try:
            held_at = known.held_at  # every daemon call that precedes a forward sets it
            states = await self.preparer.decode_step(known, requests, ahead=True)
            chunks = [(i, chunk) for i, (r, state) in enumerate(zip(requests, states, strict=True))
                      if (chunk := self.preparer.chunk(r, state)) is not None]
            results = await self._run(Prepared(session_id, requests, states, chunks,
                                               daemon_call=known.held_at != held_at), known)
            for state, result in zip(states, results, strict=True):
                if state.ahead is not None:
                    state.ahead.result = result
            if self.metrics is not None:
                self.metrics.ahead_computed(len(results))
        except Exception as exc:  # the client's next step meets the cause itself, if it lasts
            entry.ended = entry.ended or _session_gone(exc)
            if self.metrics is not None:
                self.metrics.ahead_failed(len(requests))
        finally:
            self._let_go(session_id, entry)


def _session_gone(exc: Exception) -> bool:
    """The daemon said the session is gone (closed, expired, unknown): the runner forgets it
    once no step uses it."""
    return isinstance(exc, (SessionExpired, NotFound)) and not isinstance(exc, SequenceNotFound)
