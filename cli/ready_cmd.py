"""`pagedkv ready`: wait until a daemon and a runner serve, as `pg_isready` waits for PostgreSQL.

    pagedkv ready                                   the daemon and the runner at their defaults
    pagedkv ready unix:run/pagedkvd.sock --timeout-s 30

A shell that starts both in the background (`pagedkvd ... &`) runs this before the next step:
a runner needs its daemon, and a client the runner, serving. Each target is asked gRPC's
standard health check (grpc.health.v1, service ""), which the daemon and the runner report
SERVING once they accept calls (process/grpc_server.py). Exit 0 once every target serves,
1 when one does not within --timeout-s (the target named), 2 for a bad command line.
"""

import argparse
import asyncio
import os
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.vocab.paths import default_daemon_listen, default_runner_listen

# How often a target that is not serving yet is asked again.
POLL_S = 0.2


def add_ready_arguments(parser: argparse.ArgumentParser) -> None:
    """`pagedkv ready`'s flags: the targets and how long to wait."""
    parser.add_argument("targets", nargs="*", metavar="TARGET",
                        help="gRPC targets (default: the daemon's and the runner's default "
                             "sockets)")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="how long to wait for all of them (default 60)")


def run_ready(args: argparse.Namespace) -> int:
    """Run `pagedkv ready` parsed into `args`; the exit status."""
    targets = args.targets or [default_daemon_listen(os.environ),
                               default_runner_listen(os.environ)]
    if not args.timeout_s > 0:
        print(f"pagedkv ready: --timeout-s must be positive, got {args.timeout_s}",
              file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.timeout_s
    for target in targets:
        if not asyncio.run(_wait_serving(target, deadline)):
            print(f"pagedkv ready: {target} is not serving after {args.timeout_s:g} s",
                  file=sys.stderr)
            return 1
    return 0


async def _wait_serving(target: str, deadline: float) -> bool:
    """Whether `target` reports SERVING before `deadline` (time.monotonic())."""
    request = health_pb2.HealthCheckRequest(service="")
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while (left := deadline - time.monotonic()) > 0:
            try:
                answer = await stub.Check(request, timeout=min(left, 5.0))
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.aio.AioRpcError:
                pass  # not listening yet, or starting: ask again
            await asyncio.sleep(min(POLL_S, max(deadline - time.monotonic(), 0)))
    return False
