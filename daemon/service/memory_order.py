"""Pool memory work ordered per block, run while the pool lock is free.

A call applies its change to the pool under the pool lock, synchronously, and then starts the
memory work the change owes (`MemoryWork`: typed steps, `Copy` for copy-on-write, `Zero`, and the
host tier's `ToHost`, `FromHost` and `ZeroHost`). It releases the lock
before the work runs, so another call is applied at once; only the memory work and the answers
are ordered, by the blocks they touch:

- A call's work runs after every earlier call's work on any block it copies from, copies to or
  zeroes (write after write, write after read, read after write), and likewise for the host
  tier's slots it copies to or from. Work on disjoint blocks runs
  on the worker threads side by side, off the event loop.
- A call's answer leaves once its own work is complete and synchronized (CUDA), and once every
  earlier call's work on the blocks the answer hands out (a table, the blocks a Step writes or
  reserves) is.
  A block freed with its zeroing pending goes back to the free list at once: the call that gets
  it waits for that zeroing before its answer leaves, and a copy into it, or its own zeroing,
  runs after. A copy's source or destination freed and handed out meanwhile is waited for alike.
  A call that touches no block with work in flight waits for nothing.

The runner writes a block only after an answer that handed it out, and that answer waited for
the block's work: so no memory work writes a block after someone else may own it.

A call cancelled by its deadline still waits for its memory work, and the work runs to its end.

Failure is fail-stop. A call's change is applied before its work runs, and later calls may
build on it (take the blocks it freed, share the ones it wrote), so it cannot be undone. Work
that fails (a device error: the ids were checked by the pool) leaves those blocks' contents
unknown: the call and every call waiting on its blocks get `MemoryFailed` (INTERNAL), and from
then on every call that touches the pool is refused with it, until the daemon restarts
(`failed` is set; `pagedkvd` stops on it and exits with a failure status).
"""

import asyncio
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pagedkv.daemon.core import BatchAppend, BlockCopy, SeqUpdate
from pagedkv.daemon.service.errors import MemoryFailed
from pagedkv.process.log_setup import get_logger

if TYPE_CHECKING:
    from pagedkv.memory import PoolMemoryHandle  # for the annotation below only

log = get_logger(__name__)

# Threads that run memory work. Work on disjoint blocks runs side by side, so one client's
# heavy copies or zeroing leave a light client's own small copy a thread of its own. They keep
# the event loop's CPU priority: at a lower one (nice 10, 19), a worker that holds the GIL
# between two torch calls and is then preempted by other processes stalls the loop until it
# runs again (bench_keepalive_stall.py saw a 2 s KeepAlive at nice 19 on a loaded machine),
# for no gain in the light client's latency.
MEMORY_WORKERS = 4


class BlockMemory(Protocol):
    """What the service needs from the pool memory (kv_memory.KVPoolMemory)."""

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int], /) -> None: ...

    def zero_blocks(self, ids: Sequence[int], /) -> None: ...

    def synchronize(self) -> None: ...

    def handle(self) -> "PoolMemoryHandle": ...


class HostMemory(Protocol):
    """What the service needs from the host tier's memory (host_memory.HostMemory)."""

    num_slots: int

    def to_host(self, blocks: Sequence[int], slots: Sequence[int], /) -> None: ...

    def from_host(self, slots: Sequence[int], blocks: Sequence[int], /) -> None: ...

    def zero(self, slots: Sequence[int], /) -> None: ...

    @property
    def adopted_from(self) -> str:
        """The id of the previous daemon's host memory this is ("": allocated here)."""

    @property
    def memory_id(self) -> str:
        """This host memory's id: what the restart snapshot names (service_image.py)."""


# The steps of memory work, each one call's worth of one kind, in pool blocks and host slots.
# `blocks()` and `slots()` name what it reads or writes (the keys `MemoryOrder` orders it by).

@dataclass(frozen=True, slots=True)
class Copy:
    """Copy-on-write: each pool block src[i] copied to dst[i]."""

    # Source and destination blocks, pairwise.
    src: list[int]
    dst: list[int]

    def blocks(self) -> list[int]:
        return self.src + self.dst

    def slots(self) -> list[int]:
        return []

    def perform(self, memory: BlockMemory, _host: HostMemory | None) -> None:
        memory.copy_blocks(self.src, self.dst)


@dataclass(frozen=True, slots=True)
class Zero:
    """Pool blocks zeroed (freed or evicted with zero_freed_blocks)."""

    # The blocks.
    ids: list[int]

    def blocks(self) -> list[int]:
        return self.ids

    def slots(self) -> list[int]:
        return []

    def perform(self, memory: BlockMemory, _host: HostMemory | None) -> None:
        memory.zero_blocks(self.ids)


@dataclass(frozen=True, slots=True)
class ToHost:
    """Pool blocks offloaded: block src[i] copied into host slot dst[i]."""

    # The pool blocks read, and the host slots written, pairwise.
    src: list[int]
    dst: list[int]

    def blocks(self) -> list[int]:
        return self.src

    def slots(self) -> list[int]:
        return self.dst

    def perform(self, _memory: BlockMemory, host: HostMemory | None) -> None:
        assert host is not None, "to-host work on a pool with no host tier"
        host.to_host(self.src, self.dst)


@dataclass(frozen=True, slots=True)
class FromHost:
    """Host slots restored: slot src[i] copied into pool block dst[i]."""

    # The host slots read, and the pool blocks written, pairwise.
    src: list[int]
    dst: list[int]

    def blocks(self) -> list[int]:
        return self.dst

    def slots(self) -> list[int]:
        return self.src

    def perform(self, _memory: BlockMemory, host: HostMemory | None) -> None:
        assert host is not None, "from-host work on a pool with no host tier"
        host.from_host(self.src, self.dst)


@dataclass(frozen=True, slots=True)
class ZeroHost:
    """Host slots zeroed (a dropped copy, with zero_freed_blocks)."""

    # The host slots.
    ids: list[int]

    def blocks(self) -> list[int]:
        return []

    def slots(self) -> list[int]:
        return self.ids

    def perform(self, _memory: BlockMemory, host: HostMemory | None) -> None:
        assert host is not None, "host zeroing on a pool with no host tier"
        host.zero(self.ids)


Step = Copy | Zero | ToHost | FromHost | ZeroHost


@dataclass(slots=True)
class MemoryWork:
    """Copies and zeroing a call owes pool memory, started once the call is applied and
    ordered with other calls' work by the blocks it touches (`MemoryOrder`).

    Order matters within a batch: a block freed (and zeroed) by one op may be the copy
    destination of a later one.
    """

    # The steps, in the order the pool made them (none empty).
    steps: list[Step] = field(default_factory=list)

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        if copies:
            self.steps.append(Copy([c.src for c in copies], [c.dst for c in copies]))

    def zero(self, blocks: list[int]) -> None:
        if blocks:
            self.steps.append(Zero(blocks))

    def to_host(self, blocks: list[int], slots: list[int]) -> None:
        if blocks:
            self.steps.append(ToHost(blocks, slots))

    def from_host(self, slots: list[int], blocks: list[int]) -> None:
        if slots:
            self.steps.append(FromHost(slots, blocks))

    def zero_host(self, slots: list[int]) -> None:
        if slots:
            self.steps.append(ZeroHost(slots))

    def blocks(self) -> list[int]:
        """Every pool block the work reads or writes (a block may appear more than once)."""
        return [block for step in self.steps for block in step.blocks()]

    def host_slots(self) -> list[int]:
        """Every host slot the work reads or writes."""
        return [slot for step in self.steps for slot in step.slots()]

    def perform(self, memory: BlockMemory, host: HostMemory | None = None) -> None:
        """Do the work in pool memory (and `host`, the host tier's) and wait until it is
        complete and visible to every process that maps the pool (on CUDA the copies are
        asynchronous until synchronized)."""
        for step in self.steps:
            step.perform(memory, host)
        memory.synchronize()


@dataclass(frozen=True, slots=True)
class Pending:
    """What one call's answer waits for: its own work and earlier work on blocks it touches."""

    # Futures of memory work (each done once its work is complete and synchronized).
    works: tuple["asyncio.Future[None]", ...] = ()

    async def wait(self) -> None:
        """Until every work is complete; a call cancelled meanwhile still waits, then raises
        CancelledError. MemoryFailed if any failed."""
        if not self.works:
            return
        try:
            await asyncio.shield(asyncio.gather(*self.works))
        except asyncio.CancelledError:
            await asyncio.wait(self.works)
            raise


class MemoryOrder:
    """Starts each call's memory work in block order and tells its answer what to wait for."""

    def __init__(self, workers: int = MEMORY_WORKERS) -> None:
        # Block -> the latest work that touches it, while that work is in flight.
        self._latest: dict[int, asyncio.Future[None]] = {}
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="pagedkv-memory")
        # The first failure; set once, never cleared (fail-stop).
        self.failure: MemoryFailed | None = None
        # Set with `failure`: the daemon stops on it.
        self.failed = asyncio.Event()

    def check(self) -> None:
        """Refuse a call once memory work has failed."""
        if self.failure is not None:
            raise self.failure

    def start(self, memory: BlockMemory | None, work: MemoryWork,
              answer_blocks: Callable[[], Iterable[int]], blocks_per_page: int = 1,
              host: HostMemory | None = None) -> Pending:
        """Start a call's work, just applied (the caller holds the pool lock and does not await
        before this); `answer_blocks` names the blocks its answer hands out (asked only while
        some work is in flight). Work is ordered by page (block // `blocks_per_page` of the
        call's format: formats share the pages' bytes, pages.py); with one block a page, by
        block; and by host slot, slot s under the key -1 - s (`host`: the host tier's memory)."""
        blocks = work.blocks()
        if blocks_per_page > 1:
            blocks = [block // blocks_per_page for block in blocks]
            answer = answer_blocks
            answer_blocks = lambda: (block // blocks_per_page for block in answer())  # noqa: E731
        blocks += [-1 - slot for slot in work.host_slots()]
        earlier = self._earlier(blocks, answer_blocks) if self._latest else ()
        if memory is None or not work.steps:
            return Pending(earlier)
        task = asyncio.ensure_future(self._run(memory, work, earlier, host))
        touched = set(blocks)
        for block in touched:
            self._latest[block] = task
        task.add_done_callback(partial(self._retire, touched))
        return Pending((task,))

    async def close(self) -> None:
        """Wait for the work in flight, then stop the threads."""
        if self._latest:
            await asyncio.wait(set(self._latest.values()))
        self._workers.shutdown(wait=True)

    def _earlier(self, blocks: list[int],
                 answer_blocks: Callable[[], Iterable[int]]) -> tuple["asyncio.Future[None]", ...]:
        latest = self._latest
        found = {latest[b] for b in blocks if b in latest}
        found.update(latest[b] for b in answer_blocks() if b in latest)
        return tuple(found)

    async def _run(self, memory: BlockMemory, work: MemoryWork,
                   earlier: tuple["asyncio.Future[None]", ...], host: HostMemory | None) -> None:
        if earlier:
            await asyncio.gather(*earlier)  # MemoryFailed if one failed: this work never runs
        try:
            await asyncio.get_running_loop().run_in_executor(self._workers, work.perform, memory,
                                                             host)
        except Exception as exc:
            raise self._fail(exc) from exc

    def _fail(self, exc: Exception) -> MemoryFailed:
        if self.failure is None:
            self.failure = MemoryFailed(f"pool memory work failed ({type(exc).__name__}: {exc}); "
                                        "the blocks' contents are unknown, the pool stops")
            self.failed.set()
            log.critical("pool memory work failed: the pool stops serving", exc_info=exc)
        return self.failure

    def _retire(self, blocks: set[int], task: "asyncio.Future[None]") -> None:
        """The work is over: its blocks no longer wait for it (unless a later work took them)."""
        for block in blocks:
            if self._latest.get(block) is task:
                del self._latest[block]
        if not task.cancelled():
            task.exception()  # retrieved: its calls, or none (all cancelled), have seen it


def answer_blocks(result: object, block_size: int) -> Iterable[int]:
    """The blocks an answer hands out: every table it returns, or the blocks a Step writes and
    the entries it changed (new blocks, reserved ones, copies)."""
    match result:
        case BatchAppend():
            written = np.concatenate([result.changed_block_id, result.slot_mapping // block_size])
            blocks: list[int] = np.unique(written).tolist()
            return blocks
        case SeqUpdate():
            return result.block_table
        case list():
            return [b for update in result if isinstance(update, SeqUpdate)
                    for b in update.block_table]
        case _:
            return ()
