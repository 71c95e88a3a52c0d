"""The model runner computes on a contiguous daemon's tables exactly as on a paged one's.

A random-initialized Llama shaped like the test daemon's tiny geometry (2 layers, 2 KV heads,
head_dim 64, float32) generates greedily through the runner's step engine (a Batch of Allocate,
Steps that commit, a Batch of Commit and Free) on two in-process daemons with the same pool,
one paged and one contiguous: the tokens must be the same.
"""

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedkv.client import PoolClient
from pagedkv.daemon.process.settings import AllocatorKind
from pagedkv.model_runner.kernels.attention_backend import get_backend
from pagedkv.model_runner.runner import ModelRunner

from daemon_harness import running_daemon
from engine_driver import greedy

BLOCK_SIZE = 8
NUM_BLOCKS = 16
MAX_MODEL_LEN = 32  # 4 blocks a sequence: the three prompts take blocks 0, 4 and 8 onward
NEW_TOKENS = 6
# Inside one block, past one, past two: prefill and decode cross blocks.
PROMPTS = [[(5 * i + 3 * j) % 128 for j in range(n)] for i, n in enumerate((5, 13, 20))]
CONFIG = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                     head_dim=64, max_position_embeddings=64, initializer_range=0.2,
                     eos_token_id=None, bos_token_id=None, pad_token_id=None)


async def tokens_on(allocator: AllocatorKind, model: LlamaForCausalLM) -> list[list[int]]:
    max_model_len = MAX_MODEL_LEN if allocator == "contiguous" else None
    async with running_daemon(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, with_memory=True,
                              allocator=allocator, max_model_len=max_model_len) as daemon, \
            await PoolClient.connect(daemon.runners_target) as client, \
            await client.open_session(allocator) as session:
        runner = ModelRunner.attach(model, await client.pool_info(), get_backend("torch"))
        generations = await greedy(client, runner, session.session_id, PROMPTS, NEW_TOKENS)
        daemon.service.check_invariants()
        assert daemon.pool.stats().num_sequences == 0
        return [g.tokens for g in generations]


async def test_greedy_tokens_on_a_contiguous_daemon_equal_the_paged_ones() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).eval()
    paged = await tokens_on("paged", copy.deepcopy(model))
    contiguous = await tokens_on("contiguous", model)
    assert contiguous == paged
    assert all(len(tokens) == NEW_TOKENS for tokens in paged)
