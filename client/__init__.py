"""pagedkv.client: a typed async client for the pagedkv daemon and runner, and the scheduler that
drives them (`Engine`); imports only grpc and protobuf."""

from .client import DEFAULT_TIMEOUT_S, PoolClient
from .engine import Engine, StepRecord
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
    SessionBusy,
    SessionExpired,
    SessionNotFound,
    StepNotComputed,
    Unauthenticated,
    UnknownSequence,
)
from .ops import Allocate, Append, Commit, CopyOnWrite, Fork, Free, Operation
from .outputs import CompletionOutput, RequestOutput
from .recovery import RetryPolicy
from .runner_client import RunnerClient, SeqOutput, SeqStep, StepOutputs
from .sampling_params import SamplingParams
from .scheduler import SchedulerConfig
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
    "CompletionOutput",
    "CopyOnWrite",
    "DaemonUnavailable",
    "DeadlineExceeded",
    "Engine",
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
    "RequestOutput",
    "RetryPolicy",
    "RunnerClient",
    "SamplingParams",
    "SchedulerConfig",
    "SeqOutput",
    "SeqStep",
    "SequenceBlocks",
    "SequenceExists",
    "SequenceNotFound",
    "Session",
    "SessionBusy",
    "SessionExpired",
    "SessionNotFound",
    "SessionStats",
    "StepNotComputed",
    "StepOutputs",
    "StepRecord",
    "StepResult",
    "TlsOptions",
    "Unauthenticated",
    "UnknownSequence",
]
