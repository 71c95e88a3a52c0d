"""Work shared by the layers of one forward (per_forward.py): computed by the first layer's
attention, reused by the others, keyed by the sliding window, and never carried to the next
forward. Each test compares against the same kernels computing everything per call."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedkv.model_runner.kernels import paged_attention, paged_decode, paged_prefill, store_kv
from pagedkv.model_runner.kernels.attention_backend import TORCH_BACKEND
from pagedkv.model_runner.kernels.paged_decode import paged_decode_attention_torch
from pagedkv.model_runner.kernels.paged_prefill import paged_prefill_attention_torch
from pagedkv.model_runner.kernels.per_forward import PerForward, shared
from pagedkv.model_runner.runner import ModelRunner, SequenceChunk

from kernel_utils import make_paged_batch, query_start_loc, random_tokens

SCALE = 0.125
BLOCK_SIZE = 16


def test_shared_computes_once_per_key_and_every_time_without_a_dict():
    calls: list[str] = []

    def make(name: str):
        return lambda: calls.append(name) or len(calls)

    per_forward: PerForward = {}
    assert shared(per_forward, ("a", 0), make("a")) == 1
    assert shared(per_forward, ("a", 0), make("a again")) == 1
    assert shared(per_forward, ("a", 8), make("a, window 8")) == 2
    assert shared(None, ("a", 0), make("no dict")) == 3
    assert shared(None, ("a", 0), make("no dict")) == 4
    assert calls == ["a", "a, window 8", "no dict", "no dict"]


def _count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Count the calls of module.name (a function the kernels call by module global)."""
    counter = [0]
    original = getattr(module, name)

    def counted(*args, **kwargs):
        counter[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return counter


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_layers_sharing_a_dict_get_what_each_call_computes_alone(kernel, monkeypatch):
    """Three layers' calls over one batch, two windows: one index per window, same outputs."""
    seq_lens, q_lens = [40, 7, 33], [5, 7, 1]
    batch = make_paged_batch(seq_lens, BLOCK_SIZE, 2, 64, torch.float32, "cpu")
    index_calls = _count_calls(monkeypatch, paged_decode if kernel == "decode" else paged_prefill,
                               "context_index")
    per_forward: PerForward = {}
    for window in (None, 16, None):
        if kernel == "decode":
            query = random_tokens(len(seq_lens), 4, 64, torch.float32, "cpu")

            def call(dict_or_none, query=query, window=window):
                return paged_decode_attention_torch(
                    query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                    SCALE, sliding_window=window, per_forward=dict_or_none)
        else:
            query = random_tokens(sum(q_lens), 4, 64, torch.float32, "cpu")

            def call(dict_or_none, query=query, window=window):
                return paged_prefill_attention_torch(
                    query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                    query_start_loc(q_lens, "cpu"), SCALE, sliding_window=window,
                    per_forward=dict_or_none)
        before = index_calls[0]
        alone = call(None)
        assert index_calls[0] == before + 1
        torch.testing.assert_close(call(per_forward), alone, rtol=0, atol=0)
    group = 2  # 4 query heads over 2 KV heads
    assert sorted(per_forward) == ([(kernel, 0), (kernel, 16)] if kernel == "decode"
                                   else [(kernel, 0, group), (kernel, 16, group)])
    # one index per call alone (3), one per window in the shared dict (2)
    assert index_calls[0] == 5


def test_a_runner_forward_computes_the_decode_index_once_for_all_layers(monkeypatch):
    """A 3-layer Llama decode step indexes the contexts once, and its logits equal those of a
    step computing the index in every layer; the next step indexes its own batch again."""
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    pool = torch.randn(8, 3, 2, BLOCK_SIZE, 2, 16)
    runner = ModelRunner(model, pool, BLOCK_SIZE, TORCH_BACKEND)
    # two sequences of 20 and 5 tokens in blocks [3, 1] and [6]; each decodes its last token
    chunks = [SequenceChunk([7], 19, [1 * BLOCK_SIZE + 3], [3, 1]),
              SequenceChunk([9], 4, [6 * BLOCK_SIZE + 4], [6])]
    index_calls = _count_calls(monkeypatch, paged_decode, "context_index")
    logits = runner.step(chunks)
    assert index_calls[0] == 1
    runner.step(chunks)
    assert index_calls[0] == 2
    monkeypatch.setattr(paged_decode, "shared", lambda per_forward, key, make: make())
    torch.testing.assert_close(runner.step(chunks), logits, rtol=0, atol=0)
    assert index_calls[0] == 5


def test_a_runner_forward_plans_the_stores_and_windows_once_for_all_layers(monkeypatch):
    """A 3-layer Llama decode step with a token that writes nothing (slot -1) computes
    store_kv's rows and every layer's window once; its logits and pool equal those of a step
    computing them in every layer."""
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    before = torch.randn(8, 3, 2, BLOCK_SIZE, 2, 16)
    shared_runner, alone_runner = (ModelRunner(model, before.clone(), BLOCK_SIZE, TORCH_BACKEND)
                                   for _ in range(2))
    # the first sequence writes its token into block 1, the second computes without writing
    chunks = [SequenceChunk([7], 19, [1 * BLOCK_SIZE + 3], [3, 1]),
              SequenceChunk([9], 4, [-1], [6])]
    row_calls = _count_calls(monkeypatch, store_kv, "_store_rows")
    window_calls = _count_calls(monkeypatch, paged_attention, "layer_windows")
    logits = shared_runner.step(chunks)
    assert (row_calls[0], window_calls[0]) == (1, 1)
    for module in (store_kv, paged_attention):
        monkeypatch.setattr(module, "shared", lambda per_forward, key, make: make())
    alone = alone_runner.step(chunks)
    assert (row_calls[0], window_calls[0]) == (4, 4)
    torch.testing.assert_close(alone, logits, rtol=0, atol=0)
    assert torch.equal(alone_runner.pool, shared_runner.pool)
    written = shared_runner.pool != before  # [blocks, layers, K/V, slots, H_kv, D]
    assert written.any(dim=(1, 2, 4, 5)).nonzero().tolist() == [[1, 3]]  # block 1, slot 3 only
