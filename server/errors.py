"""Errors as OpenAI's API returns them: an HTTP status and one JSON body.

    {"error": {"message": "max_tokens must be >= 1, got 0", "type": "BadRequestError",
               "param": "max_tokens", "code": 400}}

Every refusal of the server is an `ApiError`, raised anywhere below a handler and turned into
that body by app.py's error middleware, so a client (the `openai` package raises
`BadRequestError`, `AuthenticationError`, `NotFoundError`, `RateLimitError` from the status)
always gets the same shape. A refusal changes nothing: requests are checked whole before any
is submitted.

The engine's failures carry the shared causes of `pagedkv.vocab.causes`; `CAUSE_STATUS` maps
them to statuses here, at the HTTP edge, as vLLM answers the same conditions. The engine fails
a request with PoolExhausted only when it needs more blocks than the whole pool has (it waits
for blocks that other requests hold), so it can never fit: 400, as vLLM refuses a prompt longer
than its KV cache. Unsupported (structured outputs asked of a runner with no tokenizer) is the
request's to change: 400. A cause that may pass (a runner or daemon away) is a 503 to retry.
"""

from dataclasses import dataclass, field

from pagedkv.client.pool.errors import OutcomeUnknown, PagedKVError, cause_of_error
from pagedkv.vocab import causes

# The `type` of each status, as vLLM's OpenAI server names them.
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               413: "BadRequestError", 429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}
# The HTTP status of each cause an engine request may fail with; any other is a 500 (a bug).
CAUSE_STATUS = {causes.POOL_EXHAUSTED.name: 400, causes.UNSUPPORTED.name: 400,
                causes.RUNNER_UNAVAILABLE.name: 503}


@dataclass
class ApiError(Exception):
    """A request the server refuses, with the status and the body's fields."""

    status: int
    message: str
    # The request field at fault (e.g. "max_tokens", "messages[1].role"), when there is one.
    param: str | None = None
    # Extra response headers (Retry-After on 429 and 503, WWW-Authenticate on 401).
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, object]:
        """The JSON body OpenAI's clients read."""
        return {"error": {"message": self.message,
                          "type": ERROR_TYPES.get(self.status, "BadRequestError"),
                          "param": self.param, "code": self.status}}


def bad_request(param: str | None, message: str) -> ApiError:
    """400: a parameter is malformed or out of range; `message` names it."""
    return ApiError(400, message, param)


def from_value_error(exc: ValueError, known: frozenset[str] = frozenset()) -> ApiError:
    """400 for a ValueError raised by a checker below the server. Checkers start their message
    with the field ("max_tokens must be >= 1", "messages[1].role: ..."): that first word is the
    param when it is one of `known` or a path into the request."""
    message = str(exc)
    head = message.split(" ", 1)[0].rstrip(":")
    param = head if head in known or "[" in head else None
    return bad_request(param, message)


def engine_status(exc: PagedKVError) -> int:
    """The HTTP status of an engine request's failure, by its cause (CAUSE_STATUS); a call
    whose outcome is unknown (a daemon or runner gone mid-call) is a 503 too."""
    if isinstance(exc, OutcomeUnknown):
        return 503
    cause = cause_of_error(exc)
    return CAUSE_STATUS.get(cause.name, 500) if cause is not None else 500
