"""`make demo`: a real pagedkvd process and one scripted client session, narrated.

Starts `pagedkvd` on its built-in CPU defaults (the tiny geometry, 512 blocks of 16 tokens) on
a unix socket in a temporary folder, waits until gRPC health says SERVING, then plays what a
serving engine does with one request: allocate the prompt, admit a second request with the
same prompt (its full blocks come from the prefix cache), fork for parallel sampling, decode a
few tokens with the copy-on-write the fork makes necessary, read the session's stats, free
everything.
Finally it sends SIGTERM and checks that the daemon drains, exits 0 and removes its pool file.

    python -m pagedkv.client.demo
"""

import asyncio
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .client import PoolClient
from .session import Session
from .types import PoolStats, SequenceBlocks, StepResult

# How long the daemon may take to start (imports torch) and to stop (drain grace + exit).
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
# The prompt both requests share: 40 token ids, i.e. 2 full blocks of 16 and 8 tokens more.
PROMPT = list(range(1000, 1040))
DECODE_STEPS = 3


def say(text: str = "") -> None:
    print(text, flush=True)


def describe(what: str, seq: SequenceBlocks) -> None:
    cached = f", {seq.num_cached_tokens} from the prefix cache" if seq.num_cached_tokens else ""
    say(f"  {what}: seq {seq.seq_id} has {seq.num_tokens} tokens in blocks {seq.block_ids}"
        f"{cached}")


def describe_step(number: int, seq_ids: list[int], step: StepResult) -> None:
    slots = dict(zip(seq_ids, step.slot_mapping, strict=True))
    say(f"  decode step {number}: new token slots {slots}")
    for index, logical, block in zip(step.changed_seq_index, step.changed_logical_block,
                                     step.changed_block_id, strict=True):
        say(f"    seq {seq_ids[index]}: logical block {logical} is now block {block}")
    for copy in step.copies:
        say(f"    copy-on-write: block {copy.src} copied to block {copy.dst} in pool memory, "
            "before the answer")


def describe_stats(stats: PoolStats) -> None:
    say(f"  pool: {stats.free_blocks} of {stats.num_blocks} blocks free (cached ones included)")
    mine = stats.session
    if mine is None:
        return
    say(f"  session {mine.name}: {mine.num_sequences} sequences, {mine.blocks_held} blocks held "
        f"({mine.block_table_entries} table entries of a quota of {mine.max_blocks})")
    say(f"  prefix cache: {mine.prefix_cache_hits} of {mine.prefix_cache_queries} "
        "prompt tokens found")


async def wait_until_serving(target: str, process: subprocess.Popen[bytes]) -> None:
    """Poll gRPC health until SERVING; fail early if the daemon exits."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_TIMEOUT_S
    async with grpc.aio.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while loop.time() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"pagedkvd exited with {process.returncode} while starting")
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass  # not listening yet
            await asyncio.sleep(0.1)
    raise RuntimeError(f"pagedkvd was not SERVING within {START_TIMEOUT_S} s")


async def one_request_lifecycle(session: Session) -> None:
    """Prompt, shared prompt, fork, decode with copy-on-write, free."""
    say(f"Prefill: a {len(PROMPT)}-token prompt.")
    describe("allocate", await session.allocate(1, token_ids=PROMPT))
    committed = await session.commit([1])
    say(f"A runner computes its K/V, then the client commits it: {committed} full blocks become")
    say("shareable (until then they are pending and no other prompt may match them).")
    say("A second request with the same prompt: its full blocks are shared, not recomputed.")
    describe("allocate", await session.allocate(2, token_ids=PROMPT))
    say("Parallel sampling: fork seq 1 into seq 3; the child shares every block.")
    describe("fork", await session.fork(1, 3))

    say("Decode seqs 1 and 3 together. Their last block is shared and partly filled, so the")
    say("first write to it copies it (copy-on-write); after that each writes its own block.")
    seq_ids = [1, 3]
    for number in range(1, DECODE_STEPS + 1):
        next_tokens = [2000 + number, 3000 + number]
        describe_step(number, seq_ids, await session.step(seq_ids, token_ids=next_tokens))

    say()
    say("Stats with three live sequences:")
    describe_stats(await session.stats())
    say()
    released = await session.free(2)
    say(f"Free seq 2: {released} of its blocks went back to the pool; the shared ones stay "
        "with seq 1.")


async def run_client(target: str) -> None:
    async with await PoolClient.connect(target) as client:
        info = await client.pool_info()
        say(f"Pool {info.pool_id}: {info.num_blocks} blocks x {info.block_size} tokens, "
            f"model {info.model!r} ({info.num_layers} layers, {info.num_kv_heads} KV heads, "
            f"head_dim {info.head_dim}, {info.dtype}), {info.bytes_per_block} bytes per block")
        say(f"Pool memory: {info.memory.kind} {info.memory.shm_path} (layout {info.layout})")
        say()
        session = await client.open_session("demo")
        await one_request_lifecycle(session)
        freed = await session.close()
        say(f"Close the session: its {freed} remaining sequences are freed.")
        say()
        say("The pool after the close (prompt blocks stay cached for the next request; other")
        say("sessions' activity is for operators, on /metrics):")
        describe_stats(await client.stats())


def stop_daemon(process: subprocess.Popen[bytes], folder: Path) -> None:
    say()
    say("SIGTERM: the daemon drains in-flight calls, frees the pool memory and exits.")
    process.send_signal(signal.SIGTERM)
    code = process.wait(STOP_TIMEOUT_S)
    leftovers = sorted(path.name for path in folder.glob("pagedkv-*.kv"))
    if code != 0 or leftovers:
        raise RuntimeError(f"pagedkvd exited with {code}, left {leftovers}")
    say("pagedkvd exited with status 0; its pool file is gone.")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="pagedkv-demo-") as tmp:
        folder = Path(tmp)
        target = f"unix://{folder / 'pagedkvd.sock'}"
        log_path = folder / "pagedkvd.log"
        command = [sys.executable, "-m", "pagedkv.daemon.cli", "serve", "--listen", target,
                   "--shm-dir", str(folder), "--log-format", "json"]
        say(f"Starting pagedkvd on {target}")
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        try:
            asyncio.run(wait_until_serving(target, process))
            say("pagedkvd is SERVING (gRPC health).")
            asyncio.run(run_client(target))
            stop_daemon(process, folder)
        except Exception as exc:
            print(f"demo failed: {exc}\n--- pagedkvd log ---\n{log_path.read_text()}",
                  file=sys.stderr)
            return 1
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
