"""Device state on the CPU side: which RNG streams a replica saves, and which devices strategies pick.

The CUDA paths themselves run in tests/gpu/ (skipped without a GPU); here torch.cuda's functions
are stood in for, to check what meshfit asks of them.
"""

from __future__ import annotations

import torch

import meshfit as mf
from meshfit._engine._state import RandomState


def test_a_cpu_replica_saves_no_cuda_stream_and_resumes_bitwise():
    rng = RandomState("cpu")
    torch.manual_seed(3)
    state = rng.state_dict()
    assert "cuda" not in state
    expected = torch.rand(4)
    torch.rand(7)
    rng.load_state_dict(state)
    assert torch.equal(torch.rand(4), expected)


def test_a_gpu_replica_saves_and_restores_its_own_devices_cuda_stream(monkeypatch):
    streams = {1: torch.arange(16, dtype=torch.uint8)}
    restored = {}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: streams[torch.device(device).index].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.update({device.index: state}))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: (_ for _ in ()).throw(AssertionError("all GPUs")))
    rng = RandomState(torch.device("cuda", 1))  # this rank's GPU only: no context on the others
    state = rng.state_dict()
    assert torch.equal(state["cuda"], streams[1])
    rng.load_state_dict(state)
    assert list(restored) == [1] and torch.equal(restored[1], streams[1])


def test_mirrored_strategy_without_devices_takes_every_local_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    devices = mf.MirroredStrategy._resolve_devices(None)
    assert devices == [torch.device("cuda", i) for i in range(3)]  # then one process each
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert mf.MirroredStrategy._resolve_devices(None) == [torch.device("cpu")]
