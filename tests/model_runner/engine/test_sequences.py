"""SeqState's invariants (sequences.INVARIANTS): each check names what broke, and the step engine
runs them whenever a step lets go of its session's lock (the suite sets CHECK_ENV)."""

import os
from collections.abc import AsyncIterator, Callable

import pytest

from pagedkv.client import (
    PoolClient,
    SamplingParams,
    SeqOutput,
    SeqStep,
    Session,
    StructuredOutputs,
)
from pagedkv.model_runner.engine.grammar import GrammarState
from pagedkv.model_runner.engine.sequences import CHECK_ENV, Ahead, SeqState, checking
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.kernels.attention_backend import get_backend

import families
from engine_driver import RecordingRunner, new
from families import GREEDY

BS = 4


def decoding() -> SeqState:
    """A sequence of 6 tokens (a 5-token prompt), 5 held by the daemon and computed, its sixth
    decoded into a reservation that ends with its 3 blocks."""
    state = SeqState([1, 2, 3, 4, 5, 6], 5, 5, [7, 8, 9], num_cached=4, committed=4)
    state.held, state.private_end = 5, 12
    return state


def test_a_sound_state_passes() -> None:
    decoding().check(3, BS)


BROKEN: dict[str, Callable[[SeqState], object]] = {
    "0 <= prompt_len <= len(tokens)": lambda s: setattr(s, "prompt_len", 7),
    "0 <= committed <= held <= len(tokens)": lambda s: setattr(s, "committed", 6),
    "committed <= num_computed": lambda s: setattr(s, "num_computed", 3),
    "held <= private_end": lambda s: setattr(s, "private_end", 4),
    "len(tokens) <= max(held, private_end)": lambda s: s.tokens.extend(range(7)),
    "ahead.token_id == tokens[-1]": lambda s: setattr(s, "ahead", Ahead(5)),
    "ahead.result is None": lambda s: setattr(s, "ahead", Ahead(6, SeqOutput(3, 6, 5, 0, False))),
    "commit_due == 0": lambda s: setattr(s, "commit_due", 3),
}


@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_invariant_is_named_with_the_values(name: str) -> None:
    state = decoding()
    BROKEN[name](state)
    with pytest.raises(AssertionError, match=r"sequence 3 breaks .*") as caught:
        state.check(3, BS)
    assert name in str(caught.value) and "held=" in str(caught.value)


def test_a_commit_due_of_unverified_ids_is_refused() -> None:
    state = decoding()
    state.commit_due, state.verified = 4, False
    with pytest.raises(AssertionError, match="verified"):
        state.check(3, BS)


def test_a_grammar_of_another_constraint_is_refused() -> None:
    state = decoding()
    state.params = SamplingParams(structured_outputs=StructuredOutputs(regex="a+"))
    state.grammar = GrammarState(StructuredOutputs(regex="b+"), compiled=None)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="grammar"):
        state.check(3, BS)


@pytest.mark.parametrize(("value", "expected"), [("", False), ("0", False), ("1", True)])
def test_the_check_is_asked_by_its_environment_variable(value: str, expected: bool) -> None:
    assert checking({CHECK_ENV: value}) is expected


def test_another_value_of_the_variable_is_refused() -> None:
    with pytest.raises(ValueError, match=CHECK_ENV):
        checking({CHECK_ENV: "yes"})


@pytest.fixture
async def engine(runner_client: PoolClient) -> AsyncIterator[StepEngine]:
    runner = RecordingRunner.attach(families.paged_model("llama"), await runner_client.pool_info(),
                                    get_backend("torch"))
    started = StepEngine(runner_client, runner)
    await started.start()
    yield started
    await started.stop()


async def test_the_engine_checks_a_session_when_a_step_lets_go_of_it(
    session: Session, engine: StepEngine,
) -> None:
    """The suite runs every engine checking (CHECK_ENV): a state broken between two steps fails
    the next step as it lets go of the session, naming the invariant."""
    assert os.environ[CHECK_ENV] == "1" and engine.check_sequences
    [first] = await engine.step(session.session_id, [new(0, (1, 2, 3), GREEDY)])
    entry = engine.sessions.get(session.session_id)
    assert entry is not None
    entry.sequences.known(0).prompt_len = 99
    with pytest.raises(AssertionError, match=r"sequence 0 breaks 0 <= prompt_len"):
        await engine.step(session.session_id, [SeqStep(0, (first.token_id,), params=GREEDY)])
