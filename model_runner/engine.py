"""The runner's step engine: clients' steps in, one merged forward pass, sampled tokens out.

    engine = StepEngine(pool_client, model_runner)
    await engine.start()
    outcome = await engine.step(session_id, [SeqRequest(7, True, prompt, 0, params)])

A step goes through three stages:
1. prepare (on the event loop, as soon as the step arrives): validate it (a bad step fails alone,
   before the pool changes), read back sequences the runner does not know, then one daemon call
   under the client's session: `Step` for a batch of single decode tokens (committing what the
   previous forward computed), else one `Batch` of Fork ops (parallel samples, beams), then
   Allocate/Append ops. The answers are the only source of block tables and slots; the chunks to
   compute follow from them.
2. forward (on one worker thread, one at a time, so two steps' writes never interleave): every
   prepared step waiting is packed into one forward pass, then each sequence that is fully
   computed samples its next token. A step that arrives while a forward runs is prepared
   meanwhile: its daemon round trip overlaps that forward.
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
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pagedkv.client import (
    Allocate,
    Append,
    Commit,
    Fork,
    Free,
    NotFound,
    PoolClient,
    SequenceBlocks,
    SequenceNotFound,
    SessionExpired,
)
from pagedkv.proto import kvpool_pb2 as pb

from .metrics import RunnerMetrics
from .runner import ModelRunner, SequenceChunk
from .sampling import Pick, Sampler, SamplingRow, picks
from .sequences import Ahead, SeqState, SessionSequences
from .steps import History, InvalidStep, SeqRequest, SeqResult, StepOutcome, UnknownSequence

# When a step still waiting for its forward first renews its session's lease (then every third
# of the lease): most steps are answered long before.
FIRST_HOLD_S = 0.1
# How long a forward waits at most (and at most as long as the last forward took) for clients of
# the last forward to send their next step, so concurrent clients share forwards (`_gather`).
MAX_GATHER_S = 0.005


@dataclass
class _Prepared:
    """A client step between prepare and finish."""

    session_id: str
    requests: Sequence[SeqRequest]
    # The state of each requested sequence, in request order.
    states: list[SeqState]
    # (index into requests, chunk) of the sequences computed in this step.
    chunks: list[tuple[int, SequenceChunk]]
    # Requests whose token the runner appended ahead (index -> what it did), and the results
    # of those it also computed with the same sampling: no chunk, no daemon call.
    claimed: dict[int, Ahead] = field(default_factory=dict)
    ready: dict[int, SeqResult] = field(default_factory=dict)
    # Set by the forward: one result per request.
    done: asyncio.Future[list[SeqResult]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    # When it was ready for a forward (monotonic seconds).
    ready_at: float = field(default_factory=time.monotonic)

    @property
    def num_tokens(self) -> int:
        return sum(len(chunk.token_ids) for _, chunk in self.chunks)


class StepEngine:
    """Merges concurrent client steps into forward passes over one model and one pool."""

    def __init__(self, pool: PoolClient, runner: ModelRunner, *, sampler: Sampler | None = None,
                 max_batch_tokens: int = 8192, metrics: RunnerMetrics | None = None) -> None:
        self.pool = pool
        self.runner = runner
        self.sampler = sampler or Sampler()
        self.metrics = metrics
        # Most tokens one forward pass computes (steps beyond it wait for the next pass).
        self.max_batch_tokens = max_batch_tokens
        self._sessions: dict[str, SessionSequences] = {}
        # One step at a time per session: its sequences' states must not race.
        self._session_locks: dict[str, asyncio.Lock] = {}
        # Prepared steps waiting for a forward, in arrival order.
        self._ready: deque[_Prepared] = deque()
        self._wake = asyncio.Event()
        self._forward_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-forward")
        self._loop_task: asyncio.Task[None] | None = None
        # Steps being decoded ahead (each holds its session's lock).
        self._ahead_tasks: set[asyncio.Task[None]] = set()
        # The pool's free blocks per the daemon's latest answer (any session's call).
        self.free_blocks = 0

    async def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._forward_loop(), name="pagedkv-forward")

    async def stop(self) -> None:
        for task in list(self._ahead_tasks):
            task.cancel()
        await asyncio.gather(*self._ahead_tasks, return_exceptions=True)
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        self._forward_thread.shutdown(wait=True)

    def forget_all(self) -> None:
        """Drop every session's state (the daemon restarted: its pool and sessions are gone)."""
        self._sessions.clear()

    # ---------------------------------------------------------------- the step

    async def step(self, session_id: str, requests: Sequence[SeqRequest],
                   release: Sequence[int] = ()) -> StepOutcome:
        """Compute one client step; `release` names sequences to free after it."""
        self._validate(requests, release)
        started = time.monotonic()
        lock = self._session_locks.setdefault(session_id, asyncio.Lock())
        await lock.acquire()
        handed_off = False
        try:
            known = self._sessions.setdefault(session_id, SessionSequences())
            try:
                prepared = await self._prepare(session_id, known, requests)
                results = await self._run(prepared) if prepared.chunks else [
                    prepared.ready.get(i) or self._result(r, s, None)
                    for i, (r, s) in enumerate(zip(requests, prepared.states, strict=True))]
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
            return StepOutcome(results, self.free_blocks)
        finally:
            if not handed_off:
                lock.release()

    async def _run(self, prepared: _Prepared) -> list[SeqResult]:
        """Queue a prepared step for a forward and wait for its results, holding the session's
        lease meanwhile."""
        self._ready.append(prepared)
        self._wake.set()
        holder = asyncio.create_task(self._hold_lease(prepared.session_id))
        try:
            return await prepared.done
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
            states = await self._decode_step(session_id, known, requests, ahead=True)
            chunks = [(i, chunk) for i, (r, state) in enumerate(zip(requests, states, strict=True))
                      if (chunk := self._chunk(r, state)) is not None]
            results = await self._run(_Prepared(session_id, requests, states, chunks))
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

    # ---------------------------------------------------------------- checks

    def _validate(self, requests: Sequence[SeqRequest], release: Sequence[int]) -> None:
        if not requests and not release:
            raise InvalidStep("a step needs at least one sequence")
        if len({r.seq_id for r in requests}) != len(requests):
            raise InvalidStep("a sequence appears twice in one step")
        vocab = self.runner.vocab_size
        new = {r.seq_id for r in requests if r.new_sequence}
        for r in requests:
            if r.new_sequence and not r.token_ids and r.parent_seq_id is None:
                raise InvalidStep(f"new sequence {r.seq_id} has no prompt tokens")
            if r.parent_seq_id is not None and r.parent_seq_id in new | {r.seq_id}:
                raise InvalidStep(f"sequence {r.seq_id}: its parent {r.parent_seq_id} must be an "
                                  "existing sequence, not new in the same step")
            if r.num_prompt_tokens and not (r.new_sequence and r.parent_seq_id is None
                                            and r.num_prompt_tokens <= len(r.token_ids)):
                raise InvalidStep(f"sequence {r.seq_id}: num_prompt_tokens applies to a new "
                                  f"sequence without a parent and must be <= its {len(r.token_ids)}"
                                  " tokens")
            if any(not 0 <= t < vocab for t in r.token_ids):
                raise InvalidStep(f"sequence {r.seq_id}: token ids must be in [0, {vocab})")
            if r.max_compute_tokens < 0:
                raise InvalidStep(f"sequence {r.seq_id}: max_compute_tokens must be >= 0")

    async def _prepare(self, session_id: str, known: SessionSequences,
                       requests: Sequence[SeqRequest]) -> _Prepared:
        """Learn unknown sequences, then one daemon call that appends every new token (but the
        tokens the runner appended ahead)."""
        await self._learn(session_id, known, requests)
        claimed = self._claim_ahead(known, requests)
        self._check_lengths(known, requests, claimed)
        todo = [r for i, r in enumerate(requests) if i not in claimed]
        appended = iter(await self._append(session_id, known, todo) if todo else [])
        states = [self._known(known, r.seq_id) if i in claimed else next(appended)
                  for i, r in enumerate(requests)]
        # An ahead result holds if the client kept the sampling; else sample that position again.
        ready = {i: ahead.result for i, ahead in claimed.items()
                 if ahead.result is not None and ahead.params == requests[i].params}
        chunks = []
        for index, (request, state) in enumerate(zip(requests, states, strict=True)):
            chunk = None if index in ready else self._chunk(request, state, index in claimed)
            if chunk is not None:
                chunks.append((index, chunk))
        return _Prepared(session_id, requests, states, chunks, claimed, ready)

    def _check_lengths(self, known: SessionSequences, requests: Sequence[SeqRequest],
                       claimed: dict[int, Ahead]) -> None:
        """No sequence may hold more tokens than the model has positions (checked before the
        pool changes, so such a step fails alone)."""
        limit = self.runner.max_model_len
        for index, request in enumerate(requests):
            held = 0
            if request.new_sequence and request.parent_seq_id is not None:
                held = len(self._known(known, request.parent_seq_id).tokens)
            elif not request.new_sequence:
                held = len(self._known(known, request.seq_id).tokens)
            added = 0 if index in claimed else len(request.token_ids)
            if held + added > limit:
                raise InvalidStep(f"sequence {request.seq_id} would hold {held + added} tokens; "
                                  f"the model takes at most {limit} positions (max_model_len)")

    async def _append(self, session_id: str, known: SessionSequences,
                      requests: Sequence[SeqRequest]) -> list[SeqState]:
        """One daemon call for the step's memory operations: `Step` for single decode tokens,
        else a `Batch`."""
        if all(not r.new_sequence and len(r.token_ids) == 1 for r in requests):
            return await self._decode_step(session_id, known, requests)
        return await self._batch(session_id, known, requests)

    def _claim_ahead(self, known: SessionSequences,
                     requests: Sequence[SeqRequest]) -> dict[int, Ahead]:
        """The step's sequences whose token the runner appended ahead: it must be the one
        token each names. Nothing changes here: a failed step leaves them claimable."""
        claimed = {}
        for index, request in enumerate(requests):
            state = None if request.new_sequence else known.get(request.seq_id)
            if state is None or state.ahead is None:
                continue
            if tuple(request.token_ids) != (state.ahead.token_id,):
                raise InvalidStep(
                    f"sequence {request.seq_id}: the runner decoded it ahead (decode_ahead), "
                    f"appending its sampled token {state.ahead.token_id}; its next step must "
                    "name exactly that token, or release the sequence")
            claimed[index] = state.ahead
        return claimed

    async def _learn(self, session_id: str, known: SessionSequences,
                     requests: Sequence[SeqRequest]) -> None:
        """Read back existing sequences the runner has not seen: a fork (its parent's history)
        or a sequence from before a runner restart (the history the client sends)."""
        unknown = [r for r in requests if not r.new_sequence and known.get(r.seq_id) is None]
        if not unknown:
            return
        # The daemon first: another session's sequence is NOT_FOUND there, as it must be here.
        reply = await self.pool.call(self.pool.stub.GetBlockTables, lambda: (
            pb.GetBlockTablesRequest(session_id=session_id, seq_ids=[r.seq_id for r in unknown])))
        for request in unknown:
            if self._parent(known, request) is None and request.history is None:
                raise UnknownSequence(
                    f"sequence {request.seq_id} is unknown to the runner (forked, or the runner "
                    "restarted): name its parent_seq_id, or resend it with its history")
        for request, table in zip(unknown, reply.tables, strict=True):
            parent = self._parent(known, request)
            if parent is not None:  # a fork holds the parent's first num_tokens tokens
                n = table.num_tokens
                history = History(tuple(parent.tokens[:n]), min(parent.prompt_len, n),
                                  min(parent.num_computed, n))
            else:
                assert request.history is not None
                history = request.history
            tokens = list(history.token_ids)
            # One token more in the daemon: the runner that restarted appended it ahead (the
            # client's last answer sampled it, and this step names it).
            ahead = (parent is None and len(request.token_ids) == 1
                     and table.num_tokens == len(tokens) + 1)
            if ahead:
                tokens.append(request.token_ids[0])
            if len(tokens) != table.num_tokens or not (
                    0 <= history.num_computed <= len(history.token_ids)
                    and 0 <= history.prompt_len <= len(history.token_ids)):
                raise InvalidStep(f"sequence {request.seq_id}: the daemon holds "
                                  f"{table.num_tokens} tokens, its history says "
                                  f"{len(history.token_ids)}")
            state = SeqState(tokens, history.prompt_len, history.num_computed,
                             list(table.block_ids))
            if ahead:
                state.ahead = Ahead(request.token_ids[0], request.params)
            known.put(request.seq_id, state)

    @staticmethod
    def _parent(known: SessionSequences, request: SeqRequest) -> SeqState | None:
        return None if request.parent_seq_id is None else known.get(request.parent_seq_id)

    async def _decode_step(self, session_id: str, known: SessionSequences,
                           requests: Sequence[SeqRequest], ahead: bool = False) -> list[SeqState]:
        """One daemon Step appending one token to each sequence (the decode hot path); `ahead`:
        the runner's own step, ahead of the client, which each state then records."""
        states = [self._known(known, r.seq_id) for r in requests]
        # If the previous forward computed everything they hold, the Step commits it.
        commit = all(s.num_computed == len(s.tokens) for s in states)
        seq_ids = [r.seq_id for r in requests]
        tokens = [r.token_ids[0] for r in requests]
        reply = await self.pool.call(self.pool.stub.Step, lambda: pb.StepRequest(
            session_id=session_id, seq_ids=seq_ids, num_tokens=1, token_ids=tokens,
            commit=commit))
        self.free_blocks = reply.free_blocks
        for index, logical, block in zip(reply.changed_seq_index, reply.changed_logical_block,
                                         reply.changed_block_id, strict=True):
            states[index].patch(logical, block)
        bs = self.runner.block_size
        for request, state, token, held, slot in zip(requests, states, tokens, reply.num_tokens,
                                                     reply.slot_mapping, strict=True):
            state.tokens.append(token)
            if ahead:
                state.ahead = Ahead(token, request.params)
            if held != len(state.tokens) or state.slots(held - 1, held, bs) != [slot]:
                self._stale(known, request.seq_id)
        return states

    @staticmethod
    def _stale(known: SessionSequences, seq_id: int) -> None:
        """The daemon's answer disagrees with the runner's view of a sequence: the client
        changed it directly in the daemon. Forget it rather than compute on a stale table."""
        known.drop([seq_id])
        raise UnknownSequence(f"sequence {seq_id} changed in the daemon behind the runner (freed "
                              "or re-created directly): resend it with its history")

    async def _batch(self, session_id: str, known: SessionSequences,
                     requests: Sequence[SeqRequest]) -> list[SeqState]:
        """One daemon Batch: Fork the forks first (a child holds what its parent held before the
        step), Allocate each other new sequence, Append to the rest."""
        forks = [r for r in requests if r.new_sequence and r.parent_seq_id is not None]
        # The parents as they are before this step appends to them: what the children inherit.
        inherited = {r.seq_id: self._fork_parent(known, r) for r in forks}
        ops: list[Fork | Allocate | Append] = [
            Fork(r.parent_seq_id, r.seq_id) for r in forks if r.parent_seq_id is not None]
        for r in requests:
            if r.new_sequence and r.parent_seq_id is None:
                ops.append(Allocate(r.seq_id, token_ids=r.token_ids))
            elif r.token_ids:
                if not r.new_sequence:
                    self._known(known, r.seq_id)
                ops.append(Append(r.seq_id, token_ids=r.token_ids))
        answers: list[SequenceBlocks] = []
        if ops:
            reply = await self.pool.call(self.pool.stub.Batch, lambda: pb.BatchRequest(
                session_id=session_id, ops=[op.batch_op() for op in ops]))
            self.free_blocks = reply.free_blocks
            answers = [SequenceBlocks.from_proto(result) for result in reply.results]
        # A fork's Append answer comes after its Fork answer: the later one wins.
        by_seq = {answer.seq_id: answer for answer in answers}
        states = []
        for r in requests:
            answer = by_seq.get(r.seq_id)
            if r.seq_id in inherited:
                assert answer is not None
                state = inherited[r.seq_id]
                state.tokens.extend(r.token_ids)
                state.block_table = list(answer.block_ids)
                known.put(r.seq_id, state)
                if answer.num_tokens != len(state.tokens):
                    self._stale(known, r.seq_id)
            elif r.new_sequence:
                assert answer is not None
                state = SeqState(list(r.token_ids), r.num_prompt_tokens or len(r.token_ids),
                                 answer.num_cached_tokens, list(answer.block_ids),
                                 answer.num_cached_tokens)
                known.put(r.seq_id, state)
            else:
                state = self._known(known, r.seq_id)
                if answer is not None:
                    state.tokens.extend(r.token_ids)
                    state.block_table = list(answer.block_ids)
                    if answer.num_tokens != len(state.tokens):
                        self._stale(known, r.seq_id)
            states.append(state)
        return states

    def _fork_parent(self, known: SessionSequences, request: SeqRequest) -> SeqState:
        """A copy of the parent's state for a fork's child; the parent must be fully computed
        (else the child would compute K/V into blocks it shares with the parent)."""
        assert request.parent_seq_id is not None
        parent = self._known(known, request.parent_seq_id)
        if parent.num_computed != len(parent.tokens):
            raise InvalidStep(f"sequence {request.seq_id}: its parent {request.parent_seq_id} is "
                              "not fully computed yet; fork it after its prefill")
        if parent.ahead is not None:
            raise InvalidStep(f"sequence {request.seq_id}: its parent {request.parent_seq_id} "
                              "holds a token decoded ahead (decode_ahead); fork it in a step "
                              "after the one that names that token")
        return SeqState(list(parent.tokens), parent.prompt_len, parent.num_computed,
                        list(parent.block_table))

    def _known(self, known: SessionSequences, seq_id: int) -> SeqState:
        state = known.get(seq_id)
        if state is None:
            raise InvalidStep(f"sequence {seq_id} is not known to the runner: send it as a new "
                              "sequence, or name its parent on a fork's first step")
        return state

    def _chunk(self, request: SeqRequest, state: SeqState,
               resample: bool = False) -> SequenceChunk | None:
        """The tokens of `state` to compute in this step, or None if all are computed (unless
        the step is to sample again a position already computed: `resample`)."""
        bs = self.runner.block_size
        total = len(state.tokens)
        start = state.num_computed
        if start == total:
            # Everything is cached (a prompt of whole cached blocks), or computed ahead: recompute
            # the last token for its logits, writing nothing (its K/V is in a block others may
            # share).
            if not (request.new_sequence or resample):
                return None
            return SequenceChunk(state.tokens[-1:], total - 1, [-1], state.block_table)
        end = total if not request.max_compute_tokens else min(
            total, start + request.max_compute_tokens)
        return SequenceChunk(state.tokens[start:end], start, state.slots(start, end, bs),
                             state.block_table)

    # ------------------------------------------------------------- the forward

    async def _forward_loop(self) -> None:
        loop = asyncio.get_running_loop()
        # The sessions of the last forward, and how long it took.
        recent: set[str] = set()
        last_forward_s = 0.0
        while True:
            if not self._ready:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._gather(recent, min(MAX_GATHER_S, last_forward_s))
            batch = self._take_batch()
            started = time.monotonic()
            try:
                sampled = await loop.run_in_executor(self._forward_thread, self._compute, batch)
            except Exception as exc:  # a failed forward fails the steps it carried
                for prepared in batch:
                    if not prepared.done.done():
                        prepared.done.set_exception(exc)
                continue
            last_forward_s = time.monotonic() - started
            recent = {prepared.session_id for prepared in batch}
            self._observe(batch, started)
            self._deliver(batch, sampled)

    async def _gather(self, recent: set[str], window: float) -> None:
        """Wait up to `window` for the sessions of the last forward to send their next step.

        Their answers just left, while the steps of other clients were prepared during that
        forward: without waiting, the clients split into two groups whose half-size forwards
        alternate; with it, they merge into one forward."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + window
        while recent - {prepared.session_id for prepared in self._ready}:
            left = deadline - loop.time()
            if left <= 0:
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)

    def _observe(self, batch: list[_Prepared], started: float) -> None:
        if self.metrics is None:
            return
        lengths = [len(chunk.token_ids) for prepared in batch for _, chunk in prepared.chunks]
        decode = sum(1 for n in lengths if n == 1)
        self.metrics.forward(time.monotonic() - started, len(lengths), sum(lengths) - decode,
                             decode)
        for prepared in batch:
            self.metrics.queue_wait(started - prepared.ready_at)

    def _take_batch(self) -> list[_Prepared]:
        """The waiting steps, in arrival order, up to max_batch_tokens (at least one)."""
        batch: list[_Prepared] = []
        tokens = 0
        while self._ready and (not batch or tokens + self._ready[0].num_tokens
                               <= self.max_batch_tokens):
            prepared = self._ready.popleft()
            batch.append(prepared)
            tokens += prepared.num_tokens
        return batch

    def _compute(self, batch: list[_Prepared]) -> list[Pick]:
        """[forward thread] One forward over every chunk, then sampling where it is due; the
        picks come back as host values, so the loop thread touches no tensor."""
        chunks = [chunk for prepared in batch for _, chunk in prepared.chunks]
        logits = self.runner.step(chunks)
        rows, keep = [], []
        position = 0
        for prepared in batch:
            for index, chunk in prepared.chunks:
                state = prepared.states[index]
                if chunk.start + len(chunk.token_ids) == len(state.tokens):
                    rows.append(SamplingRow(prepared.requests[index].params,
                                            state.tokens[:state.prompt_len],
                                            state.tokens[state.prompt_len:]))
                    keep.append(position)
                position += 1
        if not rows:
            return []
        if len(keep) < len(chunks):
            logits = logits[torch.tensor(keep)]
        return picks(self.sampler(logits, rows), rows)

    def _deliver(self, batch: list[_Prepared], sampled: list[Pick]) -> None:
        """Advance each sequence's computed count and answer each step."""
        row = 0
        for prepared in batch:
            chosen: dict[int, Pick] = {}
            for index, chunk in prepared.chunks:
                state = prepared.states[index]
                state.num_computed = max(state.num_computed, chunk.start + len(chunk.token_ids))
                if state.num_computed == len(state.tokens):
                    chosen[index] = sampled[row]
                    row += 1
            results = [prepared.ready.get(i) or self._result(request, state, chosen.get(i))
                       for i, (request, state) in enumerate(
                           zip(prepared.requests, prepared.states, strict=True))]
            if not prepared.done.done():  # its caller is gone (cancelled): the K/V stays
                prepared.done.set_result(results)

    def _result(self, request: SeqRequest, state: SeqState, pick: Pick | None) -> SeqResult:
        if pick is None:
            return SeqResult(request.seq_id, len(state.tokens), state.num_computed,
                             state.num_cached, sampled=False)
        # A sequence that holds max_model_len tokens has no position for its sampled token.
        full = len(state.tokens) >= self.runner.max_model_len
        return SeqResult(request.seq_id, len(state.tokens), state.num_computed,
                         state.num_cached, True, pick.token_id, pick.logprob,
                         pick.top_token_ids, pick.top_logprobs, pick.finished or full)

    # -------------------------------------------------------------- finishing

    async def _finish(self, session_id: str, known: SessionSequences, prepared: _Prepared,
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
            computed = [self._known(known, seq_id).num_computed for seq_id in released]
            ops.append(Commit(released, computed))
            ops.extend(Free(seq_id) for seq_id in released)
        if ops:
            reply = await self.pool.call(self.pool.stub.Batch, lambda: pb.BatchRequest(
                session_id=session_id, ops=[op.batch_op() for op in ops]))
            self.free_blocks = reply.free_blocks
        known.drop(released)
        for seq_id in set(release) - set(released):  # never stepped here (a pruned fork)
            free = functools.partial(pb.FreeRequest, session_id=session_id, seq_id=seq_id)
            with contextlib.suppress(SequenceNotFound):
                await self.pool.call(self.pool.stub.Free, free)

