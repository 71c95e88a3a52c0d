"""The runner's step engine: clients' steps in, one merged forward pass, sampled tokens out.

    engine = StepEngine(pool_client, model_runner)
    await engine.start()
    outcome = await engine.step(session_id, [SeqRequest(7, True, prompt, 0, params)])

A step goes through three stages:
1. prepare (`Preparer`, on the event loop, as soon as the step arrives): validate it (a bad step
   fails alone, before the pool changes), read back sequences the runner does not know, then one
   daemon call under the client's session: `Step` for a batch of single decode tokens
   (committing what the previous forward computed), else one `Batch` of Fork ops (parallel
   samples, beams), then Allocate/Append ops. The answers are the only source of block tables
   and slots; the chunks to compute follow from them.
2. forward (`ForwardLoop`, on one worker thread, one at a time, so two steps' writes never
   interleave): every prepared step waiting is packed into one forward pass, then each sequence
   that is fully computed samples its next token. A step that arrives while a forward runs is
   prepared meanwhile: its daemon round trip overlaps that forward.
3. finish (on the loop): commit the blocks a prefill computed (decode blocks are committed by the
   next Step), free the sequences the client released, answer.

Decode ahead (runner.proto's `decode_ahead`, vLLM v1's async scheduling): when a client marks a
sequence whose step sampled a token that does not finish it, the runner keeps the session's lock
after answering and takes the client's next step itself: one daemon Step appends the sampled
tokens, then a forward computes them, while the answer travels and the client plans. The
client's next step names the same tokens and is answered from those results (`Ahead`); the
lock keeps every other step of the session, and so every release, behind that forward.
"""

import asyncio
import contextlib
import functools
import time
from collections.abc import Sequence

from pagedkv.client import (
    Commit,
    Free,
    NotFound,
    PoolClient,
    SequenceNotFound,
    SessionExpired,
)
from pagedkv.process.lifecycle import cancel
from pagedkv.proto import kvpool_pb2 as pb

from .forward_loop import ForwardLoop, Prepared
from .metrics import RunnerMetrics
from .preparation import Preparer
from .runner import ModelRunner
from .sampling import Sampler
from .sequences import SessionSequences
from .steps import SeqRequest, SeqResult, StepOutcome

# When a step still waiting for its forward first renews its session's lease (then every third
# of the lease): most steps are answered long before.
FIRST_HOLD_S = 0.1


class StepEngine:
    """Merges concurrent client steps into forward passes over one model and one pool."""

    def __init__(self, pool: PoolClient, runner: ModelRunner, *, sampler: Sampler | None = None,
                 max_batch_tokens: int = 8192, metrics: RunnerMetrics | None = None) -> None:
        self.pool = pool
        # The model runner (replaced by the server when the daemon restarts).
        self.runner = runner
        self.metrics = metrics
        self.forwards = ForwardLoop(lambda: self.runner, sampler or Sampler(),
                                    max_batch_tokens=max_batch_tokens, metrics=metrics)
        self.preparer = Preparer(pool, lambda: self.runner, metrics)
        self._sessions: dict[str, SessionSequences] = {}
        # One step at a time per session: its sequences' states must not race.
        self._session_locks: dict[str, asyncio.Lock] = {}
        # Steps being decoded ahead (each holds its session's lock).
        self._ahead_tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.forwards.start()

    async def stop(self) -> None:
        await cancel(*self._ahead_tasks)
        await self.forwards.stop()

    def forget_all(self) -> None:
        """Drop every session's state (the daemon restarted: its pool and sessions are gone)."""
        self._sessions.clear()

    # ---------------------------------------------------------------- the step

    async def step(self, session_id: str, requests: Sequence[SeqRequest],
                   release: Sequence[int] = ()) -> StepOutcome:
        """Compute one client step; `release` names sequences to free after it."""
        self.preparer.validate(requests, release)
        started = time.monotonic()
        lock = self._session_locks.setdefault(session_id, asyncio.Lock())
        await lock.acquire()
        handed_off = False
        try:
            known = self._sessions.setdefault(session_id, SessionSequences())
            try:
                prepared = await self.preparer.prepare(session_id, known, requests)
                results = (await self._run(prepared) if prepared.chunks
                           else self.forwards.results(prepared, {}))
                await self._finish(session_id, known, prepared, release)
            except (SessionExpired, NotFound) as exc:
                if not isinstance(exc, SequenceNotFound):  # the session is gone: forget it
                    self._sessions.pop(session_id, None)
                    self._session_locks.pop(session_id, None)
                raise
            for index in prepared.claimed:
                prepared.states[index].ahead = None
            if self.metrics is not None:
                self.metrics.step(time.monotonic() - started)
                self.metrics.ahead_used(len(prepared.ready))
            ahead = self._ahead_requests(requests, results, release)
            if ahead:  # the lock goes with the task, which releases it
                task = asyncio.create_task(self._decode_ahead(session_id, known, ahead, lock))
                self._ahead_tasks.add(task)
                task.add_done_callback(self._ahead_tasks.discard)
                handed_off = True
            return StepOutcome(results, self.preparer.free_blocks)
        finally:
            if not handed_off:
                lock.release()

    async def _run(self, prepared: Prepared) -> list[SeqResult]:
        """A prepared step's forward and results, holding the session's lease meanwhile."""
        holder = asyncio.create_task(self._hold_lease(prepared.session_id))
        try:
            return await self.forwards.compute(prepared)
        finally:
            holder.cancel()

    async def _hold_lease(self, session_id: str) -> None:
        """Keep the session's lease while its prepared step waits for and goes through a
        forward: a client that dies meanwhile stops its own KeepAlive, and a lease expiring
        mid-step would free blocks this forward still writes into."""
        period = FIRST_HOLD_S
        while True:
            await asyncio.sleep(period)
            try:
                reply = await self.pool.call(self.pool.stub.KeepAlive, lambda: (
                    pb.KeepAliveRequest(session_id=session_id)))
            except (SessionExpired, NotFound):
                return  # gone already: the step fails at its finish
            period = reply.lease_ttl_ms / 3000

    # ------------------------------------------------------------ decode ahead

    @staticmethod
    def _ahead_requests(requests: Sequence[SeqRequest], results: Sequence[SeqResult],
                        release: Sequence[int]) -> list[SeqRequest]:
        """The client's next step of the sequences it marked decode_ahead whose token this
        step sampled and that go on: append that token, sample the same way."""
        released = set(release)
        return [SeqRequest(r.seq_id, False, (result.token_id,), 0, r.params)
                for r, result in zip(requests, results, strict=True)
                if r.decode_ahead and result.sampled and not result.finished
                and r.seq_id not in released]

    async def _decode_ahead(self, session_id: str, known: SessionSequences,
                            requests: Sequence[SeqRequest], lock: asyncio.Lock) -> None:
        """[holds the session's lock; releases it] Take the client's next step: append the
        tokens in the daemon, compute them, keep the results for the step that names them.

        A failure changes nothing the client's own step cannot redo: a daemon Step either
        appended every token (each recorded as ahead) or none, and a token appended but not
        computed is computed by the client's step."""
        try:
            states = await self.preparer.decode_step(session_id, known, requests, ahead=True)
            chunks = [(i, chunk) for i, (r, state) in enumerate(zip(requests, states, strict=True))
                      if (chunk := self.preparer.chunk(r, state)) is not None]
            results = await self._run(Prepared(session_id, requests, states, chunks))
            for state, result in zip(states, results, strict=True):
                if state.ahead is not None:
                    state.ahead.result = result
            if self.metrics is not None:
                self.metrics.ahead_computed(len(results))
        except Exception:  # the client's next step meets the cause itself, if it lasts
            if self.metrics is not None:
                self.metrics.ahead_failed(len(requests))
        finally:
            lock.release()

    # -------------------------------------------------------------- finishing

    async def _finish(self, session_id: str, known: SessionSequences, prepared: Prepared,
                      release: Sequence[int]) -> None:
        """Commit what prefill chunks computed; free the released sequences (their computed
        blocks committed first, so they stay cached)."""
        bs = self.runner.block_size
        prefilled = [(prepared.requests[i].seq_id, prepared.states[i].num_computed)
                     for i, chunk in prepared.chunks
                     if len(chunk.token_ids) > 1 and prepared.states[i].num_computed >= bs]
        ops: list[Commit | Free] = []
        if prefilled:
            ops.append(Commit([seq_id for seq_id, _ in prefilled], [n for _, n in prefilled]))
        released = [seq_id for seq_id in release if known.get(seq_id) is not None]
        if released:
            computed = [self.preparer.known_state(known, seq_id).num_computed
                        for seq_id in released]
            ops.append(Commit(released, computed))
            ops.extend(Free(seq_id) for seq_id in released)
        if ops:
            reply = await self.pool.call(self.pool.stub.Batch, lambda: pb.BatchRequest(
                session_id=session_id, ops=[op.batch_op() for op in ops]))
            self.preparer.free_blocks = reply.free_blocks
        known.drop(released)
        for seq_id in set(release) - set(released):  # never stepped here (a pruned fork)
            free = functools.partial(pb.FreeRequest, session_id=session_id, seq_id=seq_id)
            with contextlib.suppress(SequenceNotFound):
                await self.pool.call(self.pool.stub.Free, free)

