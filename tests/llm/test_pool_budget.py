"""The pool an `LLM` starts on CPU is sized to what its engine can hold (pool_budget.py's rule
3), and the engine settings reach the started daemon and the engine: prefix caching on or off,
max_model_len, the default seed. Real processes: each LLM starts a daemon and a runner with the
tiny-llama preset (random weights, token-id prompts)."""

from collections.abc import Iterator

import pytest

from pagedkv.client.engine.requests import request_seed
from pagedkv.llm import LLM, SamplingParams
from pagedkv.llm.config import LLMConfig
from pagedkv.llm.model_ref import resolve_model
from pagedkv.llm.pool_budget import engine_bound

# Two full blocks of 16 tokens: a second request with it finds them cached.
PROMPT = list(range(1, 41))
GREEDY = SamplingParams(temperature=0, max_tokens=2)
SEED = 5


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    """8 sequences of 256 tokens, unseeded requests seeded from SEED."""
    with LLM("tiny-llama", device="cpu", max_num_seqs=8, max_model_len=256, seed=SEED) as started:
        yield started


def prefix_hits(llm: LLM) -> int:
    """The prefix-cache hits of the LLM's session, in tokens."""
    stats = llm._loop.run(llm._engine.session.stats())
    assert stats.session is not None
    return stats.session.prefix_cache_hits


def test_an_unseeded_request_gets_the_engines_seed(llm: LLM) -> None:
    """The engine's first request (the module's first: pytest keeps the file's order) brings
    no seed, and samples as a request seeded with request_seed(SEED, 0) does."""
    sampled = SamplingParams(temperature=1.0, max_tokens=12)
    unseeded = llm.generate([PROMPT], sampled)[0].outputs[0].token_ids
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=request_seed(SEED, 0))
    assert llm.generate([PROMPT], seeded)[0].outputs[0].token_ids == unseeded
    different = SamplingParams(temperature=1.0, max_tokens=12, seed=request_seed(SEED, 1))
    assert llm.generate([PROMPT], different)[0].outputs[0].token_ids != unseeded


def test_the_engine_bound_is_whole_blocks_of_every_sequence() -> None:
    # tiny-llama's K/V: 2 layers x 2 (K, V) x 2 heads x 32 x 4 bytes = 1 KiB a token.
    tiny = resolve_model("tiny-llama")
    config = LLMConfig(model="tiny-llama", max_num_seqs=8, max_model_len=250)
    assert engine_bound(config, tiny, "float32") == 8 * 16 * 16 * 1024
    # No max_model_len: the model's 4096 positions.
    assert engine_bound(LLMConfig(model="tiny-llama"), tiny, "float32") == 256 * 4096 * 1024


def test_a_tiny_models_cpu_pool_holds_its_sequences_and_no_more(llm: LLM) -> None:
    """8 sequences x 256 tokens = 128 blocks of 16 (2 MiB), not the 4 GiB of the old default."""
    assert llm._engine.num_blocks == 8 * 256 // 16


def test_max_model_len_bounds_the_engines_requests(llm: LLM) -> None:
    assert llm._engine.max_model_len == 256
    output = llm.generate([[5] * 250], SamplingParams(temperature=0, max_tokens=100))[0]
    assert len(output.outputs[0].token_ids) == 256 - 250 + 1
    assert output.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="at most 256 positions"):
        llm.generate([[5] * 257], GREEDY)
    with pytest.raises(ValueError, match="max_model_len 5000 exceeds the 4096 positions"):
        LLM("tiny-llama", max_model_len=5000)


def test_prefix_caching_is_on_by_default_and_off_when_asked(llm: LLM) -> None:
    before = prefix_hits(llm)
    llm.generate([PROMPT], GREEDY)
    llm.generate([PROMPT], GREEDY)
    assert prefix_hits(llm) >= before + 32
    with LLM("tiny-llama", device="cpu", num_blocks=32, enable_prefix_caching=False) as off:
        off.generate([PROMPT], GREEDY)
        off.generate([PROMPT], GREEDY)
        assert prefix_hits(off) == 0
