"""The runner follows the engine's session (runner.proto's `follow`): while the engine's next
plan is the same decode step again, the runner takes it by itself and pushes its answer.

A real `pagedkvd` and `pagedkv runner` (conftest.py's roomy pool), the engine in
this process, against transformers on the same model; the same requests with following off
are the baseline the tokens must equal.
"""

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from pagedkv.client import SamplingParams
from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.outputs import StepRecord
from pagedkv.client.engine.scheduler import SchedulerConfig

from client_engine_model import PROMPTS
from pagedkvd_process import Pagedkvd, pagedkv_runner, short_tmp_dir
from served_model import hf_greedy

# The module fixtures config_path, reference and roomy are conftest.py's.

NEW_TOKENS = 16
LONG_TOKENS = 64
STAGGERED = [SamplingParams(temperature=0.0, max_tokens=m) for m in (3, 16, 9, 16, 5, 12, 16, 7)]
LEASE_MS = 60_000


async def engine_for(pools: tuple[Pagedkvd, Pagedkvd], follow: bool = True) -> Engine:
    daemon, runner = pools
    return await Engine.connect(daemon.unix_target, runner.unix_target,
                                config=SchedulerConfig(follow=follow))


async def test_the_runner_steps_a_batch_by_itself_with_transformers_tokens(
        roomy: tuple[Pagedkvd, Pagedkvd], reference: PreTrainedModel) -> None:
    """Eight requests finishing at different lengths: most steps are the runner's own (pushed),
    each request gets transformers' greedy tokens and stops where its max_tokens says, and
    every sequence is freed at the end."""
    async with await engine_for(roomy) as engine:
        records: list[StepRecord] = []
        engine.observers.append(records.append)
        outputs = await asyncio.gather(*(engine.generate(p, params)
                                         for p, params in zip(PROMPTS, STAGGERED, strict=True)))
        pushed, steps = engine.num_pushed, engine.num_steps
        stats = (await engine.session.stats()).session
    for prompt, params, output in zip(PROMPTS, STAGGERED, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(reference, prompt,
                                                              params.max_tokens)
    # 16 decode steps at most; the engine sent the first, one per finishing request, and one
    # after each refusal as stale: the rest were pushed.
    assert pushed >= steps // 2 > 0
    assert stats is not None and (stats.num_sequences, stats.blocks_held) == (0, 0)


async def test_following_off_sends_every_step_and_gives_the_same_tokens(
        roomy: tuple[Pagedkvd, Pagedkvd]) -> None:
    """The baseline: seeded sampling gives the same tokens whether the runner follows or the
    engine sends every step (SchedulerConfig.follow=False: nothing is pushed)."""
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=NEW_TOKENS)
    results = {}
    for follow in (True, False):
        async with await engine_for(roomy, follow) as engine:
            outputs = await asyncio.gather(*(engine.generate(p, sampled) for p in PROMPTS[:4]))
            results[follow] = [list(o.outputs[0].token_ids) for o in outputs]
            assert (engine.num_pushed > 0) is follow
    assert results[True] == results[False]


async def test_requests_arriving_while_the_runner_follows(
        roomy: tuple[Pagedkvd, Pagedkvd], reference: PreTrainedModel) -> None:
    """Requests that arrive one by one while others decode change the plan: the engine sends
    it (refused as stale when the runner pushed meanwhile, then sent again) and the runner
    follows the larger batch; every request gets transformers' tokens."""
    async with await engine_for(roomy) as engine:
        tasks = []
        for prompt in PROMPTS:
            tasks.append(asyncio.create_task(engine.generate(prompt, STAGGERED[1])))
            await asyncio.sleep(0.02)
        outputs = await asyncio.gather(*tasks)
        assert engine.num_pushed > 0
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(reference, prompt, NEW_TOKENS)


async def test_a_request_left_while_the_runner_follows_is_freed(
        roomy: tuple[Pagedkvd, Pagedkvd], reference: PreTrainedModel) -> None:
    """A stream left after three outputs aborts its request: its sequence is released (the
    engine's message stops the following) and the others go on with transformers' tokens."""
    async with await engine_for(roomy) as engine:
        others = [asyncio.create_task(engine.generate(p, STAGGERED[1])) for p in PROMPTS[1:4]]
        seen = 0
        async for _ in engine.stream(PROMPTS[0], STAGGERED[1]):
            seen += 1
            if seen == 3:
                break
        outputs = await asyncio.gather(*others)
        stats = (await engine.session.stats()).session
    for prompt, output in zip(PROMPTS[1:4], outputs, strict=True):
        assert list(output.outputs[0].token_ids) == hf_greedy(reference, prompt, NEW_TOKENS)
    assert stats is not None and stats.num_sequences == 0


@pytest.fixture
def listen() -> Iterator[str]:
    """A runner socket path that outlives one runner process."""
    with short_tmp_dir() as folder:
        yield f"unix://{folder / 'runner.sock'}"


async def test_a_runner_killed_while_following_recomputes_the_followed_requests(
        roomy: tuple[Pagedkvd, Pagedkvd], config_path: Path, reference: PreTrainedModel,
        listen: str) -> None:
    """SIGKILL the runner while it follows four decoding requests, submit a fifth (the engine
    meets the dead runner either waiting for a push or sending the changed plan, whichever
    comes first) and start another runner on the same socket: the pushes the dead one sent last
    may be lost, so the engine releases the followed requests through the new runner and
    computes them again from the tokens it read (a preemption each; the lost plan is not resent
    with histories, which the daemon may have outgrown); every request ends with
    transformers' tokens, nothing left held."""
    daemon, _ = roomy
    # Long enough that the runner is still following when the client sees 4 tokens, however
    # many steps a lagging stream's push carries.
    params = SamplingParams(temperature=0.0, max_tokens=LONG_TOKENS)
    killed = False
    with contextlib.ExitStack() as runners:
        first = runners.enter_context(pagedkv_runner(daemon, "--random-init", str(config_path),
                                                     listen=listen))
        async with await Engine.connect(daemon.unix_target, listen,
                                        lease_ttl_ms=LEASE_MS) as engine:
            others = [asyncio.create_task(engine.generate(p, params)) for p in PROMPTS[1:4]]
            async for output in engine.stream(PROMPTS[0], params):
                # The runner steps them by itself now.
                if not killed and len(output.outputs[0].token_ids) >= 4 and \
                        engine.following.active:
                    killed = True
                    first.stop(signal.SIGKILL)
                    others.append(asyncio.create_task(engine.generate(PROMPTS[4], params)))
                    await asyncio.sleep(0.05)
                    runners.enter_context(pagedkv_runner(daemon, "--random-init",
                                                         str(config_path), listen=listen))
                final = output
            results = [final, *await asyncio.gather(*others)]
            stats = (await engine.session.stats()).session
    assert killed, "the runner never followed the requests"
    assert [result.num_preemptions for result in results] == [1, 1, 1, 1, 0]
    for prompt, result in zip(PROMPTS[:5], results, strict=True):
        assert list(result.outputs[0].token_ids) == hf_greedy(reference, prompt, LONG_TOKENS)
    assert stats is not None and stats.num_sequences == 0
