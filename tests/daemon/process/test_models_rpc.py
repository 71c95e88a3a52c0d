"""Several models on one pool, over gRPC (kvpool.proto, "Models and pages"): pages between
formats, caps, min_memory, prefix namespaces, sleep and wake, and the refusals.

The pool: 16 blocks of the daemon's own model ("tiny": 2 layers, 2 KV heads of 64, float32,
block_size 4: 8 KiB a block) in 8 pages of 16 KiB (two own blocks a page). "half" (1 layer)
takes 4 KiB a block: 4 blocks a page, 32 block ids. Sessions of both allocate until the pool is
full, and every figure is asserted exactly.
"""

import asyncio
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pagedkv import client as c
from pagedkv.cli.main import main
from pagedkv.client import PoolClient
from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.process.server import pool_blocks_per_page, serve
from pagedkv.daemon.process.settings import ConfigError
from pagedkv.daemon.process.settings_sources import load_toml
from pagedkv.daemon.service.models import ModelPolicy

from daemon_harness import Daemon, running_daemon

PAGE = 16384
HALF = dict(num_layers=1, num_kv_heads=2, head_dim=64, dtype="float32")
TINY = dict(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
PROMPT = list(range(100, 108))  # two full blocks


@pytest.fixture
async def daemon(request: pytest.FixtureRequest) -> AsyncIterator[Daemon]:
    policies = getattr(request, "param", {})
    async with running_daemon(num_blocks=16, block_size=4, blocks_per_page=2,
                              model_policies=policies, max_models=4) as running:
        yield running


@pytest.fixture
async def runner(daemon: Daemon) -> AsyncIterator[PoolClient]:
    async with await PoolClient.connect(daemon.runners_target) as connected:
        yield connected


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[PoolClient]:
    async with await PoolClient.connect(daemon.unix_target) as connected:
        yield connected


async def figures(client: PoolClient) -> dict[str, tuple[int, int, int]]:
    """Each model's (used_blocks, cached_blocks, format_pages), from GetStats."""
    stats = await client.stats()
    return {m.name: (m.used_blocks, m.cached_blocks, m.format_pages) for m in stats.models}


async def test_pages_move_between_formats_as_each_needs_them(
        daemon: Daemon, runner: PoolClient, client: PoolClient) -> None:
    info = await runner.register_model("half", **HALF, runner_target="unix:///half.sock")
    assert (info.bytes_per_block, info.blocks_per_page, info.num_blocks) == (4096, 4, 32)
    a = await client.open_session("a", keep_alive=False)
    b = await client.open_session("b", keep_alive=False, model="half")
    assert (a.model, b.model) == ("tiny", "half")
    await a.allocate(1, 24)  # 6 own blocks: pages 0-2
    assert await figures(client) == {"tiny": (6, 0, 8), "half": (0, 0, 0)}
    # half has no page: it gets 2 idle pages of tiny (5 blocks take 2 pages of 4), never more.
    first = await b.allocate(1, 20)
    assert first.block_ids == [12, 13, 14, 15, 16]  # pages 3 and 4: half's blocks 12-19
    assert await figures(client) == {"tiny": (6, 0, 6), "half": (5, 0, 2)}
    await b.allocate(2, 48)  # 12 blocks: 3 free, 9 more take 3 pages (5, 6, 7)
    assert await figures(client) == {"tiny": (6, 0, 3), "half": (17, 0, 5)}
    daemon.service.check_invariants()
    # Full: tiny's pages hold its sequence, so half cannot grow; nothing changes.
    with pytest.raises(c.PoolExhausted):
        await b.allocate(3, 16)
    assert await figures(client) == {"tiny": (6, 0, 3), "half": (17, 0, 5)}
    # What tiny frees is half's at once.
    await a.free(1)
    await b.allocate(3, 16)  # 4 blocks: 3 free, one more page
    assert await figures(client) == {"tiny": (0, 0, 2), "half": (21, 0, 6)}
    await a.allocate(1, 16)  # tiny's 2 pages hold 4 blocks
    with pytest.raises(c.PoolExhausted):
        await a.allocate(2, 4)  # half's 6 pages all hold a used block: none is idle
    assert daemon.service.page_moves_total == 6
    daemon.service.check_invariants()


@pytest.mark.parametrize("daemon", [{"half": ModelPolicy(max_memory=6 * 4096)}], indirect=True)
async def test_a_model_at_its_cap_is_refused_and_gives_up_its_own_cache_first(
        daemon: Daemon, runner: PoolClient, client: PoolClient) -> None:
    await runner.register_model("half", **HALF)
    b = await client.open_session("b", keep_alive=False, model="half", cache_salt="s")
    await b.allocate(1, 20)  # 5 blocks of 6
    with pytest.raises(c.ModelAtCap) as refused:
        await b.allocate(2, 8)  # 7 > 6
    assert "'half'" in refused.value.message and "max_memory=24576" in refused.value.message
    assert await figures(client) == {"tiny": (0, 0, 6), "half": (5, 0, 2)}  # nothing changed
    await b.allocate(2, 4, token_ids=[1, 2, 3, 4])  # the 6th block, keyed
    await b.commit([2])
    await b.free(2)  # cached: still the model's memory
    assert (await figures(client))["half"] == (5, 1, 2)
    await b.allocate(3, 4, token_ids=[5, 6, 7, 8])  # at the cap: its cached block goes
    assert (await figures(client))["half"] == (6, 0, 2)
    daemon.service.check_invariants()


@pytest.mark.parametrize("daemon", [{"tiny": ModelPolicy(min_memory=4 * PAGE)}], indirect=True)
async def test_min_memory_keeps_its_pages_from_other_formats(
        daemon: Daemon, runner: PoolClient, client: PoolClient) -> None:
    await runner.register_model("half", **HALF)
    b = await client.open_session("b", keep_alive=False, model="half")
    await b.allocate(1, 48)  # 12 blocks: 3 pages of tiny's idle 8, above its reserve of 4
    with pytest.raises(c.PoolExhausted):
        await b.allocate(2, 32)  # 8 blocks: 2 more pages, tiny would keep 3 < 4
    assert await figures(client) == {"tiny": (0, 0, 5), "half": (12, 0, 3)}  # nothing moved
    await b.allocate(2, 16)  # one page more: tiny keeps its 4
    assert await figures(client) == {"tiny": (0, 0, 4), "half": (16, 0, 4)}
    daemon.service.check_invariants()


@pytest.mark.parametrize("daemon", [{"half": ModelPolicy(min_memory=4 * PAGE)}], indirect=True)
async def test_min_memory_is_the_models_own_before_it_registers(
        daemon: Daemon, runner: PoolClient, client: PoolClient) -> None:
    a = await client.open_session("a", keep_alive=False)
    await a.allocate(1, 32)  # 8 blocks: the 4 pages tiny holds; half's 4 are parked
    with pytest.raises(c.PoolExhausted):
        await a.allocate(2, 4)
    assert await figures(client) == {"tiny": (8, 0, 4)}
    await runner.register_model("half", **HALF)
    assert await figures(client) == {"tiny": (8, 0, 4), "half": (0, 0, 4)}
    b = await client.open_session("b", keep_alive=False, model="half")
    await b.allocate(1, 64)  # 16 blocks: its 4 pages
    assert await figures(client) == {"tiny": (8, 0, 4), "half": (16, 0, 4)}
    assert daemon.service.page_moves_total == 0
    daemon.service.check_invariants()


async def test_models_of_one_geometry_share_a_format_but_never_a_prefix(
        daemon: Daemon, runner: PoolClient, client: PoolClient) -> None:
    info = await runner.register_model("tiny-ft", **TINY)
    assert info.format_pages == 8  # the daemon's own format
    own = await client.open_session("own", keep_alive=False, cache_salt="s")
    await own.allocate(1, 8, token_ids=PROMPT)
    await own.commit([1])
    await own.free(1)
    tuned = await client.open_session("ft", keep_alive=False, cache_salt="s", model="tiny-ft")
    miss = await tuned.allocate(1, 8, token_ids=PROMPT)  # same tokens, same salt: no hit
    assert miss.num_cached_tokens == 0
    await tuned.commit([1])
    await tuned.free(1)
    tuned_again = await client.open_session("ft2", keep_alive=False, cache_salt="s",
                                            model="tiny-ft")
    assert (await tuned_again.allocate(1, 8, token_ids=PROMPT)).num_cached_tokens == 8
    own_again = await client.open_session("own2", keep_alive=False, cache_salt="s")
    assert (await own_again.allocate(1, 8, token_ids=PROMPT)).num_cached_tokens == 8
    assert await figures(client) == {"tiny": (2, 0, 8), "tiny-ft": (2, 0, 8)}
    daemon.service.check_invariants()


async def test_sleep_drops_the_cache_closes_sessions_and_refuses_new_ones_until_woken(
        daemon: Daemon, runner: PoolClient, client: PoolClient) -> None:
    await runner.register_model("half", **HALF)
    b = await client.open_session("b", keep_alive=False, model="half", cache_salt="s")
    await b.allocate(1, 8, token_ids=PROMPT)
    await b.commit([1])
    await b.free(1)
    await b.allocate(2, 12)  # 3 blocks of its page's 4: one cached block evicted
    a = await client.open_session("a", keep_alive=False)
    await a.allocate(1, 4)
    assert await figures(client) == {"tiny": (1, 0, 7), "half": (3, 1, 1)}
    with pytest.raises(c.PermissionDenied):
        await client.set_model_state("half", True)  # not a runner
    asleep = await runner.set_model_state("half", True)
    assert asleep.asleep and (asleep.used_blocks, asleep.cached_blocks) == (0, 0)
    with pytest.raises(c.SessionNotFound):
        await b.allocate(3, 4)
    with pytest.raises(c.ModelAsleep) as refused:
        await client.open_session("b2", model="half", keep_alive=False)
    assert "half" in refused.value.message
    assert await figures(client) == {"tiny": (1, 0, 7), "half": (0, 0, 1)}  # tiny untouched
    await a.allocate(2, 4)
    await runner.set_model_state("half", False)
    woken = await client.open_session("b3", model="half", cache_salt="s", keep_alive=False)
    assert (await woken.allocate(1, 8, token_ids=PROMPT)).num_cached_tokens == 0  # dropped
    daemon.service.check_invariants()


async def test_sleep_waits_for_a_runner_hold(daemon: Daemon, runner: PoolClient,
                                             client: PoolClient) -> None:
    await runner.register_model("half", **HALF)
    b = await client.open_session("b", keep_alive=False, model="half")
    await b.allocate(1, 4)
    held = runner.attach(b.session_id, 4)
    await held.keep_alive(hold_ms=5000)
    with pytest.raises(c.SessionBusy):
        await runner.set_model_state("half", True)
    assert (await figures(client))["half"] == (1, 0, 1)  # nothing changed
    await held.keep_alive(end_hold=True)
    await runner.set_model_state("half", True)
    assert (await figures(client))["half"] == (0, 0, 1)


async def test_bad_registrations_are_refused_and_change_nothing(
        daemon: Daemon, runner: PoolClient, client: PoolClient) -> None:
    before = await figures(client)
    with pytest.raises(c.InvalidArgument) as odd:
        await runner.register_model("three", num_layers=3, num_kv_heads=2, head_dim=64,
                                    dtype="float32")  # 12288 bytes a block
    assert "12288" in odd.value.message and "page_bytes=16384" in odd.value.message
    with pytest.raises(c.PermissionDenied):
        await client.register_model("half", **HALF)  # not a runner
    with pytest.raises(c.InvalidArgument):
        await runner.register_model("bad name!", **HALF)
    with pytest.raises(c.InvalidArgument):
        await runner.register_model("x", **{**HALF, "dtype": "int3"})
    with pytest.raises(c.ModelExists) as taken:
        await runner.register_model("tiny", **HALF)  # the daemon's own, another geometry
    assert "tiny" in taken.value.message
    assert await figures(client) == before
    await runner.register_model("half", **HALF, runner_target="a")
    again = await runner.register_model("half", **HALF, runner_target="b")  # idempotent
    assert again.runner_target == "b"
    await runner.register_model("m3", **HALF)
    await runner.register_model("m4", **TINY)
    with pytest.raises(c.LimitExceeded) as full:
        await runner.register_model("m5", **HALF)
    assert "max_models=4" in full.value.message
    with pytest.raises(c.ModelNotFound) as unknown:
        await client.open_session("x", model="nobody", keep_alive=False)
    assert "'half', 'm3', 'm4', 'tiny'" in unknown.value.message or "half, m3, m4, tiny" in \
        unknown.value.message
    with pytest.raises(c.ModelNotFound):
        await runner.set_model_state("nobody", True)


async def test_pool_info_and_metrics_show_the_models(daemon: Daemon, runner: PoolClient,
                                                     client: PoolClient) -> None:
    await runner.register_model("half", **HALF)
    b = await client.open_session("b", keep_alive=False, model="half")
    await b.allocate(1, 20)
    info = await client.pool_info()
    assert (info.page_bytes, info.num_pages) == (PAGE, 8)
    assert [m.name for m in info.models] == ["tiny", "half"]
    mine = (await b.stats()).session
    assert mine is not None and mine.model == "half"
    registry: CollectorRegistry = daemon.registry
    sample = registry.get_sample_value
    assert sample("pagedkv:model_used_blocks", {"model_name": "half"}) == 5
    assert sample("pagedkv:model_memory_bytes", {"model_name": "half"}) == 5 * 4096
    assert sample("pagedkv:format_pages", {"format": "1x2x64:float32"}) == 2
    assert sample("pagedkv:format_pages", {"format": "2x2x64:float32"}) == 6
    assert sample("pagedkv:page_moves_total") == 2
    # A Step's free_blocks is of the session's format: half's 2 free blocks (its seq took a
    # sixth block) and 4 for each of the 6 pages tiny could surely give (none holds a block).
    await b.step([1])
    assert client.free_blocks == 2 + 6 * 4
    a = await client.open_session("a", keep_alive=False)
    await a.allocate(1, 4)
    await a.step([1])
    assert client.free_blocks == 10  # tiny's own: 12 blocks in 6 pages, two used


async def test_pagedkv_model_sleeps_wakes_and_lists_over_the_runner_socket(
        daemon: Daemon, runner: PoolClient, client: PoolClient,
        capsys: pytest.CaptureFixture[str]) -> None:
    await runner.register_model("half", **HALF)

    async def pagedkv(*argv: str) -> int:
        return await asyncio.to_thread(main, ["model", *argv])

    assert await pagedkv("sleep", "half", "--daemon", daemon.runners_target) == 0
    assert "half: 1x2x64 float32, asleep" in capsys.readouterr().out
    with pytest.raises(c.ModelAsleep):
        await client.open_session("b", model="half", keep_alive=False)
    assert await pagedkv("wake", "half", "--daemon", daemon.runners_target) == 0
    assert "half: 1x2x64 float32, awake" in capsys.readouterr().out
    assert await pagedkv("list", "--daemon", daemon.runners_target) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if "format pages" in line]
    assert [line.split(":")[0] for line in listed] == ["tiny", "half"]
    assert "awake" in listed[-1]
    assert await pagedkv("sleep", "nobody", "--daemon", daemon.runners_target) == 1
    assert "no model 'nobody' is registered" in capsys.readouterr().err
    assert await pagedkv("sleep", "half", "--daemon", daemon.unix_target) == 1  # no runner
    assert "for runners only" in capsys.readouterr().err
    assert await pagedkv("sleep", "--daemon", daemon.runners_target) == 2
    assert not (await figures(client))["half"][0]  # nothing was put to sleep by the refusals
    await client.open_session("b", model="half", keep_alive=False)


async def test_a_page_changing_format_is_zeroed_before_the_answer_in_one_arena() -> None:
    async with running_daemon(num_blocks=16, block_size=4, blocks_per_page=2,
                              with_memory=True) as daemon:
        assert daemon.memory is not None
        kv = daemon.memory.kv  # tiny's view: [16, 2, 2, 4, 2, 64] float32, 2 blocks a page
        kv.fill_(7.0)  # stale K/V everywhere
        async with await PoolClient.connect(daemon.runners_target) as runner, \
                await PoolClient.connect(daemon.unix_target) as client:
            info = await runner.register_model("half", **HALF)
            assert info.memory.kind == "shm" and list(info.memory.shape) == [32, 1, 2, 4, 2, 64]
            shown = (await client.pool_info()).models
            assert [m.memory.kind for m in shown] == ["", ""]  # views for runners only
            b = await client.open_session("b", keep_alive=False, model="half")
            first = await b.allocate(1, 20)  # pages 0 and 1 (tiny holds nothing): zeroed
            assert first.block_ids == [0, 1, 2, 3, 4]
            assert bool((kv[0:4] == 0).all())  # pages 0-1 in tiny's view: zero
            assert bool((kv[4:] == 7.0).all())  # the other pages untouched
            daemon.service.check_invariants()


async def test_pagedkvd_takes_page_size_and_model_tables_from_its_toml(tmp_path: Path) -> None:
    folder = Path(tempfile.mkdtemp(prefix="pkvm-"))  # short: unix socket paths are limited
    toml = tmp_path / "pagedkv.toml"
    toml.write_text(f'listen = "unix://{folder}/d.sock"\nshm_dir = "{folder}"\nnum_blocks = 16\n'
                    'page_size = "64KiB"\nmax_models = 2\n'  # tiny: 32 KiB a block of 16
                    '[models.half]\nmin_memory = "64KiB"\nmax_memory = "256KiB"\n')
    config = DaemonConfig(**load_toml(toml))
    stop = asyncio.Event()
    served = asyncio.create_task(serve(config, stop))
    try:
        async with await PoolClient.connect(f"unix://{folder}/pagedkvd-runners.sock") as runner:
            half = await runner.register_model("half", **HALF)
            assert (half.min_memory, half.max_memory, half.blocks_per_page) == (
                65536, 262144, 4)
            info = await runner.pool_info()
            assert (info.page_bytes, info.num_pages, info.num_blocks) == (65536, 8, 16)
            with pytest.raises(c.LimitExceeded):
                await runner.register_model("third", **HALF)  # max_models = 2
        stop.set()
        await served
    finally:
        served.cancel()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize(("toml", "message"), [
    ('[models.half]\nmin_memory = "2MiB"\nmax_memory = "1MiB"\n', "is above max_memory"),
    ("[models.half]\nmax_memroy = 1\n", "unknown key(s) max_memroy"),
    ('[models."bad name"]\nmax_memory = 1\n', "a model name is"),
    ('[models.half]\nmax_memory = "lots"\n', "models.half.max_memory"),
])
def test_bad_model_tables_are_refused_naming_the_key(tmp_path: Path, toml: str,
                                                     message: str) -> None:
    path = tmp_path / "pagedkv.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=re.escape(message)):
        DaemonConfig(**load_toml(path))


def test_a_page_size_the_model_does_not_divide_is_refused() -> None:
    config = DaemonConfig(page_size=48 * 1024)  # tiny: 32 KiB a block
    with pytest.raises(ConfigError, match="page_size=49152 is not a multiple"):
        pool_blocks_per_page(config, 32 * 1024)


async def test_a_batch_refused_after_its_pages_moved_moves_nothing(
        daemon: Daemon, runner: PoolClient, client: PoolClient) -> None:
    await runner.register_model("half", **HALF)
    b = await client.open_session("b", keep_alive=False, model="half")
    before = await figures(client)
    with pytest.raises(c.SequenceNotFound):  # op 0 took two pages of tiny, op 1 fails
        await b.batch([c.Allocate(1, 20), c.Free(99)])
    assert await figures(client) == before == {"tiny": (0, 0, 8), "half": (0, 0, 0)}
    assert daemon.service.page_moves_total == 0
    await b.batch([c.Allocate(1, 20), c.Allocate(2, 4)])  # 6 blocks: 2 pages
    assert await figures(client) == {"tiny": (0, 0, 6), "half": (6, 0, 2)}
    daemon.service.check_invariants()


@pytest.mark.parametrize("daemon", [{"half": ModelPolicy(min_memory=2 * PAGE)}], indirect=True)
async def test_pages_a_model_below_its_minimum_lacks_are_left_to_it(
        daemon: Daemon, runner: PoolClient, client: PoolClient) -> None:
    await runner.register_model("half", **HALF)  # holds no page yet; its minimum is 2
    await runner.register_model("third", num_layers=2, num_kv_heads=1, head_dim=64,
                                dtype="float32")  # 4 KiB blocks too, another geometry
    t = await client.open_session("t", keep_alive=False, model="third")
    await t.allocate(1, 96)  # 24 blocks: 6 of tiny's 8 idle pages, 2 left for half
    with pytest.raises(c.PoolExhausted):
        await t.allocate(2, 4)  # a 7th page would cut into half's minimum
    h = await client.open_session("h", keep_alive=False, model="half")
    await h.allocate(1, 32)  # its 2 pages
    assert await figures(client) == {"tiny": (0, 0, 0), "half": (8, 0, 2), "third": (24, 0, 6)}
    daemon.service.check_invariants()
