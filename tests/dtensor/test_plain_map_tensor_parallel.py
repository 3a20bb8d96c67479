"""A plain ``mf.dtensor.LayoutMap`` whose keys split ``nn.Linear`` weights over ``model`` takes the one
tensor-parallel mechanism (torch's styles, plain local activations) that Keras's ``ModelParallel`` takes.

On 4 gloo processes, a ``(2, 2)`` mesh: a GPT whose ``forward`` makes its positions with ``torch.arange`` and
runs ``F.scaled_dot_product_attention``, built in ``layout_map.scope()`` with the guide's ``model`` keys,
trains with ``fit`` (the last batch uneven) equal to one process, and bitwise equal to the same model under
``mf.distribution.ModelParallel`` with the same keys. The plain map keeps every weight replicated over
``batch``: a keyed weight holds its ``model`` slice and says its `Layout`. Two column-wise layers in a row
(the second gathers the first's slice) before a row-wise one train equal to one process too, also with
gradient accumulation and in TF's custom loops (``compute_average_loss`` on this process's rows, or a summed
loss on ``pack``ed inputs and labels: the replicas' gradients summed).

Which maps take that mechanism is decided without processes: what it cannot express (a column-wise slice
that no layer reads, a key over ``batch``, a kernel) keeps the whole-mesh layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _two_d_model import BATCH, D_MODEL, SEQ, arange_gpt, assert_weights_match, data, keras_keys, optimizer
from torch import nn

from tests._multiproc import run_distributed

EXAMPLES = BATCH * 2 + 5  # 3 steps, the last one uneven (3 and 2 sequences on the two replicas)
NAMES = ("sgd", "adamw")


def _train(mf, name):
    model = mf.Model(arange_gpt())
    model.compile(optimizer=optimizer(mf, name), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(EXAMPLES)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model, model.get_weights(), history.history["loss"]


def _plain_map(mf, mesh):
    """The guide's ``model`` keys in a plain (not fully sharded) DTensor map."""
    U = mf.dtensor.UNSHARDED
    layout_map = mf.dtensor.LayoutMap(mesh)
    layout_map[r"attn\.qkv\.weight"] = mf.dtensor.Layout(["model", U], mesh)  # column-wise
    layout_map[r"attn\.out\.weight"] = mf.dtensor.Layout([U, "model"], mesh)  # row-wise
    layout_map[r"mlp\.fc1\.weight"] = mf.dtensor.Layout(["model", U], mesh)
    layout_map[r"mlp\.fc2\.weight"] = mf.dtensor.Layout([U, "model"], mesh)
    return layout_map


def _two_by_two(rank, world):
    from torch.distributed.tensor import DTensor

    import meshfit as mf

    mesh = mf.dtensor.create_mesh([("batch", 2), ("model", 2)],
                                  communication_options=mf.CommunicationOptions(heartbeat_timeout_seconds=60))
    out = {"chain": _chain(mf, mesh), "accumulated": _chain(mf, mesh, 2), "custom": _chain_custom_loop(mf, mesh),
           "packed": _chain_packed_loop(mf, mesh)}
    for name in NAMES:
        with _plain_map(mf, mesh).scope():
            model, weights, losses = _train(mf, name)
        qkv = model.module.layers[0].attn.qkv.weight
        out["plain", name] = (weights, losses, isinstance(qkv, DTensor), tuple(qkv.to_local().shape),
                              qkv.layout.to_string(), type(model.module.norm.weight).__mro__[1].__name__)
        keras_mesh = mf.distribution.DeviceMesh((2, 2), ["batch", "model"], mf.distribution.list_devices())
        keras_map = mf.distribution.LayoutMap(keras_mesh)
        keras_keys(keras_map)
        mf.distribution.set_distribution(mf.distribution.ModelParallel(layout_map=keras_map, batch_dim_name="batch"))
        try:
            _, weights, losses = _train(mf, name)
        finally:
            mf.distribution.set_distribution(None)
        out["keras", name] = (weights, losses)
    return out


def _chain_module():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _chain_map(mf, mesh):
    """Column-wise, column-wise (fed the first one's slice), then row-wise."""
    U = mf.dtensor.UNSHARDED
    layout_map = mf.dtensor.LayoutMap(mesh)
    layout_map[r"^0\.weight$"] = mf.dtensor.Layout(["model", U], mesh)
    layout_map[r"^2\.weight$"] = mf.dtensor.Layout(["model", U], mesh)
    layout_map[r"^4\.weight$"] = mf.dtensor.Layout([U, "model"], mesh)
    return layout_map


def _chain_data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(BATCH * 4 + 5, 8)).astype("float32")
    y = rng.integers(0, 4, size=(len(x),)).astype("int64")
    return x, y


def _chain(mf, mesh, accumulation=None):
    """``fit``; ``accumulation``: the optimizer's ``gradient_accumulation_steps``."""
    x, y = _chain_data()
    scope = _chain_map(mf, mesh).scope() if mesh is not None else mf.get_strategy().scope()
    with scope:
        model = mf.Model(_chain_module())
        model.compile(optimizer=mf.optimizers.SGD(0.1, gradient_accumulation_steps=accumulation),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    weight = model.module[2].weight
    return model.get_weights(), tuple((weight.to_local() if hasattr(weight, "to_local") else weight).shape)


def _chain_custom_loop(mf, mesh):
    """TF's custom loop: each replica's rows, ``compute_average_loss`` over the global batch, the replicas'
    gradients summed by the placement."""
    import torch.nn.functional as F

    x, y = (torch.from_numpy(a) for a in _chain_data())
    scope = _chain_map(mf, mesh).scope() if mesh is not None else mf.get_strategy().scope()
    with scope:
        model = mf.Model(_chain_module())
        optimizer = mf.optimizers.SGD(0.1)
    optimizer.build(list(model.module.parameters()))
    context = model.strategy.input_context()
    for start in range(0, BATCH * 4, BATCH):
        rows = slice(start, start + BATCH)
        local_x = x[rows].tensor_split(context.num_input_pipelines)[context.input_pipeline_id]
        local_y = y[rows].tensor_split(context.num_input_pipelines)[context.input_pipeline_id]
        per_example = F.cross_entropy(model.module(local_x), local_y, reduction="none")
        loss = mf.nn.compute_average_loss(per_example, global_batch_size=BATCH)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.get_weights()


def _chain_packed_loop(mf, mesh):
    """The DTensor tutorial's custom loop: ``pack``ed images and labels, a summed loss over the global batch."""
    x, y = (torch.from_numpy(a) for a in _chain_data())
    with _chain_map(mf, mesh).scope():
        model = mf.Model(_chain_module())
        optimizer = mf.optimizers.SGD(0.1)
    optimizer.build(list(model.module.parameters()))
    loss_fn = mf.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    rows, devices = mesh.dim_size("batch"), mesh.num_local_devices()
    per_row = max(devices // rows, 1)
    kinds = set()
    for start in range(0, BATCH * 4, BATCH):
        images = [part for part in x[start:start + BATCH].tensor_split(rows) for _ in range(per_row)]
        labels = [part for part in y[start:start + BATCH].tensor_split(rows) for _ in range(per_row)]
        images = mf.dtensor.pack(images, mf.dtensor.Layout.batch_sharded(mesh, "batch", rank=2))
        labels = mf.dtensor.pack(labels, mf.dtensor.Layout.batch_sharded(mesh, "batch", rank=1))
        logits = model.module(images)
        kinds.add(type(logits).__name__)
        loss = loss_fn(labels, logits) / BATCH
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.get_weights(), sorted(kinds)


def _one_process(rank, world):
    import meshfit as mf

    with mf.get_strategy().scope():
        out = {name: _train(mf, name)[1:] for name in NAMES}
    out["chain"], out["accumulated"] = _chain(mf, None), _chain(mf, None, 2)
    out["custom"] = _chain_custom_loop(mf, None)
    return out


@pytest.fixture(scope="module")
def two_by_two():
    return run_distributed(_two_by_two, world_size=4, timeout=900)


@pytest.fixture(scope="module")
def one_process():
    return run_distributed(_one_process, world_size=1, timeout=300)[0]


@pytest.mark.timeout(1200)
@pytest.mark.crowded
@pytest.mark.parametrize("name", NAMES)
def test_a_plain_layout_map_gpt_equals_one_process_and_model_parallel_bitwise(two_by_two, one_process, name):
    want_weights, want_losses = one_process[name]
    for result in two_by_two:
        weights, losses, is_dtensor, local, layout, plain_kind = result["plain", name]
        assert is_dtensor and local == (3 * D_MODEL // 2, D_MODEL)  # its model slice, replicated over batch
        assert layout == "sharding_specs:model,unsharded, mesh:|batch=2,model=2|cpu"
        assert plain_kind == "Parameter"  # an unkeyed weight stays a plain replicated tensor
        assert_weights_match(weights, want_weights, name)  # fp32: 1e-5 relative
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        keras_weights, keras_losses = result["keras", name]
        assert len(weights) == len(keras_weights)
        for got, want in zip(weights, keras_weights, strict=True):
            np.testing.assert_array_equal(got, want)
        assert losses == keras_losses
    assert SEQ > 1  # positions from torch.arange(t) over more than one token


@pytest.mark.timeout(1200)
@pytest.mark.crowded
def test_a_column_wise_layer_fed_a_slice_gathers_it(two_by_two, one_process):
    want_weights, _ = one_process["chain"]
    for result in two_by_two:
        weights, local = result["chain"]
        assert local == (8, 16)  # the second column-wise layer holds its slice
        assert_weights_match(weights, want_weights, "sgd")


@pytest.mark.timeout(1200)
@pytest.mark.crowded
def test_gradient_accumulation_and_custom_loops_equal_one_process(two_by_two, one_process):
    """Accumulation: the replicas reduce once per update, the window's sum; a custom loop: the replicas'
    gradients of ``compute_average_loss`` are summed (TF's contract), with plain rows or ``pack``ed inputs."""
    for result in two_by_two:
        assert_weights_match(result["accumulated"][0], one_process["accumulated"][0], "sgd")
        assert_weights_match(result["custom"], one_process["custom"], "sgd")
        weights, kinds = result["packed"]
        assert kinds == ["DTensor"]  # packed in, DTensors out: the loss on packed labels meets them
        assert_weights_match(weights, one_process["custom"], "sgd")
    assert not all(np.array_equal(a, b) for a, b in zip(one_process["accumulated"][0], one_process["chain"][0],
                                                         strict=True))  # accumulating changed the run


# ---- which maps take the tensor-parallel mechanism (no process is started) --------------------------
def _decide(build_map, module):
    import meshfit as mf
    from meshfit.dtensor._mesh_placement import plain_tensor_parallel

    mesh = mf.dtensor.Mesh(("batch", "model"), (2, 2))
    return plain_tensor_parallel(module, build_map(mf, mesh), "batch")


class _Seed(nn.Module):
    """Seed 004's model: its map splits both kernels column-wise, so the last one's slice is the output."""

    def __init__(self):
        super().__init__()
        self.feature, self.feature_2 = nn.Linear(64, 16), nn.Linear(16, 10)

    def forward(self, x):
        return self.feature_2(torch.relu(self.feature(x)))


def _seed_map(mf, mesh):
    layout_map = mf.dtensor.LayoutMap(mesh)
    layout_map["feature.*weight"] = mf.dtensor.Layout(["model", mf.dtensor.UNSHARDED], mesh)
    return layout_map


def _batch_key_map(mf, mesh):
    layout_map = _chain_map(mf, mesh)
    layout_map[r"^4\.bias$"] = mf.dtensor.Layout(["batch"], mesh)
    return layout_map


def _conv_map(mf, mesh):
    layout_map = mf.dtensor.LayoutMap(mesh)
    layout_map[r"^0\.weight$"] = mf.dtensor.Layout(["model"] + [mf.dtensor.UNSHARDED] * 3, mesh)
    return layout_map


def _row_only_map(mf, mesh):
    layout_map = mf.dtensor.LayoutMap(mesh)
    layout_map[r"^0\.weight$"] = mf.dtensor.Layout([mf.dtensor.UNSHARDED, "model"], mesh)  # fed the whole input
    return layout_map


def test_tensor_parallel_keys_take_the_mechanism_and_the_rest_keep_whole_mesh_layouts():
    assert _decide(_chain_map, _chain_module())[0] == "model"
    assert set(_decide(_plain_map, arange_gpt())[1]) == {f"layers.{i}.{layer}" for i in range(2)
                                                         for layer in ("attn.qkv", "attn.out", "mlp.fc1", "mlp.fc2")}
    assert _decide(_seed_map, _Seed()) is None  # the slice would reach the loss
    assert _decide(_row_only_map, _chain_module()) is None  # no slice for the row-wise layer to read
    assert _decide(_batch_key_map, _chain_module()) is None
    assert _decide(_conv_map, nn.Sequential(nn.Conv2d(1, 4, 3))) is None


def _one_by_two(rank, world):
    import meshfit as mf

    mesh = mf.dtensor.create_mesh([("batch", 1), ("model", 2)]) if world > 1 else None
    return _chain(mf, mesh)


def test_a_data_axis_of_one_process_runs_tensor_parallel_alone():
    """A ``(1, 2)`` mesh: one replica, so nothing is reduced over ``batch``; equal to one process."""
    want, _ = run_distributed(_one_by_two, world_size=1, timeout=300)[0]
    for weights, local in run_distributed(_one_by_two, world_size=2, timeout=300):
        assert local == (8, 16)
        assert_weights_match(weights, want, "sgd")
