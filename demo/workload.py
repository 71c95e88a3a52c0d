"""The demo's workload: what each client process asks, identical in every run.

Four kinds of request, interleaved and arriving over the first seconds (each client its own
seeded stream), so the engines batch them continuously:
- plain: one sampled sequence;
- parallel: n=4 samples from one prefill (forks share the prompt's blocks);
- beam: beam search of width 4 (beams fork and share blocks, copy on write);
- system: a long system prompt both clients share, then a short user turn. Both clients open
  their sessions with the same cache salt, so the system prompt's blocks computed by one are
  found in the prefix cache by the other.
The random-initialized model has no end-of-sequence token: every sequence runs to max_tokens,
so a run's token count and block demand do not depend on the sampled tokens.
"""

import random
from dataclasses import dataclass
from typing import Literal, assert_never

from pagedkv.client import SamplingParams
from pagedkv.vocab.blocks import blocks_for

Kind = Literal["plain", "parallel", "beam", "system"]
KINDS: tuple[Kind, ...] = ("plain", "parallel", "beam", "system")
# The model both the daemon (`--model-config`) and the runner (`--random-init`) are given: the
# daemon's built-in default geometry (2 layers, 2 KV heads of 64, float32), vocabulary 1000.
MODEL = "tiny"
VOCAB_SIZE = 1000
BLOCK_SIZE = 16
NUM_WORKERS = 2
# The pool (full workload, `--quick`): too small for every sequence of both clients at once, so
# admission waits and growing requests are preempted, yet roomy enough for real concurrency.
NUM_BLOCKS = 256
QUICK_NUM_BLOCKS = 96
# The cache salt of every demo session: equal salts let sessions share prefix-cache blocks.
SHARED_SALT = "pagedkv-demo"
# 6 full blocks of system prompt, the same for every client.
SYSTEM_PROMPT = tuple(random.Random(0).randrange(VOCAB_SIZE) for _ in range(6 * BLOCK_SIZE))
# Requests of each kind per client: the full demo, and `--quick` (tests).
MIX: dict[Kind, int] = {"plain": 12, "parallel": 3, "beam": 3, "system": 12}
QUICK_MIX: dict[Kind, int] = {"plain": 2, "parallel": 1, "beam": 1, "system": 2}
# Mean seconds between two arrivals at one client (exponential gaps).
MEAN_GAP_S = 0.1


@dataclass(frozen=True, slots=True)
class DemoRequest:
    """One request of a client's workload."""

    kind: Kind
    # Seconds after the start of the run at which the client submits it.
    arrival_s: float
    prompt: tuple[int, ...]
    params: SamplingParams

    @property
    def max_len(self) -> int:
        """Tokens its longest sequence reaches (there is no end-of-sequence token)."""
        return len(self.prompt) + self.params.max_tokens


def workload(worker: int, quick: bool) -> list[DemoRequest]:
    """Client `worker`'s requests, in arrival order."""
    rng = random.Random(1000 + worker)
    counts = QUICK_MIX if quick else MIX
    kinds = [kind for kind in KINDS for _ in range(counts[kind])]
    rng.shuffle(kinds)
    requests, arrival = [], 0.0
    for kind in kinds:
        requests.append(DemoRequest(kind, round(arrival, 3), *_request(kind, rng)))
        arrival += rng.expovariate(1 / MEAN_GAP_S)
    return requests


def max_model_len(quick: bool) -> int:
    """The tokens a contiguous daemon must reserve per sequence for this workload: the longest
    sequence of any client, rounded up to whole blocks."""
    longest = max(r.max_len for worker in range(NUM_WORKERS) for r in workload(worker, quick))
    return blocks_for(longest, BLOCK_SIZE) * BLOCK_SIZE


def _request(kind: Kind, rng: random.Random) -> tuple[tuple[int, ...], SamplingParams]:
    def tokens(low: int, high: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(low, high)))

    seed = rng.randrange(2**32)
    match kind:
        case "plain":
            return tokens(16, 96), SamplingParams(temperature=0.8, seed=seed,
                                                  max_tokens=rng.randint(64, 128))
        case "parallel":
            return tokens(32, 64), SamplingParams(temperature=1.0, seed=seed, n=4, max_tokens=96)
        case "beam":
            return tokens(24, 48), SamplingParams(temperature=0.0, beam_width=4, max_tokens=48)
        case "system":
            return SYSTEM_PROMPT + tokens(8, 32), SamplingParams(
                temperature=0.8, seed=seed, max_tokens=rng.randint(64, 128))
    assert_never(kind)
