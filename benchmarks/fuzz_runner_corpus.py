"""What every client of the runner fuzzer shares: the cache salt, the sampling, the prompts.

Prompts come from a few base prompts (seeded), so many clients' prompts begin with the same
whole blocks: under the one shared salt the prefix cache serves one client what another client
computed, and a hostile client can aim at exactly those blocks. Standard library and
pagedkv.client only: the killed clients' processes import it without torch.
"""

import random

from pagedkv.client import SamplingParams

# Every client's sessions use this cache salt: prefixes computed for one are hits for others.
SHARED_SALT = b"fuzz-runner"
# Greedy, with the sampled token's raw logprob (the shadow compares both).
GREEDY = SamplingParams(temperature=0.0, logprobs=0)
# Base prompts, and their length in tokens.
BASES = 16
BASE_LENGTH = 96


class Corpus:
    """The prompts every client draws from (seeded: the same in every process)."""

    def __init__(self, seed: int, vocab_size: int, block_size: int) -> None:
        rng = random.Random(f"corpus-{seed}")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.bases = [[rng.randrange(vocab_size) for _ in range(BASE_LENGTH)]
                      for _ in range(BASES)]

    def prompt(self, rng: random.Random) -> list[int]:
        """A base prompt's prefix, then up to 7 tokens of its own."""
        base = rng.choice(self.bases)
        return base[:rng.randint(1, len(base))] + self.tokens(rng, rng.randint(0, 7))

    def blocks(self, rng: random.Random) -> list[int]:
        """A base prompt's first whole blocks (one to all): what honest prompts hit in the
        cache, or will."""
        return rng.choice(self.bases)[:rng.randint(1, BASE_LENGTH // self.block_size)
                                      * self.block_size]

    def tokens(self, rng: random.Random, n: int) -> list[int]:
        """`n` random token ids of the vocabulary."""
        return [rng.randrange(self.vocab_size) for _ in range(n)]
