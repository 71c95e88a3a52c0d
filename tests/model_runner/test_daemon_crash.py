"""A daemon that crashes under an attached runner, and the space its pool held.

A CPU pool is a file in /dev/shm; its pages stay allocated for as long as any process maps
it, deleted or not. A runner that kept a crashed daemon's pool mapped until the new daemon
answered left a /dev/shm sized for one pool no room for the new one ("No space left on
device"). Real processes here: a `pagedkvd` killed with SIGKILL, a `pagedkv runner` whose
/proc/<pid>/maps must drop the old pool file, and a new daemon the runner then maps. The
daemon's message when the pool cannot be created is tested on its own.
"""

import asyncio
import errno
import mmap
import os
import signal
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from pagedkv.client import PoolClient, RunnerClient, SamplingParams, SeqStep
from pagedkv.daemon.memory.kv_memory import KVPoolMemory
from pagedkv.model_runner.engine.forward_loop import ForwardLoop, Prepared
from pagedkv.model_runner.engine.sampling import Sampler
from pagedkv.model_runner.engine.sequences import SeqState
from pagedkv.model_runner.runner import SequenceChunk
from pagedkv.vocab.geometry import ModelGeometry
from pagedkv.vocab.units import format_bytes

from pagedkvd_process import pagedkv_runner, pagedkvd, short_tmp_dir
from served_model import TINY, hf_greedy, reference_model, write_config

PROMPT = [5, 17, 33, 2, 9, 71]
GEOMETRY = ModelGeometry("test", num_layers=2, num_kv_heads=2, head_dim=16, num_params=None,
                         default_dtype="float32")


async def eventually(condition: Callable[[], Awaitable[bool]], timeout: float = 60.0) -> None:
    """Poll `condition` until true: a generous deadline, no assertion on how long it took."""
    for _ in range(int(timeout / 0.05)):
        if await condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


def maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


async def test_a_runner_unmaps_a_crashed_daemons_pool_and_maps_the_new_one(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    config = str(write_config(TINY, tmp_path_factory))
    args = ("--model-config", config, "--num-blocks", "64")
    with short_tmp_dir() as workdir, pagedkvd(*args, workdir=workdir) as first, \
            pagedkv_runner(first, "--random-init", config) as runner_process:
        pid = runner_process.process.pid
        (old_file,) = first.pool_files()
        async with await RunnerClient.connect(runner_process.unix_target) as runner:
            old_pool = (await runner.info()).pool_id
            assert str(old_file) in maps(pid)  # the runner computes in the daemon's pool

            first.send(signal.SIGKILL)
            assert await asyncio.to_thread(first.process.wait, 30) == -signal.SIGKILL

            async def unmapped() -> bool:
                return str(old_file) not in maps(pid)
            await eventually(unmapped)

            async def mapped_anew() -> bool:
                return (await runner.info()).pool_id != old_pool
            socket_path = Path(first.unix_target.removeprefix("unix://"))
            with pagedkvd(*args, workdir=workdir, listen_path=socket_path) as second:
                await eventually(mapped_anew)
                (new_file,) = second.pool_files()
                assert new_file != old_file and str(new_file) in maps(pid)
                async with await PoolClient.connect(second.unix_target) as pool, \
                        await pool.open_session("after-crash") as session:
                    (first_out,) = await runner.step(
                        session, [SeqStep(1, PROMPT, True, params=SamplingParams(temperature=0))])
                    (second_out,) = await runner.step(
                        session, [SeqStep(1, [first_out.token_id])], release=[1])
                assert second.stop() == 0
    reference = reference_model(Path(config))
    assert [first_out.token_id, second_out.token_id] == hf_greedy(reference, PROMPT, 2)


async def test_the_pool_is_released_between_forwards_never_under_one() -> None:
    """`between_forwards` runs on the forward thread after the forward in progress: a release
    never frees memory a running forward reads."""
    in_forward, finish = threading.Event(), threading.Event()
    order: list[str] = []

    class BlockedRunner:
        def step(self, chunks: object) -> None:
            in_forward.set()
            finish.wait(60)
            order.append("forward ended")
            raise RuntimeError("this forward is only a stand-in")

        def release_pool(self) -> None:
            order.append("pool released")

    runner = BlockedRunner()
    forwards = ForwardLoop(lambda: runner, Sampler())  # type: ignore[arg-type,return-value]
    await forwards.start()
    try:
        chunk = SequenceChunk(token_ids=(1,), start=0, slot_mapping=(0,), block_table=(0,))
        state = SeqState(tokens=[1], prompt_len=1, num_computed=0, block_table=[0])
        forward = asyncio.create_task(forwards.compute(Prepared("s", [], [state], [(0, chunk)])))
        assert await asyncio.to_thread(in_forward.wait, 60)
        release = asyncio.create_task(forwards.between_forwards(runner.release_pool))
        await asyncio.sleep(0.1)
        assert order == []  # the forward thread is busy with the forward
        finish.set()
        await release
        assert order == ["forward ended", "pool released"]
        with pytest.raises(RuntimeError, match="stand-in"):
            await forward
    finally:
        finish.set()
        await forwards.stop()


def no_space(fd: int, offset: int, length: int) -> None:
    """posix_fallocate on a full tmpfs."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_no_room_for_the_pool_names_the_free_space_the_size_and_the_likely_holder(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A full tmpfs: the error says how much is free, how much the pool needs, what probably
    holds the rest (here: this process, mapping a deleted pool file) and how to find it."""
    stale = tmp_path / "pagedkv-12345-00ff00ff00ff00ff.kv"
    stale.write_bytes(bytes(4096))
    # The file system as the error saw it (other processes change /tmp's free space meanwhile).
    space = os.statvfs(tmp_path)
    with stale.open("r+b") as file, mmap.mmap(file.fileno(), 4096):
        stale.unlink()  # as a new daemon removes a dead one's file
        monkeypatch.setattr(os, "posix_fallocate", no_space)
        monkeypatch.setattr(os, "statvfs", lambda path: space)
        with pytest.raises(OSError) as failure:
            KVPoolMemory.create(GEOMETRY, num_blocks=64, block_size=16, dtype="float32",
                                shm_dir=str(tmp_path))
    assert failure.value.errno == errno.ENOSPC
    needed = format_bytes(2 * 2 * 64 * 16 * 2 * 16 * 4)
    assert failure.value.strerror == (
        f"cannot reserve {needed} for the KV pool in {tmp_path}: No space left on device "
        f"({format_bytes(space.f_bavail * space.f_frsize)} free of "
        f"{format_bytes(space.f_blocks * space.f_frsize)}). The likely holder is a runner "
        "still mapping a previous daemon's pool (its pages stay allocated while mapped, even "
        f"deleted); pid {os.getpid()} maps {stale.name} (deleted)"
        f". Find it with `grep -l pagedkv /proc/*/maps` or `lsof +L1 {tmp_path}`; a runner "
        "unmaps a dead daemon's pool within seconds (else restart it), or give the tmpfs room "
        "for two pools")
    assert list(tmp_path.iterdir()) == []  # the new pool's file is removed


def test_other_failures_keep_the_short_message(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    def no_permission(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))
    monkeypatch.setattr(os, "posix_fallocate", no_permission)
    with pytest.raises(OSError, match=r"^\[Errno 1\] cannot reserve 8.19 KB for the KV pool "
                                      r"in .*: Operation not permitted$"):
        KVPoolMemory.create(GEOMETRY, num_blocks=1, block_size=16, dtype="float32",
                            shm_dir=str(tmp_path))


async def test_a_runner_whose_restarted_daemon_refuses_its_model_exits_saying_why(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The pool watcher re-registers the model after a daemon restart; a refusal there (here:
    the new daemon holds another geometry under the model's name) ends the runner with the
    bad-setting status and the reason, rather than leaving it refusing every step forever."""
    config = str(write_config(TINY, tmp_path_factory))
    other = str(write_config(TINY.__class__(**{**TINY.to_dict(), "num_hidden_layers": 3}),
                             tmp_path_factory))
    with short_tmp_dir() as workdir, \
            pagedkvd("--model-config", config, "--num-blocks", "64", workdir=workdir) as first, \
            pagedkv_runner(first, "--random-init", config) as runner_process:
        first.send(signal.SIGKILL)
        assert await asyncio.to_thread(first.process.wait, 30) == -signal.SIGKILL
        socket_path = Path(first.unix_target.removeprefix("unix://"))
        with pagedkvd("--model-config", other, "--num-blocks", "64", workdir=workdir,
                      listen_path=socket_path):
            assert await asyncio.to_thread(runner_process.process.wait, 60) == 2
        assert "refused to register model" in runner_process.stderr()
