"""The runner's daemon hop side by side: StepMany as unary calls against StepMany as messages on
one KVPool.StepStream, through a real pagedkvd on a unix socket, in one run.

Two PoolClients of one daemon, the same work: SESSIONS sessions of SEQS_PER_SESSION sequences
each, and one StepMany per "forward" carrying one decode Step per session (one token per
sequence, with its id), as the runner sends after each merged forward. One client sends it as
a unary StepMany (`step_stream=False`, an external scheduler's way), the other as a message on
its stream (the bundled client's default). Rounds of ROUND_CALLS calls alternate between the
two, so load on the machine falls on both alike. Figures, one per line:

    stepmany_unary_ms          median wall time of one unary StepMany, as the client sees it
    stepmany_stream_ms         the same for one StepStream message and its answer
    stream_vs_unary_ratio      stepmany_stream_ms / stepmany_unary_ms (below 1: the stream is
                               cheaper)
    daemon_cpu_us_unary, daemon_cpu_us_stream
                               the daemon's CPU time (utime + stime) per call, each mode
    stream_messages_counted    StepStream messages on the daemon's /metrics
                               (pagedkv:stream_messages_total) over the messages sent: 1.00
                               when the figure bench_runner counts daemon calls by is honest

Sequences are freed and allocated again every RECYCLE_CALLS calls (untimed). With two or more
CPUs the daemon is pinned to one of its own (the first output line says how).
Usage: python benchmarks/bench_stream.py
"""

import asyncio
import os
import statistics
import time
import urllib.request
from pathlib import Path

from daemon_process import pin, running_pagedkvd

from pagedkv.client import Allocate, Free, PoolClient, Session, Step

SESSIONS = 4
SEQS_PER_SESSION = 8
ROUNDS = 20
ROUND_CALLS = 100
WARMUP_CALLS = 50
# Calls between re-allocations: 64 tokens on a 16-token block size is at most 5 blocks a seq.
RECYCLE_CALLS = 50
BLOCK_SIZE = 16
NUM_BLOCKS = 1024


def process_cpu_s(pid: int) -> float:
    """utime + stime of a running process (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Mode:
    """One client's sessions and the figures of its calls."""

    def __init__(self, client: PoolClient, sessions: list[Session]) -> None:
        self.client = client
        self.sessions = sessions
        # Wall time of each timed call, in ms; the daemon's CPU seconds over its rounds.
        self.times_ms: list[float] = []
        self.daemon_cpu_s = 0.0
        self.calls = 0

    async def recycle(self) -> None:
        """Every sequence freed and allocated again with a one-token prompt."""
        seq_ids = range(SEQS_PER_SESSION)
        for session in self.sessions:
            await session.batch([Free(seq_id) for seq_id in seq_ids])
            await session.batch([Allocate(seq_id, token_ids=[seq_id]) for seq_id in seq_ids])

    async def call(self) -> float:
        """One StepMany (one Step per session); its wall time in ms."""
        steps = [(session, Step(list(range(SEQS_PER_SESSION)), [7] * SEQS_PER_SESSION))
                 for session in self.sessions]
        start = time.perf_counter()
        answers = await self.client.step_many(steps)
        elapsed = (time.perf_counter() - start) * 1000
        assert all(not isinstance(answer, Exception) for answer in answers), answers
        return elapsed

    async def round(self, daemon_pid: int, calls: int, timed: bool) -> None:
        """`calls` calls, recycling the sequences (untimed, its daemon CPU left out) every
        RECYCLE_CALLS."""
        for start in range(0, calls, RECYCLE_CALLS):
            await self.recycle()
            cpu = process_cpu_s(daemon_pid)
            times = [await self.call() for _ in range(min(RECYCLE_CALLS, calls - start))]
            if timed:
                self.daemon_cpu_s += process_cpu_s(daemon_pid) - cpu
                self.times_ms += times
                self.calls += len(times)


async def mode(target: str, *, stream: bool) -> Mode:
    client = await PoolClient.connect(target, timeout=30, step_stream=stream)
    sessions = [await client.open_session(f"bench-{'stream' if stream else 'unary'}-{index}")
                for index in range(SESSIONS)]
    for session in sessions:
        await session.batch([Allocate(seq_id, token_ids=[seq_id])
                             for seq_id in range(SEQS_PER_SESSION)])
    return Mode(client, sessions)


def stream_messages(metrics: str) -> float:
    """pagedkv:stream_messages_total on the daemon's /metrics, every label."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("pagedkv:stream_messages_total{"))


async def measure(target: str, daemon_pid: int, metrics: str) -> None:
    unary, stream = await mode(target, stream=False), await mode(target, stream=True)
    for each in (unary, stream):
        await each.round(daemon_pid, WARMUP_CALLS, timed=False)
    for _ in range(ROUNDS):
        for each in (unary, stream):
            await each.round(daemon_pid, ROUND_CALLS, timed=True)
    unary_ms, stream_ms = (statistics.median(each.times_ms) for each in (unary, stream))
    print(f"stepmany_unary_ms: {unary_ms:.3f} ms")
    print(f"stepmany_stream_ms: {stream_ms:.3f} ms")
    print(f"stream_vs_unary_ratio: {stream_ms / unary_ms:.2f} ratio")
    for name, each in (("unary", unary), ("stream", stream)):
        print(f"daemon_cpu_us_{name}: {each.daemon_cpu_s / each.calls * 1e6:.0f} us")
    sent = WARMUP_CALLS + ROUNDS * ROUND_CALLS
    print(f"stream_messages_counted: {stream_messages(metrics) / sent:.2f} ratio")
    for each in (unary, stream):
        await each.client.close()


def main() -> None:
    with running_pagedkvd("--num-blocks", str(NUM_BLOCKS), "--block-size",
                          str(BLOCK_SIZE)) as daemon:
        pid = daemon.launched.process.pid
        print(f"# {pin(daemon.launched.process)}; {SESSIONS} sessions x {SEQS_PER_SESSION} "
              f"sequences per StepMany")
        asyncio.run(measure(daemon.target, pid, daemon.metrics))


if __name__ == "__main__":
    main()
