"""Drives a StepEngine the way a client would, for tests: steps until each sequence has sampled n.

    decoded = await decode(engine, session_id, [new(1, prompt, GREEDY)], n=8)
    decoded[1].tokens    # the 8 sampled tokens
    decoded[1].results   # every SeqOutput of sequence 1, sampled or not
    done = await greedy(pool_client, model_runner, session_id, prompts, n=8)  # own engine

A recording runner keeps the chunks and logits of every forward, so tests can check what was
computed (a cached prefix is not) and compare logits with transformers'.
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from pagedkv.client import PoolClient, SamplingParams, SeqOutput, SeqStep
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.kernels.attention_backend import AttentionBackend
from pagedkv.model_runner.runner import ModelRunner, SequenceChunk


@dataclass
class Decoded:
    """What decoding one sequence through the engine gave."""

    # The sampled tokens, in order.
    tokens: list[int]
    # Every result the engine returned for the sequence, sampled or not.
    results: list[SeqOutput]


def new(seq_id: int, prompt: Sequence[int], params: SamplingParams,
        max_compute_tokens: int = 0) -> SeqStep:
    """The first step of a new sequence."""
    return SeqStep(seq_id, tuple(prompt), True, max_compute_tokens, params)


async def decode(engine: StepEngine, session_id: str, first: Sequence[SeqStep], n: int,
                 release: bool = True, decode_ahead: bool = False) -> dict[int, Decoded]:
    """Step `first`, then keep stepping every sequence (its last token once one is sampled,
    else nothing, to go on with a chunked prefill) until each has sampled n tokens. A sequence
    leaves the batch once done, released on its last step when `release`. `decode_ahead` marks
    every step so (with release=False, the runner then holds one token more per sequence)."""
    if decode_ahead:
        first = [dataclasses.replace(r, decode_ahead=True) for r in first]
    requests = {r.seq_id: r for r in first}
    decoded = {r.seq_id: Decoded([], []) for r in first}
    pending: list[SeqStep] = list(first)
    while pending:
        finishing = [r.seq_id for r in pending if len(decoded[r.seq_id].tokens) == n - 1]
        results = (await engine.step(session_id, pending,
                                     release=finishing if release else ()))
        pending = []
        for result in results:
            seq = decoded[result.seq_id]
            seq.results.append(result)
            if result.sampled:
                seq.tokens.append(result.token_id)
            if len(seq.tokens) == n:
                continue
            request = requests[result.seq_id]
            tokens = (seq.tokens[-1],) if result.sampled else ()
            # No sampling: the runner keeps the one the first step sent.
            pending.append(SeqStep(result.seq_id, tokens, False, request.max_compute_tokens,
                                      None, decode_ahead=decode_ahead))
    return decoded


async def greedy(pool: PoolClient, runner: ModelRunner, session_id: str,
                 prompts: Sequence[Sequence[int]], n: int, first_seq_id: int = 0
                 ) -> list[Decoded]:
    """Greedy decoding of `prompts` as sequences first_seq_id, first_seq_id + 1, ... of the
    session, in one batch, through a StepEngine of its own over `runner` (the runner's step loop,
    as `pagedkv runner` serves it), each released on its last step; one Decoded per prompt."""
    engine = StepEngine(pool, runner)
    await engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=n)
        seq_ids = range(first_seq_id, first_seq_id + len(prompts))
        decoded = await decode(engine, session_id, [new(seq_id, prompt, params) for seq_id, prompt
                                                    in zip(seq_ids, prompts, strict=True)], n)
    finally:
        await engine.stop()
    return [decoded[seq_id] for seq_id in seq_ids]


class RecordingRunner(ModelRunner):
    """A runner that remembers the chunks and the logits of every forward it ran."""

    def __init__(self, model: PreTrainedModel, pool: torch.Tensor, block_size: int,
                 backend: AttentionBackend) -> None:
        super().__init__(model, pool, block_size, backend)
        # The chunks of each forward, and its logits: [S, V] for S chunks.
        self.chunks: list[list[SequenceChunk]] = []
        self.logits: list[torch.Tensor] = []

    def step(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        logits = super().step(chunks)
        self.chunks.append(list(chunks))
        self.logits.append(logits)  # [S, V]
        return logits


def recorder(engine: StepEngine) -> RecordingRunner:
    """The engine's runner, which must be a RecordingRunner."""
    assert isinstance(engine.runner, RecordingRunner)
    return engine.runner
