"""One Runner.StepStream: a session's steps as messages, and the runner following the session
(runner.proto's StepStream, "Following").

Each message is handled as the Step call with the same request and answered in order; a failed
one answers its status and the stream goes on. A message with `follow` set starts following
from its answer: while no next message has arrived, the runner takes the session's implied step
itself (`implied_step`: each decode_ahead sequence that sampled a token not finishing it, that
token appended) through the same step function, and pushes its answer, numbered. The engine
has computed that step ahead (decode_ahead), so a push is answered from those results and
starts the next step ahead: following is decode ahead with no client round trip between two
forwards, one mechanism, not a second stepping path.

While the step ahead is there to claim, the runner's pushes come from the engine's decode run
(`StepEngine.follow`, decode_run.py): the forward thread computes the implied steps back to back
and hands each one's outputs here, so a push costs the event loop its message alone (steps
whose push was not sent yet are merged into it, outbox.py); when the
run stops (a reservation ran out, the hold needs the loop, another step of the session), the
implied step it leaves goes through the step function, and the run starts again from its
result.

A reader task waits for the client's next message meanwhile; it never cancels a push in
progress: a message is handled once the push in progress is out (and is then refused as
StalePlan if it names sequences and was planned before pushes it had not read). Draining
ends the stream once the push in progress is out; a stream that ends mid-push ends that step as
a cancelled Step (the engine keeps the session held until its forward is done).
"""

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import grpc

from pagedkv.client import SeqStep, StepOutputs
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.steps import InvalidStep, StalePlan, implied_step
from pagedkv.model_runner.process.outbox import Outbox
from pagedkv.model_runner.process.step_messages import StepFunction, seq_request
from pagedkv.process.stream_drain import DrainableStreams
from pagedkv.proto import runner_pb2 as rpb
from pagedkv.vocab.causes import cut_message

# An exception met by a step as its status: (code, cause, message).
Failure = Callable[[Exception], tuple[grpc.StatusCode, str, str]]
# StepEngine.follow, behind the server's gate: (session, implied step, deliver, until) -> the
# implied step left, or None when no run started.
FollowFunction = Callable[[str, Sequence[SeqStep], Callable[[StepOutputs], None],
                           "asyncio.Future[Any]"], Coroutine[Any, Any, list[SeqStep] | None]]


class SessionStream:
    """One StepStream's session, the step it follows with, and its pushes."""

    def __init__(self, step: StepFunction, failure: Failure,
                 metrics: RunnerMetrics | None = None,
                 follow: FollowFunction | None = None) -> None:
        self._step = step
        # Takes the implied steps on the forward thread (None: every push through `step`).
        self._follow = follow
        self._failure = failure
        self._metrics = metrics
        # The session the stream serves: its first message's.
        self.session_id: str | None = None
        # The step the runner takes next while it follows the session; empty when it does not.
        self.implied: list[SeqStep] = []
        # Answers pushed on this stream so far: the last push's number.
        self.pushes = 0

    async def answers(self, requests: AsyncIterator[rpb.RunnerStreamRequest],
                      streams: DrainableStreams) -> AsyncIterator[rpb.RunnerStreamResponse]:
        """Each message's answer, in order, and the pushes between them while following;
        ends when the client ends the stream or the runner drains."""
        reader: asyncio.Task[rpb.RunnerStreamRequest | None] | None = None
        try:
            while True:
                if not self.implied:  # no push to make: wait for the message itself
                    message = await streams.next_message(requests)
                else:
                    reader = asyncio.create_task(streams.next_message(requests))
                    while self.implied and not reader.done() and not streams.draining:
                        ran = False
                        async for push in self._run(reader):
                            ran = True
                            yield push
                        if not ran and not reader.done() and not streams.draining:
                            yield await self._push()
                    message = await reader
                if message is None:
                    return
                yield await self._answer(message)
        finally:
            if reader is not None and not reader.done():  # the stream ends mid-push
                reader.cancel()
                await asyncio.wait({reader})

    async def _answer(self, message: rpb.RunnerStreamRequest) -> rpb.RunnerStreamResponse:
        """A message's answer, or the status a Step call would have got; it ends the following
        going on, and starts following from its answer if it asks."""
        self.implied = []
        if self.session_id is None:
            self.session_id = message.step.session_id
        release = list(message.step.release_seq_ids)
        try:
            self._check(message)
            seqs = [seq_request(seq) for seq in message.step.seqs]
            outputs = await self._step(message.step.session_id, seqs, release)
        except Exception as exc:
            return self._failed(exc, step_id=message.step_id)
        if message.follow:
            self.implied = implied_step(seqs, outputs, release)
        return rpb.RunnerStreamResponse(step_id=message.step_id, answer=outputs.message())

    def _check(self, message: rpb.RunnerStreamRequest) -> None:
        """Refuse a message of another session, one claiming pushes never sent, or one naming
        sequences that was planned before pushes it had not read (a release alone is never
        stale)."""
        if message.step.session_id != self.session_id:
            raise InvalidStep(f"step {message.step_id} names another session than the "
                              "one this stream serves (its first message's)")
        if message.pushes_read > self.pushes:
            raise InvalidStep(f"step {message.step_id}: pushes_read {message.pushes_read}, but "
                              f"the runner has pushed {self.pushes} answers on this stream")
        if message.step.seqs and message.pushes_read < self.pushes:
            raise StalePlan(f"step {message.step_id} was planned after {message.pushes_read} "
                            f"pushed answers; the runner has pushed {self.pushes}: read them "
                            "and plan again")

    async def _push(self) -> rpb.RunnerStreamResponse:
        """Take the implied step and push its answer (or its status, which ends following)."""
        assert self.session_id is not None, "following starts from a message's answer"
        self.pushes += 1
        seqs, self.implied = self.implied, []
        try:
            outputs = await self._step(self.session_id, seqs, ())
        except Exception as exc:
            if self._metrics is not None:
                self._metrics.push(ok=False)
            return self._failed(exc, push=self.pushes)
        if self._metrics is not None:
            self._metrics.push(ok=True)
        self.implied = implied_step(seqs, outputs, ())
        return rpb.RunnerStreamResponse(push=self.pushes, answer=outputs.message())

    async def _run(self, reader: asyncio.Task[Any]) -> AsyncIterator[rpb.RunnerStreamResponse]:
        """The pushes of the engine's decode run of the implied step, until it stops (`reader`
        done: the client's next message, a drain); none if no run started. Leaves the implied
        step the run left (none after a failure, which it pushes)."""
        assert self.session_id is not None, "following starts from a message's answer"
        if self._follow is None:
            return
        outbox = Outbox()
        run = asyncio.create_task(self._follow(self.session_id, self.implied, outbox.put,
                                               reader))
        run.add_done_callback(outbox.poke)
        try:
            while True:
                while (answer := outbox.take()) is not None:
                    yield self._pushed(answer)
                if run.done():
                    break
                await outbox.wait()
            left = run.result()
        except Exception as exc:
            self.implied = []
            self.pushes += 1
            if self._metrics is not None:
                self._metrics.push(ok=False)
            yield self._failed(exc, push=self.pushes)
            return
        finally:
            if not run.done():  # the stream ends mid-run: the step in progress finishes
                run.cancel()
                await asyncio.wait({run})
        if left is not None:
            self.implied = left

    def _pushed(self, answer: rpb.RunnerStepResponse) -> rpb.RunnerStreamResponse:
        """A decode run's step as its push."""
        self.pushes += 1
        if self._metrics is not None:
            self._metrics.push(ok=True)
        return rpb.RunnerStreamResponse(push=self.pushes, answer=answer)

    def _failed(self, exc: Exception, *, step_id: int = 0,
                push: int = 0) -> rpb.RunnerStreamResponse:
        code, cause, text = self._failure(exc)
        return rpb.RunnerStreamResponse(step_id=step_id, push=push, code=code.value[0],
                                        cause=cause, message=cut_message(text))
