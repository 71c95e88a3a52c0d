"""`restore = "auto"` across real `pagedkvd` processes under the fd-store supervisor, with what
the first restart snapshot did not keep: the host tier and models beyond the daemon's own.

- Host tier: blocks evicted to the host tier before SIGTERM are there after the restart (their
  slots' memory handed over like the pool's, their index in the snapshot) and a prompt's prefix
  is restored from them into the pool with the very bytes the first daemon's pool held.
- Two models on one pool (pages of 16 KiB; "half" takes 4 KiB blocks): both models' sessions,
  tables, cached prefixes, pages and runner targets come back.
"""

import mmap
from pathlib import Path

import numpy as np
from fd_store_supervisor import FdStoreSupervisor

from pagedkv.client import PoolClient

from pagedkvd_process import short_tmp_dir

BLOCK = 4
PREFIX = list(range(2 * BLOCK))  # two full blocks
HALF = dict(num_layers=1, num_kv_heads=2, head_dim=64, dtype="float32")


def mapped(folder: Path, nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """The daemon's shm file of `nbytes` (the pool's, told from the host tier's by its size),
    mapped as the test's runner would."""
    (path,) = [p for p in folder.glob("pagedkv-*.kv") if p.stat().st_size == nbytes]
    with path.open("r+b") as file:
        region = mmap.mmap(file.fileno(), nbytes)
    return region, np.frombuffer(region, dtype=np.uint8)


async def test_host_tier_copies_come_back_and_restore_the_same_bytes() -> None:
    args = ("--num-blocks", "8", "--block-size", str(BLOCK), "--host-tier-memory", "128KiB",
            "--restore", "auto")
    with short_tmp_dir() as folder:
        supervisor = FdStoreSupervisor(folder)
        try:
            with supervisor.start(*args, "--state-dir", str(folder / "state")) as first:
                async with await PoolClient.connect(first.unix_target) as client:
                    info = await client.pool_info()
                    per_block, rate = info.bytes_per_block, info.host_copy_bytes_per_s
                    assert info.host_tier_blocks == 16 and rate > 0
                    session = await client.open_session("c", cache_salt="team",
                                                        keep_alive=False)
                    table = (await session.allocate(1, token_ids=[*PREFIX, 99])).block_ids
                    region, pool = mapped(folder, 8 * per_block)
                    written = np.random.default_rng(0).integers(0, 256, 2 * per_block,
                                                                dtype=np.uint8)
                    for i, block in enumerate(table[:2]):  # the runner's forward, by hand
                        pool[block * per_block:(block + 1) * per_block] = \
                            written[i * per_block:(i + 1) * per_block]
                    await session.commit([1])
                    await session.free(1)
                    await session.allocate(2, token_ids=[7] * (8 * BLOCK))  # evicts PREFIX
                    pool[:] = 0xEE  # seq 2's forward (after the answer: PREFIX copied out)
                    del pool
                    region.close()
                    await session.free(2)
                    client.forget(session)
                assert supervisor.stop(first) == 0
            assert sorted(name.split(".")[0] for name in supervisor.names()) == [
                "pagedkv-host", "pagedkv-pool"]

            with supervisor.start(*args, "--state-dir", str(folder / "state")) as second:
                assert '"event": "restart snapshot restored"' in second.stderr()
                async with await PoolClient.connect(second.unix_target) as client:
                    info = await client.pool_info()
                    assert info.host_copy_bytes_per_s == rate  # kept, not measured again
                    other = await client.open_session("d", cache_salt="team", keep_alive=False)
                    got = await other.allocate(1, token_ids=[*PREFIX, 5])
                    assert got.num_cached_tokens == 2 * BLOCK  # restored from the host tier
                    await other.block_tables([1])  # the answer waited for the copies
                    region, pool = mapped(folder, 8 * per_block)
                    kept = np.concatenate([pool[b * per_block:(b + 1) * per_block]
                                           for b in got.block_ids[:2]])
                    assert np.array_equal(kept, written)
                    del pool, kept
                    region.close()
                assert supervisor.stop(second) == 0
        finally:
            supervisor.close()


async def test_two_models_sessions_and_pages_come_back() -> None:
    args = ("--num-blocks", "16", "--block-size", str(BLOCK), "--page-size", "16KiB",
            "--restore", "auto")
    with short_tmp_dir() as folder:
        supervisor = FdStoreSupervisor(folder)
        try:
            with supervisor.start(*args, "--state-dir", str(folder / "state")) as first:
                async with await PoolClient.connect(first.runners_target) as runner:
                    await runner.register_model("half", **HALF,
                                                runner_target="unix:///half.sock")
                async with await PoolClient.connect(first.unix_target) as client:
                    kept = {}
                    for model in ("", "half"):
                        session = await client.open_session(f"s-{model}", cache_salt="team",
                                                            model=model, keep_alive=False)
                        blocks = await session.allocate(1, token_ids=[*PREFIX, 1])
                        await session.commit([1])
                        kept[model] = (session.session_id, blocks.block_ids)
                        client.forget(session)
                    before = await client.stats()
                assert supervisor.stop(first) == 0

            with supervisor.start(*args, "--state-dir", str(folder / "state")) as second:
                assert '"event": "restart snapshot restored"' in second.stderr()
                async with await PoolClient.connect(second.unix_target) as client:
                    after = await client.stats()
                    assert [(m.name, m.used_blocks, m.cached_blocks, m.format_pages)
                            for m in after.models] == [
                        (m.name, m.used_blocks, m.cached_blocks, m.format_pages)
                        for m in before.models]
                    for model, (session_id, block_ids) in kept.items():
                        again = client.attach(session_id, BLOCK)
                        (table,) = await again.block_tables([1], token_ids=True)
                        assert table.block_ids == block_ids
                        assert table.token_ids == [*PREFIX, 1]
                        other = await client.open_session(f"new-{model}", cache_salt="team",
                                                          model=model, keep_alive=False)
                        hit = await other.allocate(1, token_ids=PREFIX)
                        assert hit.num_cached_tokens == 2 * BLOCK  # its model's prefix
                        assert hit.block_ids == block_ids[:2]
                async with await PoolClient.connect(second.runners_target) as runner:
                    info = await runner.register_model("half", **HALF,
                                                       runner_target="unix:///half.sock")
                    assert (info.bytes_per_block, info.blocks_per_page) == (4096, 4)
                assert supervisor.stop(second) == 0
        finally:
            supervisor.close()
