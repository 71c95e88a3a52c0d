"""The access log and the request id: one `http_request` line per request, and the id that
names it.

    http_request  request_id=3f2a...  method=POST path=/v1/completions status=200
                  duration_ms=41.5 peer=10.0.0.7 prompt_tokens=12 completion_tokens=16
                  finish_reasons=["length"] ttft_ms=8.3
    http_request  request_id=job-17  ... status=400  error="max_tokens must be >= 1, got 0"

A request's id is the client's `X-Request-Id` when that is a plausible id (1 to 128 letters,
digits or `-_.:`, pagedkv.vocab.request_ids' rule, so it cannot forge log fields or fill the
log), else one made here; vLLM uses the header the same way. It is echoed in the response's
`X-Request-Id` (errors and streams included) and names the answer (`cmpl-ID`, `chatcmpl-ID`),
and its engine requests carry it to the runner and the daemon, which log it. A
request that generated tokens logs its usage, each choice's finish reason (null: aborted,
e.g. its client went away) and its time to first token (`ttft_ms`: from the request's arrival,
before its body is read, to the first token of any of its prompts, as a client sees it; the
`time_to_first_token_seconds` histogram starts at the engine request instead); a refused one
logs why (the error body's message).
"""

import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.typedefs import Handler

from pagedkv.process.log_setup import get_logger
from pagedkv.server.generation import PromptRun
from pagedkv.vocab.request_ids import plausible

log = get_logger("pagedkv.server")
REQUEST_ID_HEADER = "X-Request-Id"


@dataclass(slots=True)
class Access:
    """What one request's log line says beyond its HTTP exchange."""

    # The request's id: its client's X-Request-Id, or one made here.
    request_id: str
    # When it arrived (time.monotonic()): where its ttft_ms starts.
    arrived: float
    # The engine requests it made, one per prompt: its usage and finish reasons, read at the end.
    runs: list[PromptRun] = field(default_factory=list)
    # Why it was refused (its error body's message), when it was.
    error: str | None = None

    def fields(self) -> dict[str, object]:
        """The log line's fields of the request's outcome."""
        outcome: dict[str, object] = {}
        if self.runs:
            outcome["prompt_tokens"] = sum(run.prompt_tokens for run in self.runs)
            outcome["completion_tokens"] = sum(run.completion_tokens for run in self.runs)
            outcome["finish_reasons"] = [reason for run in self.runs
                                         for reason in run.finish_reasons]
            firsts = [run.first_token_at for run in self.runs if run.first_token_at is not None]
            if firsts:
                outcome["ttft_ms"] = round((min(firsts) - self.arrived) * 1000, 1)
        if self.error is not None:
            outcome["error"] = self.error
        return outcome


ACCESS = web.RequestKey("pagedkv.access", Access)


def request_id(given: str | None) -> str:
    """`given` (a client's X-Request-Id) when it is a plausible id, else a new one."""
    if given is not None and plausible(given):
        return given
    return uuid.uuid4().hex


@web.middleware
async def access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Give the request its id (request[ACCESS]); log one line once it is answered."""
    started = time.monotonic()
    access = request[ACCESS] = Access(request_id(request.headers.get(REQUEST_ID_HEADER)),
                                      started)
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    finally:
        log.info("http_request", request_id=access.request_id, method=request.method,
                 path=request.path, status=status,
                 duration_ms=round((time.monotonic() - started) * 1000, 1),
                 peer=request.remote, **access.fields())


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """An `on_response_prepare` signal: the response carries the request's id (a response
    aiohttp made before the middlewares ran has none)."""
    access = request.get(ACCESS)
    if access is not None:
        response.headers[REQUEST_ID_HEADER] = access.request_id
