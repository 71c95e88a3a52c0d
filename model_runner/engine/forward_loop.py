"""The runner's forward passes: one at a time, over every prepared client step waiting.

    forwards = ForwardLoop(lambda: model_runner, Sampler())
    await forwards.start()
    results = await forwards.compute(prepared)     # a step whose daemon call is done

Steps prepared by several clients (their daemon round trips done, their chunks known) wait in
one queue; the loop packs the waiting steps into one forward pass on one worker thread (so two
steps' writes never interleave and the event loop never blocks on the model), samples each fully
computed sequence, and answers each step once all its chunks are computed. Before a forward it
waits briefly for the clients of the last forward (`_gather`), so concurrent clients share
forwards.

No forward computes more than `max_batch_tokens` tokens (`_take_batch`): decode steps (one token
per sequence) go first, then pieces of the other steps' chunks up to the budget, each group in
arrival order. A long prefill so runs as several forwards, and the decodes of other clients
join each of them instead of waiting for the whole prompt; its step is answered (and its blocks
committed) when its last piece is computed.

Followed sessions' decode runs (decode_run.py) join every forward: while no client step waits,
the forward thread computes their steps back to back without returning to the event loop, each
run's outputs handed to its stream from the thread. The thread reads the followed runs before
each of those forwards, so a run followed meanwhile (another session's, or one whose reservation
was just renewed) joins the next forward: one forward for every followed sequence, as vLLM's
continuous batching has one for every running sequence. (Had the thread kept the runs it
started with, a later run would wait for them all to stop: runs of several sessions took turns,
half of the sequences per forward.)

No forward starts on a session whose hold may lapse before the forward ends (`_refuse_lapsed`):
the runner was stalled (its renewals did not run), so the daemon may be about to hand the
session's blocks to someone else once it has stopped this runner (kvpool.proto's "Runner
holds"). Those steps fail alone (StepNotComputed: resend); the rest of the batch goes on.
"""

import asyncio
import contextlib
import dataclasses
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pagedkv.client import SeqOutput, SeqStep
from pagedkv.model_runner.engine.decode_run import DecodeRun, sampling_row, seq_output
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.sampling import Pick, Sampler, picks
from pagedkv.model_runner.engine.sequences import Ahead, SeqState
from pagedkv.model_runner.runner import ModelRunner, SequenceChunk
from pagedkv.process.lifecycle import cancel

# How long a forward waits at most (and at most as long as the last forward took) for clients of
# the last forward to send their next step, so concurrent clients share forwards (`_gather`).
MAX_GATHER_S = 0.005


@dataclass
class Prepared:
    """A client step between prepare and finish."""

    session_id: str
    requests: Sequence[SeqStep]
    # The state of each requested sequence, in request order.
    states: list[SeqState]
    # (index into requests, chunk) of the sequences computed in this step.
    chunks: list[tuple[int, SequenceChunk]]
    # Requests whose token the runner appended ahead (index -> what it did), and the results
    # of those it also computed with the same sampling: no chunk, no daemon call.
    claimed: dict[int, Ahead] = field(default_factory=dict)
    ready: dict[int, SeqOutput] = field(default_factory=dict)
    # Whether it made a daemon call before its forward (a decode step inside its sequences'
    # reservations makes none: its forward never waits on the daemon).
    daemon_call: bool = True
    # Set by the forward: one result per request.
    done: asyncio.Future[list[SeqOutput]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    # When it was ready for a forward (monotonic seconds).
    ready_at: float = field(default_factory=time.monotonic)
    # The pieces of `chunks` not computed yet, in order (a forward takes a prefix of them).
    left: deque[tuple[int, SequenceChunk]] = field(init=False)
    # The sampled token of each request that sampled so far (index -> pick).
    picked: dict[int, Pick] = field(default_factory=dict)
    # Forwards that computed a piece of it.
    forwards: int = 0
    # When the runner last asked the daemon to hold the step's session (its clock; the
    # daemon's deadline is at least this + hold_ms), read as each forward starts; None: no
    # hold to check (an engine without a daemon hold).
    held_since: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        self.left = deque(self.chunks)

    @property
    def decoding(self) -> bool:
        """Every piece left is one token (decode steps go first in a forward)."""
        return all(len(chunk.token_ids) == 1 for _, chunk in self.left)

    def take(self, budget: int) -> list[tuple[int, SequenceChunk]]:
        """The next pieces to compute, in order, up to `budget` tokens; a chunk longer than what
        is left of the budget is split, its tail left for a later forward."""
        pieces = []
        while self.left and budget > 0:
            index, chunk = self.left[0]
            if len(chunk.token_ids) <= budget:
                self.left.popleft()
                pieces.append((index, chunk))
                budget -= len(chunk.token_ids)
            else:
                head, tail = _split(chunk, budget)
                self.left[0] = (index, tail)
                pieces.append((index, head))
                budget = 0
        return pieces


# One forward's work: each step in it, with the pieces of its chunks it computes.
Batch = list[tuple[Prepared, list[tuple[int, SequenceChunk]]]]


def _split(chunk: SequenceChunk, count: int) -> tuple[SequenceChunk, SequenceChunk]:
    """`chunk`'s first `count` tokens, and the rest (computed by a later forward: its K/V of the
    first part is in the pool by then)."""
    head = dataclasses.replace(chunk, token_ids=chunk.token_ids[:count],
                               slot_mapping=chunk.slot_mapping[:count])
    tail = dataclasses.replace(chunk, token_ids=chunk.token_ids[count:], start=chunk.start + count,
                               slot_mapping=chunk.slot_mapping[count:])
    return head, tail


class HoldMayHaveLapsed(RuntimeError):
    """The step's session may go unheld before its forward ends: the forward was not started."""


class ForwardLoop:
    """Runs the forward passes of every client's prepared steps, merged."""

    def __init__(self, runner: Callable[[], ModelRunner], sampler: Sampler, *,
                 max_batch_tokens: int = 8192, metrics: RunnerMetrics | None = None,
                 hold_ms: int | None = None) -> None:
        # The model runner in use (it is replaced when the daemon restarts).
        self._runner = runner
        self.sampler = sampler
        self.metrics = metrics
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        # Most tokens one forward pass computes (longer chunks are split across passes).
        self.max_batch_tokens = max_batch_tokens
        # How long a hold lasts from the runner's call (`_refuse_lapsed`); None: not checked.
        self.hold_s = None if hold_ms is None else hold_ms / 1000
        # Prepared steps waiting for a forward, in arrival order.
        self._ready: deque[Prepared] = deque()
        # Followed sessions' decode runs, whose steps the forward thread takes itself; the
        # event loop adds to them while the thread reads them (`_followed`), under the lock.
        self._runs: list[DecodeRun] = []
        self._runs_lock = threading.Lock()
        self._wake = asyncio.Event()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-forward")
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="pagedkv-forward")

    async def stop(self) -> None:
        for run in self._runs:  # the thread stops looping once its step in progress is out
            run.stopping = True
        if self._task is not None:
            await cancel(self._task)
            self._task = None
        self._thread.shutdown(wait=True)
        for run in self._runs:  # the thread is gone: nothing writes any more
            run.finish(RuntimeError("the runner stopped computing"))
        self._runs = []

    async def between_forwards(self, work: Callable[[], None]) -> None:
        """Run `work` on the forward thread: after the forward in progress, before the next
        (nothing else runs there, so no forward runs meanwhile)."""
        await asyncio.get_running_loop().run_in_executor(self._thread, work)

    def follow(self, run: DecodeRun) -> None:
        """Let the forward thread take `run`'s steps from the next forward on, until it stops
        (`run.ended`)."""
        with self._runs_lock:
            self._runs.append(run)
        self._wake.set()

    async def compute(self, prepared: Prepared) -> list[SeqOutput]:
        """Queue a prepared step for the next forward; its results, one per request."""
        self._ready.append(prepared)
        self._wake.set()
        return await prepared.done

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        # The sessions of the last forward, and how long it took.
        recent: set[str] = set()
        last_forward_s = 0.0
        # When the last forward ended: the forward thread is free from then on.
        free_at = 0.0
        while True:
            if not self._ready and not self._followed():
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._ready:
                await self._gather(recent, min(MAX_GATHER_S, last_forward_s))
            batch = self._refuse_lapsed(self._take_batch(), last_forward_s)
            if not batch and not self._followed():  # every waiting step was cancelled or refused
                continue
            started = time.monotonic()
            try:
                sampled, last_forward_s = await loop.run_in_executor(
                    self._thread, self._compute, batch, last_forward_s)
            except Exception as exc:  # a failed forward fails the steps it carried
                for prepared, _ in batch:
                    if not prepared.done.done():
                        prepared.done.set_exception(exc)
                continue
            recent = {prepared.session_id for prepared, _ in batch}
            self._observe(batch, started, free_at)
            free_at = time.monotonic()
            self._deliver(batch, sampled)
            # Steps with pieces left go on first in the next forward (a failed or cancelled
            # one computes no more).
            self._ready.extendleft(reversed([prepared for prepared, _ in batch
                                             if prepared.left and not prepared.done.done()]))

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

    def _observe(self, batch: Batch, started: float, free_at: float) -> None:
        """The first forward of a batch: did the thread idle for a daemon? (the forwards
        themselves are counted on the thread, `_counted`)."""
        if self.metrics is None or not batch:
            return
        if all(len(chunk.token_ids) == 1 for _, pieces in batch for _, chunk in pieces):
            self.metrics.decode_forward(any(prepared.daemon_call and prepared.ready_at > free_at
                                            for prepared, _ in batch))
        for prepared, _ in batch:
            if prepared.forwards == 1:  # its first forward
                self.metrics.queue_wait(started - prepared.ready_at)

    def _take_batch(self) -> Batch:
        """The work of the next forward, at most max_batch_tokens tokens: the waiting decode
        steps first, then pieces of the others' chunks, each group in arrival order. Steps
        not taken stay queued; a cancelled one is dropped."""
        waiting = [prepared for prepared in self._ready if not prepared.done.done()]
        budget = self.max_batch_tokens
        batch: Batch = []
        for prepared in sorted(waiting, key=lambda p: not p.decoding):  # stable: arrival order
            if not budget:
                break
            pieces = prepared.take(budget)
            budget -= sum(len(chunk.token_ids) for _, chunk in pieces)
            prepared.forwards += 1
            batch.append((prepared, pieces))
        taken = {id(prepared) for prepared, _ in batch}
        self._ready = deque(prepared for prepared in waiting if id(prepared) not in taken)
        return batch

    def _refuse_lapsed(self, batch: Batch, forward_s: float) -> Batch:
        """Fail the steps whose session's hold may lapse before a forward as long as twice the
        last one ends; the rest of the batch. Checked just before the forward is launched."""
        if self.hold_s is None:
            return batch
        ends = time.monotonic() + 2 * forward_s
        kept: Batch = []
        for prepared, pieces in batch:
            since = prepared.held_since() if prepared.held_since is not None else math.inf
            if since + self.hold_s > ends:
                kept.append((prepared, pieces))
            elif not prepared.done.done():
                prepared.done.set_exception(HoldMayHaveLapsed(
                    "the runner's hold on the step's session may lapse before its forward "
                    "ends (the runner was stalled): forward not started"))
        return kept

    def _followed(self) -> list[DecodeRun]:
        """[either thread] The runs not over, those over dropped."""
        with self._runs_lock:
            self._runs = [run for run in self._runs if not run.over]
            return list(self._runs)

    def _compute(self, batch: Batch, forward_s: float) -> tuple[list[Pick], float]:
        """[forward thread] One forward over every piece of `batch` and the next step of each
        followed run, then sampling where it is due; then, while no client step waits, the
        runs' next steps back to back, each forward with every run followed by then. The
        batch's picks (host values, so the loop thread touches no tensor) and how long the last
        forward took."""
        while True:
            runs = self._followed()
            # A run whose daemon Step just renewed its reservations: its thread waited on it.
            waited = any(run.appended for run in runs)
            steps = [(run, chunks) for run in runs
                     if (chunks := run.decode_followed(forward_s)) is not None]
            if not batch and not steps:
                return [], forward_s
            started = time.monotonic()
            try:
                sampled = self._forward(batch, steps, waited)
            except Exception as exc:  # the runs' step fails as a client step's would
                for run, _ in steps:
                    run.finish(exc)
                raise
            forward_s = time.monotonic() - started
            position = len(sampled) - sum(len(chunks) for _, chunks in steps)
            for run, chunks in steps:
                run.advance(sampled[position:position + len(chunks)])
                position += len(chunks)
            if batch or self._ready or not steps:
                return sampled[:len(sampled) - sum(len(chunks) for _, chunks in steps)], forward_s

    def _forward(self, batch: Batch, steps: list[tuple[DecodeRun, list[SequenceChunk]]],
                 waited: bool) -> list[Pick]:
        """[forward thread] One forward over `batch`'s pieces, then the runs' chunks (every one
        sampled), counted; the picks of the sequences it sampled, in that order."""
        started = time.monotonic()
        pieces = [(prepared.states[index], chunk) for prepared, taken in batch
                  for index, chunk in taken]
        pieces.extend((state, chunk) for run, chunks in steps
                      for state, chunk in zip(run.states, chunks, strict=True))
        chunks = [chunk for _, chunk in pieces]
        logits = self._runner().step(chunks)
        keep = [position for position, (state, chunk) in enumerate(pieces)
                if chunk.start + len(chunk.token_ids) == len(state.tokens)]
        rows = [sampling_row(pieces[position][0]) for position in keep]
        result = []
        if rows:
            if len(keep) < len(chunks):
                logits = logits[torch.tensor(keep)]
            result = picks(self.sampler(logits, rows), rows)
        self._counted(chunks, time.monotonic() - started, runs_only=not batch, waited=waited)
        return result

    def _counted(self, chunks: list[SequenceChunk], seconds: float, runs_only: bool,
                 waited: bool) -> None:
        """[forward thread] Count a forward (prometheus' metrics are thread-safe); one of runs
        alone is a decode-only forward that waited on a daemon call if a run's reservations
        were just renewed (`_observe` judges the others)."""
        if self.metrics is None:
            return
        lengths = [len(chunk.token_ids) for chunk in chunks]
        decode = sum(1 for n in lengths if n == 1)
        self.metrics.forward(seconds, len(lengths), sum(lengths) - decode, decode)
        if runs_only:
            self.metrics.decode_forward(waited)

    def _deliver(self, batch: Batch, sampled: list[Pick]) -> None:
        """Advance each sequence's computed count; answer each step with no piece left."""
        row = 0
        for prepared, pieces in batch:
            for index, chunk in pieces:
                state = prepared.states[index]
                state.num_computed = max(state.num_computed, chunk.start + len(chunk.token_ids))
                if state.num_computed == len(state.tokens):
                    prepared.picked[index] = sampled[row]
                    row += 1
            # A step whose caller is gone (cancelled) gets no answer: the K/V computed stays.
            if not prepared.left and not prepared.done.done():
                prepared.done.set_result(self.results(prepared, prepared.picked))

    def results(self, prepared: Prepared, chosen: dict[int, Pick]) -> list[SeqOutput]:
        """One result per request of `prepared`: computed ahead, or from this step (`chosen`:
        the sampled token of each request that sampled, by index)."""
        limit = self._runner().max_model_len
        return [prepared.ready.get(i) or seq_output(request.seq_id, state, chosen.get(i), limit)
                for i, (request, state) in enumerate(
                    zip(prepared.requests, prepared.states, strict=True))]
