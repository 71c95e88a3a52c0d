"""What the runner fuzzer counts and prints (`fuzz_runner.py`), shared by its clients.

Hostile actions are counted by kind and outcome: "refused CODE" (an error status), "accepted"
(answered OK), "cancelled" (the client gave up mid-step), "killed" (its process was SIGKILLed).
The kinds in MUST_REFUSE are attacks with no harmless reading: each must end refused.
"""

import time
from collections import Counter, deque
from dataclasses import dataclass, field

# Findings kept in full (the counts go on).
KEEP = 20
# Hostile actions named beside a wrong token: the last RECENT_COUNT of the last RECENT_S seconds.
RECENT_S = 3.0
RECENT_COUNT = 6
# Attacks every correct stack refuses: a forged history (tokens the daemon does not hold), a
# token id outside the vocabulary, a step for another session, K/V certified by a session that
# did not compute it (Commit, Step with commit).
MUST_REFUSE = ("forged_history", "oov_history", "oov_token", "junk_session",
               "commit_uncomputed", "step_commit_uncomputed")


@dataclass
class RunnerFuzzReport:
    seed: int
    seconds: float = 0.0
    # Honest client steps answered, tokens they sampled and the shadow checked, near-ties.
    steps: int = 0
    checked_tokens: int = 0
    ties: int = 0
    # Honest sequences started (prefix-cache hits among them) and forked.
    sequences: int = 0
    cached_sequences: int = 0
    forks: int = 0
    # Honest steps sent with follow, pushed answers taken, release-only steps sent while the
    # runner followed; steps sent after a sleep letting pushes queue, and StalePlan refusals
    # (each after a push the step had not read: expected).
    follow_steps: int = 0
    pushes_taken: int = 0
    releases_mid_follow: int = 0
    stale_sent: int = 0
    stale_refusals: int = 0
    # Following gone wrong: a push that is not the implied step's, a StalePlan when every push
    # was taken, a stale step accepted, a release-only step refused while following.
    follow_findings: list[str] = field(default_factory=list)
    # Tokens (or token counts) an honest client was given that the shadow refutes.
    wrong_tokens: list[str] = field(default_factory=list)
    # Honest steps that failed, by status code; the failures other than a full pool.
    honest_failures: Counter[str] = field(default_factory=Counter)
    honest_findings: list[str] = field(default_factory=list)
    # INTERNAL or UNKNOWN answers to anyone.
    internal_errors: list[str] = field(default_factory=list)
    # (kind, outcome) of every hostile action; the recent ones, (monotonic time, description).
    hostile: Counter[tuple[str, str]] = field(default_factory=Counter)
    recent_hostile: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=64))
    # Blocks and sequences still held once every session closed or lapsed (-1: not measured),
    # and the pool's size and free blocks then.
    leaked_blocks: int = -1
    leftover_sequences: int = -1
    num_blocks: int = 0
    free_blocks: int = 0

    def hostile_started(self, kind: str, detail: str) -> None:
        """An action began: named beside a wrong token or failure meanwhile."""
        self.recent_hostile.append((time.monotonic(), f"{kind} started {detail}"))

    def hostile_action(self, kind: str, outcome: str, detail: str = "") -> None:
        """An action ended with `outcome`."""
        self.hostile[kind, outcome] += 1
        self.recent_hostile.append((time.monotonic(), f"{kind} {outcome} {detail}".strip()))

    def recent(self) -> list[str]:
        """The last RECENT_COUNT hostile actions of the last RECENT_S seconds."""
        now = time.monotonic()
        return [text for at, text in self.recent_hostile if now - at <= RECENT_S][-RECENT_COUNT:]

    def kinds(self) -> dict[str, Counter[str]]:
        """Hostile outcomes by kind."""
        by_kind: dict[str, Counter[str]] = {}
        for (kind, outcome), n in sorted(self.hostile.items()):
            by_kind.setdefault(kind, Counter())[outcome] += n
        return by_kind

    def not_refused(self) -> dict[str, int]:
        """MUST_REFUSE actions that were not refused, by kind."""
        return {kind: n for kind, outcomes in self.kinds().items() if kind in MUST_REFUSE
                if (n := sum(c for o, c in outcomes.items() if not o.startswith("refused")))}

    def figures(self) -> list[str]:
        lines = [f"runner_fuzz_steps: {self.steps} steps",
                 f"runner_fuzz_steps_per_s: {self.steps / max(self.seconds, 1e-9):.1f} steps/s",
                 f"runner_fuzz_checked_tokens: {self.checked_tokens} tokens",
                 f"runner_fuzz_wrong_tokens: {len(self.wrong_tokens)} tokens",
                 f"runner_fuzz_ties: {self.ties} tokens",
                 f"runner_fuzz_sequences: {self.sequences} sequences",
                 f"runner_fuzz_cached_sequences: {self.cached_sequences} sequences",
                 f"runner_fuzz_forks: {self.forks} forks",
                 f"runner_fuzz_follow_steps: {self.follow_steps} steps",
                 f"runner_fuzz_pushes_taken: {self.pushes_taken} pushes",
                 f"runner_fuzz_releases_mid_follow: {self.releases_mid_follow} steps",
                 f"runner_fuzz_stale_sent: {self.stale_sent} steps",
                 f"runner_fuzz_stale_refusals: {self.stale_refusals} steps",
                 f"runner_fuzz_follow_findings: {len(self.follow_findings)} findings",
                 f"runner_fuzz_honest_failed_steps: {sum(self.honest_failures.values())} steps",
                 f"runner_fuzz_internal_errors: {len(self.internal_errors)} errors",
                 f"runner_fuzz_hostile_actions: {sum(self.hostile.values())} actions",
                 f"runner_fuzz_hostile_not_refused: {sum(self.not_refused().values())} actions",
                 f"runner_fuzz_leaked_blocks: {self.leaked_blocks} blocks",
                 f"runner_fuzz_leftover_sequences: {self.leftover_sequences} sequences"]
        for kind, outcomes in self.kinds().items():
            text = ", ".join(f"{outcome} {n}" for outcome, n in outcomes.most_common())
            lines.append(f"runner_fuzz_hostile_{kind}: {sum(outcomes.values())} actions ({text})")
        return lines

    def findings(self) -> list[str]:
        found = [f"wrong token: {w}" for w in self.wrong_tokens[:KEEP]]
        found += [f"honest step failed: {f}" for f in self.honest_findings[:KEEP]]
        found += [f"following: {f}" for f in self.follow_findings[:KEEP]]
        found += [f"internal error: {e}" for e in self.internal_errors[:KEEP]]
        found += [f"{kind}: {n} actions not refused" for kind, n in self.not_refused().items()]
        if self.leaked_blocks != 0 or self.leftover_sequences != 0:
            found.append(f"{self.leaked_blocks} blocks and {self.leftover_sequences} sequences "
                         "held after every session ended")
        return found
