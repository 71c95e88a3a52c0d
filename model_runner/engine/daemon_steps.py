"""The runner's daemon Steps, coalesced: Steps that several sessions make at the same moment go to
the daemon as one StepMany call.

    steps = DaemonSteps(pool_client)
    result = await steps.step(session, Step([7], token_ids=[42]))

After a merged forward, the sessions of it whose sequences cross into a new block each make a
daemon Step (reservations.py); one call for all of them saves the daemon and the runner's event
loop a gRPC round trip per session, which is most of what an extra client costs on a CPU.

No timer: the first Step of a burst starts a sender, which yields to the event loop until a
pass adds no Step (`asyncio.sleep(0)`), then sends every Step queued. Steps made ready by one
event (the results of one forward) so travel together, and a lone Step leaves at once. Each
entry succeeds or fails alone (kvpool.proto: StepMany is all-or-nothing per entry); a call whose
answer was lost is read back entry by entry by the client (`PoolClient.step_many`), and an
entry it cannot tell fails with OutcomeUnknown.
"""

import asyncio

from pagedkv.client import PoolClient, Session, Step, StepResult
from pagedkv.model_runner.engine.metrics import RunnerMetrics

# Entries in one StepMany at most; the daemon's max_steps_per_call is at least this many.
MAX_STEP_ENTRIES = 64


class DaemonSteps:
    """Sends the runner's daemon Steps, those queued together in one StepMany."""

    def __init__(self, pool: PoolClient, metrics: RunnerMetrics | None = None) -> None:
        self.pool = pool
        self.metrics = metrics
        # Steps waiting for the next call, with the future of each one's answer.
        self._queued: list[tuple[Session, Step, asyncio.Future[StepResult]]] = []
        self._sender: asyncio.Task[None] | None = None

    @property
    def gathering(self) -> bool:
        """A burst is being gathered: a Step made now leaves in the same call."""
        return bool(self._queued)

    async def step(self, session: Session, op: Step) -> StepResult:
        """The daemon's answer to one Step of `session`; the exception of its status if it
        failed."""
        future: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        self._queued.append((session, op, future))
        if self._sender is None:
            self._sender = asyncio.create_task(self._send(), name="pagedkv-daemon-steps")
            self._sender.add_done_callback(self._sender_done)
        return await future

    def _sender_done(self, sender: asyncio.Task[None]) -> None:
        """A sender cancelled before its burst left (the runner stopping, maybe before the
        sender ever ran): its callers are cancelled, and the next Step starts a new sender."""
        if sender is self._sender:
            for _, _, future in self._queued:
                future.cancel()
            self._queued.clear()
            self._sender = None

    async def _send(self) -> None:
        """Wait for the burst to end, then send it in calls of at most MAX_STEP_ENTRIES. A Step
        queued once the burst has left starts a sender of its own, so none waits for a call."""
        seen = 0
        while len(self._queued) != seen:
            seen = len(self._queued)
            await asyncio.sleep(0)  # let the Steps made ready meanwhile join
        # A caller cancelled before the call leaves takes its entry out.
        burst = [entry for entry in self._queued if not entry[2].done()]
        self._queued.clear()
        self._sender = None
        await asyncio.gather(*(self._call(burst[start:start + MAX_STEP_ENTRIES])
                               for start in range(0, len(burst), MAX_STEP_ENTRIES)))

    async def _call(self, batch: list[tuple[Session, Step, asyncio.Future[StepResult]]]) -> None:
        """One StepMany; each entry's future gets its answer or its exception."""
        answers: list[StepResult | Exception]
        try:
            answers = list(await self.pool.step_many([(session, op) for session, op, _ in batch]))
        except asyncio.CancelledError:  # the runner stopping: nobody is left waiting
            for _, _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # no answer, or the whole call refused: every entry fails
            answers = [exc] * len(batch)
        if self.metrics is not None:
            self.metrics.daemon_steps(len(batch))
        for (_, _, future), answer in zip(batch, answers, strict=True):
            if future.done():  # its caller was cancelled meanwhile
                continue
            if isinstance(answer, Exception):
                future.set_exception(answer)
            else:
                future.set_result(answer)
