"""Turns by key (client/engine/fair_queue.py), through the scheduler's plans: a key with a flood
waiting does not keep another key's request behind it, a key at its running cap waits, and two
engines sharing a queue admit in the queue's turns.

Prompts of 40 tokens take 3 blocks (16-slot blocks); `answer` is a runner computing every step.
"""

import itertools

import pytest

from pagedkv.client import SamplingParams, SeqOutput
from pagedkv.client.engine.fair_queue import FairQueue
from pagedkv.client.engine.requests import Request
from pagedkv.client.engine.scheduler import Plan, Scheduler, SchedulerConfig

BS = 16
ids = itertools.count()


def answer(plan: Plan) -> list[SeqOutput]:
    """A runner's answer: every stepped sequence (no forks here) computed, token 7 sampled."""
    outs = []
    for seq, step in zip(plan.seqs, plan.steps, strict=True):
        held = (0 if step.new_sequence else seq.held) + len(step.token_ids)
        outs.append(SeqOutput(seq.seq_id, held, held, 0, True, 7, -0.5, (), (), False))
    return outs


def keyed(key: str, max_tokens: int = 8) -> Request:
    return Request(f"{key}{next(ids)}", list(range(1, 41)),
                   SamplingParams(temperature=0, max_tokens=max_tokens),
                   itertools.count(100 * next(ids)).__next__, key=key)


def test_a_new_key_is_admitted_before_a_flooding_keys_queue() -> None:
    """A's two running requests fill the room (6 of 7 free blocks with no watermark); A has
    four more waiting when B's arrives. A's first finishes: B's request takes the room, not
    A's oldest waiting one."""
    scheduler = Scheduler(SchedulerConfig(watermark=0), BS, 100)
    flood = [keyed("A", max_tokens=1)] + [keyed("A") for _ in range(5)]
    for r in flood:
        scheduler.add(r)
    plan = scheduler.plan(free_blocks=7)
    assert plan.admit == flood[:2]
    scheduler.update(plan, answer(plan))  # flood[0] sampled its one token: finished
    b = keyed("B")
    scheduler.add(b)
    plan = scheduler.plan(free_blocks=4)  # A was served last: B's turn
    assert plan.admit == [b] and len(plan.release) == 1  # flood[0] freed with this step
    assert list(scheduler.waiting) == flood[2:]


def test_turns_alternate_between_keys_oldest_first_within_a_key() -> None:
    scheduler = Scheduler(SchedulerConfig(watermark=0), BS, 100)
    a = [keyed("A") for _ in range(3)]
    b = [keyed("B") for _ in range(2)]
    for r in [*a, *b]:
        scheduler.add(r)
    plan = scheduler.plan(free_blocks=15)  # room for five: A, B, A, B, A
    assert plan.admit == [a[0], b[0], a[1], b[1], a[2]]


def test_a_key_at_its_running_cap_waits_while_others_are_admitted() -> None:
    queue = FairQueue(max_running_per_key=2)
    scheduler = Scheduler(SchedulerConfig(watermark=0), BS, 100, waiting=queue.line())
    a = [keyed("A") for _ in range(4)]
    b = keyed("B")
    for r in [*a, b]:
        scheduler.add(r)
    plan = scheduler.plan(free_blocks=50)
    assert plan.admit == [a[0], b, a[1]]  # room for all, but A runs at most two
    scheduler.update(plan, answer(plan))
    assert (queue.running_of("A"), queue.waiting_of("A"), queue.running_of("B")) == (2, 2, 1)
    assert scheduler.plan(free_blocks=40).admit == []


def test_preemption_and_drops_keep_the_counts() -> None:
    queue = FairQueue(max_running_per_key=1)
    scheduler = Scheduler(SchedulerConfig(watermark=0), BS, 100, waiting=queue.line())
    first, second = keyed("A"), keyed("A")
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.plan(free_blocks=50)
    assert plan.admit == [first]
    scheduler.unadmit(plan)  # its step failed: back first in line, not running
    assert (queue.running_of("A"), list(scheduler.waiting)) == (0, [first, second])
    plan = scheduler.plan(free_blocks=50)
    scheduler.update(plan, answer(plan))
    scheduler.drop(first)  # its caller went away while running
    scheduler.drop(first)  # a second drop changes nothing
    assert queue.running_of("A") == 0
    assert scheduler.plan(free_blocks=50).admit == [second]
    scheduler.drop(second)  # admitted by a step that got no answer
    assert (queue.running_of("A"), len(queue), queue.next_key()) == (0, 0, None)


def test_engines_sharing_a_queue_admit_in_its_turns() -> None:
    """Two schedulers (two engines, one pool): the one whose key is not next admits nothing,
    even with room, until the other admitted."""
    queue = FairQueue()
    first = Scheduler(SchedulerConfig(watermark=0), BS, 100, waiting=queue.line())
    second = Scheduler(SchedulerConfig(watermark=0), BS, 100, waiting=queue.line())
    a, b = keyed("A"), keyed("B")
    first.add(a)
    second.add(b)
    assert second.waiting.head() is None and second.plan(free_blocks=50).admit == []
    assert first.plan(free_blocks=50).admit == [a]
    assert second.plan(free_blocks=50).admit == [b]
    with pytest.raises(AssertionError, match="another line"):
        second.add(keyed("A"))


def test_a_negative_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="max_running_per_key"):
        FairQueue(max_running_per_key=-1)
