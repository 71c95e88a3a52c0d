"""Pool sizing: the one rule (pagedkv.vocab.pool_sizing) and the one measurement
(pagedkv.memory.device_memory) behind the daemon's kv_fraction, `LLM`'s pool and the planner."""

import os
from pathlib import Path

import pytest
import torch

from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.process.server import pool_geometry, pool_num_blocks
from pagedkv.memory import device_memory
from pagedkv.memory.device_memory import available_ram, measure
from pagedkv.vocab.pool_sizing import DeviceMemory, kv_budget, num_blocks_for_bytes

GiB = 2**30

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_accelerator_rule_takes_a_share_of_the_whole_device() -> None:
    # 0.9 of 80 GiB, 1 GiB in use (other processes, the CUDA context), 16 GiB of weights.
    cuda = DeviceMemory("cuda:1", total=80 * GiB, free=79 * GiB)
    assert kv_budget(cuda, 0.9) == int(0.9 * 80 * GiB) - GiB
    assert kv_budget(cuda, 0.9, weights=16 * GiB, reserve=GiB) == int(0.9 * 80 * GiB) - 18 * GiB
    assert kv_budget(cuda, 0.9, cap=4 * GiB) == 4 * GiB
    with pytest.raises(ValueError, match=r"no memory left for the KV cache on cuda:1: 0\.5 x "
                                         r"85\.90 GB - in use 1\.07 GB - weights 42\.95 GB"):
        kv_budget(cuda, 0.5, weights=40 * GiB)


def test_cpu_rule_takes_a_share_of_available_ram_within_the_shm_dir() -> None:
    cpu = DeviceMemory("cpu", total=0, free=10 * GiB, shm_free=64 * GiB)
    assert kv_budget(cpu, 0.5) == 5 * GiB
    assert kv_budget(cpu, 0.25, weights=2 * GiB) == 2 * GiB
    assert kv_budget(cpu, 0.5, cap=GiB) == GiB
    # A small /dev/shm (Docker's 64 MB) caps the pool below the RAM share.
    small_shm = DeviceMemory("cpu", total=0, free=10 * GiB, shm_free=2**26)
    assert kv_budget(small_shm, 0.5) == 2**26
    with pytest.raises(ValueError, match=r"no memory left for the KV cache on cpu: min\(0\.5"):
        kv_budget(cpu, 0.5, weights=11 * GiB)


@pytest.mark.parametrize("share", [0, -0.5, 1.5])
def test_share_must_be_a_fraction(share: float) -> None:
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
        kv_budget(DeviceMemory("cpu", 0, free=GiB, shm_free=GiB), share)


def test_num_blocks_for_bytes() -> None:
    assert num_blocks_for_bytes(7_800_000_000, 917_504) == 8501
    assert num_blocks_for_bytes(917_504, 917_504) == 1
    with pytest.raises(ValueError, match="cannot hold one block"):
        num_blocks_for_bytes(917_503, 917_504)
    with pytest.raises(ValueError, match="must be positive"):
        num_blocks_for_bytes(10, 0)


def test_measure_on_cpu_reads_available_ram_and_the_shm_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_memory, "available_ram", lambda: 1000 * 1024)
    free = os.statvfs(tmp_path)
    capped = os.statvfs_result((*free[:4], 64, *free[5:]))  # f_bavail = 64 fragments
    monkeypatch.setattr(device_memory.os, "statvfs", lambda _: capped)
    memory = measure("cpu", str(tmp_path))
    assert memory == DeviceMemory("cpu", total=0, free=1000 * 1024, shm_free=64 * free.f_frsize)
    # The daemon's kv_fraction 0.5 of it, in blocks of 1 KiB: capped by the shm dir.
    assert num_blocks_for_bytes(kv_budget(memory, 0.5), 1024) == min(
        500, 64 * free.f_frsize // 1024)


def test_the_daemons_kv_fraction_is_this_rule_on_this_measurement(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 GiB available, a roomy shm dir: a quarter of the RAM, 256 MiB.
    monkeypatch.setattr(device_memory, "available_ram", lambda: GiB)
    free = os.statvfs(tmp_path)
    roomy = os.statvfs_result((*free[:4], 2 * GiB // free.f_frsize, *free[5:]))
    monkeypatch.setattr(device_memory.os, "statvfs", lambda _: roomy)
    config = DaemonConfig(listen=(f"unix://{tmp_path}/d.sock",), shm_dir=tmp_path,
                          num_blocks=None, kv_fraction=0.25)
    geometry, dtype = pool_geometry(config)
    per_block = geometry.bytes_per_block(config.block_size, 4)
    assert pool_num_blocks(config, geometry, dtype) == GiB // 4 // per_block


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "meta"])
def test_measure_refuses_a_device_that_is_not_cpu_or_cuda(device: str) -> None:
    with pytest.raises(ValueError, match="device must be cpu or cuda"):
        measure(device)


def test_available_ram_is_plausible() -> None:
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < available_ram() <= total


@pytest.mark.gpu
@cuda_only
def test_measure_on_cuda() -> None:
    memory = measure("cuda")
    free, total = torch.cuda.mem_get_info()
    assert memory.total == total and 0 < memory.free <= total
    block = 2**20
    blocks = num_blocks_for_bytes(kv_budget(memory, 0.5), block)
    # Half the card minus what is in use; nothing else runs here, so it is close to half.
    assert 0 < blocks * block <= 0.5 * total - (total - free) + block
