"""One client process of the demo: an `Engine` on its own daemon session runs the client's share
of the workload and reports what it saw as one JSON line.

    python -m pagedkv.demo.worker --daemon unix:///tmp/d/pagedkvd.sock \\
        --runner unix:///tmp/d/pagedkv-runner.sock --index 0 [--quick]

Protocol on its pipes: once connected it prints "ready", then waits for a line on stdin (the
demo starts every client at once), submits each request at its arrival time, and prints its
`WorkerResult`. Times are `time.monotonic()`: CLOCK_MONOTONIC is one clock for every process
of the machine, so the demo can line them up with its samples of the pool.
"""

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass

from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.outputs import RequestOutput
from pagedkv.demo.workload import SHARED_SALT, DemoRequest, Kind, workload

READY = "ready"


@dataclass(frozen=True, slots=True)
class RequestFigures:
    """What one finished request reported."""

    kind: Kind
    prompt_tokens: int
    # Prompt tokens the prefix cache served at the request's first admission.
    cached_tokens: int
    # Tokens generated over all of its sequences.
    generated_tokens: int


@dataclass(frozen=True, slots=True)
class WorkerResult:
    """What one client saw over its run."""

    # Monotonic seconds of the start signal and of its last request's answer.
    started_s: float
    finished_s: float
    requests: list[RequestFigures]
    preemptions: int
    # Its session's prefix-cache lookups and hits, in prompt tokens (first admissions and
    # re-admissions after a preemption alike).
    prefix_cache_queries: int
    prefix_cache_hits: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "WorkerResult":
        raw = json.loads(text)
        return cls(**{**raw, "requests": [RequestFigures(**r) for r in raw["requests"]]})


async def run(daemon: str, runner: str, index: int, quick: bool) -> WorkerResult:
    requests = workload(index, quick)
    async with await Engine.connect(daemon, runner, client_name=f"demo-{index}",
                                    cache_salt=SHARED_SALT) as engine:
        print(READY, flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        started = time.monotonic()
        outputs = await asyncio.gather(*(_submit(engine, r, started) for r in requests))
        finished = time.monotonic()
        session = (await engine.session.stats()).session
        assert session is not None, "GetStats of an open session names it"
        return WorkerResult(
            started, finished,
            [_figures(r, out) for r, out in zip(requests, outputs, strict=True)],
            engine.scheduler.num_preemptions, session.prefix_cache_queries,
            session.prefix_cache_hits)


async def _submit(engine: Engine, request: DemoRequest, started: float) -> RequestOutput:
    await asyncio.sleep(max(0.0, started + request.arrival_s - time.monotonic()))
    return await engine.generate(request.prompt, request.params)


def _figures(request: DemoRequest, output: RequestOutput) -> RequestFigures:
    return RequestFigures(request.kind, output.num_prompt_tokens, output.num_cached_tokens,
                          output.num_generated_tokens)


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m pagedkv.demo.worker",
                                  description="One client process of `make demo`.")
    cli.add_argument("--daemon", required=True, help="the daemon's gRPC target")
    cli.add_argument("--runner", required=True, help="the runner's gRPC target")
    cli.add_argument("--index", type=int, required=True, help="which client's workload")
    cli.add_argument("--quick", action="store_true", help="the reduced workload")
    args = cli.parse_args(argv)
    result = asyncio.run(run(args.daemon, args.runner, args.index, args.quick))
    print(result.to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
