"""A stalled runner can never write another tenant's blocks (issue 31; daemon/service/fence.py),
as real processes: a `pagedkvd` and two `pagedkv runner`s (benchmarks/stalled_runner.py).

Runner A is stopped (SIGSTOP) while beta's step may still write beta's blocks: queued behind
another client's long prefill, or in the middle of its own. Once A's hold lapses, beta's blocks
are taken (its own Free, or its model's sleep); alpha, on runner B, gets that memory (the same
blocks, or with two models beta's pages withdrawn into alpha's format) and computes into it; A
resumes. Before the fence (a hold lapsing at its deadline whatever its runner) the free went
through, A's forward wrote beta's K/V into alpha's blocks and alpha's next tokens were wrong.
Now the free is refused while the daemon kills A (SIGKILL through its pidfd), and alpha's
tokens equal a private recomputation.
"""

import signal

import pytest
from fuzz_runner_shadow import Reference
from stalled_runner import (
    MID_FORWARD,
    QUEUED,
    FenceStack,
    Outcome,
    Scenario,
    attack,
    fence_stack,
    write_model,
)

from pagedkvd_process import short_tmp_dir

# The second model: half the layers, so half the bytes a block (another K/V format).
OTHER_LAYERS = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Runner A's model, and another format's."""
    folder = tmp_path_factory.mktemp("models")
    return write_model(folder), write_model(folder, OTHER_LAYERS)


@pytest.fixture(scope="module")
def references(models: tuple[str, str]) -> dict[str, Reference]:
    return {model: Reference(model) for model in models}


def assert_fenced(stack: FenceStack, outcome: Outcome) -> None:
    assert outcome.shared_pages > 0  # alpha computes where beta's K/V was: the premise
    assert outcome.wrong == []
    # The call taking beta's blocks after the lapse was refused while A was being stopped.
    assert "stalled past its hold; it is being stopped (fenced)" in outcome.taking.first
    assert outcome.a_exit == -signal.SIGKILL
    assert "runner fenced" in stack.daemon.stderr()


@pytest.mark.parametrize("stop", [QUEUED, MID_FORWARD])
async def test_a_stopped_runner_is_fenced_before_its_blocks_move(
        models: tuple[str, str], references: dict[str, Reference], stop: str) -> None:
    model = models[0]
    with short_tmp_dir() as folder, fence_stack(folder, model) as stack:
        assert_fenced(stack, await attack(stack, references[model], Scenario(stop)))


@pytest.mark.parametrize("sleep", [False, True], ids=["withdrawn", "asleep"])
async def test_a_page_of_a_stopped_runner_moves_to_another_format_once_it_is_fenced(
        models: tuple[str, str], references: dict[str, Reference], sleep: bool) -> None:
    """Beta's blocks freed by its own Free, or by its model's sleep; alpha, of another model,
    gets beta's pages withdrawn into its format."""
    a_model, b_model = models
    with short_tmp_dir() as folder, fence_stack(folder, a_model, b_model) as stack:
        outcome = await attack(stack, references[b_model], Scenario(MID_FORWARD, sleep))
        assert_fenced(stack, outcome)
