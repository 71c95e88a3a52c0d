"""The benchmarks' baseline block manager does the same work as the block-pool core.

`benchmarks/bench_core_trace.py` compares the core's rate with `ReferenceBlockManager`'s; the
comparison is fair only if both do the same thing. Replayed in lockstep on a small seeded trace
with shared prefixes, repeated prompts, greedy-like continuations (identical prompts decode
identical tokens, so decode fills blocks whose content is already cached) and a pool small
enough that cached blocks get evicted, both must report the same cached tokens per admission,
the same block tables, the same slot per decoded token, and the same free blocks after every
call. The reference keys a block as soon as it fills; the pool keys it pending until `commit`,
so the replay commits right after every allocation and step. It holds for each pair of hashes
the benchmark gives the two sides (`PAIRS`: the same chain on both, or nano-vllm's xxhash64).
"""

import numpy as np
import pytest

from pagedkv.daemon.core import BlockPool, NoFit, PrefixHash

from bench_core_trace import PAIRS, reference_hash
from reference_block_manager import ReferenceBlockManager
from traces import UniformSpec, make_trace

BLOCK_SIZE = 16
LIVE = 8
VOCAB = 1000
# The longest request is 90 + 100 prompt + 60 output tokens = 16 blocks, so 8 live sequences
# always fit in 160 blocks; cached blocks pile up beyond that and get evicted.
NUM_BLOCKS = 160


def prompts_and_outputs(num_requests: int) -> list[tuple[int, np.ndarray, int]]:
    """(prompt id, prompt, output length): a trace's requests, each behind one of four system
    prompts (0, 16, 40 or 90 tokens), and one in four repeating an earlier request's prompt."""
    rng = np.random.default_rng(7)
    trace = make_trace(UniformSpec("small", (1, 100), (1, 60)), num_requests, vocab=VOCAB,
                       seed=3)
    systems = [rng.integers(0, VOCAB, n, dtype=np.int64) for n in (0, 16, 40, 90)]
    requests: list[tuple[int, np.ndarray, int]] = []
    for i, req in enumerate(trace):
        if requests and rng.random() < 0.25:
            prompt_id, prompt, _ = requests[int(rng.integers(len(requests)))]
        else:
            prompt_id = i
            prompt = np.concatenate([systems[int(rng.integers(4))], req.prompt])
        requests.append((prompt_id, prompt, req.output_len))
    return requests


@pytest.mark.parametrize(("core_hash", "reference_algo"), PAIRS.values(), ids=list(PAIRS))
def test_reference_agrees_with_block_pool(core_hash: PrefixHash,
                                          reference_algo: PrefixHash | None) -> None:
    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True, prefix_hash=core_hash)
    ref = ReferenceBlockManager(NUM_BLOCKS, BLOCK_SIZE, *reference_hash(reference_algo))
    queue = iter(enumerate(prompts_and_outputs(250)))
    live: dict[int, tuple[int, int, int]] = {}  # seq -> (prompt id, tokens held, tokens left)
    cached_total = 0

    def same_blocks(seq: int | None = None) -> None:
        assert pool.num_free_blocks == ref.num_free_blocks
        assert pool.stats().used_blocks == sum(1 for count in ref.ref if count)
        if seq is not None:
            assert pool.block_table(seq) == ref.block_table(seq)

    def admit() -> bool:
        nonlocal cached_total
        item = next(queue, None)
        if item is None:
            return False
        seq, (prompt_id, prompt, output_len) = item
        result = pool.allocate(seq, len(prompt), prompt)
        cached = ref.allocate(seq, prompt)
        assert not isinstance(result, NoFit) and cached is not None
        pool.commit([seq])  # the reference keys blocks when they fill: commit at once too
        assert result.num_cached_tokens == cached, f"sequence {seq}"
        assert result.block_table == ref.block_table(seq)
        same_blocks(seq)
        cached_total += cached
        live[seq] = (prompt_id, len(prompt), output_len)
        return True

    for _ in range(LIVE):
        admit()
    steps = 0
    while live:
        seqs = list(live)
        # Greedy-like decoding: the next token depends only on the prompt and the position.
        tokens = [(live[seq][0] * 7919 + live[seq][1]) % VOCAB for seq in seqs]
        result = pool.append_batch(seqs, 1, np.array(tokens, dtype=np.int64))
        assert not isinstance(result, NoFit)
        pool.commit(seqs)
        slots = [ref.append(seq, token) for seq, token in zip(seqs, tokens, strict=True)]
        assert result.slot_mapping.tolist() == slots, f"step {steps}"
        same_blocks()
        steps += 1
        for seq in seqs:
            prompt_id, held, left = live[seq]
            if left > 1:
                live[seq] = (prompt_id, held + 1, left - 1)
                continue
            assert pool.block_table(seq) == ref.block_table(seq)
            del live[seq]
            pool.free(seq)
            ref.free(seq)
            same_blocks()
            admit()
        if steps % 64 == 0:
            pool.check_invariants()
    pool.check_invariants()
    # The trace exercised what it is meant to: prefix hits and evictions of cached blocks.
    assert cached_total > 0
    assert ref.evictions > 0
