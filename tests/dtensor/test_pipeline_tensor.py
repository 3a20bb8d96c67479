"""Pipeline stages split over a tensor axis: a map's keys inside the stages, with data replicas or full sharding.

On ``[("pipe", 2), ("model", 2)]`` and ``[("pipe", 2), ("batch", 2), ("model", 2)]`` (8 processes) the
guide's keys split the attention and MLP weights of a transformer language model (fused qkv, SDPA,
learned positions) over ``model`` inside each stage; ``LayoutMap.fully_sharded``
also shards every stage over ``batch``. Each run must give one plain process's weights, logs and
evaluation on the same global batch (rtol 1e-5: the split matmuls sum in another order), a
``model.save`` one plain process loads, and the same state digest on every process.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from _multiproc import run_distributed
from _two_d_model import data, module

TIMEOUT = 420
SPLIT = ["layers.1"]  # stage 0: embeddings and the first block; stage 1: the second block, the norm, the head


def _compiled(model: Any) -> Any:
    import meshfit as mf

    model.compile(optimizer=mf.optimizers.AdamW(1e-3), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _fit(model: Any, directory: str | None = None) -> dict[str, Any]:
    import meshfit as mf

    x, y = data(64)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[mf.callbacks.VerifyReplicas(every_n_steps=2, on_divergence="stop")]
                        if directory is not None else [])
    evaluated = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    if directory is not None:
        model.save(os.path.join(directory, "model.keras"))
    return {"history": history.history, "evaluated": evaluated,
            "weights": dict(zip(model.module.state_dict(), model.get_weights(), strict=True)),
            "digest": mf.train.state_digest(model).total}


def _keyed(mf: Any, mesh: Any, sharded: bool) -> Any:
    """The guide's keys (column-wise qkv and fc1, row-wise out and fc2) on a plain or fully sharded map."""
    U = mf.dtensor.UNSHARDED
    layout_map = mf.dtensor.LayoutMap.fully_sharded(mesh) if sharded else mf.dtensor.LayoutMap(mesh)
    for key, specs in ((r"attn\.qkv\.weight", ["model", U]), (r"attn\.out\.weight", [U, "model"]),
                       (r"mlp\.fc1\.weight", ["model", U]), (r"mlp\.fc2\.weight", [U, "model"])):
        layout_map[key] = mf.dtensor.Layout(specs, mesh)
    return layout_map.pipeline(SPLIT, microbatches=2)


def _staged(rank: int, world_size: int, mesh_dims: list[tuple[str, int]], sharded: bool, directory: str,
            keras: bool = False) -> dict[str, Any]:
    import meshfit as mf

    if keras:  # Keras 3's spelling: keys as tuples on a DeviceMesh, the pipeline on the map, ModelParallel
        names = [name for name, _ in mesh_dims]
        device_mesh = mf.distribution.DeviceMesh(tuple(n for _, n in mesh_dims), names,
                                                 mf.distribution.list_devices())
        layout_map = mf.distribution.LayoutMap(device_mesh)
        for key, specs in ((r"attn\.qkv\.weight", ("model", None)), (r"attn\.out\.weight", (None, "model")),
                           (r"mlp\.fc1\.weight", ("model", None)), (r"mlp\.fc2\.weight", (None, "model"))):
            layout_map[key] = specs
        layout_map.pipeline(SPLIT, microbatches=2)
        mf.distribution.set_distribution(mf.distribution.ModelParallel(layout_map=layout_map,
                                                                       batch_dim_name="batch"))
        try:
            return _fit(_compiled(mf.Model(module())), directory)
        finally:
            mf.distribution.set_distribution(None)
    mesh = mf.dtensor.create_mesh(mesh_dims)
    with _keyed(mf, mesh, sharded).scope():
        model = mf.Model(module())
    return _fit(_compiled(model), directory)


def _one_process() -> dict[str, Any]:
    import meshfit as mf

    return _fit(_compiled(mf.Model(module())))


def _check(results: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    for result in results:
        for name in ("loss", "accuracy"):
            np.testing.assert_allclose(result["history"][name], expected["history"][name], rtol=1e-5, err_msg=name)
        for name, value in expected["evaluated"].items():
            np.testing.assert_allclose(result["evaluated"][name], value, rtol=1e-5, err_msg=name)
        for path, value in expected["weights"].items():
            np.testing.assert_allclose(result["weights"][path], value, rtol=1e-5, atol=1e-6, err_msg=path)
        assert result["digest"] == results[0]["digest"]


def _both_spellings(rank: int, world_size: int, mesh_dims: list[tuple[str, int]], sharded: bool,
                    directory: str) -> list[dict[str, Any]]:
    """The DTensor spelling, then Keras 3's (`mf.distribution.ModelParallel` with tuple keys and
    ``LayoutMap(...).pipeline(...)``), in one run of the processes."""
    return [_staged(rank, world_size, mesh_dims, sharded, directory),
            _staged(rank, world_size, mesh_dims, sharded, os.path.join(directory, "keras"), True)]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize(("mesh_dims", "sharded", "keras"), [
    ([("pipe", 2), ("model", 2)], False, False),
    ([("pipe", 2), ("batch", 2), ("model", 2)], False, True),  # both spellings
    ([("pipe", 2), ("batch", 2), ("model", 2)], True, False),
])
def test_tensor_parallel_stages_equal_one_process(tmp_path: Any, mesh_dims: list[tuple[str, int]],
                                                  sharded: bool, keras: bool) -> None:
    import meshfit as mf

    expected = _one_process()
    size = int(np.prod([n for _, n in mesh_dims]))
    if keras:
        (tmp_path / "keras").mkdir()
        runs = run_distributed(_both_spellings, world_size=size, timeout=TIMEOUT - 60,
                               args=(mesh_dims, sharded, str(tmp_path)))
        _check([dtensor for dtensor, _ in runs], expected)
        _check([keras_run for _, keras_run in runs], expected)
    else:
        _check(run_distributed(_staged, world_size=size, timeout=TIMEOUT - 60,
                               args=(mesh_dims, sharded, str(tmp_path))), expected)
    loaded = mf.load_model(str(tmp_path / "model.keras"), module=module())
    for path, value in loaded.module.state_dict().items():
        np.testing.assert_allclose(value.numpy(), expected["weights"][path], rtol=1e-5, atol=1e-6, err_msg=path)


def _refused(rank: int, world_size: int) -> list[str]:
    import meshfit as mf

    messages = []
    mesh = mf.dtensor.create_mesh([("pipe", 2), ("model", 2)])
    wrong = mf.dtensor.LayoutMap(mesh)
    wrong[r"attn\.qkv\.weight"] = mf.dtensor.Layout(["pipe", mf.dtensor.UNSHARDED], mesh)  # not the tensor axis
    plain = mf.dtensor.create_mesh([("pipe", 2), ("batch", 2)])
    keyed = mf.dtensor.LayoutMap(plain)
    keyed[r"attn\.qkv\.weight"] = mf.dtensor.Layout(["batch", mf.dtensor.UNSHARDED], plain)  # no tensor axis
    for layout_map in (wrong, keyed):
        try:  # refused when the model is made (a pipeline is placed then)
            with layout_map.pipeline(SPLIT, microbatches=2).scope():
                model = _compiled(mf.Model(module()))
            model.fit(*data(16), batch_size=16, epochs=1, verbose=0)
        except ValueError as error:
            messages.append(str(error))
    return messages


@pytest.mark.timeout(TIMEOUT)
def test_keys_a_pipeline_cannot_place_are_refused_naming_them() -> None:
    for messages in run_distributed(_refused, world_size=4, timeout=TIMEOUT - 60):
        assert len(messages) == 2, messages
        # each process names the weight of its own stage (layers.0 or layers.1) and the axis it may use
        assert ".attn.qkv.weight'" in messages[0] and "tensor axis 'model'" in messages[0], messages[0]
        assert "qkv" in messages[1] and "the mesh has none" in messages[1], messages[1]


def test_the_stage_layouts_refuse_two_tensor_axes() -> None:
    import meshfit as mf
    from meshfit.dtensor._stage_layouts import tensor_axis_of

    mesh = mf.dtensor.Mesh(("pipe", "batch", "model", "expert"), (1, 1, 1, 1))
    with pytest.raises(ValueError, match="one tensor axis"):
        tensor_axis_of(mesh, "pipe", "batch")
    assert tensor_axis_of(mf.dtensor.Mesh(("pipe", "model"), (1, 1)), "pipe", None) == "model"


def _dropping(rank: int, world_size: int) -> list[np.ndarray]:
    import torch
    from _pipeline_model import Classifier, compile_model
    from _pipeline_model import data as rows
    from torch import nn

    import meshfit as mf

    class Dropping(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))
            return self.head(self.drop(self.blocks(h)).mean(dim=1))

    mesh = mf.dtensor.create_mesh([("pipe", 2), ("model", 2)])
    layout_map = mf.dtensor.LayoutMap(mesh)
    layout_map[r"blocks\.\d\.fc\.weight"] = mf.dtensor.Layout(["model", mf.dtensor.UNSHARDED], mesh)
    with layout_map.pipeline(["blocks.2"], microbatches=2).scope():
        model = mf.Model(Dropping())
    compile_model(mf, model)
    torch.manual_seed(100 + rank)  # every process its own random stream, as a careless script leaves it
    x, y = rows(64)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[mf.callbacks.VerifyReplicas(every_n_steps=1, on_divergence="stop")])
    return [np.asarray(w) for w in model.get_weights()]


@pytest.mark.timeout(TIMEOUT)
def test_dropout_inside_a_tensor_split_stage_keeps_the_tensor_parts_equal() -> None:
    """Dropout on a stage's replicated activations, each process seeded differently: the processes along the
    tensor axis draw one mask (DTensor's random-number tracker), so the replica check finds their copies equal at
    every step and every process reads the same weights."""
    runs = run_distributed(_dropping, world_size=4, timeout=TIMEOUT - 60)
    for weights in runs[1:]:
        for got, want in zip(weights, runs[0], strict=True):
            np.testing.assert_array_equal(got, want)
