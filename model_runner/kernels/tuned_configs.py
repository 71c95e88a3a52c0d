"""Launch options of the Triton kernels (num_warps, num_stages), tuned on a device and committed as
data, so that no first launch tunes under load.

    options = launch_options(ConfigKey("decode", 128, 4, "bfloat16", "bfloat16"),
                             default=LaunchOptions(num_warps=4, num_stages=2))
    launch(kernel, grid, ..., **options.kwargs())

The table (tuned_configs.json, next to this module) maps (kernel, HEAD_DIM, GROUP, dtype, cache
dtype) to the options benchmarks/tune_kernels_gpu.py (`make tune-gpu`) measured fastest on the
device it names (`tuned_on`; null: nobody tuned it, the entries are the launchers' defaults). A
key the table lacks gets the launcher's own default: the spill-free choices that
test_kernels_compile checks. The table is read once, on the first launch; a malformed table is a
ValueError naming the file and what is wrong in it, before any kernel runs with it.
"""

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

# The committed table.
TABLE_PATH = Path(__file__).with_name("tuned_configs.json")
# The kernels whose options the table holds: decode's split kernel and the prefill kernel (the
# store and merge kernels are a few microseconds, launched with Triton's defaults).
KERNELS = ("decode", "prefill")
# Model dtypes and cache dtypes a key may name (torch's names, without "torch.").
DTYPES = ("float16", "bfloat16", "float32")
KV_DTYPES = (*DTYPES, "float8_e4m3fn")
# The keys the tuner measures and the committed table holds: the families' head dims, the usual
# GQA groups (another group falls back to the defaults), each model dtype with a cache of its own
# dtype and with an fp8 one.
TABLE_HEAD_DIMS = (64, 128, 256)
TABLE_GROUPS = (1, 2, 4, 8)
# Values a launch may take: warps per program, software-pipelining stages of the K/V loop.
NUM_WARPS = (1, 2, 4, 8, 16)
NUM_STAGES = (1, 2, 3, 4, 5, 6)
# The fields of one entry and of the table.
KEY_FIELDS = ("kernel", "head_dim", "group", "dtype", "kv_dtype")
ENTRY_FIELDS = (*KEY_FIELDS, "num_warps", "num_stages")
TABLE_FIELDS = ("tuned_on", "triton", "configs")


@dataclass(frozen=True)
class ConfigKey:
    """What a kernel's best launch options depend on."""

    kernel: str  # one of KERNELS
    head_dim: int  # the model's head_dim (the kernel's HEAD_DIM)
    group: int  # query heads per KV head (the kernel's GROUP)
    dtype: str  # the query's dtype: the model's
    kv_dtype: str  # the cache's dtype (float8_e4m3fn for an fp8 cache)

    @classmethod
    def of(cls, kernel: str, head_dim: int, group: int, dtype: torch.dtype,
           kv_dtype: torch.dtype) -> "ConfigKey":
        """The key of a launch on tensors of these torch dtypes."""
        return cls(kernel, head_dim, group, dtype_name(dtype), dtype_name(kv_dtype))


@dataclass(frozen=True)
class LaunchOptions:
    """Triton's launch options the table chooses."""

    num_warps: int  # warps per program
    num_stages: int  # pipelining stages of the kernel's loop over K/V tiles

    def kwargs(self) -> dict[str, int]:
        """The options as a launch's keyword arguments."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclass(frozen=True)
class TunedTable:
    """A table of launch options and where it came from."""

    path: Path  # the file it was read from (or is written to)
    tuned_on: str | None  # the device the tuner measured on; None: untuned defaults
    triton: str | None  # the Triton version it was measured with
    configs: dict[ConfigKey, LaunchOptions]  # the options of each key

    def options(self, key: ConfigKey, default: LaunchOptions) -> LaunchOptions:
        """The key's options, or `default` when the table lacks it."""
        return self.configs.get(key, default)

    def with_options(self, key: ConfigKey, options: LaunchOptions) -> "TunedTable":
        """A copy of the table with `key` set to `options`."""
        return replace(self, configs={**self.configs, key: options})

    def to_json(self) -> str:
        """The table as the file holds it: one entry a line, in key order."""
        entries = [{**vars(key), **vars(self.configs[key])}
                   for key in sorted(self.configs, key=_sort_key)]
        lines = ",\n".join(f"    {json.dumps(entry)}" for entry in entries)
        return (f'{{\n  "tuned_on": {json.dumps(self.tuned_on)},\n  "triton": '
                f'{json.dumps(self.triton)},\n  "configs": [\n{lines}\n  ]\n}}\n')


def table_keys(kernels: tuple[str, ...] = KERNELS) -> list[ConfigKey]:
    """The keys of the table the tuner writes, in the file's order."""
    return [ConfigKey(kernel, head_dim, group, dtype, kv_dtype)
            for kernel in kernels for head_dim in TABLE_HEAD_DIMS for group in TABLE_GROUPS
            for dtype in DTYPES for kv_dtype in (dtype, "float8_e4m3fn")]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def load_table(path: Path) -> TunedTable:
    """The table in `path`; ValueError naming the file and the fault if it is malformed."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"tuned launch configs {path}: {exc}") from exc
    try:
        return _parse(path, data)
    except ValueError as exc:
        raise ValueError(f"tuned launch configs {path}: {exc}") from None


def _parse(path: Path, data: Any) -> TunedTable:
    if not isinstance(data, dict) or sorted(data) != sorted(TABLE_FIELDS):
        raise ValueError(f"expected an object with exactly the fields {TABLE_FIELDS}")
    for name in ("tuned_on", "triton"):
        if data[name] is not None and not isinstance(data[name], str):
            raise ValueError(f"{name} must be a string or null, got {data[name]!r}")
    if not isinstance(data["configs"], list):
        raise ValueError("configs must be a list")
    configs: dict[ConfigKey, LaunchOptions] = {}
    for index, entry in enumerate(data["configs"]):
        key, options = _parse_entry(entry, f"configs[{index}]")
        if key in configs:
            raise ValueError(f"configs[{index}] repeats the key {vars(key)}")
        configs[key] = options
    return TunedTable(path, data["tuned_on"], data["triton"], configs)


def _parse_entry(entry: Any, where: str) -> tuple[ConfigKey, LaunchOptions]:
    if not isinstance(entry, dict) or sorted(entry) != sorted(ENTRY_FIELDS):
        raise ValueError(f"{where} must be an object with exactly the fields {ENTRY_FIELDS}, "
                         f"got {entry!r}")
    allowed: dict[str, tuple[object, ...]] = {
        "kernel": KERNELS, "dtype": DTYPES, "kv_dtype": KV_DTYPES, "num_warps": NUM_WARPS,
        "num_stages": NUM_STAGES}
    for name, values in allowed.items():
        if entry[name] not in values or isinstance(entry[name], bool):
            raise ValueError(f"{where}.{name} must be one of {values}, got {entry[name]!r}")
    for name in ("head_dim", "group"):
        value = entry[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}.{name} must be an int >= 1, got {value!r}")
    key = ConfigKey(*(entry[name] for name in KEY_FIELDS))
    return key, LaunchOptions(entry["num_warps"], entry["num_stages"])


def _sort_key(key: ConfigKey) -> tuple[int, int, int, int, int]:
    return (KERNELS.index(key.kernel), key.head_dim, key.group, DTYPES.index(key.dtype),
            KV_DTYPES.index(key.kv_dtype))


# The table the launchers read: the committed one, loaded on first use (`active_table`).
_active: TunedTable | None = None


def active_table() -> TunedTable:
    """The table the launchers read now (the committed file, read once)."""
    global _active
    if _active is None:
        _active = load_table(TABLE_PATH)
    return _active


@contextlib.contextmanager
def using(table: TunedTable) -> Iterator[None]:
    """Make the launchers read `table` for the block (the tuner's candidates, tests)."""
    global _active
    before, _active = _active, table
    try:
        yield
    finally:
        _active = before


def launch_options(key: ConfigKey, default: LaunchOptions) -> LaunchOptions:
    """The options a launch of `key` takes: the active table's, else `default`."""
    return active_table().options(key, default)
