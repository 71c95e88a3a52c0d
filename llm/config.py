"""What `LLM(...)` takes: vLLM's names where they exist, checked before any process starts."""

from dataclasses import dataclass

from pagedkv.client.engine.scheduler import SchedulerConfig
from pagedkv.vocab.geometry import canonical_dtype
from pagedkv.vocab.units import parse_bytes


@dataclass(frozen=True, slots=True)
class LLMConfig:
    """The settings of one `LLM`; ValueError on construction for a bad one."""

    # A local Hugging Face model directory (config.json, weights, tokenizer files), or a preset
    # (tiny, tiny-llama, small-llama) randomly initialized, for demos. None only with `daemon`:
    # the runner's model is then whatever it serves.
    model: str | None = None
    # The folder of the tokenizer; default: the model's directory.
    tokenizer: str | None = None
    # Dtype of the weights and the KV pool: float16, bfloat16, float32, or "auto" (the model
    # config's, float32 when it names none).
    dtype: str = "auto"
    # Token slots per KV block (a power of two).
    block_size: int = 16
    # CUDA: the share of the device's memory pagedkv may use (weights, KV pool, activations),
    # as vLLM's. Ignored on CPU (pool_budget.py says what the CPU pool gets).
    gpu_memory_utilization: float = 0.9
    # The KV pool's size in bytes (an int or "2GiB"), or in blocks; at most one of the two.
    # Either one replaces the sizing by gpu_memory_utilization (CUDA) or the CPU default.
    kv_cache_memory: int | str | None = None
    num_blocks: int | None = None
    # Most sequences stepped together, and most tokens computed per step (prompts are chunked).
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # The embedded daemon's host tier (bytes, an int or "4GiB"; 0: none), as vLLM's swap_space:
    # evicted prefix blocks and preempted requests' blocks come back from host memory instead
    # of being recomputed. `swap` chooses per sequence (SchedulerConfig.swap).
    host_tier_memory: int | str = 0
    swap: str = "auto"
    # Where the pool and the model live: "cpu", "cuda" or "cuda:N"; None: cuda when available.
    device: str | None = None
    # Seed of a preset's random initialization.
    seed: int = 0
    # gRPC targets of a running daemon and runner to use instead of starting both; e.g.
    # "unix:///run/pagedkv/pagedkvd.sock". With `daemon`, give `runner` or `model_name`.
    daemon: str | None = None
    runner: str | None = None
    # With `daemon`: the name of the model to generate with, as its runner registered it with
    # the daemon (kvpool.proto's "Models and pages"): that runner is used (or, with `runner`,
    # checked to serve it).
    model_name: str | None = None
    # Seconds the embedded daemon and runner may take to become ready (the runner loads the
    # model in that time).
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        self._check_sources()
        self._check_pool()
        if self.device is not None:
            kind, _, index = self.device.partition(":")
            if kind not in ("cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
                raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be positive, got {self.startup_timeout_s}")
        self.scheduler()

    def _check_sources(self) -> None:
        """A model to start, or running services to use; a dtype both can load."""
        if self.daemon is None and (self.runner is not None or self.model_name is not None):
            raise ValueError("runner and model_name name a running daemon's runner: give daemon "
                             "too (or neither, to start a daemon and a runner)")
        if self.daemon is not None and self.runner is None and not self.model_name:
            raise ValueError("with daemon, give runner (a running runner's target) or "
                             "model_name (the model whose runner to use)")
        if self.model is None and self.daemon is None:
            raise ValueError("give model: a local model directory or a preset")
        if self.dtype != "auto":
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    def _check_pool(self) -> None:
        """Block size, and at most one explicit pool size."""
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.num_blocks is not None:
            raise ValueError("size the KV pool with kv_cache_memory or num_blocks, not both")
        try:
            kv_cache_bytes = self.kv_cache_bytes
        except ValueError as exc:
            raise ValueError(f"kv_cache_memory: {exc}") from exc
        if kv_cache_bytes is not None and kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        try:
            host_tier = self.host_tier_bytes
        except ValueError as exc:
            raise ValueError(f"host_tier_memory: {exc}") from exc
        if host_tier and self.daemon is not None:
            raise ValueError("host_tier_memory sizes the daemon LLM starts: a running daemon's "
                             "is its own setting")

    def scheduler(self) -> SchedulerConfig:
        """The engine's batch limits."""
        return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               swap=self.swap)

    @property
    def host_tier_bytes(self) -> int:
        """host_tier_memory in bytes (ValueError for a malformed or negative size)."""
        size = self.host_tier_memory
        nbytes = size if isinstance(size, int) else parse_bytes(size)
        if nbytes < 0:
            raise ValueError(f"host_tier_memory must be 0 (none) or positive, got {size!r}")
        return nbytes

    @property
    def kv_cache_bytes(self) -> int | None:
        """kv_cache_memory in bytes (ValueError for a malformed size)."""
        return None if self.kv_cache_memory is None else parse_bytes(self.kv_cache_memory)
