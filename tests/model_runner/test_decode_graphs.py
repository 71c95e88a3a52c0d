"""Decode steps replayed from CUDA graphs (ModelRunner.capture_decode_graphs, decode_graphs.py).

On the CPU, torch.cuda.CUDAGraph cannot run: a stand-in GraphOps "captures" a forward by running
it once and "replays" it by running it again into the same static logits, so the bucketing, the
padding and the static buffers are tested for real (the torch backend computes). A decode step of
S sequences replays the smallest bucket of at least S, its logits equal the eager runner's, padded
rows never write the pool, and steps that do not fit (prefill, mixed, too many sequences) run
eagerly. The host passes max_q_len to the prefill kernel. The gpu test captures real graphs on a
device (Triton kernels) and checks greedy tokens against the eager runner's.
"""

import copy
from collections.abc import Callable

import pytest
import torch

from pagedkv.model_runner.decode_graphs import PAD_SLOT, GraphOps
from pagedkv.model_runner.kernels.attention_backend import TORCH_BACKEND, TRITON_BACKEND
from pagedkv.model_runner.kernels.paged_prefill import paged_prefill_attention_triton
from pagedkv.model_runner.kernels.triton_env import triton
from pagedkv.model_runner.models import kv_geometry
from pagedkv.model_runner.runner import ModelRunner, SequenceChunk

from families import FAMILIES
from kernel_launches import record_launches

BLOCK_SIZE = 16
NUM_BLOCKS = 48
LONGEST = 128  # max_model_len: tables of 8 blocks
BUCKETS = (1, 2, 4)
PROMPTS = [[3, 1, 4, 1, 5], list(range(7, 24)), list(range(30, 63))]  # 5, 17, 33 tokens


class FakeGraphs:
    """GraphOps whose capture runs the forward and whose replay runs it again into the same
    static logits; counts both."""

    def __init__(self) -> None:
        self.captured: list[int] = []  # each capture's batch rows, in capture order
        self.replays = 0

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None],
                                                                   torch.Tensor]:
        logits = forward().clone()
        self.captured.append(logits.shape[0])

        def replay() -> None:
            self.replays += 1
            logits.copy_(forward())

        return replay, logits


def _runner(backend=TORCH_BACKEND, device: str = "cpu") -> ModelRunner:
    model_class, family_config = FAMILIES["llama"]
    config = copy.deepcopy(family_config)
    config.max_position_embeddings = LONGEST
    torch.manual_seed(0)
    model = model_class(config).eval().to(device)
    layers, kv_heads, head_dim, _ = kv_geometry(model)
    pool = torch.zeros(NUM_BLOCKS, layers, 2, BLOCK_SIZE, kv_heads, head_dim, device=device)
    return ModelRunner(model, pool, BLOCK_SIZE, backend)


def _graphed(backend=TORCH_BACKEND, device: str = "cpu") -> tuple[ModelRunner, FakeGraphs]:
    runner, fake = _runner(backend, device), FakeGraphs()
    runner.capture_decode_graphs(GraphOps(fake.capture), BUCKETS)
    return runner, fake


def _table(seq: int) -> list[int]:
    """Sequence `seq`'s blocks: 8 each, interleaved, none of them block 0 (the padding's)."""
    return [1 + seq + 3 * i for i in range(LONGEST // BLOCK_SIZE)]


def _slot(seq: int, position: int) -> int:
    return _table(seq)[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


def _prefill(runner: ModelRunner, seqs: list[int]) -> torch.Tensor:
    return runner.step([SequenceChunk(PROMPTS[s], 0, [_slot(s, p) for p in range(len(PROMPTS[s]))],
                                      _table(s)) for s in seqs])


def _decode(runner: ModelRunner, tokens: dict[int, int], lengths: dict[int, int]) -> torch.Tensor:
    """One decode step of `tokens` (sequence -> its new token), each at position lengths[seq]."""
    return runner.step([SequenceChunk([token], lengths[s], [_slot(s, lengths[s])],
                                      _table(s)[:lengths[s] // BLOCK_SIZE + 1])
                        for s, token in tokens.items()])


def _greedy(runner: ModelRunner, seqs: list[int], steps: int) -> list[list[int]]:
    """Prefill `seqs`, then decode `steps` greedy tokens of each, all in one batch."""
    logits = _prefill(runner, seqs)
    lengths = {s: len(PROMPTS[s]) for s in seqs}
    tokens = {s: int(row.argmax()) for s, row in zip(seqs, logits, strict=True)}
    out = [list(tokens.values())]
    for _ in range(steps):
        logits = _decode(runner, tokens, lengths)
        lengths = {s: n + 1 for s, n in lengths.items()}
        tokens = {s: int(row.argmax()) for s, row in zip(seqs, logits, strict=True)}
        out.append(list(tokens.values()))
    return out


def test_one_graph_per_bucket_largest_first_and_steps_pad_to_the_smallest_that_holds_them():
    runner, fake = _graphed()
    assert fake.captured == [4, 2, 1]
    graphs = runner.decode_graphs
    assert graphs is not None
    assert [graphs.bucket_for(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    assert graphs.static.width == LONGEST // BLOCK_SIZE


@pytest.mark.parametrize("seqs", [[0], [0, 1, 2], [1, 2]])
def test_graph_decode_equals_eager_decode(seqs):
    runner, fake = _graphed()
    eager = _runner()
    assert _greedy(runner, seqs, steps=20) == _greedy(eager, seqs, steps=20)
    assert fake.replays == 20  # every decode step replayed; the prefill ran eagerly
    # The same slots written (padded rows wrote none), with the same K/V up to the rounding
    # of a batch of another size.
    assert torch.equal(runner.pool != 0, eager.pool != 0)
    torch.testing.assert_close(runner.pool, eager.pool, atol=1e-5, rtol=1e-5)


def test_padded_rows_never_write_the_pool():
    runner, _ = _graphed()
    _prefill(runner, [0, 1, 2])
    lengths = {s: len(PROMPTS[s]) for s in (0, 1, 2)}
    _decode(runner, {0: 5, 1: 6, 2: 7}, lengths)  # bucket 4: one padded row
    # A step of one sequence after it (bucket 1): rows 1 and 2 of the static buffers still hold
    # the last step's sequences, whose slots it must not write again.
    before = runner.pool.clone()
    lengths = {0: lengths[0] + 1}
    _decode(runner, {0: 9}, lengths)
    static = runner.decode_graphs.static
    changed = (runner.pool != before).flatten(4).any(-1)  # [block, layer, k/v, slot]
    written = changed.nonzero()[:, [0, 3]].unique(dim=0).tolist()
    slot = _slot(0, lengths[0])
    assert written == [[slot // BLOCK_SIZE, slot % BLOCK_SIZE]]
    # Three sequences again after a step of four in the static rows: the fourth is padding.
    _decode(runner, {0: 1, 1: 2, 2: 3, 3: 4}, {0: 40, 1: 18, 2: 34, 3: 1})
    before = runner.pool.clone()
    _decode(runner, {0: 9, 1: 9, 2: 9}, {0: 41, 1: 19, 2: 35})
    assert (static.slots[3].item(), static.seq_lens[3].item()) == (PAD_SLOT, 1)
    changed = (runner.pool != before).flatten(4).any(-1)
    written = changed.nonzero()[:, [0, 3]].unique(dim=0).tolist()
    assert written == sorted([[_slot(s, n) // BLOCK_SIZE, _slot(s, n) % BLOCK_SIZE]
                              for s, n in ((0, 41), (1, 19), (2, 35))])


def test_steps_that_do_not_fit_a_graph_run_eagerly():
    runner, fake = _graphed()
    _prefill(runner, [0, 1, 2])  # prefill: eager
    lengths = {s: len(PROMPTS[s]) for s in (0, 1, 2)}
    mixed = [SequenceChunk([5], lengths[0], [_slot(0, lengths[0])], _table(0)),
             SequenceChunk([6, 7], lengths[1], [_slot(1, lengths[1]), _slot(1, lengths[1] + 1)],
                           _table(1))]
    runner.step(mixed)
    five = [SequenceChunk([5], lengths[0], [-1], _table(0))] * 5  # past the largest bucket
    runner.step(five)
    assert fake.replays == 0


def test_cuda_graphs_are_refused_on_the_cpu():
    runner = _runner()
    with pytest.raises(ValueError, match="eager is the only path on the CPU"):
        runner.capture_decode_graphs()
    assert runner.decode_graphs is None


def test_the_host_passes_max_q_len_and_the_prefill_grid_uses_it(monkeypatch):
    runner = _runner()
    lengths = {0: len(PROMPTS[0])}
    chunks = [SequenceChunk([5], lengths[0], [-1], _table(0)),
              SequenceChunk(PROMPTS[1], 0, [-1] * 17, _table(1)),
              SequenceChunk(PROMPTS[2][:9], 0, [-1] * 9, _table(2))]
    context = runner.prepare(chunks).context
    assert (context.num_decodes, context.max_decode_len, context.max_q_len) == (1, 6, 17)
    launches = record_launches(monkeypatch)
    query = torch.zeros(20, 4, 32)
    pool = torch.zeros(4, 2, BLOCK_SIZE, 2, 32)
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([10, 10], dtype=torch.int32)
    starts = torch.tensor([0, 10, 20], dtype=torch.int32)
    paged_prefill_attention_triton(query, *pool.unbind(1), tables, lens, starts, 0.1,
                                   check_values=False, max_q_len=20)
    block_m = launches[-1].kwargs["BLOCK_M"]
    assert launches[-1].grid == (2, 4, triton.cdiv(20, block_m))  # not read from starts
    with pytest.raises(ValueError, match="shorter than the longest chunk"):
        paged_prefill_attention_triton(query, *pool.unbind(1), tables, lens, starts, 0.1,
                                       max_q_len=5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seqs", [[0], [0, 1, 2]])
def test_cuda_graph_decode_gives_the_eager_tokens_on_the_gpu(seqs):
    """Real graphs (torch.cuda.CUDAGraph) of the Triton kernels: greedy tokens as eager."""
    runner = _runner(TRITON_BACKEND, "cuda")
    runner.capture_decode_graphs(buckets=BUCKETS)
    replays = []
    graphs = runner.decode_graphs
    assert graphs is not None
    run = graphs.run
    graphs.run = lambda inputs: replays.append(1) or run(inputs)  # type: ignore[method-assign]
    eager = _runner(TRITON_BACKEND, "cuda")
    assert _greedy(runner, seqs, steps=20) == _greedy(eager, seqs, steps=20)
    assert len(replays) == 20
