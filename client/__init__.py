"""pagedkv.client: a typed async client for the pagedkv daemon (imports only grpc and protobuf)."""

from .client import DEFAULT_TIMEOUT_S, PoolClient
from .errors import (
    AnswerTooLarge,
    Cancelled,
    DaemonUnavailable,
    DeadlineExceeded,
    InvalidArgument,
    LimitExceeded,
    MessageTooLarge,
    NotFound,
    OutcomeUnknown,
    PagedKVError,
    PermissionDenied,
    PoolExhausted,
    SequenceExists,
    SequenceNotFound,
    SessionExpired,
    SessionNotFound,
    Unauthenticated,
    UnknownSequence,
)
from .ops import Allocate, Append, Commit, CopyOnWrite, Fork, Free, Operation
from .recovery import RetryPolicy
from .runner_client import RunnerClient, SeqOutput, SeqStep, StepOutputs
from .sampling_params import SamplingParams
from .session import Session
from .tls import TlsOptions
from .types import (
    BlockCopy,
    PoolInfo,
    PoolStats,
    SequenceBlocks,
    SessionStats,
    StepResult,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Allocate",
    "AnswerTooLarge",
    "Append",
    "BlockCopy",
    "Cancelled",
    "Commit",
    "CopyOnWrite",
    "DaemonUnavailable",
    "DeadlineExceeded",
    "Fork",
    "Free",
    "InvalidArgument",
    "LimitExceeded",
    "MessageTooLarge",
    "NotFound",
    "Operation",
    "OutcomeUnknown",
    "PagedKVError",
    "PermissionDenied",
    "PoolClient",
    "PoolExhausted",
    "PoolInfo",
    "PoolStats",
    "RetryPolicy",
    "RunnerClient",
    "SamplingParams",
    "SeqOutput",
    "SeqStep",
    "SequenceBlocks",
    "SequenceExists",
    "SequenceNotFound",
    "Session",
    "SessionExpired",
    "SessionNotFound",
    "SessionStats",
    "StepOutputs",
    "StepResult",
    "TlsOptions",
    "Unauthenticated",
    "UnknownSequence",
]
