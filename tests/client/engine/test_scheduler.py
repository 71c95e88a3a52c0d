"""The scheduler's decisions, exactly: admission by free blocks, token budgets, preemption order,
release before a short step, and the forks of parallel samples and beams.

The scheduler is pure bookkeeping (no I/O): these tests hand it the answers a runner would give
(`SeqOutput`s) and check each plan's sequences, tokens and block estimates.
"""

import itertools
from collections.abc import Sequence

from pagedkv.client import SamplingParams, SeqOutput
from pagedkv.client.engine.requests import Request
from pagedkv.client.engine.scheduler import Plan, Scheduler, SchedulerConfig

BS = 16


def make(config: SchedulerConfig | None = None, num_blocks: int = 100) -> Scheduler:
    return Scheduler(config or SchedulerConfig(), BS, num_blocks)


ids = itertools.count()


def request(prompt_len: int, params: SamplingParams | None = None) -> Request:
    return Request(f"r{next(ids)}", list(range(1, prompt_len + 1)),
                   params or SamplingParams(temperature=0, max_tokens=8),
                   itertools.count(100 * next(ids)).__next__)


def top(request: Request, *best: tuple[int, float]) -> list[tuple[int, float]]:
    """A beam's top-K candidates: `best`, then unlikely distinct tokens up to K."""
    assert request.beam is not None
    k = request.beam.candidates_per_beam
    return [*best, *((90 + i, -20.0 - i) for i in range(k - len(best)))]


def answer(plan: Plan, tokens: Sequence[int] | None = None,
           tops: Sequence[Sequence[tuple[int, float]]] | None = None) -> list[SeqOutput]:
    """What a runner answers: every stepped sequence fully computed and sampled (token 7, or
    `tokens`), holding what it held plus what the step sent."""
    outs = []
    for i, (seq, step) in enumerate(zip(plan.seqs, plan.steps, strict=True)):
        held = len(step.token_ids) if step.new_sequence and step.parent_seq_id is None else (
            (seq.parent.held if seq.parent else seq.held) + len(step.token_ids))
        computed = held if not step.max_compute_tokens else min(
            held, seq.computed + step.max_compute_tokens)
        top = tuple(tops[i]) if tops else ()
        outs.append(SeqOutput(seq.seq_id, held, computed, 0, computed == held,
                              tokens[i] if tokens else 7, -0.5, tuple(t for t, _ in top),
                              tuple(lp for _, lp in top), False))
    return outs


def test_admission_stops_at_the_free_blocks_minus_the_watermark() -> None:
    """Prompts of 40 tokens take 3 blocks; with 10 free and a 1-block watermark (1% of 100),
    three are admitted, the fourth waits."""
    scheduler = make()
    requests = [request(40) for _ in range(4)]
    for r in requests:
        scheduler.add(r)
    plan = scheduler.plan(free_blocks=10)
    assert plan.admit == requests[:3]
    assert plan.blocks == 9
    assert [(s.new_sequence, len(s.token_ids)) for s in plan.steps] == [(True, 40)] * 3
    assert list(scheduler.waiting) == requests[3:]


def test_a_long_prompt_is_chunked_by_the_token_budget() -> None:
    scheduler = make(SchedulerConfig(max_num_batched_tokens=64))
    first, second = request(100), request(10)
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.plan(free_blocks=50)
    assert plan.admit == [first]  # no budget left for the second
    assert [(s.max_compute_tokens, len(s.token_ids)) for s in plan.steps] == [(64, 100)]
    scheduler.update(plan, answer(plan))
    plan = scheduler.plan(free_blocks=43)
    # The rest of the prompt (36 tokens, nothing to append), then the second request.
    assert [(s.seq_id, s.new_sequence, s.max_compute_tokens, len(s.token_ids))
            for s in plan.steps] == [(first.seqs[0].seq_id, False, 36, 0),
                                     (second.seqs[0].seq_id, True, 10, 10)]


def test_parallel_samples_count_against_max_num_seqs() -> None:
    scheduler = make(SchedulerConfig(max_num_seqs=6))
    four = SamplingParams(temperature=1.0, n=4, max_tokens=4)
    a, b = request(5, four), request(5, four)
    scheduler.add(a)
    scheduler.add(b)
    assert scheduler.plan(free_blocks=50).admit == [a]


def test_the_newest_request_is_preempted_when_decodes_need_more_blocks() -> None:
    """Two requests of 16 tokens each fill their block; their next tokens need a block each.
    With one free block the newer one is preempted, freed, and requeued first in line."""
    scheduler = make(SchedulerConfig(watermark=0.0))
    old, new = request(16), request(16)
    scheduler.add(old)
    scheduler.add(new)
    plan = scheduler.plan(free_blocks=2)
    scheduler.update(plan, answer(plan))
    later = request(3)
    scheduler.add(later)
    plan = scheduler.plan(free_blocks=1)
    assert plan.preempt == [new] and not plan.steps
    assert scheduler.preempt_ids(plan) == [new.seqs[0].seq_id]
    scheduler.preempted(plan)
    assert scheduler.running == [old]
    assert list(scheduler.waiting) == [new, later]
    plan = scheduler.plan(free_blocks=3)
    # The old one decodes (1 block); the preempted one is re-admitted with prompt + its token
    # (2 blocks).
    assert [(s.new_sequence, list(s.token_ids), s.num_prompt_tokens) for s in plan.steps] == [
        (False, [7], 0), (True, [*range(1, 17), 7], 16)]


def test_a_contiguous_daemon_charges_a_reservation_per_new_sequence_and_nothing_to_grow() -> None:
    """Each sequence reserves 64 tokens (4 blocks): with 10 free blocks two 16-token prompts are
    admitted (no watermark: reservations never grow), the third waits. Their next tokens start
    a second block, which a paging daemon would need (the test above preempts for it); here
    they decode with no block free."""
    scheduler = Scheduler(SchedulerConfig(), BS, 100, reservation_blocks=4)
    first, second, third = request(16), request(16), request(3)
    for r in (first, second, third):
        scheduler.add(r)
    plan = scheduler.plan(free_blocks=10)
    assert (plan.admit, plan.blocks) == ([first, second], 8)
    scheduler.update(plan, answer(plan))
    plan = scheduler.plan(free_blocks=0)
    assert not plan.preempt and plan.admit == [] and plan.blocks == 0
    assert [list(s.token_ids) for s in plan.steps] == [[7], [7]]
    # Parallel samples are admitted with a reservation for each (n=3: 12 blocks), taken by the
    # parent, then by its forks; the room for the forks is not given to the next request.
    samples = Scheduler(SchedulerConfig(), BS, 100, reservation_blocks=4)
    parallel, after = request(20, SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=4)), \
        request(3)
    samples.add(parallel)
    samples.add(after)
    assert samples.plan(free_blocks=11).admit == []
    plan = samples.plan(free_blocks=15)
    assert (plan.admit, plan.blocks) == ([parallel], 4)
    samples.update(plan, answer(plan))
    # Two children to fork, 4 blocks each; the parent decodes inside its own reservation.
    assert samples.plan(free_blocks=11).blocks == 2 * 4


def test_a_short_step_releases_finished_sequences_first() -> None:
    scheduler = make(SchedulerConfig(watermark=0.0))
    done, going = request(16, SamplingParams(temperature=0, max_tokens=1)), request(16)
    scheduler.add(done)
    scheduler.add(going)
    plan = scheduler.plan(free_blocks=2)
    scheduler.update(plan, answer(plan))
    assert done.finished and len(scheduler.to_release) == 1  # its one sequence
    released = list(scheduler.to_release)
    plan = scheduler.plan(free_blocks=0)  # the going one needs a block: free first
    assert (plan.steps, plan.release) == ([], released)
    scheduler.update(plan, [])
    assert scheduler.to_release == []


def test_parallel_samples_fork_from_the_prompt_once_it_is_computed() -> None:
    scheduler = make()
    r = request(20, SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=4))
    scheduler.add(r)
    plan = scheduler.plan(free_blocks=50)
    assert len(plan.steps) == 1 and plan.steps[0].new_sequence
    scheduler.update(plan, answer(plan))
    plan = scheduler.plan(free_blocks=48)
    parent = r.seqs[0].seq_id
    assert [(s.seq_id == parent, s.new_sequence, list(s.token_ids), s.parent_seq_id)
            for s in plan.steps] == [(True, False, [7], None), (False, True, [], parent),
                                     (False, True, [], parent)]
    # Seeds differ per sample, each sent with its sequence's first step only (the runner keeps
    # the parent's); the parent's appending copies the shared partial block.
    assert len({s.params.seed for s in plan.seqs}) == 3
    assert [s.params is None for s in plan.steps] == [True, False, False]
    assert [s.params for s in plan.steps[1:]] == [s.params for s in plan.seqs[1:]]
    assert plan.blocks == 1


def test_beams_continue_in_their_sequence_fork_for_extra_continuations_and_free_the_rest() -> None:
    scheduler = make()
    r = request(5, SamplingParams(temperature=0, beam_width=2, n=2, max_tokens=5))
    scheduler.add(r)
    plan = scheduler.plan(free_blocks=50)
    (first,) = plan.seqs
    assert plan.steps[0].params.logprobs == r.beam.candidates_per_beam  # type: ignore[union-attr]
    # One beam: its two best tokens start two beams (the second a fork).
    scheduler.update(plan, answer(plan, tops=[top(r, (10, -0.1), (11, -0.2))]))
    plan = scheduler.plan(free_blocks=49)
    assert [(s.seq_id, s.new_sequence, list(s.token_ids), s.parent_seq_id)
            for s in plan.steps] == [(first.seq_id, False, [10], None),
                                     (r.seqs[1].seq_id, True, [11], first.seq_id)]
    # Both best continuations come from beam 1 (the fork): beam 0's sequence is released.
    fork = r.seqs[1]
    scheduler.update(plan, answer(plan, tops=[top(r, (20, -5.0), (21, -6.0)),
                                              top(r, (30, -0.1), (31, -0.2))]))
    assert scheduler.to_release == [first.seq_id]
    plan = scheduler.plan(free_blocks=48)
    assert [(s.seq_id, list(s.token_ids), s.parent_seq_id) for s in plan.steps] == [
        (fork.seq_id, [30], None), (r.seqs[1].seq_id, [31], fork.seq_id)]
    assert plan.release == [first.seq_id]


def test_a_release_that_failed_for_good_is_not_planned_again() -> None:
    # A daemon restarted cold: the session, and the finished sequences with it, are gone, so
    # the release-only step fails each time; planned again, the engine would loop on it and
    # never publish the finished requests.
    scheduler = make()
    done = request(16, SamplingParams(temperature=0, max_tokens=1))
    scheduler.add(done)
    plan = scheduler.plan(free_blocks=10)
    scheduler.update(plan, answer(plan))
    assert done.finished and len(scheduler.to_release) == 1
    plan = scheduler.plan(free_blocks=10)
    assert plan.release == scheduler.to_release and not plan.steps
    scheduler.release_sent(plan)  # the engine's _fail
    assert not scheduler.has_work


def test_an_aborted_request_is_dropped_and_its_sequences_released_by_the_next_plan() -> None:
    scheduler = make()
    running, waiting = request(20), request(20)
    scheduler.add(running)
    plan = scheduler.plan(free_blocks=3)
    scheduler.update(plan, answer(plan))
    scheduler.add(waiting)
    scheduler.abort(running)
    scheduler.abort(waiting)
    plan = scheduler.plan(free_blocks=50)
    assert (plan.steps, plan.release, plan.admit) == ([], [running.seqs[0].seq_id], [])
    assert scheduler.running == [] and list(scheduler.waiting) == []


def test_sampled_sequences_decode_ahead_but_a_parent_before_its_forks_and_beams() -> None:
    """decode_ahead marks a sequence whose next step appends its sampled token: a plain request
    from its prefill on; sample 0 of n=3 not on its prefill (the others fork from it next step,
    holding what it holds now) but from then on, with its forks; never a beam."""
    scheduler = make()
    plain = request(20)
    samples = request(20, SamplingParams(temperature=1.0, n=3, max_tokens=8))
    beams = request(20, SamplingParams(temperature=0, beam_width=2, max_tokens=8))
    for r in (plain, samples, beams):
        scheduler.add(r)
    plan = scheduler.plan(free_blocks=50)
    assert [s.decode_ahead for s in plan.steps] == [True, False, False]
    scheduler.update(plan, answer(plan, tops=[top(beams, (7, -0.5))] * 3))
    plan = scheduler.plan(free_blocks=40)
    names = {id(plain): "plain", id(samples): "samples", id(beams): "beams"}
    assert sorted((names[id(owner)], seq.index, step.decode_ahead)
                  for seq, step, owner in zip(plan.seqs, plan.steps, plan.owners, strict=True)) \
        == [("beams", 0, False), ("beams", 1, False), ("plain", 0, True), ("samples", 0, True),
            ("samples", 1, True), ("samples", 2, True)]
    off = make(SchedulerConfig(decode_ahead=False))
    off.add(request(20))
    assert [s.decode_ahead for s in off.plan(free_blocks=50).steps] == [False]


def test_a_push_finishing_a_request_dropped_meanwhile_queues_its_release_once() -> None:
    """The runner follows a request, its caller leaves (dropped: its sequence queued for
    release), the engine's plan releasing it is refused as stale, and the push read then
    finishes the sequence: it is still released once (a release naming it twice is refused
    whole by the runner, and the engine would give up on it, leaving it held)."""
    scheduler = make()
    left = request(20, SamplingParams(temperature=0, max_tokens=2))
    scheduler.add(left)
    prefill = scheduler.plan(free_blocks=50)
    scheduler.update(prefill, answer(prefill))
    seq_id = left.seqs[0].seq_id
    followed = scheduler.plan(free_blocks=50)  # the decode step the runner takes by itself
    scheduler.abort(left)
    stale = scheduler.plan(free_blocks=50)
    assert stale.release == [seq_id]
    scheduler.unadmit(stale)  # refused as stale: nothing changed
    scheduler.update(followed, answer(followed))  # the push it had not read
    assert scheduler.plan(free_blocks=50).release == [seq_id]
