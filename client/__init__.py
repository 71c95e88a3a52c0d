"""pagedkv.client: a typed async client for the pagedkv daemon and runner, and the scheduler that
drives them (`Engine`); imports only grpc and protobuf."""

from pagedkv.client.engine.engine import Engine, StepRecord
from pagedkv.client.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.client.engine.scheduler import SchedulerConfig
from pagedkv.client.pool.client import DEFAULT_TIMEOUT_S, PoolClient
from pagedkv.client.pool.errors import (
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
    RunnerUnavailable,
    RunnerUnreachable,
    SequenceExists,
    SequenceNotFound,
    SessionBusy,
    SessionExpired,
    SessionNotFound,
    StepNotComputed,
    Unauthenticated,
    UnknownSequence,
)
from pagedkv.client.pool.ops import (
    Allocate,
    Append,
    Commit,
    CopyOnWrite,
    Fork,
    Free,
    Operation,
    Step,
)
from pagedkv.client.pool.recovery import RetryPolicy
from pagedkv.client.pool.runner_client import (
    History,
    RunnerClient,
    RunnerInfo,
    SeqOutput,
    SeqStep,
    StepOutputs,
)
from pagedkv.client.pool.runner_stream import RunnerStream
from pagedkv.client.pool.sampling_params import SamplingParams
from pagedkv.client.pool.session import Session
from pagedkv.client.pool.tls import TlsOptions
from pagedkv.client.pool.types import (
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
    "History",
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
    "RunnerInfo",
    "RunnerStream",
    "RunnerUnavailable",
    "RunnerUnreachable",
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
    "Step",
    "StepNotComputed",
    "StepOutputs",
    "StepRecord",
    "StepResult",
    "TlsOptions",
    "Unauthenticated",
    "UnknownSequence",
]
