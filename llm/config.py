"""What `LLM(...)`, `pagedkv generate` and `pagedkv serve` take: one set of engine settings with
vLLM's names (its EngineArgs), checked before any process starts.

    config = LLMConfig(model="/models/qwen2.5-0.5b", max_model_len=4096)
    LLMConfig.add_cli_args(parser, positional_model=True)    # --max-model-len, ...
    config = LLMConfig.from_cli_args(parser.parse_args())

Each field's flag is its name with dashes (`max_model_len` -> `--max-model-len`), as vLLM's
`EngineArgs.add_cli_args` spells them; a flag not given leaves the field's default, so the
defaults live here only. The settings of the daemon and runner an `LLM` starts (pool, block
size, dtype, device, prefix caching, host tier) are refused with `daemon`: a running daemon's
and runner's own settings apply there, and a flag accepted must be honoured.
"""

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Self

from pagedkv.client.engine.scheduler import SchedulerConfig
from pagedkv.client.engine.swap_rule import SWAP_MODES
from pagedkv.vocab.geometry import KV_CACHE_DTYPES, cache_dtype, model_dtype
from pagedkv.vocab.units import parse_bytes

# Token slots per KV block of a started daemon when block_size is not given (vLLM's on CUDA).
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class LLMConfig:
    """The settings of one engine; ValueError on construction for a bad one."""

    # A local Hugging Face model directory (config.json, weights, tokenizer files), or a preset
    # (tiny, tiny-llama, small-llama) randomly initialized, for demos. None only with `daemon`:
    # the runner's model is then whatever it serves.
    model: str | None = None
    # The folder of the tokenizer; default: the model's directory.
    tokenizer: str | None = None
    # Dtype of the weights and the KV pool: float16, bfloat16, float32, or "auto" (the model
    # config's, float32 when it names none).
    dtype: str = "auto"
    # The KV pool's dtype, as vLLM's --kv-cache-dtype: "auto" (dtype's) or "fp8"/"fp8_e4m3"
    # (e4m3 with scale 1.0: half an fp16 block), given to the daemon and the runner started.
    kv_cache_dtype: str = "auto"
    # Token slots per KV block (a power of two); None: DEFAULT_BLOCK_SIZE.
    block_size: int | None = None
    # The share of the device's memory pagedkv may use, as vLLM's (weights, KV pool,
    # activations); None: 0.9 on CUDA, the CPU rule of pool_budget.py on CPU.
    gpu_memory_utilization: float | None = None
    # The KV pool's size in bytes (an int or "2GiB"), or in blocks; at most one of the two.
    # Either one replaces the sizing of pool_budget.py.
    kv_cache_memory: int | str | None = None
    num_blocks: int | None = None
    # The most tokens a sequence may hold, prompt and completion (vLLM's max_model_len): at most
    # the model's positions; None: the model's positions.
    max_model_len: int | None = None
    # Most sequences stepped together, and most tokens computed per step (prompts are chunked).
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Share the blocks of identical prompt prefixes (the daemon's prefix cache); None: on.
    enable_prefix_caching: bool | None = None
    # The embedded daemon's host tier (bytes, an int or "4GiB"; 0: none), as vLLM's swap_space:
    # evicted prefix blocks and preempted requests' blocks come back from host memory instead
    # of being recomputed. `swap` chooses per sequence (SchedulerConfig.swap).
    host_tier_memory: int | str = 0
    swap: str = "auto"
    # Where the pool and the model live: "cpu", "cuda" or "cuda:N"; None: cuda when available.
    device: str | None = None
    # vLLM's seed: the seed of every request that brings none (each its own, derived from this
    # one and the request's number, so a run is reproducible), and of a preset's random
    # weights. None: unseeded requests draw from the runner's shared generator; preset seed 0.
    seed: int | None = None
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
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be positive, got {self.startup_timeout_s}")
        self.scheduler()

    def _check_sources(self) -> None:
        """A model to start, or running services to use (and nothing of the started ones'); a
        dtype both can load."""
        if self.daemon is None and (self.runner is not None or self.model_name is not None):
            raise ValueError("runner and model_name name a running daemon's runner: give daemon "
                             "too (or neither, to start a daemon and a runner)")
        if self.daemon is not None and self.runner is None and not self.model_name:
            raise ValueError("with daemon, give runner (a running runner's target) or "
                             "model_name (the model whose runner to use)")
        if self.model is None and self.daemon is None:
            raise ValueError("give model: a local model directory or a preset")
        if self.daemon is not None:
            for name in STARTED_ONLY:
                if getattr(self, name) != _FIELDS[name].default:
                    raise ValueError(f"{name} sets the daemon and runner LLM starts: with "
                                     "daemon, the running ones' own settings apply")
        if self.dtype != "auto":
            object.__setattr__(self, "dtype", model_dtype(self.dtype))
        cache_dtype("float16", self.kv_cache_dtype)  # ValueError naming the choices

    def _check_pool(self) -> None:
        """Block size, and at most one explicit pool size."""
        if self.block_size is not None and (self.block_size <= 0
                                            or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
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
            _ = self.host_tier_bytes  # parsed here for its ValueError
        except ValueError as exc:
            raise ValueError(f"host_tier_memory: {exc}") from exc

    def scheduler(self) -> SchedulerConfig:
        """The engine's batch limits, its positions and its default seed."""
        return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               swap=self.swap, max_model_len=self.max_model_len or 0,
                               seed=self.seed)

    @property
    def started_block_size(self) -> int:
        """The block size of a daemon this config starts."""
        return self.block_size or DEFAULT_BLOCK_SIZE

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

    # ------------------------------------------------------------------ the command line

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *,
                     positional_model: bool = False) -> None:
        """Declare a flag per field of CLI_FLAGS on `parser` (and, with `positional_model`, the
        model as the first positional argument too, as `vllm serve MODEL`)."""
        group = parser.add_argument_group("engine", "the engine's settings (vLLM's names)")
        if positional_model:
            group.add_argument("model_tag", nargs="?", metavar="MODEL", default=argparse.SUPPRESS,
                               help="the model, as --model")
        for name, options in CLI_FLAGS.items():
            default = _FIELDS[name].default
            options = {**options, "help": options["help"].format(default=default)}
            group.add_argument(f"--{name.replace('_', '-')}", default=argparse.SUPPRESS,
                               **options)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> Self:
        """The config of the flags given (the rest keep their defaults), with `overrides`;
        ValueError naming what is wrong."""
        given = {name: getattr(args, name) for name in CLI_FLAGS if hasattr(args, name)}
        return cls(**{**given, "model": cls.cli_model(args), **overrides})

    @staticmethod
    def cli_model(args: argparse.Namespace) -> str | None:
        """The model the command line names, as MODEL or --model; ValueError when it names two."""
        model, tag = getattr(args, "model", None), getattr(args, "model_tag", None)
        if None not in (model, tag) and model != tag:
            raise ValueError(f"the model is given twice: {tag!r} and --model {model!r}")
        return tag or model


_FIELDS = {field.name: field for field in dataclasses.fields(LLMConfig)}

# The fields of the daemon and runner an LLM starts: refused (when not their defaults) with a
# running daemon, whose own settings apply.
STARTED_ONLY = ("dtype", "kv_cache_dtype", "block_size", "gpu_memory_utilization",
                "kv_cache_memory", "num_blocks", "enable_prefix_caching", "host_tier_memory",
                "device")

# The fields `add_cli_args` declares, with argparse's options ({default}: the field's).
CLI_FLAGS: dict[str, dict[str, Any]] = {
    "model": {"help": "a local Hugging Face model directory, or a preset (random weights, "
                      "token ids only)"},
    "tokenizer": {"help": "the tokenizer's folder (default: the model's)"},
    "dtype": {"help": "float16, bfloat16, float32 or auto (default: the model config's)"},
    "kv_cache_dtype": {"choices": KV_CACHE_DTYPES,
                       "help": "the KV cache's dtype: auto (dtype's) or fp8 (e4m3, half an fp16 "
                               "block) (default {default})"},
    "device": {"help": "cpu, cuda or cuda:N (default: cuda when available)"},
    "max_model_len": {"type": int, "help": "most tokens a sequence holds, prompt and "
                                           "completion (default: the model's positions)"},
    "block_size": {"type": int, "help": f"token slots per KV block (default "
                                        f"{DEFAULT_BLOCK_SIZE})"},
    "gpu_memory_utilization": {"type": float, "help": "share of the device's memory to use "
                                                      "(default 0.9 on CUDA; on CPU, of the "
                                                      "RAM available, default 0.25)"},
    "kv_cache_memory": {"metavar": "BYTES", "help": "KV pool size, e.g. 2GiB (default: "
                                                    "planned from the model and the memory)"},
    "num_blocks": {"type": int, "help": "KV pool size in blocks"},
    "max_num_seqs": {"type": int, "help": "most sequences batched together (default "
                                          "{default})"},
    "max_num_batched_tokens": {"type": int, "help": "most tokens computed per step (default "
                                                    "{default})"},
    "enable_prefix_caching": {"action": argparse.BooleanOptionalAction,
                              "help": "share the KV blocks of identical prompt prefixes "
                                      "(default: on)"},
    "host_tier_memory": {"metavar": "BYTES", "help": "the started daemon's host tier, e.g. "
                                                     "8GiB (default 0: none)"},
    "swap": {"choices": SWAP_MODES, "help": "restore evicted and preempted blocks from the "
                                            "host tier, or recompute them (default {default}: "
                                            "whichever is faster)"},
    "seed": {"type": int, "help": "the seed of requests that bring none, and of a preset's "
                                  "weights (default: unseeded)"},
    "daemon": {"help": "gRPC target of a running pagedkvd (starts none)"},
    "runner": {"help": "gRPC target of a running pagedkv runner (with --daemon)"},
}
