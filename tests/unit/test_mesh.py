"""Joining the process group: torchrun's env:// group when torchrun's variables are set, else a group of one;
gloo on CPU, NCCL for CUDA tensors with gloo beside it for CPU ones."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from elastic_trainer.config import ConfigError
from elastic_trainer.elastic.torchrun_env import TorchrunEnv
from elastic_trainer.parallel import mesh


@pytest.fixture
def calls(monkeypatch):
    got = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: got.append((a, k)))
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return got


def test_without_torchrun_a_group_of_one_on_a_private_store(calls):
    mesh.init_process_group(torch.device("cpu"), TorchrunEnv.read().distributed)
    [(args, kwargs)] = calls
    assert args == ("gloo",) and set(kwargs) == {"store", "rank", "world_size"}
    assert isinstance(kwargs["store"], dist.HashStore) and kwargs["rank"] == 0 and kwargs["world_size"] == 1


@pytest.mark.parametrize("only", ["RANK", "WORLD_SIZE"])
def test_half_of_torchrun_s_variables_is_not_torchrun(calls, monkeypatch, only):
    monkeypatch.setenv(only, "0")
    with pytest.raises(ConfigError, match=f"environment variable {only} is set but"):
        TorchrunEnv.read()  # the rank stops here, with one line
    mesh.init_process_group(torch.device("cpu"), distributed=False)
    assert calls[0][0] == ("gloo",) and isinstance(calls[0][1]["store"], dist.HashStore)


@pytest.mark.parametrize(
    "device, backend, device_id",
    [
        (torch.device("cpu"), "gloo", None),
        (torch.device("cuda", 1), "cuda:nccl,cpu:gloo", torch.device("cuda", 1)),
    ],
)
def test_under_torchrun_the_env_group_with_the_device_s_backend(calls, monkeypatch, device, backend, device_id):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    mesh.init_process_group(device, TorchrunEnv.read().distributed)
    assert calls == [((backend,), {"device_id": device_id})]


def test_a_joined_group_is_kept(calls, monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    mesh.init_process_group(torch.device("cpu"), True)
    assert calls == []


def test_the_device_is_the_local_rank_s_gpu_or_the_cpu(monkeypatch):
    """cuda:(the local rank mod the GPUs this process sees), made current; cpu without GPUs. The CUDA calls are
    replaced (this machine has none): what is checked is which device is asked for."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: pytest.fail("asked a GPU's name without GPUs"))
    assert mesh.default_device() == torch.device("cpu") and mesh.accelerator() == ("cpu", None)
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"NVIDIA H100 #{i}")
    assert mesh.default_device(3) == torch.device("cuda", 1) and current == [1]
    assert mesh.default_device() == torch.device("cuda", 0) and current == [1, 0]
    assert mesh.accelerator() == ("cuda", "NVIDIA H100 #0")
