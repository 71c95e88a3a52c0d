"""ModelRunner.warm_up launches every compiled kernel variant the runner's batches meet.

Triton specializes a kernel on its integer arguments (1 becomes a constant, a multiple of 16 an
alignment hint), so an argument that changes from batch to batch (a stride of the packed tokens,
the block table's width, the split-K plan) would compile a new variant, for seconds, the first
time a batch brings a new value under load. The kernels mark those do_not_specialize, and the
runner's warm-up launches what is left at start. Here the kernels record their launches instead
of running (kernel_launches), and each launch's variant is the key Triton's JIT would cache it
under on an H100 (its own binder on the launch's real arguments): batches of 1, 3 and 17
sequences with contexts of 5, 64 and 1000 tokens, decode, prefill and mixed, meet exactly the
variants the warm-up launched, one per kernel and layer kind (decode: one split, and several).
"""

import copy
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from pagedkv.model_runner.kernels import paged_decode
from pagedkv.model_runner.kernels.attention_backend import TRITON_BACKEND
from pagedkv.model_runner.kernels.triton_env import triton
from pagedkv.model_runner.models import kv_geometry
from pagedkv.model_runner.runner import ModelRunner, SequenceChunk
from pagedkv.vocab.blocks import blocks_for

from families import FAMILIES
from kernel_launches import Launch, record_launches, variant_key
from kernel_utils import skip_unless_triton_runs_on

BLOCK_SIZE = 16
NUM_BLOCKS = 64
LONGEST = 1024
# An H100's SMs: the split-K policy sizes its splits by them (the CPU has none, so one split).
H100_SMS = 132
# Variants per kernel: Llama's and Phi3's layers are all alike (Phi3's fused QKV gives strides
# that change with the token count); Gemma2 alternates windowed and full layers, and a window
# of 100 positions never needs more than one split.
EXPECTED = {
    "llama": {"_store_kv_kernel": 1, "_prefill_kernel": 1, "_decode_split_kernel": 2,
              "_decode_merge_kernel": 1},
    "phi3": {"_store_kv_kernel": 1, "_prefill_kernel": 1, "_decode_split_kernel": 2,
             "_decode_merge_kernel": 1},
    "gemma2": {"_store_kv_kernel": 1, "_prefill_kernel": 2, "_decode_split_kernel": 3,
               "_decode_merge_kernel": 1},
}


def _runner(family: str, device: str = "cpu") -> ModelRunner:
    model_class, family_config = FAMILIES[family]
    config = copy.deepcopy(family_config)
    config.max_position_embeddings = LONGEST
    if family == "gemma2":
        config.sliding_window = 100
    torch.manual_seed(0)
    model = model_class(config).eval().to(device)
    layers, kv_heads, head_dim, _ = kv_geometry(model)
    pool = torch.zeros(NUM_BLOCKS, layers, 2, BLOCK_SIZE, kv_heads, head_dim, device=device)
    return ModelRunner(model, pool, BLOCK_SIZE, TRITON_BACKEND)


def _batches(num_seqs: int, context: int) -> list[list[SequenceChunk]]:
    """A decode, a prefill and a mixed batch of `num_seqs` sequences of `context` tokens."""
    table = [block % NUM_BLOCKS for block in range(blocks_for(context, BLOCK_SIZE))]
    decode = [SequenceChunk([1], context - 1, [-1], table)] * num_seqs
    prefill = [SequenceChunk([1] * context, 0, [-1] * context, table)] * num_seqs
    return [decode, prefill, decode[:-1] + prefill[-1:]]


def _variants(launches: Sequence[Launch]) -> set[str]:
    return {variant_key(launch) for launch in launches}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_batches_of_any_shape_meet_only_the_warmed_up_variants(monkeypatch, family):
    skip_unless_triton_runs_on("cpu")
    runner = _runner(family)
    policy = paged_decode.default_num_splits
    monkeypatch.setattr(paged_decode, "default_num_splits",
                        lambda programs, tiles, _sms: policy(programs, tiles, H100_SMS))
    launches = record_launches(monkeypatch)
    runner.warm_up()
    warmed = _variants(launches)
    assert Counter(key.split(":")[0] for key in warmed) == EXPECTED[family]

    launches.clear()
    _serve_every_shape(runner)
    assert _variants(launches) == warmed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_after_warm_up_no_batch_compiles_a_kernel_on_the_gpu(monkeypatch, family):
    """The GPU twin of the test above: Triton's JIT itself reports every compile."""
    runner = _runner(family, "cuda")
    runner.warm_up()
    compiled: list[str] = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook",
                        lambda **hook: compiled.append(hook["repr"]))
    _serve_every_shape(runner)
    assert compiled == []


def _serve_every_shape(runner: ModelRunner) -> None:
    for num_seqs in (1, 3, 17):
        for context in (5, 64, 1000):
            for chunks in _batches(num_seqs, context):
                runner.step(chunks)
