"""A daemon SIGKILLed under greedy streams, restored from its crash log (issue 34), against the
same crash with the crash log off (the next daemon starts cold).

A `pagedkvd` (restore = "auto") under the production fd store host (what systemd keeps, here
kept by this process), a `pagedkv runner` with its /metrics, STREAMS greedy streams through the
client `Engine` (following: the runner's decode runs push the tokens). Once every stream has
half its tokens, the daemon is SIGKILLed; once the streams stalled (the runner met the daemon
gone), the next daemon starts with the stored pool memory.

With the crash log the next daemon replays it: the runner forgets its sequences' progress, the
engine resends their histories, and the runner computes again only the tokens past each
sequence's committed ones, into the sequence's own slots. Every stream must end with the tokens
of an uninterrupted run (checked). Without it the next daemon starts cold: the session is gone,
the engine's requests fail, and each stream's prompt plus its tokens so far is submitted again
(what a client must do), every token computed again.

Figures:
    recomputed_tokens_after_daemon_crash  the runner's pagedkv_runner:recomputed_tokens
    tokens_uncommitted_at_crash   per running sequence, the tokens the engine's resend names
                                  (`held`, read once the streams stalled after the kill) past
                                  the tokens the daemon had committed (read just before the
                                  kill): what the runner must compute again
    recomputed_equals_uncommitted  1 when the two are equal
    requests_failed_after_daemon_crash  streams that ended in an error (crash log on)
    recomputed_tokens_after_daemon_crash_cold  prefill tokens the runner computed for the
                                  streams submitted again (crash log off)
    requests_failed_after_daemon_crash_cold  streams that ended in an error (crash log off)

Usage: python benchmarks/bench_daemon_crash_restore.py [--streams 16] [--new-tokens 96] [--quick]
"""

import argparse
import asyncio
import contextlib
import signal
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from e2e import BLOCK_SIZE, PRESET, VOCAB, add_quick_flag, figure, metric_sum
from prometheus_client.parser import text_string_to_metric_families
from restart_engine import stream
from restart_streams import StreamLog, check, kill_midway

from pagedkv.client import SamplingParams
from pagedkv.client.engine.engine import Engine
from pagedkv.process.fd_store_host import FdStoreHost
from pagedkv.process.launch import READY_STATE, Launched, free_tcp_port, start_daemon, start_runner

# Prompt lengths cycle through these (tokens), so the streams' tails differ.
PROMPT_LENS = (24, 37, 50, 63, 76, 89)
NUM_BLOCKS = 1024
QUIET = ("--log-level", "warning")
RECOMPUTED = "pagedkv_runner:recomputed_tokens_total"
PREFILL = "pagedkv_runner:tokens_total"
# The streams stalled: no token arrived for this long after the kill.
STALL_S = 1.0
# No phase of a run takes longer (a hang fails the bench instead of stalling it).
PHASE_TIMEOUT_S = 120.0


class Stack:
    """A daemon under an fd store, its runner, and the runner's /metrics, in one folder."""

    def __init__(self, folder: Path, crash_log: bool) -> None:
        self.store = FdStoreHost(8)
        self.args = ("--shm-dir", str(folder), "--model-config", PRESET, "--num-blocks",
                     str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--restore", "auto",
                     "--state-dir", str(folder / "state"), *QUIET,
                     *(() if crash_log else ("--no-crash-log",)))
        self.folder = folder
        self.metrics = f"127.0.0.1:{free_tcp_port()}"
        self.daemon = self.start_daemon()
        self.runner = start_runner(self.daemon.runners_target, folder, "--random-init", PRESET,
                                   "--torch-threads", "1", "--metrics-listen", self.metrics,
                                   *QUIET)
        self.runner.wait_for_notification(READY_STATE)

    def start_daemon(self) -> Launched:
        daemon = start_daemon(self.folder, *self.args, fd_store=self.store)
        daemon.wait_for_notification(READY_STATE)
        return daemon

    async def engine(self) -> Engine:
        """An Engine on the daemon and the runner (a lease that outlasts the crash)."""
        return await Engine.connect(self.daemon.unix_target, self.runner.unix_target,
                                    lease_ttl_ms=120_000)

    async def crash(self, engine: Engine, logs: list[StreamLog], new_tokens: int) -> int:
        """Midway, SIGKILL the daemon, wait for the streams to stall and start the next daemon;
        the tokens the engine's resend names past the daemon's committed ones."""
        await kill_midway(logs, new_tokens, lambda: None)
        committed = await _committed(engine)
        self.daemon.stop(signal.SIGKILL)
        await _stalled(logs)
        held = {seq.seq_id: seq.held for request in engine.scheduler.running
                for seq in request.seqs}
        self.daemon = await asyncio.to_thread(self.start_daemon)
        return sum(count - committed[seq_id] for seq_id, count in held.items()
                   if seq_id in committed)

    def close(self) -> None:
        self.runner.stop()
        self.daemon.stop()
        self.store.close()


async def _committed(engine: Engine) -> dict[int, int]:
    """The daemon's committed tokens of each running sequence."""
    seqs = [seq for request in engine.scheduler.running for seq in request.seqs]
    tables = await engine.session.block_tables([seq.seq_id for seq in seqs])
    return {seq.seq_id: table.num_cached_tokens
            for seq, table in zip(seqs, tables, strict=True)}


async def _stalled(logs: list[StreamLog]) -> None:
    """Once no stream got a token for STALL_S."""
    while True:
        count = sum(len(log.tokens) for log in logs)
        await asyncio.sleep(STALL_S)
        if sum(len(log.tokens) for log in logs) == count:
            return


@contextlib.contextmanager
def stack(crash_log: bool) -> Iterator[Stack]:
    with tempfile.TemporaryDirectory(prefix="pkvd-", dir="/tmp") as folder:
        running = Stack(Path(folder), crash_log)
        try:
            yield running
        finally:
            running.close()


async def uninterrupted(running: Stack, prompts: list[list[int]],
                        params: SamplingParams) -> list[list[int]]:
    async with await running.engine() as engine:
        outputs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return [list(output.outputs[0].token_ids) for output in outputs]


async def crashed(running: Stack, prompts: list[list[int]],
                  params: SamplingParams) -> tuple[list[StreamLog], int, int]:
    """The streams through a daemon crash: their logs, the uncommitted tokens, and how many
    streams failed."""
    logs = [StreamLog(p) for p in prompts]
    async with await running.engine() as engine:
        tasks = [asyncio.create_task(stream(engine, log, log.prompt, params)) for log in logs]
        tail = await asyncio.wait_for(running.crash(engine, logs, params.max_tokens),
                                      PHASE_TIMEOUT_S)
        ends = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True),
                                      PHASE_TIMEOUT_S)
    return logs, tail, sum(isinstance(end, BaseException) for end in ends)


async def restored(running: Stack, prompts: list[list[int]],
                   params: SamplingParams) -> tuple[int, int, int]:
    """Through a crash restored from the log: (recomputed, uncommitted, failed)."""
    expected = await uninterrupted(running, prompts, params)
    before = metric_sum(running.metrics, RECOMPUTED)
    logs, tail, failed = await crashed(running, prompts, params)
    check(logs, expected, "crash log")
    return round(metric_sum(running.metrics, RECOMPUTED) - before), tail, failed


async def cold(running: Stack, prompts: list[list[int]],
               params: SamplingParams) -> tuple[int, int]:
    """The same crash with no crash log, every failed stream submitted again with its tokens
    so far: (the prefill tokens the runner computed for them, failed streams)."""
    expected = await uninterrupted(running, prompts, params)
    logs, _, failed = await crashed(running, prompts, params)
    before = _prefill(running)
    again = [log for log in logs if len(log.tokens) < params.max_tokens]
    async with await running.engine() as engine:
        await asyncio.wait_for(asyncio.gather(*(stream(
            engine, log, [*log.prompt, *log.tokens], SamplingParams(
                temperature=0.0, max_tokens=params.max_tokens - len(log.tokens),
                ignore_eos=True)) for log in again)), PHASE_TIMEOUT_S)
    check(logs, expected, "cold")
    return round(_prefill(running) - before), failed


def _prefill(running: Stack) -> float:
    """The runner's prefill tokens so far (forward chunks of more than one token)."""
    with urllib.request.urlopen(f"http://{running.metrics}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(found.value for family in text_string_to_metric_families(text)
               for found in family.samples
               if found.name == PREFILL and found.labels.get("kind") == "prefill")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    add_quick_flag(parser)
    args = parser.parse_args()
    # Quick: tokens enough that the kill, at half of them, leaves more than a reservation's
    # worth to compute (a run the runner can finish inside its reservations meets no daemon).
    streams, new_tokens = (2, 256) if args.quick else (args.streams, args.new_tokens)
    prompts = [[(7 * i + 3 * j) % VOCAB for j in range(PROMPT_LENS[i % len(PROMPT_LENS)])]
               for i in range(streams)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    with stack(crash_log=True) as running:
        recomputed, tail, failed = await restored(running, prompts, params)
    figure("recomputed_tokens_after_daemon_crash", recomputed, "tokens", 0)
    figure("tokens_uncommitted_at_crash", tail, "tokens", 0)
    figure("recomputed_equals_uncommitted", int(recomputed == tail), "bool", 0)
    figure("requests_failed_after_daemon_crash", failed, "requests", 0)
    with stack(crash_log=False) as running:
        recomputed_cold, failed_cold = await cold(running, prompts, params)
    figure("recomputed_tokens_after_daemon_crash_cold", recomputed_cold, "tokens", 0)
    figure("requests_failed_after_daemon_crash_cold", failed_cold, "requests", 0)


if __name__ == "__main__":
    asyncio.run(main())
