"""A stalled runner can never write another tenant's blocks (issue 31; daemon/service/fence.py),
as real processes: a `pagedkvd` and two `pagedkv runner`s (benchmarks/stalled_runner.py).

Runner A is stopped (SIGSTOP) while beta's step may still write beta's blocks: queued behind
another client's long prefill, or in the middle of its own. Once A's hold lapses, beta frees
directly; alpha, on runner B, gets the same blocks and computes into them; A resumes. Before
the fence (a hold lapsing at its deadline whatever its runner) beta's free went through, A's
forward wrote beta's K/V into alpha's blocks and alpha's next tokens were wrong. Now the free
is refused while the daemon kills A (SIGKILL through its pidfd), and alpha's tokens equal a
private recomputation.
"""

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzz_runner_shadow import Reference
from stalled_runner import MID_FORWARD, QUEUED, FenceStack, attack, fence_stack, write_slow_model

from pagedkvd_process import short_tmp_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_slow_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def reference(model: Path) -> Reference:
    return Reference(str(model))


@pytest.fixture
def stack(model: Path) -> Iterator[FenceStack]:
    with short_tmp_dir() as folder, fence_stack(folder, model) as running:
        yield running


@pytest.mark.parametrize("case", [QUEUED, MID_FORWARD])
async def test_a_stopped_runner_is_fenced_before_its_blocks_move(
        stack: FenceStack, reference: Reference, case: str) -> None:
    outcome = await attack(stack, reference, case)
    assert outcome.shared_blocks > 0  # alpha computes in blocks beta had: the attack's premise
    assert outcome.wrong == []
    # Beta's free after the lapse was refused while A was being stopped, not granted.
    assert "stalled past its hold; it is being stopped (fenced)" in outcome.probe.first
    assert outcome.a_exit == -signal.SIGKILL
    assert "runner fenced" in stack.daemon.stderr()
