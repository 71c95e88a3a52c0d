"""Every supported model family through the StepEngine over a real pagedkvd, against transformers.

Ten families, each random-initialized (fp32, initializer_range 0.2) from a tiny config: Llama
(GQA, RoPE), Qwen2 (qkv bias), Qwen3 (q/k norm), Mistral, Gemma (scaled embeddings), Gemma2
(soft caps, query_pre_attn_scalar), Phi3 (fused qkv), GPT-2 and OPT (learned positions), GPT-NeoX
(partial rotary). Their KV geometry is the same (2 layers, 2 KV heads, head_dim 32, float32:
GQA families have 4 query heads of 32, the others 2), so one daemon, its pool laid out from the
Llama config.json, serves them all.

The engine runs in-process on the test's event loop; each test opens its own session (its own
cache salt, so tests never share cached blocks). Per family:
- greedy tokens of a ragged batch of three prompts decoded together equal transformers'
  `generate(do_sample=False)` with eager attention, and the logits of every position the engine
  sampled from equal an eager forward's within 1e-4;
- chunked prefill, a prompt served from the prefix cache, a forked sequence and a freed and
  recomputed sequence generate those same tokens.
"""

from collections.abc import Sequence

import pytest
import torch

from pagedkv.client import History, PoolClient, SeqOutput, SeqStep, Session
from pagedkv.model_runner.engine.step_engine import StepEngine

from engine_driver import decode, new, recorder
from families import (
    BLOCK_SIZE,
    FAMILIES,
    GREEDY,
    NEW_TOKENS,
    VOCAB,
    eager_logits,
    expected_tokens,
)

LOGITS_ATOL = 1e-4


def greedy(seq_id: int, prompt: Sequence[int], max_compute_tokens: int = 0) -> SeqStep:
    return new(seq_id, prompt, GREEDY, max_compute_tokens)


def full_logprobs(result: SeqOutput) -> torch.Tensor:
    """[V] the raw log-distribution a result reports (logprobs=VOCAB: every token)."""
    assert len(result.top_token_ids) == VOCAB
    logprobs = torch.full((VOCAB,), float("nan"))
    logprobs[list(result.top_token_ids)] = torch.tensor(result.top_logprobs)
    return logprobs


FAMILY_NAMES = list(FAMILIES)


# ------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("family", FAMILY_NAMES)
async def test_ragged_batch_matches_eager_generate_and_logits(
    family: str, session: Session, engine: StepEngine,
    prompts: list[tuple[int, ...]],
) -> None:
    """Three prompts of 5, 17 and 33 tokens prefilled in one forward, then decoded together.

    Logits, two ways: the runner's raw logits of each sampled row (every step computes all three
    sequences, in request order) against an eager forward; and what a client sees, the engine's
    logprobs of the whole vocabulary, against log_softmax of the eager logits."""
    decoded = await decode(engine, session.session_id,
                           [greedy(i, prompt) for i, prompt in enumerate(prompts)], NEW_TOKENS)
    runner = recorder(engine)
    assert len(runner.logits) == NEW_TOKENS
    for i, prompt in enumerate(prompts):
        assert decoded[i].tokens == expected_tokens(family, prompt), f"prompt {len(prompt)}"
        eager = eager_logits(family, prompt)  # [NEW_TOKENS, V]
        paged = torch.stack([logits[i] for logits in runner.logits])
        torch.testing.assert_close(paged, eager, atol=LOGITS_ATOL, rtol=0)
        reported = torch.stack([full_logprobs(r) for r in decoded[i].results])
        torch.testing.assert_close(reported, torch.log_softmax(eager, dim=-1),
                                   atol=LOGITS_ATOL, rtol=0)
        assert [r.logprob for r in decoded[i].results] == [
            r.top_logprobs[0] for r in decoded[i].results]  # greedy: the most likely token
    assert (await session.stats()).session.num_sequences == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("family", FAMILY_NAMES)
async def test_chunked_prefill_generates_the_same_tokens(
    family: str, session: Session, engine: StepEngine,
    prompts: list[tuple[int, ...]],
) -> None:
    """At most 7 tokens per sequence and step: the 33-token prompt takes five steps (7, 7, 7, 7,
    5) and samples only on the last, while the 5-token prompt already decodes beside it."""
    decoded = await decode(engine, session.session_id,
                           [greedy(i, prompt, max_compute_tokens=7)
                            for i, prompt in enumerate(prompts)], NEW_TOKENS)
    longest = decoded[2].results
    assert [r.num_computed for r in longest[:5]] == [7, 14, 21, 28, 33]
    assert [r.sampled for r in longest[:5]] == [False, False, False, False, True]
    assert [len(chunk.token_ids) for chunk in recorder(engine).chunks[0]] == [5, 7, 7]
    for i, prompt in enumerate(prompts):
        assert decoded[i].tokens == expected_tokens(family, prompt), f"prompt {len(prompt)}"


@pytest.mark.parametrize("family", FAMILY_NAMES)
async def test_a_cached_prefix_computes_fewer_tokens_and_the_same_output(
    family: str, session: Session, engine: StepEngine, prompts: list[tuple[int, ...]],
) -> None:
    """A 33-token prompt generated and released (its computed blocks committed, then cached);
    then, in one step, that prompt plus 7 more tokens and its first 32 tokens alone. Both find
    the two blocks in the cache: the first computes only its other 8 tokens, the second, all of
    whose tokens are cached, recomputes its last token for the logits without writing it (slot
    -1). Their tokens are those of the same prompts computed fresh."""
    prompt = prompts[2]
    first = await decode(engine, session.session_id, [greedy(1, prompt)], NEW_TOKENS)
    assert first[1].tokens == expected_tokens(family, prompt)
    assert first[1].results[0].num_cached == 0
    longer, whole_blocks = (*prompt, *prompts[1][:7]), prompt[:2 * BLOCK_SIZE]
    runner = recorder(engine)
    runner.chunks = []
    again = await decode(engine, session.session_id,
                         [greedy(2, longer), greedy(3, whole_blocks)], NEW_TOKENS)
    assert [again[i].results[0].num_cached for i in (2, 3)] == [2 * BLOCK_SIZE] * 2
    suffix, last = runner.chunks[0]
    assert (suffix.start, len(suffix.token_ids)) == (2 * BLOCK_SIZE, len(longer) - 32)
    assert (last.start, list(last.token_ids), list(last.slot_mapping)) == (
        31, [prompt[31]], [-1])
    assert again[2].tokens == expected_tokens(family, longer)
    assert again[3].tokens == expected_tokens(family, whole_blocks)


def child_step(seq_id: int, parent: int, prompt: Sequence[int], generated: Sequence[int],
               token: int) -> SeqStep:
    """The first step of a child the client forked itself with KVPool.Fork: the daemon may hold
    fewer of its tokens than the runner's answers said of its parent (the runner appends decode
    tokens once a block), so it names its history, as the client knows it."""
    return SeqStep(seq_id, (token,), False, 0, GREEDY, parent_seq_id=parent,
                   history=History((*prompt, *generated), len(prompt), 0))


@pytest.mark.parametrize("family", FAMILY_NAMES)
async def test_a_forked_sequence_continues_like_its_parent(
    family: str, session: Session, engine: StepEngine,
    prompts: list[tuple[int, ...]],
) -> None:
    """The parent (17-token prompt) samples 3 tokens; the client forks it in the daemon (the
    shared last block holds its K/V, partly filled), then steps parent and child together, the
    child naming its parent and its history on its first step: both continue with the parent's
    greedy tokens, each appending into its own copy of the last block."""
    prompt = prompts[1]
    head = await decode(engine, session.session_id, [greedy(1, prompt)], n=3,
                        release=False)
    forked = await session.fork(1, 2)
    # The daemon got the first token with the runner's call that reserved slots, the second
    # went into them (certified with the next call), the third is not appended yet.
    assert forked.num_tokens == len(prompt) + 1
    last = head[1].tokens[-1]
    tails = await decode(engine, session.session_id, [
        SeqStep(1, (last,), False, 0, GREEDY),
        child_step(2, 1, prompt, head[1].tokens[:-1], last)], n=NEW_TOKENS - 3)
    expected = expected_tokens(family, prompt)
    assert head[1].tokens + tails[1].tokens == expected
    assert head[1].tokens + tails[2].tokens == expected


@pytest.mark.parametrize("family", FAMILY_NAMES)
async def test_a_freed_and_recomputed_sequence_gives_the_same_tokens(
    family: str, client: PoolClient, session: Session, engine: StepEngine,
    prompts: list[tuple[int, ...]],
) -> None:
    """A sequence preempted after 4 tokens (released), then recomputed as a new sequence of the
    same id holding prompt + those tokens, continues as if never interrupted: in its session,
    from its committed blocks (one full block cached), and in a fresh session, from nothing."""
    prompt = prompts[1]
    expected = expected_tokens(family, prompt)
    head = await decode(engine, session.session_id, [greedy(1, prompt)], n=4)
    assert head[1].tokens == expected[:4]
    resumed = (*prompt, *head[1].tokens)
    cached = await decode(engine, session.session_id, [greedy(1, resumed)], n=NEW_TOKENS - 4)
    assert cached[1].results[0].num_cached == BLOCK_SIZE
    assert head[1].tokens + cached[1].tokens == expected
    async with await client.open_session("engine-families-fresh") as fresh:
        recomputed = await decode(engine, fresh.session_id, [greedy(1, resumed)],
                                  n=NEW_TOKENS - 4)
    assert recomputed[1].results[0].num_cached == 0
    assert head[1].tokens + recomputed[1].tokens == expected


# ------------------------------------- forks and releases at the edges (Llama suffices)


@pytest.mark.parametrize("family", ["llama"])
async def test_a_fork_of_sequence_zero_continues_like_its_parent(
    family: str, session: Session, engine: StepEngine, prompts: list[tuple[int, ...]],
) -> None:
    prompt = prompts[1]
    head = await decode(engine, session.session_id, [greedy(0, prompt)], 3, release=False)
    await session.fork(0, 1)
    last = head[0].tokens[-1]
    tails = await decode(engine, session.session_id, [
        SeqStep(0, (last,), False, 0, GREEDY),
        child_step(1, 0, prompt, head[0].tokens[:-1], last)], NEW_TOKENS - 3)
    expected = expected_tokens(family, prompt)
    assert head[0].tokens + tails[0].tokens == head[0].tokens + tails[1].tokens == expected


@pytest.mark.parametrize("family", ["llama"])
async def test_a_fork_first_stepped_after_its_parent_continues_like_it(
    family: str, session: Session, engine: StepEngine, prompts: list[tuple[int, ...]],
) -> None:
    """Beam search or a token budget may step the parent before the child it just forked."""
    prompt = prompts[1]
    head = await decode(engine, session.session_id, [greedy(1, prompt)], 3, release=False)
    await session.fork(1, 2)
    last = head[1].tokens[-1]
    parent = await decode(engine, session.session_id, [SeqStep(1, (last,), False, 0, GREEDY)],
                          NEW_TOKENS - 3, release=False)
    child = await decode(engine, session.session_id, [
        child_step(2, 1, prompt, head[1].tokens[:-1], last)], NEW_TOKENS - 3)
    assert head[1].tokens + parent[1].tokens == head[1].tokens + child[2].tokens == (
        expected_tokens(family, prompt))


@pytest.mark.parametrize("family", ["llama"])
async def test_releasing_a_fork_never_stepped_frees_it(
    family: str, session: Session, engine: StepEngine, prompts: list[tuple[int, ...]],
) -> None:
    await decode(engine, session.session_id, [greedy(1, prompts[1])], 1, release=False)
    await session.fork(1, 2)
    await engine.step(session.session_id, [], release=[1, 2])
    stats = (await session.stats()).session
    assert stats is not None
    assert stats.num_sequences == 0
