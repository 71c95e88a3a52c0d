"""How many pagedkv source files one decode step runs through in the daemon.

A runner's decode step reaches the daemon as one StepMany: here one entry stepping 8 sequences
by a token each, with commit and a runner's hold, on a real `KVPoolServicer` over a
`PoolService` with a tiny CPU pool memory, called in-process (no gRPC transport: the count is
of the daemon's code, not grpc's). The step is traced (`sys.settrace`) after a warm-up step,
and every distinct pagedkv source file a traced frame executes is counted. Figures:

    step_files        distinct pagedkv source files one StepMany executes
    step_functions    distinct pagedkv functions it executes

`--list` prints the files. Usage: python benchmarks/bench_step_files.py [--list]
"""

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import pagedkv.daemon
from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.edge.servicer import KVPoolServicer
from pagedkv.daemon.memory.kv_memory import KVPoolMemory
from pagedkv.daemon.service.operations import Allocate
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.vocab.geometry import TINY_CPU_GEOMETRY

SEQS = 8
NUM_BLOCKS, BLOCK_SIZE = 64, 4
ROOT = str(Path(pagedkv.daemon.__file__).resolve().parent.parent)  # the package's folder


async def traced_step(directory: str) -> tuple[set[str], set[tuple[str, str]]]:
    """The files and functions one StepMany of SEQS sequences executes."""
    memory = KVPoolMemory.create(TINY_CPU_GEOMETRY, NUM_BLOCKS, BLOCK_SIZE, "float32",
                                 shm_dir=directory)
    service = PoolService(BlockPool(NUM_BLOCKS, BLOCK_SIZE), memory, pool_id="files",
                          geometry=TINY_CPU_GEOMETRY)
    servicer = KVPoolServicer(service)
    session = service.open_session("runner")
    await service.batch(session.session_id, [Allocate(s, 1, [s]) for s in range(SEQS)])
    step = pb.StepRequest(session_id=session.session_id, seq_ids=range(SEQS), num_tokens=1,
                          token_ids=[7] * SEQS, commit=True, hold_ms=1000)
    request = pb.StepManyRequest(steps=[step])
    context: Any = None  # the servicer reads no context on success
    await servicer.StepMany(request, context)  # warm-up: imports, first-use caches
    files: set[str] = set()
    functions: set[tuple[str, str]] = set()

    def trace(frame: FrameType, event: str, _arg: object) -> None:
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(ROOT) and "/.venv/" not in path:
            files.add(path[len(ROOT) + 1:])
            functions.add((path, frame.f_code.co_qualname))

    sys.settrace(trace)
    try:
        answer = await servicer.StepMany(request, context)
    finally:
        sys.settrace(None)
    assert answer.results[0].HasField("step"), answer
    await service.stop()
    memory.close()
    return files, functions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the files")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pkv-files-") as directory:
        files, functions = asyncio.run(traced_step(directory))
    if args.list:
        for path in sorted(files):
            print(f"# {path}")
    print(f"step_files: {len(files)} files")
    print(f"step_functions: {len(functions)} functions")


if __name__ == "__main__":
    main()
