"""The daemon's memory while large requests queue for the pool, with and without the byte budget.

Issue 17 #11: eight Allocates of 6.3 MB (a million token ids each) queued for the pool lock
added 410-430 MiB to the daemon: each was parsed and its token ids copied into a Python list
while it waited. Now token ids stay packed until the call holds the lock, and a request over
64 KiB is parsed only once `max_queued_request_bytes` has room (daemon/service/request_budget.py).

A real `pagedkvd` (tiny pool); one client keeps the pool lock busy with the largest Batch of
Commits `max_call_work` allows, while REQUESTS Allocates of TOKENS token ids (6.3 MB each, in a
session whose quota refuses them once they hold the lock) are sent at once. The daemon's peak
resident memory during the burst (VmHWM, reset just before it) above its level before:

    queued_requests_peak_mib_budget      default max_queued_request_bytes (32 MiB)
    queued_requests_peak_mib_no_budget   max_queued_request_bytes at its maximum (no bound)
    queued_requests_peak_mib_old         the code before (PYTHONPATH at an old tree's pagedkv
                                         folder, as bench_batch_cost.py allows)

Usage: python benchmarks/bench_queued_requests.py
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from daemon_process import running_pagedkvd

from pagedkv.daemon.service.limits import LIMITS
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc
from pagedkv.proto.limits import MESSAGE_SIZE_OPTIONS

if TYPE_CHECKING:
    from pagedkv.proto.kvpool_pb2_grpc import KVPoolAsyncStub

REQUESTS = 8
# A million token ids of 5-7 bytes: about 6.3 MB on the wire.
TOKENS = 1_000_000
TOKEN_BASE = 2**35
# The lock holder's session: sequences named by each of its Commits.
HOLDER_SEQS = 4096


def rss_kib(pid: int, field: str) -> int:
    """A memory figure of a process from /proc (VmRSS, VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


async def hold_the_lock(stub: KVPoolAsyncStub, stop: asyncio.Event) -> None:
    """Keep the pool busy with the largest Batch of Commits max_call_work allows."""
    sid = (await stub.OpenSession(pb.OpenSessionRequest(client_name="holder"))).session_id
    for first in range(0, HOLDER_SEQS, 1024):
        await stub.Batch(pb.BatchRequest(session_id=sid, ops=[
            pb.BatchOp(allocate=pb.AllocateRequest(seq_id=seq, num_tokens=0))
            for seq in range(first, first + 1024)]))
    commit = pb.BatchOp(commit=pb.CommitRequest(seq_ids=range(HOLDER_SEQS)))
    largest = (1 << 18) // (1 + HOLDER_SEQS)
    while not stop.is_set():
        await stub.Batch(pb.BatchRequest(session_id=sid, ops=[commit] * largest))


async def burst(target: str, pid: int) -> float:
    """MiB the daemon's peak resident memory grew by during the burst of Allocates."""
    async with grpc.aio.insecure_channel(target, options=MESSAGE_SIZE_OPTIONS) as channel:
        stub = kvpool_pb2_grpc.KVPoolStub(channel)
        stop = asyncio.Event()
        holder = asyncio.create_task(hold_the_lock(stub, stop))
        await asyncio.sleep(2.0)  # the holder's sequences are in; its Commits run
        sid = (await stub.OpenSession(pb.OpenSessionRequest(client_name="burst",
                                                            max_blocks=1))).session_id
        request = pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=TOKENS,
                                     token_ids=range(TOKEN_BASE, TOKEN_BASE + TOKENS))
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM restarts from VmRSS
        before = rss_kib(pid, "VmRSS")
        calls = [stub.Allocate(request) for _ in range(REQUESTS)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, grpc.aio.AioRpcError) for r in results), "quota refuses them"
        stop.set()
        await holder
        return (rss_kib(pid, "VmHWM") - before) / 1024


async def main() -> None:
    size = pb.AllocateRequest(session_id="x" * 55, seq_id=1, num_tokens=TOKENS, token_ids=range(
        TOKEN_BASE, TOKEN_BASE + TOKENS)).ByteSize()
    print(f"{REQUESTS} Allocates of {size / 1e6:.1f} MB each")
    spec = LIMITS.get("max_queued_request_bytes")
    # Before the budget (PYTHONPATH at an old tree's pagedkv): one run, as it was.
    modes = [("old", ())] if spec is None else [
        ("budget", ()), ("no_budget", ("--max-queued-request-bytes", str(spec.maximum)))]
    for name, args in modes:
        with running_pagedkvd("--num-blocks", "64", *args) as daemon:
            grown = await burst(daemon.target, daemon.launched.process.pid)
        print(f"queued_requests_peak_mib_{name}: {grown:.0f} MiB")


if __name__ == "__main__":
    asyncio.run(main())
