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

Following (runner.proto's StepStream, "Following"; `follow`): a followed session's implied
steps go to the forward thread once the step computed ahead is claimed (decode_run.py): it
computes them back to back inside the sequences' reservations, each step's outputs handed to the
stream from the thread; the event loop acts only where the plan changes (a message, a drain,
another step of the session, a hold, a spent reservation: renewed by one daemon Step, after which
the run goes on). The run holds the session's lock throughout, as a step decoded ahead does.

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
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.client import (
    Append,
    Commit,
    DaemonUnavailable,
    Free,
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
from pagedkv.model_runner.engine.decode_run import DecodeRun
from pagedkv.model_runner.engine.forward_loop import ForwardLoop, Prepared
from pagedkv.model_runner.engine.grammar import Grammars
from pagedkv.model_runner.engine.holds import DEFAULT_HOLD_MS, SessionHolds
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.preparation import Preparer
from pagedkv.model_runner.engine.sampling import Sampler
from pagedkv.model_runner.engine.sequences import SeqState, SessionSequences, checking
from pagedkv.model_runner.engine.sessions import SessionEntry, SessionTable
from pagedkv.model_runner.engine.step_checks import check_writes
from pagedkv.model_runner.engine.steps import InvalidStep, StepNotComputed
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

    # ---------------------------------------------------------------- the step

    async def step(self, session_id: str, requests: Sequence[SeqStep],
                   release: Sequence[int] = ()) -> StepOutputs:
        """Compute one client step; `release` names sequences to free after it."""
        self.preparer.validate(requests, release)
        started = time.monotonic()
        compiled = await self.grammars.compile(requests)  # before anything changes
        entry = self.sessions.enter(session_id)
        try:
            await entry.lock.acquire()
        except BaseException:
            self.sessions.leave(session_id, entry)
            raise
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
                await self._finish(known, prepared, release)
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

    def _let_go(self, session_id: str, entry: SessionEntry) -> None:
        """Let go of the session's lock (no forward of it is left): its hold ends once idle.
        Checking (sequences.CHECK_ENV), its sequences' states are checked first."""
        try:
            if self.check_sequences:
                entry.sequences.check(self.runner.block_size)
        finally:
            self._release(session_id, entry)

    def _release(self, session_id: str, entry: SessionEntry) -> None:
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
                await _outlive(forward)
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

    # ---------------------------------------------------------------- following

    async def follow(self, session_id: str, implied: Sequence[SeqStep],
                     deliver: Callable[[StepOutputs], None],
                     until: asyncio.Future[Any]) -> list[SeqStep] | None:
        """Take the followed session's implied steps (runner.proto's "Following") on the
        forward thread while it can (decode_run.py), each step's outputs `deliver`ed in order
        (on the forward thread, the first one here: it must be thread-safe), until `until` is
        done (the client's next message, a drain: the step in progress is
        delivered first). The first step is the one the runner computed ahead (decode_ahead).

        Returns the implied step left to `step` once the run stopped; None, having delivered
        nothing, when the step ahead is not there to claim (it failed, or was not taken: a
        reservation ran out): `step` takes the implied step then. StepNotComputed when a
        run's forward failed (its step's tokens appended in the runner, not computed)."""
        entry = self.sessions.enter(session_id)
        try:
            await entry.lock.acquire()
        except BaseException:
            self.sessions.leave(session_id, entry)
            raise
        try:
            known = entry.sequences
            first = None if entry.ended or until.done() else _claim_ahead(known, implied)
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
        assert self.forwards.hold_s is not None, "the engine's forwards check holds"
        runs = [DecodeRun(entry, [r.seq_id for r in implied],
                          [known.known(r.seq_id) for r in implied],
                          [r.token_ids[0] for r in implied], deliver,
                          lambda: self.pool.free_blocks, self.runner.block_size,
                          self.runner.max_model_len, self.forwards.hold_s,
                          asyncio.get_running_loop())]

        def stop(_: object) -> None:  # the stream's next message, or a drain
            runs[-1].stopping = True

        until.add_done_callback(stop)
        holder = asyncio.create_task(self.holds.keep(known))
        try:
            while True:
                await self._decode_run(runs[-1])
                if until.done() or not runs[-1].spent:
                    return runs[-1].implied()
                known.stepped += 1
                # Appended as ahead: a step that comes first (the run stops) claims them.
                try:
                    await self.preparer.decode_step(known, runs[-1].implied(), ahead=True)
                except DaemonUnavailable:  # maybe applied: the caller forgets the session
                    raise
                except PagedKVError:  # not applied (a full pool...): `step` meets it itself,
                    return runs[-1].implied()  # claiming what a partial call appended ahead
                if until.done():
                    return runs[-1].implied()
                runs.append(dataclasses.replace(runs[-1], appended=True, over=False))
        finally:
            holder.cancel()
            until.remove_done_callback(stop)

    async def _decode_run(self, run: DecodeRun) -> None:
        """[holds the session's lock and its hold] Let the forward thread take `run` until it
        stops; a forward that failed makes its step StepNotComputed, and a caller cancelled
        meanwhile waits for the step in progress before the hold ends."""
        known = run.known
        self.forwards.follow(run)
        try:
            await asyncio.shield(run.ended)
        except asyncio.CancelledError:  # the stream ended: the step in progress finishes
            run.stopping = True
            await _outlive(run.ended)
            with contextlib.suppress(asyncio.CancelledError, PagedKVError):
                await self.holds.end(known)  # else it lapses
            raise
        except Exception as exc:
            await self.holds.end_quietly(known)
            raise StepNotComputed(
                "the implied step's tokens were appended but its forward failed "
                f"({type(exc).__name__}): resend it without token_ids, or release its "
                "sequences") from exc

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

    # -------------------------------------------------------------- finishing

    async def _finish(self, known: SessionSequences, prepared: Prepared,
                      release: Sequence[int]) -> None:
        """Make the commits of what prefill chunks computed due (they ride the session's next
        daemon call, holds.py); free the released sequences (their computed blocks committed
        first, so they stay cached). Only sequences whose ids the runner knows are the daemon's
        are committed (SeqState.verified). The step's forward is done and the session's lock
        held, so no forward of it is left: when sequences are released the hold ends, with the
        Batch (which carries the commits due), and the client may close at once."""
        bs = self.runner.block_size
        for index, chunk in prepared.chunks:
            state = prepared.states[index]
            if len(chunk.token_ids) > 1 and state.num_computed >= bs and state.verified:
                state.commit_due = state.num_computed
        if not release:
            return
        released = [seq_id for seq_id in release if known.get(seq_id) is not None]
        step_log.released(known, released)
        certified = [(seq_id, state, _computed(state)) for seq_id in released
                     if (state := known.known(seq_id)).verified]
        due = known.due(skip=released)
        ops: list[Commit | Free | Append] = [due] if due is not None else []
        # The tokens they decoded into reserved slots and computed are appended first (by id:
        # certified), so their blocks are committed too; nothing past them ever is.
        ops.extend(Append(seq_id, token_ids=state.tokens[state.held:n])
                   for seq_id, state, n in certified if n > state.held)
        if certified:
            ops.append(Commit([seq_id for seq_id, _, _ in certified],
                              [n for _, _, n in certified]))
        ops.extend(Free(seq_id) for seq_id in released)
        if ops:
            await known.session.batch(ops, end_hold=True)
            known.hold_ended()
            known.clear_due(due.seq_ids if due is not None else ())
        known.drop(released)
        for seq_id in set(release) - set(released):  # never stepped here (a pruned fork)
            with contextlib.suppress(SequenceNotFound):
                await known.session.free(seq_id)
        if not ops:  # a hold of a forgotten entry's too
            await self.holds.end(known)


def implied_step(requests: Sequence[SeqStep], results: Sequence[SeqOutput],
                 release: Sequence[int]) -> list[SeqStep]:
    """The client's next step of the sequences it marked decode_ahead whose token this step
    sampled and that go on (runner.proto's "implied step"): append that token, with the
    sampling the request carries (the kept one, once the step filled it in), decode_ahead
    again, nothing released. What the runner computes ahead, and the step it takes itself while
    it follows a session (model_runner/process/follow.py)."""
    released = set(release)
    return [SeqStep(r.seq_id, (result.token_id,), params=r.params, decode_ahead=True)
            for r, result in zip(requests, results, strict=True)
            if r.decode_ahead and result.sampled and not result.finished
            and r.seq_id not in released]


def _claim_ahead(known: SessionSequences, implied: Sequence[SeqStep]) -> list[SeqOutput] | None:
    """The results the runner computed ahead for the implied step (each sequence's appended
    token the one it names, with the sampling it kept), now the step's own; None, nothing
    changed, unless every sequence has one."""
    states = [known.get(r.seq_id) for r in implied]
    results = [state.ahead.result for state, r in zip(states, implied, strict=True)
               if state is not None and state.ahead is not None
               and state.ahead.token_id == r.token_ids[0]
               and r.params in (None, state.params)]  # None: the kept one
    if len(results) != len(implied) or any(result is None for result in results):
        return None
    claimed = [state.claim_ahead() for state in states if state is not None]
    return [result for result in claimed if result is not None]


def _computed(state: SeqState) -> int:
    """The leading tokens of a released sequence whose K/V the runner computed and may certify:
    not a token it decoded ahead that its client never named (an overshoot past a stop)."""
    return min(state.num_computed, len(state.tokens) - (state.ahead is not None))


def _session_gone(exc: Exception) -> bool:
    """The daemon said the session is gone (closed, expired, unknown): the runner forgets it
    once no step uses it."""
    return isinstance(exc, (SessionExpired, NotFound)) and not isinstance(exc, SequenceNotFound)


async def _outlive(forward: asyncio.Future[Any]) -> None:
    """Wait for `forward` to end, however often the waiter is cancelled (the engine cancels
    `forward` itself when it stops)."""
    while not forward.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({forward})
