"""Memory work off the event loop, complete before the answer, undone with the call if it fails.

A real in-process daemon (gRPC over a unix socket) over real CPU pool memory, wrapped so a test
can hold a copy-on-write copy at a gate (a slow copy, like 64 copies of Llama-8B blocks) or make
it fail (a device error). The rules checked:
- a slow copy blocks neither the event loop (another client's KeepAlive is answered while it
  runs) nor another client's lease (a call queued behind it for several leases still succeeds);
- the answer leaves only once the copies are done and the memory synchronized;
- memory work that fails answers INTERNAL and leaves pool and session exactly as they were.
"""

import asyncio
import pickle
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from pagedkv.client import PagedKVError, PoolClient, Session
from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.memory.kv_memory import KVPoolMemory
from pagedkv.daemon.service.operations import Allocate, Fork
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.memory import PoolMemoryHandle
from pagedkv.memory.attach import attach_pool
from pagedkv.vocab.geometry import resolve_geometry

from daemon_harness import Daemon, running_daemon
from pool_state import pool_state


@dataclass
class GatedMemory:
    """Real pool memory whose copies wait at `gate` (when set up) or fail (when `fail`)."""

    # The real memory the work lands in.
    inner: KVPoolMemory
    # Closed gate: copies wait until the test opens it.
    gate: threading.Event | None = None
    # Copies and zeroing raise, as after a device error.
    fail: bool = False
    # Set when a copy has started (on the memory worker thread).
    started: threading.Event = field(default_factory=threading.Event)
    # What was done, in order: ("copy" | "zero" | "sync", thread name).
    log: list[tuple[str, str]] = field(default_factory=list)

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int], /) -> None:
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10), "the test never opened the gate"
        self._do("copy")
        self.inner.copy_blocks(src, dst)

    def zero_blocks(self, ids: Sequence[int], /) -> None:
        self._do("zero")
        self.inner.zero_blocks(ids)

    def synchronize(self) -> None:
        self.log.append(("sync", threading.current_thread().name))
        self.inner.synchronize()

    def handle(self) -> PoolMemoryHandle:
        return self.inner.handle()

    def _do(self, what: str) -> None:
        if self.fail:
            raise RuntimeError(f"{what} failed: device lost")
        self.log.append((what, threading.current_thread().name))


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon(num_blocks=16, block_size=4, with_memory=True,
                              zero_freed_blocks=True) as running:
        yield running


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[PoolClient]:
    async with await PoolClient.connect(daemon.unix_target) as connected:
        yield connected


def gate_memory(daemon: Daemon, **options: object) -> GatedMemory:
    assert daemon.memory is not None
    memory = GatedMemory(daemon.memory, **options)  # type: ignore[arg-type]
    daemon.service.memory = memory
    return memory


async def forked_pair(session: Session) -> None:
    """Seq 1 with a half-full block, forked into seq 2: a step on 2 copies that block."""
    await session.allocate(1, 2)
    await session.fork(1, 2)


async def test_a_slow_copy_blocks_neither_the_loop_nor_another_clients_lease(
        daemon: Daemon, client: PoolClient) -> None:
    gate = threading.Event()
    memory = gate_memory(daemon, gate=gate)
    heavy = await client.open_session("heavy")
    light = await client.open_session("light", lease_ttl_ms=300, keep_alive=False)
    await forked_pair(heavy)
    step = asyncio.create_task(heavy.step([2]))
    assert await asyncio.to_thread(memory.started.wait, 10)  # the copy is running
    assert await light.keep_alive() == 300  # answered while the copy runs
    queued = asyncio.create_task(light.allocate(1, 4))  # waits for the pool behind the copy
    await asyncio.sleep(1.0)  # more than three of light's leases
    assert not step.done() and not queued.done()
    gate.set()
    assert [(c.src, c.dst) for c in (await step).copies] == [(0, 1)]
    assert (await queued).num_tokens == 4  # its lease was renewed on arrival, held while queued
    assert await light.keep_alive() == 300
    assert daemon.service.lease_expiries_total == 0
    assert [what for what, _ in memory.log] == ["copy", "sync"]
    assert all(thread.startswith("pagedkv-memory") for _, thread in memory.log)
    daemon.service.check_invariants()


async def test_the_answer_leaves_after_the_copy_is_in_memory(
        daemon: Daemon, client: PoolClient) -> None:
    assert daemon.memory is not None
    other_mapping = attach_pool(daemon.memory.handle())  # as a runner process maps it
    session = await client.open_session("reader")
    await forked_pair(session)
    other_mapping[:, :, 0] = 7.0  # the runner wrote block 0's K/V
    step = await session.step([2])
    (copy,) = step.copies
    assert (copy.src, copy.dst) == (0, 1)
    assert bool((other_mapping[:, :, 1] == 7.0).all())  # in place when the answer arrives


@pytest.mark.parametrize("call", ["step", "batch_free", "close"])
async def test_failed_memory_work_answers_internal_and_changes_nothing(
        daemon: Daemon, client: PoolClient, call: str) -> None:
    session = await client.open_session("victim")
    await forked_pair(session)
    await session.allocate(3, 5)
    memory = gate_memory(daemon, fail=True)
    service = daemon.service
    live = next(iter(service.sessions))
    before = (pool_state(daemon.pool), sorted(live.seq_ids), live.table_entries)
    with pytest.raises(PagedKVError) as failure:
        if call == "step":  # a copy-on-write copy fails
            await session.step([2])
        elif call == "batch_free":  # zeroing of the freed blocks fails
            await session.free(3)
        else:
            await session.close()
    assert failure.value.code == grpc.StatusCode.INTERNAL
    assert (pool_state(daemon.pool), sorted(live.seq_ids), live.table_entries) == before
    assert live in service.sessions
    memory.fail = False  # the device is back: the same call now goes through
    if call == "close":
        assert await session.close() == 3
    else:
        await session.step([2]) if call == "step" else await session.free(3)
    service.check_invariants()


# A runner process: maps the pool, waits for "go", prints whether the given blocks hold 7s.
READER = """
import pickle, sys
from pagedkv.memory.attach import attach_pool
kv = attach_pool(pickle.loads(bytes.fromhex(sys.stdin.readline().strip())))
print("attached", flush=True)
blocks = [int(b) for b in sys.stdin.readline().split()]
print(bool((kv[:, :, blocks] == 7).all()), flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_copies_are_visible_to_another_process_when_the_answer_leaves_cuda() -> None:
    """The CUDA twin of test_the_answer_leaves_after_the_copy_is_in_memory: 64 copy-on-write
    copies of Llama-8B blocks (2 MiB each) are asynchronous kernels; the daemon synchronizes
    before answering, so a runner process that reads right after the answer sees them."""
    geometry = resolve_geometry("llama-3.1-8b")
    with KVPoolMemory.create(geometry, 160, 16, "bfloat16", device="cuda") as memory:
        service = PoolService(BlockPool(160, 16), memory, pool_id="gpu")
        session = service.open_session("gpu")
        reader = subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert reader.stdin is not None and reader.stdout is not None
        reader.stdin.write(pickle.dumps(memory.handle()).hex() + "\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == "attached"
        sid = session.session_id
        for parent in range(64):  # 64 parents with a half-full block, each forked
            await service.allocate(sid, Allocate(parent, 8))
            await service.fork(sid, Fork(parent, 100 + parent))
        memory.kv[:, :, :64] = 7
        torch.cuda.synchronize()
        step = await service.step(sid, [100 + p for p in range(64)])
        reader.stdin.write(" ".join(str(copy.dst) for copy in step.copies) + "\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == "True"
        assert reader.wait(60) == 0
        await service.stop()
