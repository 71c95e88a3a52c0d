"""A step's shape, checked before anything is read or changed (`validate_step`)."""

import pytest

from pagedkv.client import SamplingParams, SeqStep
from pagedkv.model_runner.engine.step_checks import validate_step
from pagedkv.model_runner.engine.steps import InvalidStep

VOCAB = 100
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def test_a_release_naming_a_sequence_twice_is_refused_whole() -> None:
    """The daemon would refuse the release's commit naming it twice after the runner's other
    work: the runner refuses the step first, saying which id."""
    with pytest.raises(InvalidStep, match="release_seq_ids names sequence 4 twice"):
        validate_step([], [3, 4, 4], VOCAB)
    validate_step([], [3, 4], VOCAB)


def test_a_sequence_stepped_twice_is_refused() -> None:
    twice = [SeqStep(1, (5,), True, params=GREEDY), SeqStep(1, (6,), True, params=GREEDY)]
    with pytest.raises(InvalidStep, match="a sequence appears twice in one step"):
        validate_step(twice, [], VOCAB)
