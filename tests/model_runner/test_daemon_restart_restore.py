"""A runner across a daemon restart with `restore = "auto"`: real processes, the daemon under
a supervisor that emulates systemd's fd store (tests/support/fd_store_supervisor.py). The
next daemon adopts the pool memory and restores the session, and PoolInfo.previous_pool_id
names the old pool: the runner maps the same memory again and keeps its sequences, so a
sequence half-generated before the SIGTERM goes on with the tokens a run with no restart
gives."""

import asyncio
from pathlib import Path

import pytest
from fd_store_supervisor import FdStoreSupervisor, restoring_daemon_args

from pagedkv.client import PoolClient, RunnerClient, SamplingParams, SeqStep

from pagedkvd_process import pagedkv_runner, short_tmp_dir
from served_model import TINY, hf_greedy, reference_model, write_config

PROMPT = [5, 17, 33, 2, 9, 71]


async def test_a_runner_keeps_its_sequence_across_a_restored_restart(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    config = str(write_config(TINY, tmp_path_factory))
    with short_tmp_dir() as folder:
        args = restoring_daemon_args(config, folder)
        supervisor = FdStoreSupervisor(folder)
        try:
            first = supervisor.start(*args)
            with first, pagedkv_runner(first, "--random-init", config) as runner_process:
                async with await RunnerClient.connect(runner_process.unix_target) as runner:
                    old_pool = (await runner.info()).pool_id
                    async with await PoolClient.connect(first.unix_target) as pool:
                        session = await pool.open_session("kept", lease_ttl_ms=60_000,
                                                          keep_alive=False)
                        (out,) = await runner.step(session, [SeqStep(
                            1, PROMPT, True, params=SamplingParams(temperature=0))])
                        tokens = [out.token_id]
                        pool.forget(session)  # left open: the restart cuts its client off
                    assert supervisor.stop(first) == 0
                    with supervisor.start(*args) as second:
                        new_pool = await _mapped_anew(runner, old_pool)
                        async with await PoolClient.connect(second.unix_target) as pool:
                            assert (await pool.pool_info()).previous_pool_id == old_pool
                            again = pool.attach(session.session_id, session.block_size)
                            for _ in range(2):
                                (out,) = await runner.step(again, [SeqStep(1, [out.token_id])])
                                tokens.append(out.token_id)
                        assert new_pool != old_pool
                        assert '"daemon restarted with its pool kept' in runner_process.stderr()
                        assert supervisor.stop(second) == 0
        finally:
            supervisor.close()
    assert tokens == hf_greedy(reference_model(Path(config)), PROMPT, 3)


async def _mapped_anew(runner: RunnerClient, old_pool: str) -> str:
    """The runner's pool id once it is not `old_pool` (its watcher polls every second)."""
    for _ in range(600):
        pool_id = (await runner.info()).pool_id
        if pool_id != old_pool:
            return pool_id
        await asyncio.sleep(0.05)
    raise AssertionError(f"the runner still maps pool {old_pool}")
