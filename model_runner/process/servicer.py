"""The Runner gRPC servicer: thin translations between runner.proto and the `StepEngine`.

Errors keep the daemon's words: a daemon error met while acting for a client (an unknown
session, a full pool) reaches the client with the daemon's status code, message and cause
(`pagedkv-error` metadata), so the client's error classes work the same against either process;
the runner's own refusals name their causes of the same table (`pagedkv.vocab.causes`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc

from pagedkv.client import PagedKVError
from pagedkv.client.pool.errors import cause_of_error
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.steps import (
    StalePlan,
    StepNotComputed,
    UnknownSequence,
    Unsupported,
)
from pagedkv.model_runner.process.follow import FollowFunction, SessionStream
from pagedkv.model_runner.process.step_messages import StepFunction, seq_request
from pagedkv.process.grpc_errors import errors_to_status
from pagedkv.process.stream_drain import DrainableStreams
from pagedkv.proto import runner_pb2 as rpb
from pagedkv.proto import runner_pb2_grpc
from pagedkv.vocab import causes
from pagedkv.vocab.causes import Cause

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]


class RunnerUnavailable(RuntimeError):
    """The runner cannot compute now: its daemon is away, or restarted and the runner is mapping
    the new pool (UNAVAILABLE, cause "RunnerUnavailable"); nothing was changed."""


# Each of the runner's own exceptions' cause; first match wins. ValueError: InvalidStep, or
# SamplingParams' own checks.
CAUSES: tuple[tuple[type[Exception], Cause], ...] = (
    (ValueError, causes.INVALID_ARGUMENT),
    (UnknownSequence, causes.UNKNOWN_SEQUENCE),
    (StepNotComputed, causes.STEP_NOT_COMPUTED),  # applied in the daemon: not "nothing changed"
    (StalePlan, causes.STALE_PLAN),
    (Unsupported, causes.UNSUPPORTED),
    (RunnerUnavailable, causes.RUNNER_UNAVAILABLE),
)


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str, str]:
    """(code, cause, message) for an exception met by a step, as the daemon's `failure_of`; a
    daemon error (a client one) is relayed with its own cause, or its code alone if it names
    none (cause "")."""
    if isinstance(exc, PagedKVError):
        relayed = cause_of_error(exc)
        return exc.code, relayed.name if relayed else "", exc.message
    cause = next((cause for kind, cause in CAUSES if isinstance(exc, kind)), causes.INTERNAL)
    message = (f"internal error ({type(exc).__name__}); see the runner log"
               if cause is causes.INTERNAL else str(exc))
    return grpc.StatusCode[cause.code], cause.name, message


def _failure(servicer: RunnerServicer, exc: Exception, rpc: str
             ) -> tuple[grpc.StatusCode, str, str]:
    """`status_of`, with an internal error logged by the servicer's (rate-limited) log."""
    code, cause, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        servicer.log_failure(exc)
    return code, cause, message


# Wraps the runner's servicer methods: every exception becomes its status (`_failure`).
grpc_errors = errors_to_status(_failure)


class RunnerServicer(runner_pb2_grpc.RunnerServicer):
    """Serves `pagedkv.v1.Runner` from a step function (the engine's)."""

    def __init__(self, step: StepFunction, info: Callable[[], rpb.RunnerInfo],
                 log_failure: Callable[[Exception], None],
                 metrics: RunnerMetrics | None = None,
                 follow: FollowFunction | None = None) -> None:
        self._step = step
        # Takes a followed session's implied steps on the forward thread (follow.py).
        self._follow = follow
        self._info = info
        self.log_failure = log_failure
        # Counts the answers pushed to following streams.
        self._metrics = metrics
        # The open StepStreams, ended when the runner drains (`end_streams`).
        self._streams = DrainableStreams()

    @grpc_errors
    async def GetRunnerInfo(self, request: rpb.GetRunnerInfoRequest,
                            context: Context) -> rpb.RunnerInfo:
        return self._info()

    @grpc_errors
    async def Step(self, request: rpb.RunnerStepRequest,
                   context: Context) -> rpb.RunnerStepResponse:
        seqs = [seq_request(seq) for seq in request.seqs]
        outputs = await self._step(request.session_id, seqs, list(request.release_seq_ids))
        return outputs.message()

    async def StepStream(self, requests: AsyncIterator[rpb.RunnerStreamRequest],
                         context: Context) -> AsyncIterator[rpb.RunnerStreamResponse]:
        """Each message a Step of the stream's session (its first message's), answered in
        order; a failed one answers its status and the stream goes on; between messages the
        runner may follow the session, pushing its implied steps' answers (follow.py). A
        stream its client ends mid-step cancels that step as a cancelled Step call is
        (computed, not answered). A draining runner ends the stream (OK) once its step (or
        push) in progress is answered."""
        stream = SessionStream(self._step, lambda exc: _failure(self, exc, "StepStream"),
                               self._metrics, self._follow)
        async for answer in stream.answers(requests, self._streams):
            yield answer

    def end_streams(self) -> None:
        """The runner drains: every StepStream ends between two steps."""
        self._streams.end()
