"""A decode run's pushes merged while the stream lags (model_runner/process/outbox.py): a step
put while the push before is not taken joins it, entries in step order, free_blocks the
latest; the client's `StepOutputs.steps` splits the push back into exactly the steps put, a
finish included and logprobs kept; a push stops taking steps at the entry bound; a push taken
is never merged into; the loop is woken once per message."""

import asyncio
import threading

import pytest

from pagedkv.client import SeqOutput, StepOutputs
from pagedkv.model_runner.process.outbox import MAX_PUSH_ENTRIES, Outbox, entries

# Three followed sequences' two steps: sequence 8 finishes at the first (it is gone from the
# second), sequence 7 asked for two top logprobs.
FIRST = StepOutputs([
    SeqOutput(7, 10, 10, 0, True, 5, -0.5, (5, 9), (-0.5, -1.5)),
    SeqOutput(8, 12, 12, 0, True, 2, -0.25, finished=True),
    SeqOutput(9, 20, 20, 4, True, 3, -1.0),
], free_blocks=30)
SECOND = StepOutputs([
    SeqOutput(7, 11, 11, 0, True, 6, -0.75, (6, 1), (-0.75, -2.0)),
    SeqOutput(9, 21, 21, 4, True, 4, -0.125),
], free_blocks=29)


def received(answer: object) -> list[StepOutputs]:
    """What the client makes of a push: its outputs, split into steps."""
    return StepOutputs.from_message(answer).steps()  # type: ignore[arg-type]


def same(got: StepOutputs, want: StepOutputs) -> bool:
    return list(got) == list(want) and got.free_blocks == want.free_blocks


async def test_a_step_put_before_the_push_is_taken_joins_it_in_order() -> None:
    outbox = Outbox()
    outbox.put(FIRST)
    outbox.put(SECOND)
    answer = outbox.take()
    assert outbox.take() is None  # one message
    assert answer is not None
    assert list(answer.seq_ids) == [7, 8, 9, 7, 9]
    assert answer.free_blocks == 29  # the latest
    first, second = received(answer)
    assert list(first) == list(FIRST) and list(second) == list(SECOND)
    assert first.free_blocks == second.free_blocks == 29


async def test_merged_steps_equal_the_steps_applied_one_by_one() -> None:
    """Each sequence's tokens, logprobs and counts, read from one merged push, are those of
    the pushes sent one step at a time."""
    one_by_one, merged = Outbox(), Outbox()
    separate = []
    for step in (FIRST, SECOND, FIRST):  # any steps: the split is by repeated seq ids
        one_by_one.put(step)
        separate.append(answer := one_by_one.take())
        assert answer is not None
        merged.put(step)
    whole = merged.take()
    assert whole is not None
    parts = received(whole)
    assert [list(part) for part in parts] == [list(StepOutputs.from_message(a))
                                             for a in separate]


async def test_a_push_taken_is_not_merged_into() -> None:
    outbox = Outbox()
    outbox.put(FIRST)
    first = outbox.take()
    outbox.put(SECOND)
    second = outbox.take()
    assert first is not None and second is not None
    assert [same(s, FIRST) for s in received(first)] == [True]
    assert [same(s, SECOND) for s in received(second)] == [True]


async def test_a_free_blocks_of_zero_is_the_latest_too() -> None:
    outbox = Outbox()
    outbox.put(FIRST)
    outbox.put(StepOutputs(list(SECOND), free_blocks=0))
    answer = outbox.take()
    assert answer is not None and answer.free_blocks == 0


async def test_a_push_takes_steps_up_to_the_entry_bound_then_a_second_message_queues() -> None:
    # FIRST counts 3 entries + 2 top logprobs, SECOND 2 + 2: 9 fit in 9, not in 8.
    assert entries(FIRST.message()) == 5 and entries(SECOND.message()) == 4
    roomy, tight = Outbox(max_entries=9), Outbox(max_entries=8)
    for outbox in (roomy, tight):
        outbox.put(FIRST)
        outbox.put(SECOND)
    assert roomy.take() is not None and roomy.take() is None
    first, second = tight.take(), tight.take()
    assert first is not None and second is not None and tight.take() is None
    assert list(first.seq_ids) == [7, 8, 9] and list(second.seq_ids) == [7, 9]
    # A step bigger than the bound alone goes alone.
    small = Outbox(max_entries=2)
    small.put(FIRST)
    small.put(FIRST)
    assert [len(a.seq_ids) for a in (small.take(), small.take()) if a is not None] == [3, 3]
    assert MAX_PUSH_ENTRIES == 4096


def test_the_bound_must_be_positive() -> None:
    async def make() -> Outbox:
        return Outbox(max_entries=0)

    with pytest.raises(ValueError, match="max_entries must be at least 1, got 0"):
        asyncio.run(make())


async def test_steps_put_from_another_thread_before_the_loop_takes_are_one_message() -> None:
    outbox = Outbox()
    wakes = 0

    async def waiter() -> None:
        nonlocal wakes
        await outbox.wait()
        wakes += 1

    waiting = asyncio.create_task(waiter())
    putter = threading.Thread(target=lambda: [outbox.put(FIRST) for _ in range(50)])
    putter.start()
    await asyncio.to_thread(putter.join)
    await asyncio.wait_for(waiting, 5)
    answer = outbox.take()
    assert answer is not None and outbox.take() is None
    assert len(received(answer)) == 50 and wakes == 1


def test_a_single_step_splits_into_itself() -> None:
    assert FIRST.steps() == [FIRST]
    assert StepOutputs([], 3).steps()[0].free_blocks == 3
