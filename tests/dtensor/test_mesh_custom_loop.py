"""The seed's custom training loop on a mesh: ``pack``, ``Adam(..., mesh=mesh)``, mesh-aware metrics.

Ported line by line (``tf.GradientTape`` becomes ``torch.autograd.grad``, ``tf.split`` becomes
``tensor_split``); run on a data-parallel ``("batch", 2)`` mesh with per-layer replicated layouts
(the seed's first flow) and on a ``batch`` × ``model`` (2, 2) mesh with sharded weights, each equal
to the same loop in one plain process.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from tests._multiproc import run_distributed

STEPS, BATCH = 20, 16


def _data():
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.normal(size=(STEPS * BATCH, 8)).astype("float32"))
    y = torch.from_numpy(rng.integers(0, 4, size=(STEPS * BATCH,)).astype("int64"))
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]


def _module():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _scalar(value):
    from torch.distributed.tensor import DTensor

    return float((value.full_tensor() if isinstance(value, DTensor) else value).detach())


def _custom_loop(mesh_dims, sharded, spelling="per_layer", backward=False):
    import meshfit as mf

    mesh = mf.dtensor.create_mesh(mesh_dims) if mesh_dims else None
    model = module = _module()
    if mesh is not None:
        unsharded_layout_2d = mf.dtensor.Layout.replicated(mesh, 2)
        unsharded_layout_1d = mf.dtensor.Layout.replicated(mesh, 1)
        if sharded:
            layout_map = mf.dtensor.LayoutMap(mesh)
            layout_map[r"^1\.weight$"] = mf.dtensor.Layout(["model", mf.dtensor.UNSHARDED], mesh)
            layout_map[r"^1\.bias$"] = mf.dtensor.Layout(["model"], mesh)
            layout_map[r"^3\.weight$"] = mf.dtensor.Layout([mf.dtensor.UNSHARDED, "model"], mesh)
            mf.dtensor.apply_layouts(model, layout_map)
        elif spelling == "layout_map":  # the same replicated layouts as a LayoutMap, the model built in its scope
            layout_map = mf.dtensor.LayoutMap(mesh)
            layout_map[r"weight$"] = unsharded_layout_2d
            layout_map[r"bias$"] = unsharded_layout_1d
            with layout_map.scope():
                model = mf.Model(model)
            model.build(_data()[0][0])
            module = model.module
        else:  # the seed's Dense(kernel_layout=..., bias_layout=...), one layer at a time
            for layer in (model[1], model[3]):
                mf.dtensor.apply_layouts(layer, {"weight": unsharded_layout_2d, "bias": unsharded_layout_1d})
        image_layout = mf.dtensor.Layout.batch_sharded(mesh, "batch", rank=2)
        label_layout = mf.dtensor.Layout.batch_sharded(mesh, "batch", rank=1)
    optimizer = mf.optimizers.Adam(0.01, mesh=mesh)
    metrics = {"accuracy": mf.metrics.SparseCategoricalAccuracy(mesh=mesh)}
    loss_fn = mf.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    params = list(module.parameters())
    optimizer.build(params)

    def train_step(model, x, y, optimizer, metrics):
        logits = model(x)
        # the sum of the batch-sharded per-example losses: a replicated global loss (scalar)
        loss = loss_fn(y, logits)
        if backward:  # the PyTorch spelling
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        else:  # the seed's tape.gradient + apply_gradients
            gradients = torch.autograd.grad(loss, params)
            optimizer.apply_gradients(zip(gradients, params, strict=True))
        for metric in metrics.values():
            metric.update_state(y_true=y, y_pred=logits)
        return {"loss": loss / len(x)}

    def pack_dtensor_inputs(images, labels, image_layout, label_layout):
        # One component per local device: that device's rows (devices that differ only along
        # `model` hold the same rows). On the seed's 1-D mesh this is its tf.split(images, n).
        num_local_devices = image_layout.mesh.num_local_devices()
        rows = image_layout.mesh.dim_size("batch")
        per_row = num_local_devices // rows
        images = [part for part in images.tensor_split(rows) for _ in range(per_row)]
        labels = [part for part in labels.tensor_split(rows) for _ in range(per_row)]
        return mf.dtensor.pack(images, image_layout), mf.dtensor.pack(labels, label_layout)

    results = {}
    pbar = mf.callbacks.Progbar(target=None, stateful_metrics=[], stream=io.StringIO())
    losses = []
    for step, (images, labels) in enumerate(_data()):
        if mesh is not None:
            images, labels = pack_dtensor_inputs(images, labels, image_layout, label_layout)
        results.update(train_step(model, images, labels, optimizer, metrics))
        for metric_name, metric in metrics.items():
            results[metric_name] = metric.result()
        losses.append(_scalar(results["loss"]))
        pbar.update(step, values=[(k, _scalar(v)) for k, v in results.items()], finalize=False)
    weights = [_scalar_tensor(p) for p in module.parameters()]
    layouts = [p.layout.to_string() for p in module.parameters()] if mesh is not None else []
    kinds = sorted({type(p).__mro__[1].__name__ if hasattr(type(p), "_meshfit_layout_class") else type(p).__name__
                    for p in module.parameters()})
    return weights, losses, float(metrics["accuracy"].result()), layouts, kinds


def _scalar_tensor(param):
    from torch.distributed.tensor import DTensor

    value = param.full_tensor() if isinstance(param, DTensor) else param
    return value.detach().numpy().copy()


def _on_mesh(rank, world, mesh_dims, sharded, spelling="per_layer", backward=False):
    return _custom_loop(mesh_dims, sharded, spelling, backward)


def _close(a, b, tol=1e-5):
    return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12)) for x, y in zip(a, b, strict=True)) <= tol


@pytest.fixture(scope="module")
def one_process():
    return _custom_loop(None, False)


def test_seed_custom_loop_on_a_data_parallel_mesh_equals_one_process(one_process):
    weights, losses, accuracy, *_ = one_process
    for got_weights, got_losses, got_accuracy, layouts, _ in run_distributed(
            _on_mesh, world_size=2, args=([("batch", 2)], False), timeout=300):
        assert _close(got_weights, weights)
        assert got_losses == pytest.approx(losses, rel=1e-5)
        assert got_accuracy == pytest.approx(accuracy)  # summed over the two data shards
        assert layouts[0] == "sharding_specs:unsharded,unsharded, mesh:|batch=2|cpu"


def test_seed_custom_loop_on_a_2x2_mesh_with_sharded_weights_equals_one_process(one_process):
    weights, losses, accuracy, *_ = one_process
    for got_weights, got_losses, got_accuracy, layouts, _ in run_distributed(
            _on_mesh, world_size=4, args=([("batch", 2), ("model", 2)], True), timeout=300):
        assert _close(got_weights, weights)
        assert got_losses == pytest.approx(losses, rel=1e-5)
        assert got_accuracy == pytest.approx(accuracy)  # over `batch` only: model peers are not counted twice
        assert layouts[0] == "sharding_specs:model,unsharded, mesh:|batch=2,model=2|cpu"


@pytest.mark.parametrize("backward", [False, True], ids=["apply_gradients", "loss_backward"])
def test_seed_custom_loop_with_an_all_replicated_layout_map_and_pack(one_process, backward):
    """Seed 004's flow with a LayoutMap instead of per-layer layouts: the same kind of parameter, and
    the packed inputs meet it (no "mixed torch.Tensor and DTensor"), with either spelling of a step."""
    weights, losses, accuracy, *_ = one_process
    per_layer = run_distributed(_on_mesh, world_size=2, args=([("batch", 2)], False), timeout=300)
    for got_weights, got_losses, got_accuracy, layouts, kinds in run_distributed(
            _on_mesh, world_size=2, args=([("batch", 2)], False, "layout_map", backward), timeout=300):
        assert kinds == per_layer[0][4], (kinds, per_layer[0][4])
        assert _close(got_weights, weights)
        assert got_losses == pytest.approx(losses, rel=1e-5)
        assert got_accuracy == pytest.approx(accuracy)
        assert layouts[0] == "sharding_specs:unsharded,unsharded, mesh:|batch=2|cpu"
