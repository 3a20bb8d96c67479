"""Bad input for 2-D parallelism is refused when the model is created (before any step), with the
parameter path, the axis and the fix in the message."""

from __future__ import annotations

import pytest
from _two_d_model import TransformerLM, module, two_d_map
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

    def three_heads():  # head_dim 4: qkv's 36 rows split 18 and 18, not whole heads of 12 rows
        torch.manual_seed(0)
        return TransformerLM(d_model=12, heads=3)

    refused("heads", two_d_map(mf, mesh), three_heads)

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
    heads = errors["heads"]  # torch cannot split a head (an uneven split alone is accepted)
    assert "'layers.0.attn.qkv.weight'" in heads and "[18, 18]" in heads and "head_dim 4" in heads, heads
    assert "'layers.0.attn'" in heads and "divides" in heads and "remove the key" in heads
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
