"""triton_env: every Triton launch runs inside its tensors' device context, and interpreted
kernels refuse CUDA tensors.

Triton launches on the calling thread's current CUDA device; the runner's forward runs on a worker
thread that never chose one, so a launcher that skipped the context would put a cuda:1 pool's
kernels on cuda:0. The kernels only record their launches here (kernel_launches), so a launcher
that starts a kernel any other way than through triton_env.launch is caught: it records no
device.
"""

import pytest
import torch

from pagedkv.model_runner.kernels.paged_decode import paged_decode_attention_triton
from pagedkv.model_runner.kernels.paged_prefill import paged_prefill_attention_triton
from pagedkv.model_runner.kernels.store_kv import _store_kv_kernel, store_kv_triton
from pagedkv.model_runner.kernels.triton_env import is_interpreted, require_triton_device

from kernel_launches import record_launches
from kernel_utils import (
    DEVICES,
    make_paged_batch,
    query_start_loc,
    random_tokens,
    skip_unless_triton_runs_on,
)

SCALE = 0.25


@pytest.mark.parametrize("device", DEVICES)
def test_every_launcher_launches_inside_its_tensors_device(monkeypatch, device):
    skip_unless_triton_runs_on(device)
    batch = make_paged_batch([5, 200], 16, 2, 32, torch.float32, device)
    keys = random_tokens(2, 2, 32, torch.float32, device, seed=2)
    launches = record_launches(monkeypatch)

    store_kv_triton(keys, keys, batch.k_cache, batch.v_cache,
                    torch.tensor([0, 17], device=device))
    query = random_tokens(2, 4, 32, torch.float32, device)
    paged_decode_attention_triton(query, batch.k_cache, batch.v_cache, batch.block_tables,
                                  batch.seq_lens, SCALE, num_splits=2)  # split, then merge
    paged_prefill_attention_triton(query, batch.k_cache, batch.v_cache, batch.block_tables,
                                   batch.seq_lens, query_start_loc([1, 1], device), SCALE)

    assert [launch.name for launch in launches] == [
        "_store_kv_kernel", "_decode_split_kernel", "_decode_merge_kernel", "_prefill_kernel"]
    for launch in launches:
        assert launch.tensor_devices() == {batch.pool.device}, launch.name
        assert launch.device == batch.pool.device, f"{launch.name} ran outside its device"


def test_interpreted_kernels_refuse_cuda_tensors():
    skip_unless_triton_runs_on("cpu")  # the kernels here are interpreted
    assert is_interpreted(_store_kv_kernel)
    for device in (torch.device("cuda"), torch.device("cuda", 1)):
        with pytest.raises(ValueError, match=r"TRITON_INTERPRET=1.*unset TRITON_INTERPRET"):
            require_triton_device(device, _store_kv_kernel)
    require_triton_device(torch.device("cpu"), _store_kv_kernel)  # what the interpreter is for
