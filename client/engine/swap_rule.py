"""Swap or recompute: whether a new sequence's prefix comes back from the daemon's host tier.

A request re-admitted after preemption is allocated again from its tokens; its committed blocks
that the pool evicted since sit in the daemon's host tier (kvpool.proto's "The host-memory
tier"), which restores them unless the allocation says `skip_host_tier`. Restoring costs
copies, recomputing costs a forward over the block's tokens. Per block:

    copy_s      = bytes_per_block / host_copy_bytes_per_s   (the copy in)
    recompute_s = block_size / prefill_tokens_per_s

The copy out to the host tier was made when the pool evicted the block, whatever this choice
is, so only the copy back in is weighed.

`SchedulerConfig.swap` picks the rule: "auto" restores when copy_s < recompute_s (a tie
recomputes), and also while prefill_tokens_per_s is not measured yet (the daemon's default, what
a client that says nothing gets); "always" restores; "never" recomputes. Without a tier
(PoolInfo.host_tier_blocks == 0) nothing is skipped: the flag would change nothing. A prompt's
first admission is the same trade (its prefix may hit the host tier), so the rule applies to
every new sequence without a parent.

    rule = SwapRule("auto", HostTier.from_pool_info(pool_info), block_size=16)
    rule.prefill.observe(tokens=512, seconds=0.02)    # each step's computed tokens and time
    skip = rule.skip_host_tier()                      # SeqStep.skip_host_tier of a new sequence
"""

from dataclasses import dataclass

from pagedkv.client.pool.types import PoolInfo

SWAP_MODES = ("auto", "always", "never")
# Steps computing fewer tokens are decodes, bound by the step's fixed costs rather than by the
# forward's work: their rate would understate what a prefill computes per second.
MIN_MEASURED_TOKENS = 64
# The weight of each new step's rate in the moving average: recent steps count most, and one
# slow step (a compile, another client's burst) moves it only a fifth of the way.
RATE_WEIGHT = 0.2


@dataclass(frozen=True, slots=True)
class HostTier:
    """What the rule reads of the daemon's host tier, once, from its PoolInfo."""

    # Blocks of the daemon's own model the tier holds; 0 = no tier.
    num_blocks: int = 0
    # K and V of block_size tokens over all layers: what one block's copy moves.
    bytes_per_block: int = 0
    # The daemon's copy rate between the tier and the pool; 0 = not known.
    copy_bytes_per_s: int = 0

    @classmethod
    def from_pool_info(cls, info: PoolInfo) -> "HostTier":
        return cls(info.host_tier_blocks, info.bytes_per_block, info.host_copy_bytes_per_s)


def skip_host_tier(mode: str, tier: HostTier, block_size: int,
                   prefill_tokens_per_s: float | None) -> bool:
    """Whether a new sequence without a parent should recompute its prefix rather than have the
    daemon restore it from the host tier (see the module's docstring for the rule). An unknown
    copy rate counts as unmeasured: the daemon's default, restoring."""
    if mode not in SWAP_MODES:
        raise ValueError(f"swap must be one of {', '.join(SWAP_MODES)}, got {mode!r}")
    if tier.num_blocks == 0 or mode == "always":
        return False
    if mode == "never":
        return True
    if not prefill_tokens_per_s or tier.copy_bytes_per_s <= 0:
        return False
    copy_s = tier.bytes_per_block / tier.copy_bytes_per_s
    recompute_s = block_size / prefill_tokens_per_s
    return not copy_s < recompute_s


@dataclass
class PrefillRate:
    """Tokens computed per second of runner steps that computed more than MIN_MEASURED_TOKENS:
    an exponentially weighted moving average, None until such a step was seen."""

    tokens_per_s: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        """One step's tokens computed and its wall time (send to answer)."""
        if tokens <= MIN_MEASURED_TOKENS or seconds <= 0:
            return
        rate = tokens / seconds
        if self.tokens_per_s is None:
            self.tokens_per_s = rate
        else:
            self.tokens_per_s += RATE_WEIGHT * (rate - self.tokens_per_s)


class SwapRule:
    """The engine's swap decisions: its mode, the daemon's tier, its own prefill rate, and how
    often each way was chosen."""

    def __init__(self, mode: str, tier: HostTier, block_size: int) -> None:
        self.mode = mode
        self.tier = tier
        self.block_size = block_size
        self.prefill = PrefillRate()
        # Decisions for new sequences, to restore from the host tier and to recompute (with a
        # tier only; as planned: a plan made again after a failed step decides again).
        self.num_restore = 0
        self.num_recompute = 0

    def skip_host_tier(self) -> bool:
        """The decision for one new sequence without a parent, counted."""
        skip = skip_host_tier(self.mode, self.tier, self.block_size, self.prefill.tokens_per_s)
        if self.tier.num_blocks:
            if skip:
                self.num_recompute += 1
            else:
                self.num_restore += 1
        return skip
