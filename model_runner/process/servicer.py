"""The Runner gRPC servicer: thin translations between runner.proto and the `StepEngine`.

Errors keep the daemon's words: a daemon error met while acting for a client (an unknown
session, a full pool) reaches the client with the daemon's status code, message and cause
(`pagedkv-error` metadata), so the client's error classes work the same against either process;
the runner's own refusals name their causes of the same table (`pagedkv.vocab.causes`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from pagedkv.client import History, PagedKVError, SamplingParams, SeqStep, StepOutputs
from pagedkv.client.pool.errors import cause_of_error
from pagedkv.model_runner.engine.steps import InvalidStep, StepNotComputed, UnknownSequence
from pagedkv.process.grpc_errors import errors_to_status
from pagedkv.process.stream_drain import DrainableStreams
from pagedkv.proto import runner_pb2 as rpb
from pagedkv.proto import runner_pb2_grpc
from pagedkv.vocab import causes
from pagedkv.vocab.causes import Cause, cut_message

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]

# StepEngine.step, behind whatever gate the server puts before it.
StepFunction = Callable[[str, Sequence[SeqStep], Sequence[int]], Awaitable[StepOutputs]]


# max_tokens of a request that set none: more than any sequence generates.
NO_LIMIT = 2**31 - 1


class RunnerUnavailable(RuntimeError):
    """The runner cannot compute now: its daemon is away, or restarted and the runner is mapping
    the new pool (UNAVAILABLE, cause "RunnerUnavailable"); nothing was changed."""


# Each of the runner's own exceptions' cause; first match wins. ValueError: InvalidStep, or
# SamplingParams' own checks.
CAUSES: tuple[tuple[type[Exception], Cause], ...] = (
    (ValueError, causes.INVALID_ARGUMENT),
    (UnknownSequence, causes.UNKNOWN_SEQUENCE),
    (StepNotComputed, causes.STEP_NOT_COMPUTED),  # applied in the daemon: not "nothing changed"
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
                 log_failure: Callable[[Exception], None]) -> None:
        self._step = step
        self._info = info
        self.log_failure = log_failure
        # The open StepStreams, ended when the runner drains (`end_streams`).
        self._streams = DrainableStreams()

    @grpc_errors
    async def GetRunnerInfo(self, request: rpb.GetRunnerInfoRequest,
                            context: Context) -> rpb.RunnerInfo:
        return self._info()

    @grpc_errors
    async def Step(self, request: rpb.RunnerStepRequest,
                   context: Context) -> rpb.RunnerStepResponse:
        return await self._answer(request)

    async def StepStream(self, requests: AsyncIterator[rpb.RunnerStreamRequest],
                         context: Context) -> AsyncIterator[rpb.RunnerStreamResponse]:
        """Each message a Step of the stream's session (its first message's), answered in
        order; a failed one answers its status and the stream goes on. A stream its client
        ends mid-step cancels that step as a cancelled Step call is (computed, not answered).
        A draining runner ends the stream (OK) once its step in progress is answered."""
        session_id: str | None = None
        while (message := await self._streams.next_message(requests)) is not None:
            if session_id is None:
                session_id = message.step.session_id
            yield await self._stream_answer(session_id, message)

    def end_streams(self) -> None:
        """The runner drains: every StepStream ends between two steps."""
        self._streams.end()

    async def _answer(self, request: rpb.RunnerStepRequest) -> rpb.RunnerStepResponse:
        """One step, as Step and StepStream compute it: an exception is its failure."""
        seqs = [seq_request(seq) for seq in request.seqs]
        outputs = await self._step(request.session_id, seqs, list(request.release_seq_ids))
        return rpb.RunnerStepResponse(outputs=[output.message() for output in outputs],
                                      free_blocks=outputs.free_blocks)

    async def _stream_answer(self, session_id: str,
                             message: rpb.RunnerStreamRequest) -> rpb.RunnerStreamResponse:
        """A stream message's answer: the step's, or the status a Step call would have got."""
        try:
            if message.step.session_id != session_id:
                raise InvalidStep(f"step {message.step_id} names another session than the "
                                  "one this stream serves (its first message's)")
            answer = await self._answer(message.step)
        except Exception as exc:
            code, cause, text = _failure(self, exc, "StepStream")
            return rpb.RunnerStreamResponse(step_id=message.step_id, code=code.value[0],
                                            cause=cause, message=cut_message(text))
        return rpb.RunnerStreamResponse(step_id=message.step_id, answer=answer)


def sampling_params(message: rpb.SamplingParams) -> SamplingParams:
    """`message` as SamplingParams (ValueError if invalid), read once per sequence (the runner
    keeps it): proto3 zeros mean "off" (temperature 0 = greedy; logprobs < 0 = none)."""
    return SamplingParams(
        temperature=message.temperature, top_k=message.top_k,
        top_p=message.top_p if 0 < message.top_p <= 1 else 1.0, min_p=message.min_p,
        repetition_penalty=message.repetition_penalty or 1.0,
        seed=message.seed if message.has_seed else None,
        logprobs=message.logprobs if message.logprobs >= 0 else None,
        stop_token_ids=tuple(message.stop_token_ids), max_tokens=message.max_tokens or NO_LIMIT)


def seq_request(message: rpb.SequenceStep) -> SeqStep:
    history = None
    if message.HasField("history"):
        history = History(tuple(message.history.token_ids), message.history.prompt_len,
                          message.history.num_computed)
    params = None
    if message.HasField("sampling"):
        try:
            params = sampling_params(message.sampling)
        except ValueError as exc:
            raise InvalidStep(f"sequence {message.seq_id}: {exc}") from None
    return SeqStep(message.seq_id, tuple(message.token_ids), message.new_sequence,
                   message.max_compute_tokens, params,
                   message.parent_seq_id if message.has_parent else None, history,
                   message.num_prompt_tokens, message.decode_ahead)
