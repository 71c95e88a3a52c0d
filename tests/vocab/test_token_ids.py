"""The vocabulary check the client engine and the `LLM` share (vocab/token_ids.py)."""

import pytest

from pagedkv.vocab.token_ids import check_vocabulary


def test_ids_in_the_vocabulary_pass() -> None:
    check_vocabulary([0, 5, 9], 10, "prompt")
    check_vocabulary([], 10, "prompt")


def test_ids_outside_name_the_caller_and_the_first_five() -> None:
    with pytest.raises(ValueError) as caught:
        check_vocabulary([1, 10, -1, 11, 12, 13, 14], 10, "prompt 2:")
    assert str(caught.value) == ("prompt 2: token ids must be in [0, 10) (the model's vocabulary), "
                                 "got [10, -1, 11, 12, 13]")
