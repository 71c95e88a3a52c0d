"""What bench_runner_restart.py records of greedy streams cut by a kill: each stream's tokens
and their arrival times, the kill's time, and the gaps it left.

    logs = [StreamLog(prompt) for prompt in prompts]
    ... each stream calls log.extend(new_token_ids) as tokens come ...
    kill_at = await kill_midway(logs, new_tokens, lambda: os.kill(pid, signal.SIGKILL))
    ... the streams go on (or are submitted again) to their end ...
    Crash(logs, kill_at, ready_s).gaps_ms()
"""

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from e2e import BLOCK_SIZE


@dataclass
class StreamLog:
    """One stream's tokens and when each reached the client."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    # time.monotonic() of each token's arrival.
    times: list[float] = field(default_factory=list)
    # Tokens it had when the processes were killed.
    at_kill: int = 0

    def extend(self, new: Sequence[int]) -> None:
        self.tokens.extend(new)
        self.times.extend([time.monotonic()] * len(new))

    def gap_s(self, kill_at: float) -> float:
        """The longest wait between two of its tokens from its last before `kill_at` on: the
        restart's stall (tokens computed before the kill may still arrive after it)."""
        last = max(i for i, t in enumerate(self.times) if t <= kill_at)
        return max(b - a for a, b in itertools.pairwise(self.times[last:]))


@dataclass(frozen=True)
class Crash:
    """One run with a kill in the middle."""

    logs: list[StreamLog]
    # time.monotonic() of the kill.
    kill_at: float
    # From the kill to the new processes' READY=1 (the runner's; cold: the daemon's, then the
    # runner's): what of the gap is process start. None where not measured.
    ready_s: float | None = None
    # Tokens the new runner computed beyond the new positions (None where not measured).
    recomputed: int | None = None
    # Computed positions past each sequence's committed tokens at the kill, read from the
    # daemon: the least a restarted runner must compute again (None where not measured).
    uncommitted: int | None = None

    def gaps_ms(self) -> list[float]:
        return [1000 * log.gap_s(self.kill_at) for log in self.logs]


async def kill_midway(logs: list[StreamLog], new_tokens: int, kill: Callable[[], None]) -> float:
    """Once every stream has half its tokens, `kill()`; the time of the kill."""
    while min(len(log.tokens) for log in logs) < new_tokens // 2:
        await asyncio.sleep(0.002)
    kill_at = time.monotonic()
    kill()
    for log in logs:
        log.at_kill = len(log.tokens)
    return kill_at


def check(logs: list[StreamLog], expected: list[list[int]], what: str) -> None:
    """Every stream ended with the tokens of the uninterrupted run."""
    differ = [i for i, (log, tokens) in enumerate(zip(logs, expected, strict=True))
              if log.tokens != tokens]
    assert not differ, f"{what}: streams {differ} differ from the uninterrupted run"


def partial_block_tokens(logs: list[StreamLog]) -> int:
    """Computed positions past each stream's last full block at the kill (its last token is not
    computed yet): the uncommitted tail if every full block were committed at once."""
    return sum((len(log.prompt) + log.at_kill - 1) % BLOCK_SIZE for log in logs)
