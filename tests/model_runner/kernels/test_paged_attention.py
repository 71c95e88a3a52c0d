"""The "pagedkv" attention hook on a mixed batch: decode rows on the decode kernel.

When decodes join a prefill forward, the runner packs the one-token sequences first
(PagedContext.num_decodes, max_decode_len) and each layer runs the decode kernel on those rows
and the prefill kernel on the others, in the same call. Under the interpreter, on one Llama layer
over a random pool (slots -1: nothing is written, every call reads the same pool): the layer
launches both kernels, its decode split-K sized by the decodes' longest context rather than the
prefill's wide table; its decode rows equal the decode kernel run alone on just those sequences,
its prefill rows the prefill kernel's; and a mixed step's logits come back in chunk order, equal
to each chunk's own step, on both backends.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedkv.model_runner.kernels import paged_decode
from pagedkv.model_runner.kernels.attention_backend import TORCH_BACKEND, TRITON_BACKEND
from pagedkv.model_runner.kernels.paged_attention import CONTEXT_KWARG, paged_attention_forward
from pagedkv.model_runner.kernels.paged_decode import paged_decode_attention_triton
from pagedkv.model_runner.kernels.paged_prefill import paged_prefill_attention_triton
from pagedkv.model_runner.runner import ModelRunner, SequenceChunk

from kernel_launches import record_launches
from kernel_utils import (
    DEVICES,
    TOLERANCE,
    query_start_loc,
    random_tokens,
    skip_unless_triton_runs_on,
)

BLOCK_SIZE = 16
NUM_BLOCKS = 40
SCALE = 0.25
# One layer, 4 query heads sharing 2 KV heads of 16.
CONFIG = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     eos_token_id=None, bos_token_id=None, pad_token_id=None)
# Request order: a decode at context 100 (7 blocks), a 5-token chunk ending at 300 (19 blocks:
# the batch's table width, 5 tiles), a decode at context 9. Packed: both decodes, then the chunk.
TABLES = [list(range(0, 7)), list(range(7, 26)), [26]]
STARTS_AND_TOKENS = [(99, [3]), (295, [1, 2, 3, 4, 5]), (8, [7])]
CHUNKS = [SequenceChunk(tokens, start, [-1] * len(tokens), table)
          for (start, tokens), table in zip(STARTS_AND_TOKENS, TABLES, strict=True)]


def _runner(backend, device: str) -> ModelRunner:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).eval().to(device)
    pool = torch.randn(NUM_BLOCKS, 1, 2, BLOCK_SIZE, 2, 16).to(device)
    return ModelRunner(model, pool, BLOCK_SIZE, backend)


def _tables(rows: list[int], device: str) -> torch.Tensor:
    """[len(rows), widest] int32: those sequences' tables alone, padded with -1."""
    width = max(len(TABLES[row]) for row in rows)
    return torch.tensor([TABLES[row] + [-1] * (width - len(TABLES[row])) for row in rows],
                        dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_rows_of_a_mixed_batch_run_on_the_decode_kernel(monkeypatch, device):
    skip_unless_triton_runs_on(device)
    # One split per tile the plan covers, as a GPU's SMs would ask for: the grid shows the bound.
    monkeypatch.setattr(paged_decode, "default_num_splits", lambda programs, tiles, sms: tiles)
    runner = _runner(TRITON_BACKEND, device)
    context = runner.prepare(CHUNKS).context
    assert (context.num_decodes, context.max_decode_len) == (2, 100)
    layer = runner.model.model.layers[0].self_attn
    # [1, H, T, D] in packed order: the decodes' two rows, then the chunk's five
    query = random_tokens(7, 4, 16, torch.float32, device)[None].transpose(1, 2)
    key, value = (random_tokens(7, 2, 16, torch.float32, device, seed=s)[None].transpose(1, 2)
                  for s in (2, 3))
    layer_call = (layer, query, key, value, None, SCALE)

    with monkeypatch.context() as recording:  # record the launches, run nothing
        launches = record_launches(recording)
        paged_attention_forward(*layer_call, **{CONTEXT_KWARG: context})
    assert [(launch.name, launch.grid) for launch in launches if launch.name != "_store_kv_kernel"
            ] == [("_decode_split_kernel", (2, 2, 2)), ("_decode_merge_kernel", (2, 4)),
                  ("_prefill_kernel", (1, 4, 1))]  # 2 splits: cdiv(100, 64), not the table's 5

    # run them, in a fresh forward (nothing carried over in per_forward)
    context = runner.prepare(CHUNKS).context
    out = paged_attention_forward(*layer_call, **{CONTEXT_KWARG: context})[0][0]  # [T, H_q, D]
    q = query[0].transpose(0, 1)  # [T, H_q, D]
    k_cache, v_cache = runner.pool[:, 0].unbind(1)
    decodes = paged_decode_attention_triton(
        q[:2], k_cache, v_cache, _tables([0, 2], device),
        torch.tensor([100, 9], dtype=torch.int32, device=device), SCALE, num_splits=2)
    prefill = paged_prefill_attention_triton(
        q[2:], k_cache, v_cache, _tables([1], device),
        torch.tensor([300], dtype=torch.int32, device=device), query_start_loc([5], device),
        SCALE)
    torch.testing.assert_close(out[:2], decodes, rtol=0, atol=0)
    torch.testing.assert_close(out[2:], prefill, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", [TORCH_BACKEND, TRITON_BACKEND], ids=["torch", "triton"])
def test_a_mixed_step_returns_each_chunks_logits_in_chunk_order(backend, device):
    if backend is TRITON_BACKEND:
        skip_unless_triton_runs_on(device)
    runner = _runner(backend, device)
    mixed = runner.step(CHUNKS)
    alone = torch.cat([runner.step([chunk]) for chunk in CHUNKS])
    atol, rtol = TOLERANCE[torch.float32]
    torch.testing.assert_close(mixed, alone, atol=atol, rtol=rtol)
