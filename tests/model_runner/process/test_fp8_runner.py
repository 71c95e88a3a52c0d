"""kv_cache_dtype fp8 through real processes: a daemon whose own model's format is fp8, a runner
that must say the same (a runner of the model's dtype is refused at registration, the error
naming both formats), and `LLM(kv_cache_dtype="fp8")` passing it to the daemon and the runner
it starts."""

import asyncio
from pathlib import Path

import pytest

from pagedkv.client import PoolClient
from pagedkv.llm import LLM, SamplingParams
from pagedkv.process.launch import READY_STATE, NoNotification, start_daemon, start_runner
from pagedkv.vocab.geometry import PRESETS

from pagedkvd_process import short_tmp_dir

MODEL = "tiny-llama"
BLOCK_SIZE = 16


def _fp32_block_bytes() -> int:
    return PRESETS[MODEL].geometry().bytes_per_block(BLOCK_SIZE, 4)


async def _pool_dtype(target: str) -> tuple[str, int]:
    pool = await PoolClient.connect(target)
    try:
        info = await pool.pool_info()
        return info.dtype, info.bytes_per_block
    finally:
        await pool.close()


def test_a_runner_must_match_the_daemons_fp8_format() -> None:
    with short_tmp_dir() as folder, start_daemon(
            Path(folder), "--model-config", MODEL, "--num-blocks", "32", "--kv-cache-dtype",
            "fp8") as daemon:
        daemon.wait_for_notification(READY_STATE)
        dtype, per_block = asyncio.run(_pool_dtype(daemon.unix_target))
        assert (dtype, per_block) == ("float8_e4m3fn", _fp32_block_bytes() // 4)
        with start_runner(daemon.runners_target, Path(folder), "--random-init",
                          MODEL) as runner:
            with pytest.raises(NoNotification) as refused:
                runner.wait_for_notification(READY_STATE)
            assert runner.wait_for_exit() != 0
        geometry = f"{PRESETS[MODEL].num_layers}x2x32"
        assert (f"registered with geometry {geometry}:float8_e4m3fn, not "
                f"{geometry}:float32") in str(refused.value)
        with start_runner(daemon.runners_target, Path(folder), "--random-init", MODEL,
                          "--kv-cache-dtype", "fp8") as runner:
            runner.wait_for_notification(READY_STATE)


async def _models(target: str) -> dict[str, tuple[str, int]]:
    pool = await PoolClient.connect(target)
    try:
        return {m.name: (m.dtype, m.blocks_per_page) for m in (await pool.pool_info()).models}
    finally:
        await pool.close()


def test_an_fp8_model_shares_the_pages_of_an_fp32_one() -> None:
    """Another name, another format: the fp8 model's blocks are a quarter of the fp32 model's,
    four to a page of the daemon's own model's block."""
    with short_tmp_dir() as folder, start_daemon(
            Path(folder), "--model-config", MODEL, "--num-blocks", "32") as daemon:
        daemon.wait_for_notification(READY_STATE)
        with start_runner(daemon.runners_target, Path(folder), "--random-init", MODEL,
                          "--kv-cache-dtype", "fp8", "--model-name", "fp8-twin") as runner:
            runner.wait_for_notification(READY_STATE)
            models = asyncio.run(_models(daemon.unix_target))
    assert models == {MODEL: ("float32", 1), "fp8-twin": ("float8_e4m3fn", 4)}


def test_llm_passes_kv_cache_dtype_to_what_it_starts() -> None:
    with LLM(model=MODEL, kv_cache_dtype="fp8", num_blocks=32, max_num_seqs=2) as llm:
        dtype, _ = asyncio.run(_pool_dtype(llm.daemon_target))
        [out] = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=8))
    assert dtype == "float8_e4m3fn"
    assert len(out.outputs[0].token_ids) == 8
