"""A runner across a daemon restarted by hand, with no fd store ($FDSTORE unset) and
`restore = "auto"`: the runner (`--keep-pool`) keeps a descriptor of the pool file and hands
it back to the next daemon (daemon/memory/pool_keepers.py), which adopts the memory and
restores the session as under the fd store. Real processes; the sequence half-generated before
the SIGTERM goes on with the tokens of a run with no restart."""

from pathlib import Path

import pytest
from fd_store_supervisor import restoring_daemon_args

from pagedkv.client import PoolClient, RunnerClient, SamplingParams, SeqStep

from pagedkvd_process import pagedkv_runner, pagedkvd, restarted, short_tmp_dir
from served_model import TINY, hf_greedy, reference_model, write_config

PROMPT = [5, 17, 33, 2, 9, 71]


async def test_the_runner_hands_the_pool_back_and_keeps_its_sequence(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    config = str(write_config(TINY, tmp_path_factory))
    with short_tmp_dir() as folder:
        args = restoring_daemon_args(config, folder)
        with pagedkvd(*args, workdir=folder) as first, pagedkv_runner(
                first, "--random-init", config, "--keep-pool") as runner_process:
            async with await RunnerClient.connect(runner_process.unix_target) as runner:
                old_pool = (await runner.info()).pool_id
                async with await PoolClient.connect(first.unix_target) as pool:
                    session = await pool.open_session("kept", lease_ttl_ms=60_000,
                                                      keep_alive=False)
                    (out,) = await runner.step(session, [SeqStep(
                        1, PROMPT, True, params=SamplingParams(temperature=0))])
                    tokens = [out.token_id]
                    pool.forget(session)  # left open: the restart cuts its client off
                assert first.stop() == 0
                assert '"event": "pool file left for the runners to hand back"' in first.stderr()
                async with restarted(first, runner, old_pool, *args) as second:
                    log = second.stderr()
                    assert '"event": "pool descriptor taken back from a runner"' in log
                    assert '"event": "restart snapshot restored"' in log
                    async with await PoolClient.connect(second.unix_target) as pool:
                        assert (await pool.pool_info()).previous_pool_id == old_pool
                        again = pool.attach(session.session_id, session.block_size)
                        for _ in range(2):
                            (out,) = await runner.step(again, [SeqStep(1, [out.token_id])])
                            tokens.append(out.token_id)
                    assert '"daemon restarted with its pool kept' in runner_process.stderr()
                    assert second.stop() == 0
    assert tokens == hf_greedy(reference_model(Path(config)), PROMPT, 3)


async def test_without_a_keeping_runner_the_next_daemon_starts_cold(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    config = str(write_config(TINY, tmp_path_factory))
    with short_tmp_dir() as folder:
        args = restoring_daemon_args(config, folder)
        with pagedkvd(*args, workdir=folder) as first:
            assert first.stop() == 0
            assert not first.pool_files()  # nobody keeps it: removed as before
        with pagedkvd(*args, workdir=folder) as second:
            log = second.stderr()
            assert '"event": "pool descriptor taken back' not in log
            assert '"event": "restart snapshot refused: starting cold"' in log
            assert second.stop() == 0
