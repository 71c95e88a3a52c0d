"""Forks the runner makes in a step (parallel samples, beams) and re-admitted sequences.

One Llama family model (tests/support/families.py's) over a real pagedkvd. A step may name
new sequences with a parent: the runner forks the parent in the daemon before the step's other
appends, so a child holds what its parent held before the step; a child without tokens
recomputes its last token (writing nothing) to sample a token of its own. A new sequence may
say how many of its tokens are the prompt (a request re-admitted after preemption), so
max_tokens and seeds go on as before.
"""

import pytest

from pagedkv.client import SamplingParams, SeqStep, Session
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.engine.steps import InvalidStep

from engine_driver import decode, new, recorder
from families import BLOCK_SIZE, GREEDY, NEW_TOKENS, expected_tokens

FAMILY = "llama"
# The fixtures daemon, prompts and (per family) engine are conftest.py's.


@pytest.mark.parametrize("family", [FAMILY])
async def test_children_without_tokens_resample_the_last_position_sharing_the_prompt(
    family: str, session: Session, engine: StepEngine, prompts: list[tuple[int, ...]],
) -> None:
    """Parallel sampling from one prefill: the 33-token prompt is computed once (seq 1); next
    step, seq 1 appends its token while children 2 and 3 fork from it and each recompute only
    position 32, writing nothing. Greedy children pick the parent's first token, then all three
    continue alike; the children shared the prompt's blocks (the daemon holds 3 full blocks of
    prompt once, not thrice)."""
    prompt = prompts[2]
    head = await decode(engine, session.session_id, [new(1, prompt, GREEDY)], 1, release=False)
    first = head[1].tokens[0]
    runner = recorder(engine)
    runner.chunks = []
    outcome = await engine.step(session.session_id, [
        SeqStep(1, (first,), False, 0, GREEDY),
        SeqStep(2, (), True, 0, GREEDY, parent_seq_id=1),
        SeqStep(3, (), True, 0, GREEDY, parent_seq_id=1)])
    assert [(c.start, list(c.slot_mapping)) for c in runner.chunks[0][1:]] == [(32, [-1])] * 2
    assert [r.token_id for r in outcome[1:]] == [first, first]
    assert outcome.free_blocks > 0
    stats = (await session.stats()).session
    assert stats is not None
    # The children hold the 33-token prompt in the parent's blocks 0, 1 and the partial 2; the
    # parent's append copied block 2 for itself: 4 blocks, not 3 x 3.
    assert (stats.num_sequences, stats.blocks_held) == (3, 4)
    tails = await decode(engine, session.session_id, [
        SeqStep(i, (r.token_id,), False, 0, GREEDY) for i, r in
        zip((1, 2, 3), outcome, strict=True)], NEW_TOKENS - 2)
    expected = expected_tokens(family, prompt)
    assert [first, outcome[0].token_id, *tails[1].tokens] == expected
    for child in (2, 3):  # one token behind their parent
        assert [outcome[child - 1].token_id, *tails[child].tokens] == expected[:-1]


@pytest.mark.parametrize("family", [FAMILY])
async def test_a_fork_with_tokens_branches_before_the_parent_appends(
    family: str, session: Session, engine: StepEngine, prompts: list[tuple[int, ...]],
) -> None:
    """A beam's second continuation: the parent appends token a, the child (forked in the same
    step) appends token b; the child holds the parent's tokens before the step plus b, and its
    first append copies the shared partial last block (the parent keeps its own)."""
    prompt = prompts[1]
    head = await decode(engine, session.session_id, [new(1, prompt, GREEDY)], 1, release=False)
    a = head[1].tokens[0]
    b = (a + 1) % 128
    outcome = await engine.step(session.session_id, [
        SeqStep(1, (a,), False, 0, GREEDY),
        SeqStep(2, (b,), True, 0, GREEDY, parent_seq_id=1)])
    assert [r.num_tokens for r in outcome] == [len(prompt) + 1] * 2
    tables = await session.block_tables([1, 2])
    assert tables[0].block_ids[0] == tables[1].block_ids[0]  # the full block is shared
    assert tables[0].block_ids[1] != tables[1].block_ids[1]  # the partial one was copied
    child = await decode(engine, session.session_id, [
        SeqStep(2, (outcome[1].token_id,), False, 0, GREEDY)], 2)
    assert [outcome[1].token_id, *child[2].tokens] == expected_tokens(
        family, (*prompt, b), 3)


@pytest.mark.parametrize("family", [FAMILY])
async def test_a_readmitted_sequence_counts_only_its_prompt_as_prompt(
    family: str, session: Session, engine: StepEngine, prompts: list[tuple[int, ...]],
) -> None:
    """Preempted after 3 of max_tokens=5 tokens and re-admitted with prompt + those 3 tokens and
    num_prompt_tokens = the prompt: it finishes after 2 more tokens, as if never preempted, and
    seeded sampling gives the tokens of an uninterrupted run."""
    prompt = prompts[1]
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=5)
    whole = await decode(engine, session.session_id, [new(1, prompt, seeded)], 5)
    assert whole[1].results[-1].finished
    head = whole[1].tokens[:3]
    resumed = SeqStep(2, (*prompt, *head), True, 0, seeded, num_prompt_tokens=len(prompt))
    tail = await decode(engine, session.session_id, [resumed], 2)
    assert head + tail[2].tokens == whole[1].tokens
    assert [r.finished for r in tail[2].results] == [False, True]


@pytest.mark.parametrize("family", [FAMILY])
async def test_bad_forks_fail_alone_and_change_nothing(
    family: str, session: Session, engine: StepEngine, prompts: list[tuple[int, ...]],
) -> None:
    prompt = prompts[2]
    await engine.step(session.session_id, [new(1, prompt, GREEDY, max_compute_tokens=BLOCK_SIZE)])
    with pytest.raises(InvalidStep, match="not fully computed"):
        await engine.step(session.session_id, [SeqStep(2, (), True, 0, GREEDY,
                                                          parent_seq_id=1)])
    with pytest.raises(InvalidStep, match="must be an existing sequence"):
        await engine.step(session.session_id, [new(3, prompt, GREEDY),
                                                SeqStep(4, (), True, 0, GREEDY,
                                                           parent_seq_id=3)])
    with pytest.raises(InvalidStep, match="num_prompt_tokens"):
        await engine.step(session.session_id, [
            SeqStep(5, prompt, True, 0, GREEDY, num_prompt_tokens=len(prompt) + 1)])
    stats = (await session.stats()).session
    assert stats is not None and stats.num_sequences == 1
