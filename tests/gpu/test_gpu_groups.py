"""Process groups with a GPU: one process with gloo + NCCL, two processes sharing one GPU over gloo,
and a DTensor layout on a one-device CUDA mesh."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _gpu import MARKS, compiled_model, data, in_fresh_process, mlp
from _multiproc import run_distributed

import meshfit as mf

pytestmark = MARKS


def _one_process_gloo_and_nccl(store_file: str):
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{store_file}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        on_gpu, on_cpu = torch.ones(4, device="cuda:0"), torch.ones(2)
        dist.all_reduce(on_gpu)  # NCCL
        dist.all_reduce(on_cpu)  # gloo
        strategy = mf.MultiWorkerMirroredStrategy()  # joins the group the user formed
        with strategy.scope():
            model = compiled_model()
        history = model.fit(*data(), batch_size=32, epochs=1, verbose=0)
        return (on_gpu.tolist(), on_cpu.tolist(), str(strategy.device),
                next(model.module.parameters()).device.type, history.history["loss"])
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # a fresh process (tests/gpu/_gpu.py in_fresh_process)
def test_a_one_process_group_with_gloo_for_cpu_and_nccl_for_cuda(tmp_path):
    store = str(tmp_path / "store")
    on_gpu, on_cpu, device, parameters, loss = in_fresh_process(functools.partial(_one_process_gloo_and_nccl, store))
    assert on_gpu == [1.0] * 4 and on_cpu == [1.0] * 2
    assert device == "cuda:0" and parameters == "cuda"
    assert np.isfinite(loss).all()


def _two_processes_one_gpu(rank: int, world: int):
    torch.cuda.set_device(0)
    tensor = torch.full((3,), float(rank + 1), device="cuda:0")
    dist.all_reduce(tensor)  # gloo reduces CUDA tensors through host memory
    strategy = mf.MultiWorkerMirroredStrategy()
    summed = strategy.all_reduce_sum(torch.full((2,), float(rank), device="cuda:0"))
    shared = strategy.broadcast_tensor(torch.full((2,), float(rank + 5), device="cuda:0"))
    return tensor.cpu().tolist(), summed.cpu().tolist(), shared.cpu().tolist()


def test_two_processes_share_one_gpu_over_gloo_with_cuda_tensors():
    results = run_distributed(_two_processes_one_gpu, world_size=2, timeout=180)
    for reduced, summed, shared in results:
        assert reduced == [3.0] * 3 and summed == [1.0, 1.0] and shared == [5.0, 5.0]


def _layout_on_a_cuda_mesh():
    from torch.distributed.tensor import DTensor

    mesh = mf.dtensor.create_mesh([("batch", 1)], devices=["cuda:0"])
    layout_map = mf.dtensor.LayoutMap(mesh)
    layout_map[r"^0\.weight$"] = mf.dtensor.Layout.replicated(mesh, rank=2)
    with layout_map.scope():
        model = compiled_model(mlp())
    history = model.fit(*data(), batch_size=32, epochs=1, verbose=0)
    weight = model.module[0].weight
    try:
        return (isinstance(weight, DTensor), weight.device.type, str(weight.layout.mesh.device_type),
                history.history["loss"])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow  # a fresh process (tests/gpu/_gpu.py in_fresh_process)
def test_a_dtensor_layout_on_a_one_device_cuda_mesh():
    is_dtensor, device, mesh_device, loss = in_fresh_process(_layout_on_a_cuda_mesh)
    assert is_dtensor and device == "cuda" and mesh_device == "cuda"
    assert np.isfinite(loss).all()
