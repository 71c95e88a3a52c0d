"""The models one pool serves and their K/V formats (kvpool.proto, "Models and pages").

A model is a name, a K/V geometry (its `KvShape`: layers, KV heads, head size, dtype), the
runner target it registered, whether it sleeps, and its [models.NAME] policy. A format is one
geometry: one block pool over num_pages * blocks_per_page block ids, of which it holds only
the pages the page broker gave it (`pages.py`), its session operations, its cache hygiene and
its view of the pool memory. Models of one geometry share a format; their prefix keys differ
by a tag put before the session's salt (`Model.salt_tag`), so one model never hits another's
K/V. The daemon's own model (its model_config) is model 0 of format 0, with an empty tag:
a one-model daemon keys its prefixes exactly as before models existed.

Registration is checked before anything is stored: a malformed name or geometry, a geometry
whose bytes_per_block does not divide page_bytes (INVALID_ARGUMENT), a name taken with
another geometry (ModelExists), max_models reached (LimitExceeded). Registering a name again
with the same geometry is idempotent (a restarted runner): only its runner target changes.
"""

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pagedkv.daemon.core import BlockPool, InvalidArgument
from pagedkv.daemon.service.cache_hygiene import CacheHygiene
from pagedkv.daemon.service.errors import LimitExceeded, ModelExists, ModelNotFound
from pagedkv.daemon.service.memory_order import BlockMemory
from pagedkv.daemon.service.session_ops import SessionOps
from pagedkv.vocab.geometry import canonical_dtype, dtype_bytes

# A model's name: at most 128 bytes of letters, digits and "._-/:" (kvpool.proto ModelInfo).
MODEL_NAME = re.compile(r"^[A-Za-z0-9._\-/:]{1,128}$")
# The bound on registered models when the settings give none.
DEFAULT_MAX_MODELS = 16


@dataclass(frozen=True, slots=True)
class KvShape:
    """A K/V geometry: what decides a format (block_size is the pool's, the same for all)."""

    # Transformer layers, KV heads per layer, elements per head vector.
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # Canonical dtype name ("float16", "bfloat16", "float32").
    dtype: str

    def bytes_per_block(self, block_size: int) -> int:
        """K and V of `block_size` tokens in every layer."""
        return (2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)
                * block_size)

    @property
    def label(self) -> str:
        """The format's name in metrics and messages, e.g. "2x2x16:float32"."""
        return f"{self.num_layers}x{self.num_kv_heads}x{self.head_dim}:{self.dtype}"


def checked_shape(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> KvShape:
    """A geometry from a request, or InvalidArgument naming what is wrong."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
        if not 0 < value <= 1 << 16:
            raise InvalidArgument(f"{name} must be in [1, 65536], got {value}")
    try:
        return KvShape(num_layers, num_kv_heads, head_dim, canonical_dtype(dtype))
    except ValueError as exc:
        raise InvalidArgument(f"dtype: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """A model's [models.NAME] table, in bytes; 0 = none."""

    # Reserved: other formats never take the pool below what this model still needs of it.
    min_memory: int = 0
    # Cap on the model's memory (blocks its sessions hold + its committed cached blocks).
    max_memory: int = 0


@dataclass(slots=True, eq=False)
class Format:
    """One geometry's blocks: a pool over every page's block ids, holding some pages."""

    # Its index: 0 is the daemon's own model's format.
    number: int
    shape: KvShape
    bytes_per_block: int
    # page_bytes / bytes_per_block: block b lies in page b // blocks_per_page.
    blocks_per_page: int
    # Its bookkeeping, session operations, and cache hygiene (its cached blocks by model).
    pool: BlockPool
    ops: SessionOps
    hygiene: CacheHygiene
    # Its view of the pool memory (None: a bookkeeping-only pool).
    memory: BlockMemory | None


@dataclass(slots=True, eq=False)
class Model:
    """One registered model."""

    name: str
    # Index in registration order (0: the daemon's own), the holder group of its sessions.
    number: int
    format: Format
    # Where its runner serves clients, as registered; "" if none.
    runner_target: str = ""
    # Sleeping: no new session, nothing cached (`PoolService.set_model_state`).
    asleep: bool = False
    policy: ModelPolicy = ModelPolicy()

    @property
    def salt_tag(self) -> bytes:
        """Put before a session's salt where the pool keys prefixes: b"" for the daemon's own
        model (its keys as before), b"model:NAME\\0" for every other."""
        return b"" if self.number == 0 else b"model:" + self.name.encode() + b"\0"

    def memory_bytes(self) -> int:
        """Blocks its sessions hold and its committed cached blocks, in bytes."""
        fmt = self.format
        used = fmt.pool.blocks_held(2, self.number)
        return (used + fmt.hygiene.cached.count(self.number)) * fmt.bytes_per_block


@dataclass(frozen=True, slots=True)
class ModelFigures:
    """One model's figures now, for GetStats, GetPoolInfo and /metrics."""

    model: Model
    # Blocks its sessions hold, and its committed cached blocks (of its format).
    used_blocks: int
    cached_blocks: int
    # Pages its format holds (shared by the models of its geometry).
    format_pages: int


class ModelRegistry:
    """The registered models and their formats (see the module docstring)."""

    def __init__(self, own_name: str, own: Format, *, page_bytes: int,
                 policies: dict[str, ModelPolicy], max_models: int,
                 new_format: Callable[[int, KvShape, int], Format]) -> None:
        # Bytes of one page; every format's bytes_per_block divides it.
        self.page_bytes = page_bytes
        # Each model's policy by name, from the settings (a model not listed has none).
        self.policies = policies
        self.max_models = max_models
        # Builds format `number` of a shape with `blocks_per_page` (the service's).
        self._new_format = new_format
        self.formats: list[Format] = [own]
        # The most block ids of any format: what an answer's block ids are bounded by.
        self.max_num_blocks = own.pool.num_blocks
        self._by_name: dict[str, Model] = {}
        self.own = self._add(own_name, own, "")

    def __iter__(self) -> Iterator[Model]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> Model:
        """The model of that name ("" = the daemon's own), or ModelNotFound listing them."""
        if not name:
            return self.own
        model = self._by_name.get(name)
        if model is None:
            shown = name if MODEL_NAME.match(name) else "(malformed name)"
            raise ModelNotFound(f"no model {shown!r} is registered; registered: "
                                f"{', '.join(sorted(self._by_name))}")
        return model

    def register(self, name: str, shape: KvShape, runner_target: str,
                 allow_new_format: bool) -> Model:
        """Register `name` (idempotent for the same shape); checks first, then changes."""
        if not MODEL_NAME.match(name):
            raise InvalidArgument("model name must be 1 to 128 bytes of letters, digits and "
                                  f"'._-/:', got {name[:64]!r}")
        if len(runner_target.encode()) > 512:
            raise InvalidArgument("runner_target is longer than 512 bytes")
        known = self._by_name.get(name)
        if known is not None:
            if known.format.shape != shape:
                raise ModelExists(f"model {name!r} is registered with geometry "
                                  f"{known.format.shape.label}, not {shape.label}")
            known.runner_target = runner_target
            return known
        if len(self._by_name) >= self.max_models:
            raise LimitExceeded(f"{len(self._by_name)} models are registered; the limit is "
                                f"max_models={self.max_models}")
        fmt = next((f for f in self.formats if f.shape == shape), None)
        if fmt is None:
            fmt = self._format_for(shape, allow_new_format)
        return self._add(name, fmt, runner_target)

    def _format_for(self, shape: KvShape, allow_new_format: bool) -> Format:
        block_size = self.formats[0].pool.block_size
        per_block = shape.bytes_per_block(block_size)
        if self.page_bytes <= 0 or self.page_bytes % per_block:
            raise InvalidArgument(f"geometry {shape.label} takes {per_block} bytes per block of "
                                  f"{block_size} tokens, which does not divide the pool's "
                                  f"page_bytes={self.page_bytes}")
        if not allow_new_format:
            raise InvalidArgument(f"geometry {shape.label} differs from the pool's "
                                  f"{self.formats[0].shape.label}, and this pool serves one "
                                  "format (allocator contiguous, or no per-format memory views)")
        fmt = self._new_format(len(self.formats), shape, self.page_bytes // per_block)
        self.formats.append(fmt)
        self.max_num_blocks = max(self.max_num_blocks, fmt.pool.num_blocks)
        return fmt

    def _add(self, name: str, fmt: Format, runner_target: str) -> Model:
        model = Model(name, len(self._by_name), fmt, runner_target,
                      policy=self.policies.get(name, ModelPolicy()))
        self._by_name[name] = model
        return model

    def models_of(self, fmt: Format) -> list[Model]:
        """The models sharing `fmt`."""
        return [m for m in self._by_name.values() if m.format is fmt]
