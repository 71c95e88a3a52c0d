"""A long prefill is split across forwards by `max_batch_tokens`, and other clients' decodes
join those forwards instead of waiting for the whole prompt (issue 17, finding 13).

The runner's forwards are gated: each waits for a permit the test gives, so the test knows what
is queued when a forward goes and the forwards' composition is exact, never a matter of timing.
One daemon for the module (the families' Llama pool), an in-process engine per test.
"""

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
import torch

from pagedkv.client import PoolClient, SeqStep, Session, StepOutputs
from pagedkv.model_runner.engine.forward_loop import Batch, ForwardLoop, Prepared
from pagedkv.model_runner.engine.sampling import Sampler
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.kernels.attention_backend import get_backend
from pagedkv.model_runner.runner import SequenceChunk

from engine_driver import RecordingRunner, new
from families import GREEDY, expected_tokens, paged_model

# The fixture daemon is conftest.py's (the families' pool).

MAX_BATCH_TOKENS = 16
# A prefill of nine forwards or more at 16 tokens each, and a prompt that decodes beside it.
LONG, SHORT = 150, 5


class GatedRunner(RecordingRunner):
    """Each forward waits for a permit (`go`), so the test decides what is queued when it goes."""

    entered = 0  # forwards that started (each waits for its permit)
    released = 0  # permits given

    def step(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        self.entered += 1
        self.permits.acquire()
        return super().step(chunks)

    def go(self) -> None:
        self.released += 1
        self.permits.release()

    @property
    def waiting(self) -> bool:
        """A forward waits for its permit."""
        return self.entered > self.released


@pytest.fixture
async def engine(runner_client: PoolClient) -> AsyncIterator[StepEngine]:
    """An engine on the daemon's runner socket, as a runner is, its forwards gated."""
    runner = GatedRunner.attach(paged_model("llama"), await runner_client.pool_info(),
                                get_backend("torch"))
    runner.permits = threading.Semaphore(0)
    started = StepEngine(runner_client, runner, max_batch_tokens=MAX_BATCH_TOKENS)
    await started.start()
    yield started
    runner.permits.release(1000)  # a failed test leaves no forward waiting
    await started.stop()


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.001)


async def answered(runner: GatedRunner, step: "asyncio.Task[StepOutputs]") -> StepOutputs:
    """Let the forwards go one at a time until `step` is answered."""
    while not step.done():
        await until(lambda: runner.waiting or step.done())
        if not step.done():
            runner.go()
    return step.result()


def prompt(n: int, salt: int) -> tuple[int, ...]:
    return tuple((7 * i + salt) % 127 + 1 for i in range(n))


async def test_decodes_of_another_client_run_between_the_chunks_of_a_long_prefill(
        client: PoolClient, session: Session, engine: StepEngine) -> None:
    runner = engine.runner
    assert isinstance(runner, GatedRunner)
    long, short = prompt(LONG, 3), prompt(SHORT, 5)
    async with await client.open_session("decoding") as other:
        first = asyncio.create_task(engine.step(other.session_id, [new(1, short, GREEDY)]))
        decoded = [(await answered(runner, first))[0].token_id]
        prefill = asyncio.create_task(engine.step(session.session_id, [new(1, long, GREEDY)]))
        for _ in range(3):
            await until(lambda: runner.waiting)  # a piece of the prefill waits for its permit
            decode = asyncio.create_task(engine.step(other.session_id, [
                SeqStep(1, (decoded[-1],), False, 0, GREEDY)]))
            await until(lambda: any(p.session_id == other.session_id
                                    for p in engine.forwards._ready))
            decoded.append((await answered(runner, decode))[0].token_id)
            assert not prefill.done()  # answered between two pieces of the prefill
        result = (await answered(runner, prefill))[0]
        sizes = [[len(chunk.token_ids) for chunk in forward] for forward in runner.chunks]
        # The short prefill; then the prefill's pieces, each decode first in the forward
        # after it arrived (1 + 15 tokens), the rest 16 at a time.
        assert sizes == [[5], [16], [1, 15], [16], [1, 15], [16], [1, 15], [16], [16], [16], [9]]
        assert decoded == expected_tokens("llama", short, 4)
        assert result.sampled and result.token_id == expected_tokens("llama", long, 1)[0]
        assert (result.num_tokens, result.num_computed) == (LONG, LONG)
        # Its blocks were committed once all were computed: the same prompt again is served
        # from the cache (its 9 whole blocks) and gives the same token.
        again = asyncio.create_task(engine.step(session.session_id, [new(2, long, GREEDY)]))
        cached = (await answered(runner, again))[0]
        assert cached.num_cached == LONG // 16 * 16
        assert cached.token_id == result.token_id


def tokens(n: int, start: int = 0) -> SequenceChunk:
    """A chunk of n tokens from `start` (ids and slots do not matter to the batching)."""
    return SequenceChunk(list(range(n)), start, list(range(start, start + n)), [0])


def shape(batch: Batch) -> list[tuple[str, list[tuple[int, int, int]]]]:
    """Each step of a forward, with its pieces as (request index, start, tokens)."""
    return [(prepared.session_id, [(i, c.start, len(c.token_ids)) for i, c in pieces])
            for prepared, pieces in batch]


async def test_a_forward_takes_decodes_first_then_pieces_of_the_others_in_arrival_order() -> None:
    """Budget 8: A (a prefill of 10 + 3) arrived first, then B (two decodes), then C (5)."""
    forwards = ForwardLoop(lambda: None, Sampler(), max_batch_tokens=8)  # type: ignore[arg-type,return-value]
    a = Prepared("A", [], [], [(0, tokens(10)), (1, tokens(3))])
    b = Prepared("B", [], [], [(0, tokens(1, 40)), (1, tokens(1, 50))])
    c = Prepared("C", [], [], [(0, tokens(5))])
    forwards._ready.extend([a, b, c])
    assert shape(forwards._take_batch()) == [("B", [(0, 40, 1), (1, 50, 1)]), ("A", [(0, 0, 6)])]
    assert list(forwards._ready) == [c]
    forwards._ready.appendleft(a)  # what the loop does after the forward: A goes on first
    assert shape(forwards._take_batch()) == [("A", [(0, 6, 4), (1, 0, 3)]), ("C", [(0, 0, 1)])]
    forwards._ready.appendleft(c)
    assert shape(forwards._take_batch()) == [("C", [(0, 1, 4)])]
    assert not a.left and not c.left


async def test_a_decode_step_wider_than_the_budget_is_split_by_sequences() -> None:
    forwards = ForwardLoop(lambda: None, Sampler(), max_batch_tokens=2)  # type: ignore[arg-type,return-value]
    wide = Prepared("W", [], [], [(i, tokens(1, 16 * i)) for i in range(3)])
    forwards._ready.append(wide)
    assert shape(forwards._take_batch()) == [("W", [(0, 0, 1), (1, 16, 1)])]
    assert [index for index, _ in wide.left] == [2]


def test_a_budget_below_one_token_is_refused() -> None:
    with pytest.raises(ValueError, match="max_batch_tokens must be >= 1"):
        ForwardLoop(lambda: None, Sampler(), max_batch_tokens=0)  # type: ignore[arg-type,return-value]
