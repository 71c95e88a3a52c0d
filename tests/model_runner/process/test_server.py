"""The runner process's start (serve()): what it checks before it loads its model."""

from pathlib import Path

import pytest
import torch

from pagedkv.memory import cuda_driver
from pagedkv.memory.cuda_driver import CudaDriverTooOld
from pagedkv.model_runner.models import ModelSource
from pagedkv.model_runner.process import server
from pagedkv.model_runner.process.server import RunnerConfig, serve

from daemon_harness import running_daemon


async def test_a_cuda_pool_on_a_driver_too_old_for_torch_stops_the_start_before_the_model(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The daemon's pool says CUDA device 0 (a CPU daemon here, its answer read as a GPU one's):
    # the runner checks the driver before torch opens the device for the model.
    monkeypatch.setattr(server, "_pool_device", lambda info: "cuda:0")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cuda_driver, "driver_cuda_version", lambda: 12080)

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(server, "load_model", no_load)
    async with running_daemon(with_memory=True) as daemon:
        config = RunnerConfig(model=ModelSource(random_init="tiny"),
                              daemon=daemon.runners_target,
                              listen=f"unix://{tmp_path / 'runner.sock'}")  # never bound
        with pytest.raises(CudaDriverTooOld, match=r"built for CUDA 13\.0, but the NVIDIA driver "
                                                   r"supports CUDA up to 12\.8"):
            await serve(config)
