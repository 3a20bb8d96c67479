"""Bad input for 2-D parallelism is refused when the model is created (before any step), with the
parameter path, the axis and the fix in the message."""

from __future__ import annotations

import pytest
from _two_d_model import module, two_d_map
from torch import nn

from tests._multiproc import run_distributed

# 4 gloo processes a run, several runs a test, on a shared 2-core machine
pytestmark = pytest.mark.timeout(1200)


def _errors(rank, world):
    import numpy as np
    import torch

    import meshfit as mf

    mesh = mf.dtensor.create_mesh([("batch", 2), ("model", 2)])
    U = mf.dtensor.UNSHARDED
    out = {}

    def refused(name, layout_map, build=module, blocks_fit=False):
        try:
            with layout_map.scope():
                model = mf.Model(build())
                if blocks_fit:
                    model.compile(optimizer="sgd", loss="mse")
                    x = np.ones((4, 4), "float32")
                    model.fit(x, x, batch_size=4, epochs=1, verbose=0)
        except ValueError as error:
            out[name] = str(error)
        else:
            out[name] = None

    try:
        mf.dtensor.Layout(["tensor", U], mesh)
    except ValueError as error:
        out["axis"] = str(error)

    def uneven():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 4))

    layout_map = mf.dtensor.LayoutMap.fully_sharded(mesh)
    layout_map["0.weight"] = mf.dtensor.Layout(["model", U], mesh)
    refused("divide", layout_map, uneven)

    layout_map = two_d_map(mf, mesh)
    layout_map[r"norm1\.weight"] = mf.dtensor.Layout(["model"], mesh)
    refused("operation", layout_map)

    layout_map = two_d_map(mf, mesh)
    layout_map[r"attn\.proj\.weight"] = mf.dtensor.Layout(["model", U], mesh)
    refused("unmatched", layout_map)

    layout_map = two_d_map(mf, mesh)
    layout_map.blocks = ["layers.7"]
    refused("blocks", layout_map)

    layout_map = two_d_map(mf, mesh)
    layout_map[r"head\.weight"] = mf.dtensor.Layout(["batch", U], mesh)
    refused("batch", layout_map)

    def square():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

    layout_map = mf.dtensor.LayoutMap.fully_sharded(mesh)
    layout_map["2.weight"] = mf.dtensor.Layout([U, "model"], mesh)  # row-wise, fed by a whole layer
    refused("row_alone", layout_map, square, blocks_fit=True)
    return out


def test_bad_two_d_layouts_are_refused_with_the_path_the_axis_and_the_fix():
    errors = run_distributed(_errors, world_size=4, timeout=400)[0]
    assert "'tensor'" in errors["axis"] and "['batch', 'model']" in errors["axis"]
    assert "'0.weight'" in errors["divide"] and "'model'" in errors["divide"] and "divisible by 2" in errors["divide"]
    message = errors["operation"]
    assert "'layers.0.norm1.weight'" in message and "LayerNorm" in message and "'model'" in message
    assert "Remove the key" in message
    assert "'attn\\\\.proj\\\\.weight'" in errors["unmatched"] and "matches none" in errors["unmatched"]
    assert "'layers.7'" in errors["blocks"] and "names no submodule" in errors["blocks"]
    assert "'head.weight'" in errors["batch"] and "already shards every weight over 'batch'" in errors["batch"]
    assert "'2'" in errors["row_alone"] and "column-wise" in errors["row_alone"]


def test_keys_over_two_axes_are_refused_without_processes():
    import meshfit as mf
    from meshfit.dtensor._tensor_parallel import tensor_parallel_styles

    mesh = mf.dtensor.Mesh(("batch", "model", "expert"), (1, 2, 2))
    layout_map = mf.dtensor.LayoutMap.fully_sharded(mesh)
    layout_map[r"attn\.qkv\.weight"] = mf.dtensor.Layout(["model", mf.dtensor.UNSHARDED], mesh)
    layout_map[r"mlp\.fc1\.weight"] = mf.dtensor.Layout(["expert", mf.dtensor.UNSHARDED], mesh)
    with pytest.raises(ValueError, match="one axis"):
        tensor_parallel_styles(module(), layout_map, "batch")
    layout_map = mf.dtensor.LayoutMap.fully_sharded(mesh)
    layout_map[r"attn\.out\.bias"] = mf.dtensor.Layout(["model"], mesh)
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.out\.bias'.*column-wise weight"):
        tensor_parallel_styles(module(), layout_map, "batch")
