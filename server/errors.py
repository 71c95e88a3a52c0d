"""Errors as OpenAI's API returns them: an HTTP status and one JSON body.

    {"error": {"message": "max_tokens must be >= 1, got 0", "type": "BadRequestError",
               "param": "max_tokens", "code": 400}}

Every refusal of the server is an `ApiError`, raised anywhere below a handler and turned into
that body by app.py's error middleware, so a client (the `openai` package raises
`BadRequestError`, `AuthenticationError`, `NotFoundError`, `RateLimitError` from the status)
always gets the same shape. A refusal changes nothing: requests are checked whole before any
is submitted.
"""

from dataclasses import dataclass, field

# The `type` of each status, as vLLM's OpenAI server names them.
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               413: "BadRequestError", 429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


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
