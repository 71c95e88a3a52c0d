"""Memory work off the event loop and off the pool lock, ordered per block, fail-stop.

A real in-process daemon (gRPC over a unix socket) over real CPU pool memory, wrapped so a test
can hold a copy-on-write copy or a zeroing at a gate (slow work, like 64 copies of Llama-8B
blocks) or make it fail (a device error). The rules checked (memory_order.py):
- a slow copy or zeroing blocks neither the event loop nor another session's calls that touch
  none of its blocks: they are answered while it is held;
- a call touching a block with work in flight (its table, a block it writes, a copy's source
  or destination, a freed block being zeroed and handed out again) waits for that work, and
  its own work on the block runs after it;
- the answer leaves only once the copies are done and the memory synchronized; a call cancelled
  meanwhile still waits for its work;
- memory work that fails stops the pool: that call, calls waiting on its blocks and every later
  call get INTERNAL.
"""

import asyncio
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch

from pagedkv.client import PagedKVError, PoolClient, Session
from pagedkv.daemon.core import BlockCopy, BlockPool
from pagedkv.daemon.memory.kv_memory import KVPoolMemory
from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.process.server import serve
from pagedkv.daemon.service.errors import MemoryFailed
from pagedkv.daemon.service.memory_order import (
    Copy,
    FromHost,
    MemoryWork,
    ToHost,
    Zero,
    ZeroHost,
)
from pagedkv.daemon.service.operations import Allocate, Fork
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.memory import PoolMemoryHandle
from pagedkv.memory.attach import attach_pool
from pagedkv.vocab.geometry import resolve_geometry

from daemon_harness import Daemon, running_daemon


@dataclass
class GatedMemory:
    """Real pool memory whose copies wait at `gate` (when set up) or fail (when `fail`)."""

    # The real memory the work lands in.
    inner: KVPoolMemory
    # Closed gate: copies wait until the test opens it (only those into `gated`, if given).
    gate: threading.Event | None = None
    gated: frozenset[int] = frozenset()
    # Closed gate: zeroing waits until the test opens it.
    zero_gate: threading.Event | None = None
    # Copies and zeroing raise, as after a device error.
    fail: bool = False
    # Set when a copy has started (on the memory worker thread).
    started: threading.Event = field(default_factory=threading.Event)
    # Set when a zeroing has started.
    zeroing: threading.Event = field(default_factory=threading.Event)
    # What was done, in order: ("copy" | "zero" | "sync", thread name).
    log: list[tuple[str, str]] = field(default_factory=list)

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int], /) -> None:
        if self.gate is not None and (not self.gated or self.gated & set(dst)):
            self.started.set()
            assert self.gate.wait(10), "the test never opened the gate"
        self._do("copy")
        self.inner.copy_blocks(src, dst)

    def zero_blocks(self, ids: Sequence[int], /) -> None:
        self.zeroing.set()
        if self.zero_gate is not None:
            assert self.zero_gate.wait(10), "the test never opened the gate"
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


async def applied(condition: Callable[[], bool]) -> None:
    """Until the daemon has applied what the test sent (the calls then wait, if at all, for
    memory work alone); fails if it never does (a call waits for the pool)."""
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the daemon did not apply the calls")


async def test_a_step_touching_no_busy_block_is_answered_while_another_sessions_copy_is_held(
        daemon: Daemon, client: PoolClient) -> None:
    gate = threading.Event()
    memory = gate_memory(daemon, gate=gate)
    heavy = await client.open_session("heavy")
    light = await client.open_session("light", lease_ttl_ms=300, keep_alive=False)
    await forked_pair(heavy)
    step = asyncio.create_task(heavy.step([2]))  # copies block 0 into block 1
    assert await asyncio.to_thread(memory.started.wait, 10)  # the copy is held at the gate
    assert await light.keep_alive() == 300
    # Before per-block ordering these waited behind the copy (the gate's assertion failed).
    assert (await light.allocate(1, 4)).block_ids == [2]
    assert (await light.step([1])).slot_mapping == [12]  # block 3: a new one
    assert not step.done()
    gate.set()
    assert [(c.src, c.dst) for c in (await step).copies] == [(0, 1)]
    assert daemon.service.lease_expiries_total == 0
    assert [what for what, _ in memory.log] == ["copy", "sync"]
    assert all(thread.startswith("pagedkv-memory") for _, thread in memory.log)
    daemon.service.check_invariants()


async def test_a_copy_on_other_blocks_runs_beside_a_held_copy(
        daemon: Daemon, client: PoolClient) -> None:
    gate = threading.Event()
    memory = gate_memory(daemon, gate=gate, gated=frozenset({1}))
    heavy = await client.open_session("heavy")
    light = await client.open_session("light")
    await forked_pair(heavy)
    step = asyncio.create_task(heavy.step([2]))  # copies block 0 into block 1: held
    assert await asyncio.to_thread(memory.started.wait, 10)
    await forked_pair(light)  # block 2, shared
    # Its own copy runs on another worker (one worker: it waited, the gate's assertion failed).
    assert [(c.src, c.dst) for c in (await light.step([2])).copies] == [(2, 3)]
    assert not step.done()
    gate.set()
    await step
    daemon.service.check_invariants()


async def test_calls_touching_a_block_being_copied_wait_for_the_copy(
        daemon: Daemon, client: PoolClient) -> None:
    gate = threading.Event()
    memory = gate_memory(daemon, gate=gate)
    session = await client.open_session("copier")
    await forked_pair(session)
    live = next(iter(daemon.service.sessions))
    step = asyncio.create_task(session.step([2]))  # copies block 0 (seq 1's) into block 1
    assert await asyncio.to_thread(memory.started.wait, 10)
    # Each of these touches a block of the copy: its destination (seq 2's table), its source
    # (seq 1 now writes into block 0 alone), the destination freed (and zeroed).
    read = asyncio.create_task(session.block_tables([2]))
    write = asyncio.create_task(session.step([1]))
    await applied(lambda: daemon.pool.num_tokens(live.key(1)) == 3 and live.in_flight == 3)
    free = asyncio.create_task(session.free(2))
    await applied(lambda: 2 not in live.seq_ids)
    assert not (step.done() or read.done() or write.done() or free.done())
    gate.set()
    await step
    assert [t.block_ids for t in await read] == [[1]]
    assert (await write).slot_mapping == [2]  # block 0, once the copy has read it
    assert await free == 1
    # The zeroing of the freed copy ran after the copy into it, never before.
    assert [what for what, _ in memory.log] == ["copy", "sync", "zero", "sync"]
    daemon.service.check_invariants()


async def test_a_block_being_zeroed_is_handed_out_only_with_its_zeroing_done(
        daemon: Daemon, client: PoolClient) -> None:
    gate = threading.Event()
    memory = gate_memory(daemon, zero_gate=gate)
    first = await client.open_session("first")
    second = await client.open_session("second")
    await first.allocate(1, 60)  # blocks 0-14
    await second.allocate(1, 3)  # block 15: the pool is full
    freeing = asyncio.create_task(first.free(1))  # blocks 0-14 zeroed, held at the gate
    assert await asyncio.to_thread(memory.zeroing.wait, 10)
    assert (await second.step([1])).slot_mapping == [63]  # its own block: answered at once
    live = next(s for s in daemon.service.sessions if s.client_name == "second")
    taking = asyncio.create_task(second.allocate(2, 4))  # gets a block being zeroed
    stepping = asyncio.create_task(second.step([1]))  # block 15 is full: so does its next one
    await applied(lambda: 2 in live.seq_ids and live.in_flight == 2)
    assert not (taking.done() or stepping.done() or freeing.done())
    gate.set()
    assert await freeing == 15
    assert (await taking).block_ids[0] in range(15)
    assert (await stepping).slot_mapping[0] // 4 in range(15)
    assert [what for what, _ in memory.log] == ["zero", "sync"]
    daemon.service.check_invariants()


async def test_a_cancelled_call_still_waits_for_its_memory_work(daemon: Daemon) -> None:
    gate = threading.Event()
    memory = gate_memory(daemon, gate=gate)
    service = daemon.service
    sid = service.open_session("cancelled").session_id
    await service.allocate(sid, Allocate(1, 2))
    await service.fork(sid, Fork(1, 2))
    step = asyncio.create_task(service.step(sid, [2]))
    assert await asyncio.to_thread(memory.started.wait, 10)
    step.cancel()  # its deadline passed
    for _ in range(10):
        await asyncio.sleep(0)
    assert not step.done()  # still waiting for the copy it started
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await step
    assert memory.log[0][0] == "copy"
    # It was applied (a lost answer: the client reads it back).
    (table,) = await service.block_tables(sid, [2])
    assert (table.block_table, table.num_tokens) == ([1], 3)
    service.check_invariants()


async def test_the_answer_leaves_after_the_copy_is_in_memory(
        daemon: Daemon, client: PoolClient) -> None:
    assert daemon.memory is not None
    other_mapping = attach_pool(daemon.memory.handle())  # as a runner process maps it
    session = await client.open_session("reader")
    await forked_pair(session)
    other_mapping[0] = 7.0  # the runner wrote block 0's K/V
    step = await session.step([2])
    (copy,) = step.copies
    assert (copy.src, copy.dst) == (0, 1)
    assert bool((other_mapping[1] == 7.0).all())  # in place when the answer arrives


@pytest.mark.parametrize("call", ["step", "batch_free", "close"])
async def test_failed_memory_work_stops_the_pool(
        daemon: Daemon, client: PoolClient, call: str) -> None:
    session = await client.open_session("victim")
    other = await client.open_session("bystander")
    await forked_pair(session)
    await session.allocate(3, 5)
    memory = gate_memory(daemon, fail=True)
    with pytest.raises(PagedKVError) as failure:
        if call == "step":  # a copy-on-write copy fails
            await session.step([2])
        elif call == "batch_free":  # zeroing of the freed blocks fails
            await session.free(3)
        else:
            await session.close()
    assert failure.value.code == grpc.StatusCode.INTERNAL
    assert daemon.service.memory_order.failed.is_set()
    memory.fail = False  # even with the device back, the blocks' contents are unknown
    with pytest.raises(PagedKVError) as refused:
        await other.allocate(1, 4)
    assert refused.value.code == grpc.StatusCode.INTERNAL
    assert len(daemon.pool) == (3 if call == "step" else 2 if call == "batch_free" else 0)


async def test_calls_waiting_on_failed_work_fail_too(daemon: Daemon, client: PoolClient) -> None:
    gate = threading.Event()
    memory = gate_memory(daemon, gate=gate)
    session = await client.open_session("victim")
    await forked_pair(session)
    step = asyncio.create_task(session.step([2]))  # copies block 0 into block 1
    assert await asyncio.to_thread(memory.started.wait, 10)
    read = asyncio.create_task(session.block_tables([2]))  # waits for the copy into block 1
    live = next(iter(daemon.service.sessions))
    await applied(lambda: live.in_flight == 2)
    memory.fail = True
    gate.set()
    for call in (step, read):
        with pytest.raises(PagedKVError) as failure:
            await call
        assert failure.value.code == grpc.StatusCode.INTERNAL


async def test_pagedkvd_stops_when_memory_work_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve(), as pagedkvd runs it, drains and raises MemoryFailed (pagedkvd then exits with a
    failure status) once a copy fails; it is not asked to stop."""

    def lost(*_: object) -> None:
        raise RuntimeError("copy failed: device lost")

    monkeypatch.setattr(KVPoolMemory, "copy_blocks", lost)
    folder = Path(tempfile.mkdtemp(prefix="pkvf-"))  # short: unix socket paths are limited
    config = DaemonConfig(listen=(f"unix://{folder}/d.sock",), shm_dir=folder, num_blocks=64)
    served = asyncio.create_task(serve(config, asyncio.Event()))
    try:
        async with await PoolClient.connect(f"unix://{folder}/d.sock") as client:
            session = await client.open_session("victim")
            await forked_pair(session)
            with pytest.raises(PagedKVError) as failure:
                await session.step([2])
            assert failure.value.code == grpc.StatusCode.INTERNAL
        with pytest.raises(MemoryFailed, match="copy failed: device lost"):
            await served
    finally:
        served.cancel()
        shutil.rmtree(folder, ignore_errors=True)


# A runner process: maps the pool, waits for "go", prints whether the given blocks hold 7s.
READER = """
import pickle, sys
from pagedkv.memory.attach import attach_pool
kv = attach_pool(pickle.loads(bytes.fromhex(sys.stdin.readline().strip())))
print("attached", flush=True)
blocks = [int(b) for b in sys.stdin.readline().split()]
print(bool((kv[blocks] == 7).all()), flush=True)
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
        memory.kv[:64] = 7
        torch.cuda.synchronize()
        step = await service.step(sid, [100 + p for p in range(64)])
        reader.stdin.write(" ".join(str(copy.dst) for copy in step.copies) + "\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == "True"
        assert reader.wait(60) == 0
        await service.stop()


class RecordingMemory:
    """Pool and host memory that only records what it was asked, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int], list[int]]] = []
        self.num_slots = 4

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.calls.append(("copy", list(src), list(dst)))

    def zero_blocks(self, ids: Sequence[int]) -> None:
        self.calls.append(("zero", list(ids), []))

    def synchronize(self) -> None:
        self.calls.append(("sync", [], []))

    def to_host(self, blocks: Sequence[int], slots: Sequence[int]) -> None:
        self.calls.append(("to_host", list(blocks), list(slots)))

    def from_host(self, slots: Sequence[int], blocks: Sequence[int]) -> None:
        self.calls.append(("from_host", list(slots), list(blocks)))

    def zero(self, slots: Sequence[int]) -> None:
        self.calls.append(("zero_host", list(slots), []))


def test_memory_work_is_typed_steps_done_in_order() -> None:
    """Each kind of work is a typed step naming its blocks and slots; empty ones are skipped,
    and the work runs in the order it was recorded, then synchronizes once."""
    work = MemoryWork()
    work.copy([BlockCopy(1, 2)])
    work.zero([3])
    work.zero([])  # nothing: no step
    work.to_host([4], [0])
    work.from_host([1], [5])
    work.zero_host([2])
    assert work.steps == [Copy([1], [2]), Zero([3]), ToHost([4], [0]), FromHost([1], [5]),
                          ZeroHost([2])]
    assert work.blocks() == [1, 2, 3, 4, 5]  # what MemoryOrder orders the work by
    assert work.host_slots() == [0, 1, 2]
    memory = RecordingMemory()
    work.perform(memory, memory)
    assert memory.calls == [("copy", [1], [2]), ("zero", [3], []), ("to_host", [4], [0]),
                            ("from_host", [1], [5]), ("zero_host", [2], []), ("sync", [], [])]
