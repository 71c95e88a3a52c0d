"""The runner calls the daemon once a block, not once a token (model_runner/engine/reservations.py).

A daemon Step that appends a sequence's token reserves 2 blocks' worth of slots past it; the
runner decodes into them without a call and certifies those tokens, by id, with its next call.
These tests hold the runner side of the rollback rules: whatever ends a sequence (an early stop
with a token decoded past it, an abort, a runner that dies between reserving and certifying, a
lease that lapses), no slot the runner did not compute is ever committed, and no reserved block
is leaked. One Llama family model (tests/support/families.py's) over a real pagedkvd (16
slots a block, 128 blocks), the engine in-process.
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

import pytest
from prometheus_client import CollectorRegistry

from pagedkv.client import History, PoolClient, SamplingParams, SeqStep, Session, SessionExpired
from pagedkv.model_runner.engine import holds
from pagedkv.model_runner.engine.forward_loop import Prepared
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.sequences import SeqState
from pagedkv.model_runner.engine.step_checks import check_writes
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.engine.steps import StepNotComputed
from pagedkv.model_runner.kernels.attention_backend import get_backend
from pagedkv.model_runner.runner import SequenceChunk

import families
from engine_driver import RecordingRunner, decode, new
from families import BLOCK_SIZE, NUM_BLOCKS, expected_tokens

FAMILY = "llama"
# The fixtures daemon and prompts are conftest.py's (the families' pool).


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


async def start_engine(client: PoolClient, registry: CollectorRegistry) -> StepEngine:
    runner = RecordingRunner.attach(families.paged_model(FAMILY), await client.pool_info(),
                                    get_backend("torch"))
    engine = StepEngine(client, runner, metrics=RunnerMetrics(registry))
    await engine.start()
    return engine


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
async def engine(runner_client: PoolClient,
                 registry: CollectorRegistry) -> AsyncIterator[StepEngine]:
    started = await start_engine(runner_client, registry)
    yield started
    await started.stop()


@pytest.fixture
def salt(request: pytest.FixtureRequest) -> str:
    """The test's own cache salt: no test is served another's blocks."""
    return str(request.node.name)


@pytest.fixture
async def app(client: PoolClient, salt: str) -> AsyncIterator[Session]:
    async with await client.open_session("app", cache_salt=salt) as opened:
        yield opened


async def cached(client: PoolClient, salt: str, tokens: Sequence[int]) -> int:
    """Leading tokens of `tokens` the prefix cache serves another session of the salt: the
    committed blocks (certified computed K/V) holding them."""
    async with await client.open_session("probe", cache_salt=salt) as probe:
        return (await probe.allocate(1, token_ids=tokens)).num_cached_tokens


async def nothing_leaked(client: PoolClient) -> None:
    """Every block is free again (or cached, which an allocation may take): no reserved block
    outlives its sequence."""
    assert (await client.stats()).free_blocks == NUM_BLOCKS


def daemon_calls(registry: CollectorRegistry) -> tuple[float, float]:
    """The runner's StepMany calls to the daemon, and the Step entries they carried."""
    count = registry.get_sample_value("pagedkv_runner:steps_per_daemon_call_count")
    total = registry.get_sample_value("pagedkv_runner:steps_per_daemon_call_sum")
    return count or 0.0, total or 0.0


async def test_sequences_at_different_offsets_share_one_call_per_reservation(
    app: Session, engine: StepEngine, registry: CollectorRegistry,
    prompts: list[tuple[int, ...]],
) -> None:
    """Four sequences at four offsets in their blocks decode 40 tokens each: the first decode
    step calls (the prefill's Batch reserved nothing), every sequence joins it, and they run
    low together: 2 calls of one Step entry each for 39 decode steps (one per token before),
    and the tokens transformers generates."""
    lengths = (3, 9, 14, 20)
    seqs = [(*prompts[2], *prompts[1])[:n] for n in lengths]
    decoded = await decode(engine, app.session_id,
                           [new(i, seq, greedy(40)) for i, seq in enumerate(seqs)], 40)
    for i, seq in enumerate(seqs):
        assert decoded[i].tokens == expected_tokens(FAMILY, seq, 40)
    # First call: every table covers n + 1 + 32 slots, 3 blocks past the prompt's; the
    # shortest reservation (n = 14: 48 slots, 33 tokens decoded into it) ends first.
    assert daemon_calls(registry) == (2.0, 2.0)


async def lockstep(engine: StepEngine, sessions: Sequence[Session],
                   prompts: Sequence[Sequence[int]], n: int, passes_apart: int) -> None:
    """Sequence 1 of each session (its prompt) decodes n tokens, the sessions stepping
    together: each round, every session's step is sent, each `passes_apart` event-loop passes
    after the one before (as steps arriving on several streams are), and the next round waits
    for every answer (they share forwards)."""
    async def send(index: int, requests: list[SeqStep], last: bool) -> int:
        for _ in range(index * passes_apart):
            await asyncio.sleep(0)
        outcome = await engine.step(sessions[index].session_id, requests,
                                    release=[1] if last else ())
        return outcome[0].token_id
    steps = [[new(1, prompt, greedy(n))] for prompt in prompts]
    for round_ in range(n):
        sampled = await asyncio.gather(*(send(i, requests, round_ == n - 1)
                                         for i, requests in enumerate(steps)))
        steps = [[SeqStep(1, (token,))] for token in sampled]


@pytest.fixture
def no_idle_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """No hold ends between rounds however slow the machine (a session whose hold ended
    calls at its next step, reservations.py): the daemon calls counted are the reservations'."""
    monkeypatch.setattr(holds, "IDLE_END_S", 3600.0)


async def test_sessions_at_different_offsets_join_one_call_per_reservation(
    client: PoolClient, app: Session, salt: str, engine: StepEngine, no_idle_end: None,
    registry: CollectorRegistry, prompts: list[tuple[int, ...]],
) -> None:
    """Two sessions, one sequence each at offsets 14 and 20 of their blocks, decode 50 tokens
    stepping together, the second's steps arriving one event-loop pass after the first's.
    Both call at the first decode step (the prefill reserved nothing): slots up to 48 and 64.
    At decode step 35 the first runs out; the second, 10 slots short of its end (less than
    LOW_BLOCKS blocks), joins its StepMany: 2 calls of 2 entries for 49 decode steps. Without
    joining the second would call alone at step 45: 3 calls."""
    base = (*prompts[2], *prompts[1])
    async with await client.open_session("other", cache_salt=salt) as other:
        await lockstep(engine, [app, other], [base[:14], base[:20]], 50, passes_apart=1)
    assert daemon_calls(registry) == (2.0, 4.0)


async def test_sessions_stepped_in_the_same_pass_join_one_call_per_reservation(
    client: PoolClient, app: Session, salt: str, engine: StepEngine, no_idle_end: None,
    registry: CollectorRegistry, prompts: list[tuple[int, ...]],
) -> None:
    """As above, both sessions' steps sent in the same event-loop pass (as the runner's own
    decode-ahead steps of one forward's sessions are): the same 2 calls of 2 entries."""
    base = (*prompts[2], *prompts[1])
    async with await client.open_session("other", cache_salt=salt) as other:
        await lockstep(engine, [app, other], [base[:14], base[:20]], 50, passes_apart=0)
    assert daemon_calls(registry) == (2.0, 4.0)


async def test_an_early_stop_commits_what_was_computed_never_the_token_decoded_past_it(
    client: PoolClient, app: Session, salt: str, engine: StepEngine,
    prompts: list[tuple[int, ...]],
) -> None:
    """A 20-token prompt decoded with decode_ahead: the client stops at its 28th token and
    releases; the runner had already appended that token ahead (position 47, the last slot of
    the third block) into its reservation and computed it. The release certifies and commits
    the 27 tokens the client's steps named (positions 20 to 46: two full blocks), never the
    block the overshoot would complete; the reservation goes back with the sequence."""
    prompt = prompts[2][:20]
    tokens = expected_tokens(FAMILY, prompt, 28)
    steps = [dataclasses.replace(new(1, prompt, greedy(40)), decode_ahead=True)]
    for token in tokens[:27]:
        outcome = await engine.step(app.session_id, steps)
        steps = [SeqStep(1, (outcome[0].token_id,), decode_ahead=True)]
        assert outcome[0].token_id == token
    last = await engine.step(app.session_id, steps)  # samples token 28: the client's stop
    assert last[0].token_id == tokens[27]
    await asyncio.gather(*engine._ahead_tasks)  # the runner appended it ahead, computed it
    await engine.step(app.session_id, [], release=[1])
    assert await cached(client, salt, (*prompt, *tokens)) == 2 * BLOCK_SIZE
    await nothing_leaked(client)


async def test_an_abort_mid_reservation_frees_the_reserved_blocks(
    client: PoolClient, app: Session, salt: str, engine: StepEngine,
    prompts: list[tuple[int, ...]],
) -> None:
    """Three sequences aborted (released) halfway into their reservations: what they computed
    is committed (the 16-slot blocks full of computed tokens), not a slot more, and every
    reserved block is free again."""
    seqs = [prompts[0], prompts[1], prompts[2][:30]]
    decoded = await decode(engine, app.session_id,
                           [new(i, seq, greedy(40)) for i, seq in enumerate(seqs)], 12)
    for i, seq in enumerate(seqs):
        held = (*seq, *decoded[i].tokens[:-1])  # the last sampled token was never appended
        assert await cached(client, salt, (*held, *decoded[i].tokens[-1:])) == (
            len(held) // BLOCK_SIZE * BLOCK_SIZE)
    await nothing_leaked(client)


async def test_a_runner_gone_between_reserving_and_certifying_leaves_nothing_committed(
    client: PoolClient, runner_client: PoolClient, app: Session, salt: str,
    engine: StepEngine, prompts: list[tuple[int, ...]],
) -> None:
    """The runner decodes 11 tokens of a 14-token prompt: its first decode call appended token
    1 and reserved slots 15 to 46; tokens 2 to 10 went into them, computed, never certified.
    It goes away (no release). The daemon holds 15 tokens, commits none of the reserved slots
    (no block past the daemon's tokens is served from the cache); a restarted runner given the
    client's history appends the 9 tokens the daemon lacks, computes them again and goes on
    with transformers' tokens; its release leaves no block behind."""
    prompt = prompts[2][:14]
    expected = expected_tokens(FAMILY, prompt, 16)
    head = await decode(engine, app.session_id, [new(1, prompt, greedy(40))], 11,
                        release=False)
    assert head[1].tokens == expected[:11]
    await engine.stop()  # the runner is gone: no call certifies what it decoded
    table = (await app.block_tables([1]))[0]
    assert table.num_tokens == len(prompt) + 1
    assert len(table.block_ids) == 3  # 15 + 32 reserved slots
    assert await cached(client, salt, (*prompt, *expected[:11])) == 0  # no full block
    restarted = await start_engine(runner_client, CollectorRegistry())
    try:
        history = History((*prompt, *head[1].tokens[:10]), len(prompt), 0)
        resent = SeqStep(1, head[1].tokens[10:], params=greedy(40), history=history)
        tail = await decode(restarted, app.session_id, [resent], 5)
    finally:
        await restarted.stop()
    assert head[1].tokens + tail[1].tokens == expected
    await nothing_leaked(client)



async def test_a_lease_that_lapses_mid_reservation_frees_it_and_commits_nothing_more(
    client: PoolClient, salt: str, engine: StepEngine, prompts: list[tuple[int, ...]],
) -> None:
    """A client that dies (no KeepAlive of its own) with tokens decoded into its sequence's
    reservation, uncertified: once the session is idle the runner ends its hold, the lease
    lapses, and the daemon frees the sequence with its reserved blocks; nothing past what the
    runner's calls committed is ever served from the cache; the runner's next step of the
    session is SessionExpired and the runner forgets it."""
    dying = await client.open_session("dying", lease_ttl_ms=1000, cache_salt=salt,
                                      keep_alive=False)
    prompt = prompts[1]  # 17 tokens
    head = await decode(engine, dying.session_id, [new(1, prompt, greedy(40))], 8,
                        release=False)
    # The first decode call committed the prompt's full block; 7 tokens are uncertified.
    while (await client.stats()).free_blocks != NUM_BLOCKS:  # a call naming it renews it
        await asyncio.sleep(0.2)
    with pytest.raises(SessionExpired):
        await dying.block_tables([1])
    assert await cached(client, salt, (*prompt, *head[1].tokens)) == BLOCK_SIZE
    with pytest.raises(SessionExpired):
        await engine.step(dying.session_id, [SeqStep(1, head[1].tokens[-1:])])
    assert engine.sessions.get(dying.session_id) is None


async def test_no_forward_writes_past_the_daemons_tokens_and_the_reservation() -> None:
    """Defence in depth (check_writes): a sequence whose daemon holds 18 tokens and whose
    reservation ends at slot 32 may be computed up to position 31; a chunk reaching position 32
    (a slot the daemon never gave it) is refused before the forward."""
    state = SeqState(list(range(32)), 10, 18, [3, 4], committed=16)
    state.held, state.private_end = 18, 32
    inside = SequenceChunk(state.tokens[18:], 18, state.slots(18, 32, BLOCK_SIZE),
                           state.block_table)
    check_writes(Prepared("s", [SeqStep(1, (31,))], [state], [(0, inside)]))
    state.tokens.append(32)
    past = dataclasses.replace(inside, token_ids=state.tokens[18:],
                               slot_mapping=[*inside.slot_mapping, 5 * BLOCK_SIZE])
    with pytest.raises(StepNotComputed, match="past the 32 slots"):
        check_writes(Prepared("s", [SeqStep(1, (32,))], [state], [(0, past)]))
