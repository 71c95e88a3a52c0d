"""The fp8 KV cache (kv_cache_dtype fp8) against the full-precision one: capacity and accuracy.

    fp8_blocks_ratio: blocks per byte of an fp8 view of one arena over an fp16 view of it
        (KVMemory.view, the daemon's own layout; llama-3.1-8b's geometry, 16-token blocks).
    Per family (three of tests/support/families.py: Llama, Qwen2 with its qkv bias, Gemma2 with
    its soft caps), the same random fp32 weights run greedily on two pools, fp32 and fp8, on the
    CPU path (the torch twins; the CPU has no fp16 matmul worth timing, so the full-precision
    pool is fp32's, not fp16's):
    fp8_kl_mean_<family>, fp8_kl_max_<family>: KL(fp32 || fp8) of the next-token distributions
        at each of GREEDY_TOKENS positions, the fp8 pool fed the fp32 pool's tokens (nats);
    fp8_greedy_agree_<family>: the share of GREEDY_TOKENS greedy tokens each pool generates on
        its own that are equal, position by position, and fp8_greedy_first_diff_<family> the
        first position where they differ (GREEDY_TOKENS: none);
    fp8_rel_err_tensor_<family>, fp8_rel_err_token_head_<family>: ||dequant(quant(x)) - x|| /
        ||x|| of the K/V the fp32 run wrote, under the per-tensor scale 1.0 pagedkv stores and
        under a per-token-per-head scale (amax / 448), the alternative it did not choose.

    .venv/bin/python benchmarks/bench_fp8_kv.py [--tokens 256]
"""

import argparse
import copy
import math
import sys
from pathlib import Path

import torch
from transformers import PreTrainedModel

from pagedkv.daemon.memory.kv_memory import KVMemory
from pagedkv.model_runner.kernels.attention_backend import get_backend
from pagedkv.model_runner.kernels.paged_checks import FP8_CACHE_DTYPE, FP8_MAX
from pagedkv.model_runner.runner import ModelRunner, SequenceChunk
from pagedkv.vocab.geometry import BUILTIN_GEOMETRIES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from families import FAMILIES  # type: ignore[import-not-found]  # the tests' one definition

GREEDY_TOKENS = 256
BLOCK_SIZE = 16
PROMPT = [(7 * i + 3) % 128 for i in range(16)]
MEASURED_FAMILIES = ("llama", "qwen2", "gemma2")


def blocks_ratio() -> float:
    """Blocks per byte of an fp8 view of one arena over its fp16 view's."""
    geometry = BUILTIN_GEOMETRIES["llama-3.1-8b"]
    page = geometry.bytes_per_block(BLOCK_SIZE, 2)
    with KVMemory.create(num_pages=2, page_bytes=page) as arena:
        blocks = [arena.view(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim,
                             dtype, BLOCK_SIZE).num_blocks for dtype in ("float16", "fp8")]
        return blocks[1] / blocks[0]  # the same bytes: blocks per byte in the same ratio


def family_model(family: str, positions: int) -> PreTrainedModel:
    """The family's seeded random weights (families.reference_model's), its positions raised
    to hold the prompt and the greedy tokens."""
    model_class, config = FAMILIES[family]
    config = copy.deepcopy(config)
    config.max_position_embeddings = positions
    torch.manual_seed(0)
    model: PreTrainedModel = model_class(config).eval()
    return model


class Run:
    """One sequence on its own pool: blocks 0, 1, ... in order, slot = position."""

    def __init__(self, model: PreTrainedModel, dtype: torch.dtype, positions: int) -> None:
        config = model.config.get_text_config()
        heads = config.num_key_value_heads if hasattr(config, "num_key_value_heads") else (
            config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        num_blocks = math.ceil(positions / BLOCK_SIZE)
        self.pool = torch.zeros(num_blocks, config.num_hidden_layers, 2, BLOCK_SIZE, heads,
                                head_dim, dtype=dtype)
        self.runner = ModelRunner(model, self.pool, BLOCK_SIZE, get_backend("torch"))
        self.table = list(range(num_blocks))
        self.length = 0

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Compute `tokens` after what the sequence holds; the next token's log-probabilities."""
        slots = list(range(self.length, self.length + len(tokens)))
        logits = self.runner.step([SequenceChunk(tokens, self.length, slots, self.table)])
        self.length += len(tokens)
        return logits[0].log_softmax(-1)


def greedy(run: Run, n: int, forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens (or the `forced` ones fed instead) and [n, vocab] log-probabilities."""
    logprobs, tokens = [run.feed(PROMPT)], []
    for i in range(n):
        tokens.append(int(logprobs[-1].argmax()) if forced is None else forced[i])
        if i + 1 < n:
            logprobs.append(run.feed([tokens[-1]]))
    return tokens, torch.stack(logprobs)


def rel_errors(pool: torch.Tensor, length: int) -> tuple[float, float]:
    """The K/V of `length` tokens in an fp32 pool quantized per tensor (scale 1.0) and per
    token and head (amax / FP8_MAX): each one's relative error."""
    kv = pool.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :length]  # [L, 2, T, H, D]
    per_tensor = kv.clamp(-FP8_MAX, FP8_MAX).to(FP8_CACHE_DTYPE).float()
    scale = kv.abs().amax(-1, keepdim=True).clamp_min(1e-30) / FP8_MAX
    per_token_head = (kv / scale).to(FP8_CACHE_DTYPE).float() * scale
    norm = float(kv.norm())
    return float((per_tensor - kv).norm()) / norm, float((per_token_head - kv).norm()) / norm


def measure_family(family: str, n: int) -> dict[str, float]:
    positions = len(PROMPT) + n
    model = family_model(family, positions)
    exact = Run(copy.deepcopy(model), torch.float32, positions)
    tokens, exact_logprobs = greedy(exact, n)
    forced = Run(copy.deepcopy(model), FP8_CACHE_DTYPE, positions)
    _, fp8_logprobs = greedy(forced, n, tokens)
    kl = (exact_logprobs.exp() * (exact_logprobs - fp8_logprobs)).sum(-1)  # [n]
    free, _ = greedy(Run(model, FP8_CACHE_DTYPE, positions), n)
    same = [a == b for a, b in zip(tokens, free, strict=True)]
    tensor_err, token_head_err = rel_errors(exact.pool, positions - 1)
    return {f"fp8_kl_mean_{family}": float(kl.mean()), f"fp8_kl_max_{family}": float(kl.max()),
            f"fp8_greedy_agree_{family}": sum(same) / n,
            f"fp8_greedy_first_diff_{family}": same.index(False) if False in same else n,
            f"fp8_rel_err_tensor_{family}": tensor_err,
            f"fp8_rel_err_token_head_{family}": token_head_err}


UNITS = {"kl": "nats", "agree": "ratio", "first": "tokens", "err": "ratio"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=GREEDY_TOKENS,
                        help=f"greedy tokens per pool (default {GREEDY_TOKENS})")
    parser.add_argument("--families", nargs="+", default=list(MEASURED_FAMILIES),
                        choices=sorted(FAMILIES))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"fp8_blocks_ratio: {blocks_ratio():.3f} ratio")
    for family in args.families:
        for name, value in measure_family(family, args.tokens).items():
            unit = next(u for key, u in UNITS.items() if f"_{key}" in name)
            print(f"{name}: {value:.6g} {unit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
