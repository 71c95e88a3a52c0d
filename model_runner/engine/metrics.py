"""The runner's Prometheus figures: step latency, tokens and sequences per forward, prefill vs
decode tokens, how long a prepared step waited for its forward, how many sessions' daemon
Steps shared one call, and the answers pushed to streams following a session."""

import prometheus_client
from prometheus_client.registry import CollectorRegistry

# A step takes milliseconds (decode) to seconds (a long CPU prefill).
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class RunnerMetrics:
    """Fed by the step engine; exported on the runner's /metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._step = prometheus_client.Histogram(
            "pagedkv_runner:step_duration_seconds",
            "A client step, arrival to answer; a step of a decode run (following), its forward "
            "taken to its push.",
            registry=registry, buckets=STEP_BUCKETS_S)
        self._wait = prometheus_client.Histogram(
            "pagedkv_runner:queue_wait_seconds",
            "From a step's daemon round trip done to its forward starting.",
            registry=registry, buckets=STEP_BUCKETS_S)
        self._forward = prometheus_client.Histogram(
            "pagedkv_runner:forward_duration_seconds", "One merged forward pass with sampling.",
            registry=registry, buckets=STEP_BUCKETS_S)
        self._tokens = prometheus_client.Histogram(
            "pagedkv_runner:tokens_per_forward", "Tokens computed by one forward pass.",
            registry=registry, buckets=SIZE_BUCKETS)
        self._seqs = prometheus_client.Histogram(
            "pagedkv_runner:sequences_per_forward", "Sequences in one forward pass.",
            registry=registry, buckets=SIZE_BUCKETS)
        self._kind = prometheus_client.Counter(
            "pagedkv_runner:tokens", "Tokens computed, by kind (prefill or decode).", ["kind"],
            registry=registry)
        self._ahead = prometheus_client.Counter(
            "pagedkv_runner:decode_ahead_tokens",
            "Decode tokens computed ahead of their client's step (decode_ahead), answered from "
            "those results (a decode run's pushed tokens count as both), and ahead steps that "
            "failed (the client's step redid them).",
            ["outcome"], registry=registry)
        self._daemon_steps = prometheus_client.Histogram(
            "pagedkv_runner:steps_per_daemon_call",
            "Sessions' daemon Steps sent in one StepMany call (daemon_steps.py).",
            registry=registry, buckets=SIZE_BUCKETS)
        self._decode_starts = prometheus_client.Counter(
            "pagedkv_runner:decode_forwards",
            "Decode-only forwards by how they started: idle_wait if a step of it that made a "
            "daemon call became ready (that call answered) after the previous forward ended, so "
            "the forward thread sat idle for it (waiting on the daemon, or on the client's step "
            "before that); queued if every such step was ready when the thread came free (a "
            "step inside its sequences' reservations makes no daemon call).",
            ["start"], registry=registry)
        self._pushes = prometheus_client.Counter(
            "pagedkv_runner:pushes",
            "Answers pushed on Runner.StepStreams while the runner followed their sessions "
            "(follow): answered, or failed (the push carried its status and following ended).",
            ["outcome"], registry=registry)
        self._recomputed = prometheus_client.Counter(
            "pagedkv_runner:recomputed_tokens",
            "Tokens of histories a client resent (the runner had forgotten the sequence: its "
            "own restart, or a daemon that went away or came back from its crash log) computed "
            "again: those past the daemon's committed tokens (the step's new token not "
            "counted).",
            registry=registry)
        # The labelled series fed on every forward and every decode run step, looked up once
        # (a `labels()` call takes a lock and builds a key: the forward thread pays it per step).
        self._prefill_tokens = self._kind.labels("prefill")
        self._decode_tokens = self._kind.labels("decode")
        self._ahead_computed = self._ahead.labels("computed")
        self._ahead_used = self._ahead.labels("used")
        self._decode_idle_wait = self._decode_starts.labels("idle_wait")
        self._decode_queued = self._decode_starts.labels("queued")
        self._pushes_answered = self._pushes.labels("answered")

    def recomputed(self, num_tokens: int) -> None:
        self._recomputed.inc(num_tokens)

    def push(self, ok: bool) -> None:
        (self._pushes_answered if ok else self._pushes.labels("failed")).inc()

    def decode_forward(self, waited: bool) -> None:
        (self._decode_idle_wait if waited else self._decode_queued).inc()

    def daemon_steps(self, entries: int) -> None:
        self._daemon_steps.observe(entries)

    def step(self, seconds: float) -> None:
        self._step.observe(seconds)

    def queue_wait(self, seconds: float) -> None:
        self._wait.observe(seconds)

    def ahead_computed(self, num_tokens: int) -> None:
        self._ahead_computed.inc(num_tokens)

    def ahead_used(self, num_tokens: int) -> None:
        self._ahead_used.inc(num_tokens)

    def ahead_failed(self, num_tokens: int) -> None:
        self._ahead.labels("failed").inc(num_tokens)

    def forward(self, seconds: float, num_seqs: int, prefill_tokens: int,
                decode_tokens: int) -> None:
        self._forward.observe(seconds)
        self._seqs.observe(num_seqs)
        self._tokens.observe(prefill_tokens + decode_tokens)
        self._prefill_tokens.inc(prefill_tokens)
        self._decode_tokens.inc(decode_tokens)
