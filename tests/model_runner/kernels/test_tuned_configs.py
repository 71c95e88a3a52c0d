"""The tuned launch options (tuned_configs.json): the committed table loads and covers every key
the tuner measures, the launchers take their num_warps/num_stages from it for every key the runner
can launch (recorded, not run), a key the table lacks falls back to the launcher's default, and a
malformed table is a ValueError naming the file and the fault."""

import json
from pathlib import Path

import pytest
import torch

from pagedkv.model_runner.kernels.paged_decode import (
    default_options,
    paged_decode_attention_triton,
)
from pagedkv.model_runner.kernels.paged_prefill import (
    DEFAULT_OPTIONS,
    paged_prefill_attention_triton,
)
from pagedkv.model_runner.kernels.tuned_configs import (
    TABLE_GROUPS,
    TABLE_HEAD_DIMS,
    TABLE_PATH,
    ConfigKey,
    LaunchOptions,
    TunedTable,
    load_table,
    table_keys,
    using,
)

from kernel_launches import Launch, record_launches

KV_HEADS = 2
# The two kernels the table tunes, by their function names.
TUNED = {"_decode_split_kernel": "decode", "_prefill_kernel": "prefill"}


def _launch_attention(head_dim: int, group: int, dtype: torch.dtype,
                      kv_dtype: torch.dtype) -> None:
    """One decode (two splits) and one prefill launch on tiny CPU tensors."""
    pool = torch.zeros(4, 2, 16, KV_HEADS, head_dim, dtype=kv_dtype)
    k_cache, v_cache = pool.unbind(1)
    tables = torch.arange(4, dtype=torch.int32)[None]
    lens = torch.tensor([64], dtype=torch.int32)
    query = torch.zeros(2, KV_HEADS * group, head_dim, dtype=dtype)
    paged_decode_attention_triton(query[:1], k_cache, v_cache, tables, lens, 0.1, num_splits=2)
    paged_prefill_attention_triton(query, k_cache, v_cache, tables, lens,
                                   torch.tensor([0, 2], dtype=torch.int32), 0.1)


def _tuned_launches(launches: list[Launch]) -> dict[str, LaunchOptions]:
    """kernel ("decode"/"prefill") -> the options its launch got."""
    return {TUNED[launch.name]: LaunchOptions(launch.kwargs["num_warps"],
                                              launch.kwargs["num_stages"])
            for launch in launches if launch.name in TUNED}


def test_the_committed_table_covers_every_key_and_untuned_means_the_defaults() -> None:
    table = load_table(TABLE_PATH)
    assert set(table.configs) == set(table_keys())
    assert table.to_json() == TABLE_PATH.read_text()  # the tuner's format, byte for byte
    if table.tuned_on is None:  # nobody has tuned it: the entries are the launchers' defaults
        for key, options in table.configs.items():
            default = (default_options(key.head_dim, getattr(torch, key.dtype))
                       if key.kernel == "decode" else DEFAULT_OPTIONS)
            assert options == default, key


def test_every_key_the_runner_can_launch_takes_the_tables_options(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A table whose every entry differs from the defaults, so taking it shows.
    marked = {key: LaunchOptions(1, 6) if key.kernel == "decode" else LaunchOptions(16, 5)
              for key in table_keys()}
    launches = record_launches(monkeypatch)
    with using(TunedTable(Path("marked.json"), "test", None, marked)):
        for head_dim in TABLE_HEAD_DIMS:
            for group in TABLE_GROUPS:
                for dtype in (torch.float16, torch.bfloat16, torch.float32):
                    for kv_dtype in (dtype, torch.float8_e4m3fn):
                        launches.clear()
                        _launch_attention(head_dim, group, dtype, kv_dtype)
                        assert _tuned_launches(launches) == {
                            "decode": LaunchOptions(1, 6), "prefill": LaunchOptions(16, 5)}, \
                            (head_dim, group, dtype, kv_dtype)


def test_a_key_the_table_lacks_falls_back_to_the_launchers_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    launches = record_launches(monkeypatch)
    only = {ConfigKey("decode", 256, 3, "float32", "float32"): LaunchOptions(2, 3)}
    with using(TunedTable(Path("sparse.json"), None, None, only)):
        _launch_attention(256, 3, torch.float32, torch.float32)  # decode's key is in the table
        assert _tuned_launches(launches) == {"decode": LaunchOptions(2, 3),
                                             "prefill": DEFAULT_OPTIONS}
        launches.clear()
        _launch_attention(256, 5, torch.float32, torch.float32)  # GROUP 5: no entry at all
        assert _tuned_launches(launches) == {"decode": LaunchOptions(8, 2),  # the spill rule
                                             "prefill": DEFAULT_OPTIONS}


GOOD_ENTRY = {"kernel": "decode", "head_dim": 128, "group": 4, "dtype": "bfloat16",
              "kv_dtype": "bfloat16", "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize(("text", "fault"), [
    ("{", "Expecting"),
    (json.dumps({"tuned_on": None, "configs": []}), "exactly the fields"),
    (json.dumps({"tuned_on": 3, "triton": None, "configs": []}), "tuned_on must be"),
    (json.dumps({"tuned_on": None, "triton": None, "configs": {}}), "configs must be a list"),
    (json.dumps({"tuned_on": None, "triton": None, "configs": [{**GOOD_ENTRY, "num_warps": 3}]}),
     "configs[0].num_warps must be one of"),
    (json.dumps({"tuned_on": None, "triton": None, "configs": [{**GOOD_ENTRY, "kernel": "x"}]}),
     "configs[0].kernel must be one of"),
    (json.dumps({"tuned_on": None, "triton": None, "configs": [{**GOOD_ENTRY, "group": True}]}),
     "configs[0].group must be an int >= 1"),
    (json.dumps({"tuned_on": None, "triton": None, "configs": [{**GOOD_ENTRY, "extra": 1}]}),
     "configs[0] must be an object with exactly the fields"),
    (json.dumps({"tuned_on": None, "triton": None, "configs": [GOOD_ENTRY, GOOD_ENTRY]}),
     "configs[1] repeats the key"),
])
def test_a_malformed_table_is_an_error_naming_the_file_and_the_fault(
        tmp_path: Path, text: str, fault: str) -> None:
    path = tmp_path / "tuned_configs.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="tuned launch configs") as error:
        load_table(path)
    assert str(path) in str(error.value) and fault in str(error.value), error.value


def test_a_missing_table_is_an_error_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=str(tmp_path / "absent.json")):
        load_table(tmp_path / "absent.json")
