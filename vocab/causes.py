"""The causes of a failed pagedkv call: one table shared by the daemon, the runner and clients.

A daemon or runner that refuses a call names its cause in the trailing metadata `pagedkv-error`
(and a failed StepMany entry in its `cause`), beside the gRPC status code, so a client can tell
apart causes that share a code (an unknown session from an unknown sequence). Each edge maps
its own exceptions to a `Cause` here; the client maps each cause's name to its exception class.
A runner relays the causes of the daemon's (and its own client's) errors by the same names.

Codes are written as `grpc.StatusCode` member names ("NOT_FOUND"), not numbers: the vocabulary
imports no grpc, a name reads as the status it is in logs and docs, and each edge turns it into
its status with `grpc.StatusCode[cause.code]` (a test checks that every name is one).
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Cause:
    """One cause of a failed call, as it travels."""

    # The wire name: the value of `pagedkv-error`, e.g. "SequenceNotFound" (at most 32 bytes,
    # the room a StepMany entry's answer charges for it).
    name: str
    # The gRPC status code it always travels with, as a grpc.StatusCode member name.
    code: str


# Refusals of the daemon: nothing changed.
SESSION_NOT_FOUND = Cause("SessionNotFound", "NOT_FOUND")
SEQUENCE_NOT_FOUND = Cause("SequenceNotFound", "NOT_FOUND")
SEQUENCE_EXISTS = Cause("SequenceExists", "ALREADY_EXISTS")
INVALID_ARGUMENT = Cause("InvalidArgument", "INVALID_ARGUMENT")
POOL_EXHAUSTED = Cause("PoolExhausted", "RESOURCE_EXHAUSTED")
LIMIT_EXCEEDED = Cause("LimitExceeded", "RESOURCE_EXHAUSTED")
ANSWER_TOO_LARGE = Cause("AnswerTooLarge", "RESOURCE_EXHAUSTED")
SESSION_EXPIRED = Cause("SessionExpired", "FAILED_PRECONDITION")
SESSION_BUSY = Cause("SessionBusy", "FAILED_PRECONDITION")
PERMISSION_DENIED = Cause("PermissionDenied", "PERMISSION_DENIED")
# Models (kvpool.proto's "Models and pages").
MODEL_NOT_FOUND = Cause("ModelNotFound", "NOT_FOUND")
MODEL_EXISTS = Cause("ModelExists", "ALREADY_EXISTS")
MODEL_AT_CAP = Cause("ModelAtCap", "RESOURCE_EXHAUSTED")
MODEL_ASLEEP = Cause("ModelAsleep", "FAILED_PRECONDITION")

# Refusals of the runner: nothing changed, but for StepNotComputed (the step's daemon calls
# were applied, its forward failed). StalePlan: a stream step planned before answers the runner
# pushed (runner.proto's `follow`).
UNKNOWN_SEQUENCE = Cause("UnknownSequence", "FAILED_PRECONDITION")
STEP_NOT_COMPUTED = Cause("StepNotComputed", "ABORTED")
RUNNER_UNAVAILABLE = Cause("RunnerUnavailable", "UNAVAILABLE")
STALE_PLAN = Cause("StalePlan", "ABORTED")
# The runner cannot do what a step asks (structured outputs on a model without a tokenizer).
UNSUPPORTED = Cause("Unsupported", "FAILED_PRECONDITION")

# What a runner's own daemon calls met, relayed to its client under the client's names (the
# client names them from the code alone when a status carries no cause): NotFound and
# Unauthenticated changed nothing; the other four may or may not have been applied.
NOT_FOUND = Cause("NotFound", "NOT_FOUND")
UNAUTHENTICATED = Cause("Unauthenticated", "UNAUTHENTICATED")
DAEMON_UNAVAILABLE = Cause("DaemonUnavailable", "UNAVAILABLE")
DEADLINE_EXCEEDED = Cause("DeadlineExceeded", "DEADLINE_EXCEEDED")
CANCELLED = Cause("Cancelled", "CANCELLED")
MESSAGE_TOO_LARGE = Cause("MessageTooLarge", "RESOURCE_EXHAUSTED")

# A bug in pagedkv (the daemon's or the runner's log has the traceback); it has no client class
# of its own.
INTERNAL = Cause("Internal", "INTERNAL")

# The most bytes of a failure's message carried inside an answer (a StepMany entry's, a stream
# message's: kvpool.proto StepManyResult, StepStreamResponse; runner.proto RunnerStreamResponse).
MESSAGE_BYTES = 256


def cut_message(text: str) -> str:
    """`text` cut to at most MESSAGE_BYTES bytes of UTF-8, never inside a character."""
    return text.encode()[:MESSAGE_BYTES].decode(errors="ignore")


# Every cause by its wire name.
CAUSES: dict[str, Cause] = {cause.name: cause for cause in (
    SESSION_NOT_FOUND, SEQUENCE_NOT_FOUND, SEQUENCE_EXISTS, INVALID_ARGUMENT, POOL_EXHAUSTED,
    LIMIT_EXCEEDED, ANSWER_TOO_LARGE, SESSION_EXPIRED, SESSION_BUSY, PERMISSION_DENIED,
    MODEL_NOT_FOUND, MODEL_EXISTS, MODEL_AT_CAP, MODEL_ASLEEP,
    UNKNOWN_SEQUENCE, STEP_NOT_COMPUTED, RUNNER_UNAVAILABLE, STALE_PLAN, UNSUPPORTED,
    NOT_FOUND, UNAUTHENTICATED, DAEMON_UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED,
    MESSAGE_TOO_LARGE, INTERNAL)}
