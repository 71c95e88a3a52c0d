"""One table of error causes (`pagedkv.vocab.causes`): every exception the daemon or the runner
raises in a call maps through it to the client exception it means.

The daemon's and the runner's exceptions are found by walking subclasses, so a new one fails
these tests until it is given its cause here and at its edge. (That a runner outage reaches a
client as `RunnerUnavailable` through real processes: tests/model_runner/process/test_servicer.py.)
"""

import importlib
import pkgutil
from pathlib import Path

import grpc
import pytest

from pagedkv import client as c
from pagedkv.client.pool.errors import BY_CAUSE, error_from_status
from pagedkv.daemon.core import InvalidArgument, PoolError, SequenceExists, SequenceNotFound
from pagedkv.daemon.edge.status import failure_of
from pagedkv.daemon.service.answer_size import ENTRY_CAUSE_BYTES
from pagedkv.daemon.service.errors import (
    AnswerTooLarge,
    LimitExceeded,
    ModelAsleep,
    ModelAtCap,
    ModelExists,
    ModelNotFound,
    PermissionDenied,
    PoolExhausted,
    PoolFull,
    SessionBusy,
    SessionExpired,
    SessionNotFound,
)
from pagedkv.model_runner.engine.forward_loop import HoldMayHaveLapsed
from pagedkv.model_runner.engine.steps import (
    InvalidStep,
    StalePlan,
    StepNotComputed,
    UnknownSequence,
    Unsupported,
)
from pagedkv.model_runner.models import ModelMismatch
from pagedkv.model_runner.process import servicer
from pagedkv.model_runner.process.servicer import RunnerUnavailable
from pagedkv.model_runner.runner import PoolReleased
from pagedkv.vocab.causes import CAUSES, INTERNAL

# What a client catches for each of the daemon's exceptions.
DAEMON: dict[type[Exception], type[c.PagedKVError]] = {
    PoolError: c.InvalidArgument,
    InvalidArgument: c.InvalidArgument,
    SequenceNotFound: c.SequenceNotFound,
    SequenceExists: c.SequenceExists,
    SessionNotFound: c.SessionNotFound,
    SessionExpired: c.SessionExpired,
    SessionBusy: c.SessionBusy,
    LimitExceeded: c.LimitExceeded,
    AnswerTooLarge: c.AnswerTooLarge,
    PoolExhausted: c.PoolExhausted,
    PermissionDenied: c.PermissionDenied,
    PoolFull: c.PoolExhausted,
    ModelNotFound: c.ModelNotFound,
    ModelExists: c.ModelExists,
    ModelAtCap: c.ModelAtCap,
    ModelAsleep: c.ModelAsleep,
}

# What a client catches for each exception defined in the runner, met by a step.
RUNNER: dict[type[Exception], type[c.PagedKVError]] = {
    InvalidStep: c.InvalidArgument,
    UnknownSequence: c.UnknownSequence,
    StepNotComputed: c.StepNotComputed,
    StalePlan: c.StalePlan,
    Unsupported: c.Unsupported,
    RunnerUnavailable: c.RunnerUnavailable,
    # Raised at start or by the pool watcher, never in a step; as a ValueError it would be a
    # caller's mistake.
    ModelMismatch: c.InvalidArgument,
    # A forward after the pool was released: the step engine says StepNotComputed; met
    # anywhere else it is a bug (INTERNAL, the base class).
    PoolReleased: c.PagedKVError,
    # A forward not started because its hold may lapse: the same (StepNotComputed in a step).
    HoldMayHaveLapsed: c.PagedKVError,
}


def import_all(package: str) -> None:
    """Import every module of `package`, so walking subclasses finds every exception in it."""
    path = importlib.import_module(package).__path__
    for module in pkgutil.walk_packages(path, f"{package}."):
        if not module.name.endswith(".__main__"):  # runs the command
            importlib.import_module(module.name)


def subclasses(base: type[Exception]) -> set[type[Exception]]:
    """`base` and every subclass of it imported so far."""
    found = {base}
    for kind in base.__subclasses__():
        found |= subclasses(kind)
    return found


def defined_in(package: str) -> set[type[Exception]]:
    """Every exception class defined in a module of `package`."""
    import_all(package)
    return {kind for kind in subclasses(Exception) if kind.__module__.startswith(f"{package}.")}


def test_every_cause_has_a_grpc_code_and_fits_a_step_many_entry() -> None:
    for cause in CAUSES.values():
        assert grpc.StatusCode[cause.code].name == cause.code
        assert len(cause.name.encode()) <= ENTRY_CAUSE_BYTES, cause


def test_every_cause_has_its_client_class_named_as_it_is() -> None:
    # Earlier clients looked a cause up by their class names: the wire names stay those.
    assert set(BY_CAUSE) == set(CAUSES) - {INTERNAL.name}
    for name, kind in BY_CAUSE.items():
        assert kind.__name__ == name
        error = error_from_status(grpc.StatusCode[CAUSES[name].code], name, "m")
        assert type(error) is kind and error.message == "m"
    internal = error_from_status(grpc.StatusCode.INTERNAL, INTERNAL.name, "bug")
    assert type(internal) is c.PagedKVError


def test_every_client_exception_is_the_class_of_a_cause_or_a_base() -> None:
    # Before the table, RunnerUnavailable had no class: a runner outage read as the daemon's.
    # RunnerUnreachable is no cause: it is the runner client's reading of a cause-less
    # UNAVAILABLE (no runner answered), which no peer sends or relays by name.
    assert subclasses(c.PagedKVError) - set(BY_CAUSE.values()) == {
        c.PagedKVError, c.OutcomeUnknown, c.RunnerUnreachable}


def test_every_daemon_exception_reaches_the_client_as_its_own_class() -> None:
    import_all("pagedkv.daemon")
    assert subclasses(PoolError) == set(DAEMON)
    for kind, expected in DAEMON.items():
        code, cause, message = failure_of(kind("what was wrong"), "Test")
        error = error_from_status(code, cause, message)
        assert type(error) is expected, kind
        assert error.code == code and error.message == "what was wrong"


def test_every_runner_exception_reaches_the_client_as_its_own_class() -> None:
    assert defined_in("pagedkv.model_runner") == set(RUNNER)
    for kind, expected in RUNNER.items():
        code, cause, message = servicer.status_of(kind("what was wrong"))
        error = error_from_status(code, cause, message)
        assert type(error) is expected, kind
        assert (code == grpc.StatusCode.INTERNAL) is (expected is c.PagedKVError)


@pytest.mark.parametrize(("name", "kind"), BY_CAUSE.items())
def test_a_runner_relays_each_client_error_it_meets_as_the_same_class(
        name: str, kind: type[c.PagedKVError]) -> None:
    code = grpc.StatusCode[CAUSES[name].code]
    relayed = error_from_status(*servicer.status_of(kind(code, "from the daemon")))
    assert type(relayed) is kind and relayed.code == code
    assert relayed.message == "from the daemon"


def test_a_runner_relays_an_error_without_a_cause_by_its_code_alone() -> None:
    status = servicer.status_of(c.PagedKVError(grpc.StatusCode.UNIMPLEMENTED, "no such method"))
    assert status == (grpc.StatusCode.UNIMPLEMENTED, "", "no such method")


async def test_a_runner_that_does_not_answer_is_unreachable_not_a_daemon(tmp_path: Path) -> None:
    """No runner at the target: the runner's client says so (RunnerUnreachable, an
    OutcomeUnknown), where the daemon's client says DaemonUnavailable."""
    target = f"unix://{tmp_path}/nobody.sock"
    with pytest.raises(c.RunnerUnreachable, match="no pagedkv runner answered"):
        await c.RunnerClient.connect(target)
    with pytest.raises(c.DaemonUnavailable, match="no pagedkv daemon answered"):
        await c.PoolClient.connect(target, timeout=0.2)
