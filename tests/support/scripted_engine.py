"""An engine over a scripted runner, with no daemon and no model: the runner computes every step
at once and samples token 7, and fails the steps it is told to as a full pool would."""

import types
from collections.abc import Sequence

import grpc

from pagedkv.client import (
    PoolExhausted,
    PoolStats,
    SeqOutput,
    SeqStep,
    StepOutputs,
)
from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.scheduler import SchedulerConfig

BS = 16
NUM_BLOCKS = 8
# The model's vocabulary by default (token 7 is in every one).
VOCAB_SIZE = 100


class ScriptedRunner:
    """Computes every step at once and samples token 7, except the steps numbered in `full`
    (from 1), which fail as a daemon with another client's blocks in the pool would."""

    def __init__(self, full: set[int]) -> None:
        self.full = full
        self.calls = 0
        self.held: dict[int, int] = {}
        # Unary steps, as RunnerClient's without stream_steps: nothing follows, nothing pushes.
        self.streams = None

    async def step(self, session: object, seqs: Sequence[SeqStep],
                   release: Sequence[int] = (), *, follow: bool = False) -> StepOutputs:
        self.calls += 1
        if self.calls in self.full:
            raise PoolExhausted(grpc.StatusCode.RESOURCE_EXHAUSTED, "pool full")
        outputs = []
        for seq in seqs:
            held = (0 if seq.new_sequence else self.held[seq.seq_id]) + len(seq.token_ids)
            self.held[seq.seq_id] = held
            outputs.append(SeqOutput(seq.seq_id, held, held, 0, True, 7, -0.5, (), (), False))
        for seq_id in release:
            self.held.pop(seq_id)
        return StepOutputs(outputs, NUM_BLOCKS)

    async def close(self) -> None:
        pass


async def free_pool() -> PoolStats:
    return PoolStats(NUM_BLOCKS, BS, NUM_BLOCKS, None)


def engine(runner: ScriptedRunner, max_model_len: int = 0,
           vocab_size: int = VOCAB_SIZE) -> Engine:
    session = types.SimpleNamespace(block_size=BS, stats=free_pool)
    pool = types.SimpleNamespace(close=runner.close)
    return Engine(pool, session, runner, vocab_size=vocab_size, eos_token_ids=(),  # type: ignore[arg-type]
                  num_blocks=NUM_BLOCKS, free_blocks=NUM_BLOCKS, config=SchedulerConfig(),
                  max_model_len=max_model_len)
