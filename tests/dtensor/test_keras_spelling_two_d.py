"""Keras 3's spelling (``mf.distribution.DeviceMesh``, ``LayoutMap``, ``ModelParallel``) runs the same placement
as the DTensor spelling (``mf.dtensor.LayoutMap.fully_sharded`` with ``model`` keys).

On 4 gloo processes, a ``(2, 2)`` mesh: the guide's transformer trained by ``ModelParallel`` with a plain
Keras map and with ``LayoutMap.fully_sharded(device_mesh)`` ends with weights bitwise equal to the DTensor
spelling's (SGD and AdamW, the last batch uneven); a GPT whose ``forward`` makes its positions with
``torch.arange`` and runs ``F.scaled_dot_product_attention`` trains under ``ModelParallel`` equal to one
process. On 2 processes, ``mf.distribution.LayoutMap.fully_sharded`` equals ``mf.dtensor``'s bitwise. Bad
layouts are refused when the ``ModelParallel`` is created.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from _two_d_model import (
    BATCH,
    D_MODEL,
    arange_gpt,
    assert_weights_match,
    data,
    keras_keys,
    module,
    optimizer,
    scope,
)

from tests._multiproc import run_distributed

EXAMPLES = BATCH * 2 + 5  # 3 steps, the last one uneven (3 and 2 sequences on the two replicas)


def _train(mf, build, name):
    model = mf.Model(build())
    model.compile(optimizer=optimizer(mf, name), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(EXAMPLES)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model.get_weights(), history.history["loss"], _local_shape(model.module.layers[0].attn.qkv.weight)


def _local_shape(weight):
    from torch.distributed.tensor import DTensor

    return tuple((weight.to_local() if isinstance(weight, DTensor) else weight).shape)


def _keras(mf, shape, fully_sharded):
    """A ``ModelParallel`` on a Keras ``DeviceMesh`` of ``shape`` (``["batch", "model"]``, or ``["batch"]``)."""
    names = ["batch", "model"][:len(shape)]
    mesh = mf.distribution.DeviceMesh(shape, names, mf.distribution.list_devices())
    layout_map = mf.distribution.LayoutMap.fully_sharded(mesh) if fully_sharded else mf.distribution.LayoutMap(mesh)
    if "model" in names:
        keras_keys(layout_map)
    return mf.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _under(mf, distribution, build, name):
    mf.distribution.set_distribution(distribution)
    try:
        return _train(mf, build, name)
    finally:
        mf.distribution.set_distribution(None)


def _two_by_two(rank, world):
    import meshfit as mf

    out = {}
    for name in ("sgd", "adamw"):
        with scope(mf, (2, 2)):  # the DTensor spelling: LayoutMap.fully_sharded + model keys
            out["dtensor", name] = _train(mf, module, name)
        for fully_sharded in (False, True):
            out["keras", name, fully_sharded] = _under(mf, _keras(mf, (2, 2), fully_sharded), module, name)
    for tied in (False, True):
        out["gpt", tied] = _under(mf, _keras(mf, (2, 2), False), functools.partial(arange_gpt, tied), "sgd")
    return out


def _plain_gpt(rank, world):
    import meshfit as mf

    with mf.get_strategy().scope():
        return {tied: _train(mf, functools.partial(arange_gpt, tied), "sgd") for tied in (False, True)}


@pytest.fixture(scope="module")
def two_by_two():
    return run_distributed(_two_by_two, world_size=4, timeout=900)


@pytest.mark.timeout(1200)
@pytest.mark.crowded
@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("fully_sharded", [False, True], ids=["layout_map", "layout_map_fully_sharded"])
def test_model_parallel_equals_the_dtensor_spelling_bitwise_on_two_by_two(two_by_two, name, fully_sharded):
    for result in two_by_two:
        want_weights, want_losses, want_local = result["dtensor", name]
        weights, losses, local = result["keras", name, fully_sharded]
        assert local == want_local == (3 * D_MODEL // 4, D_MODEL)  # split over model (rows), then batch
        assert len(weights) == len(want_weights)
        for got, want in zip(weights, want_weights, strict=True):
            np.testing.assert_array_equal(got, want)
        assert losses == want_losses


@pytest.fixture(scope="module")
def plain_gpt():
    return run_distributed(_plain_gpt, world_size=1, timeout=300)[0]


@pytest.mark.timeout(1200)
@pytest.mark.crowded
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "head_tied_to_embedding"])
def test_a_gpt_with_arange_positions_under_model_parallel_equals_one_process(two_by_two, plain_gpt, tied):
    """``tied``: the head and the embedding (two default blocks) share their weight; the placement keeps
    the tie (the model is then sharded over ``batch`` as one unit)."""
    want_weights, want_losses, _ = plain_gpt[tied]
    for result in two_by_two:
        weights, losses, local = result["gpt", tied]
        assert local == (3 * D_MODEL // 4, D_MODEL)
        assert_weights_match(weights, want_weights, "adamw")  # elementwise rtol 1e-5
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


def _fully_sharded_two(rank, world):
    import meshfit as mf

    out = {}
    for name in ("sgd", "adamw"):
        mesh = mf.dtensor.create_mesh([("batch", 2)])
        with mf.dtensor.LayoutMap.fully_sharded(mesh).scope():
            out["dtensor", name] = _train(mf, module, name)
        out["keras", name] = _under(mf, _keras(mf, (2,), True), module, name)
    return out


@pytest.mark.timeout(600)
def test_keras_layout_map_fully_sharded_equals_the_dtensor_one_bitwise_on_two_processes():
    for result in run_distributed(_fully_sharded_two, world_size=2, timeout=500):
        for name in ("sgd", "adamw"):
            for got, want in zip(result["keras", name][0], result["dtensor", name][0], strict=True):
                np.testing.assert_array_equal(got, want)
            assert result["keras", name][1] == result["dtensor", name][1]


# ---- bad input: refused when the ModelParallel is created (no process is started) -----------------
def _mesh(mf, names=("batch", "model")):
    return mf.distribution.DeviceMesh((2, 2), list(names), [f"cpu:{i}" for i in range(4)])


def test_a_layout_axis_the_device_mesh_lacks_is_refused():
    import meshfit as mf

    layout_map = mf.distribution.LayoutMap(_mesh(mf))
    # a layout built on another mesh keeps that mesh's axes: the map's own mesh lacks "tensor"
    layout_map["fc.weight"] = mf.distribution.TensorLayout(("tensor", None), _mesh(mf, ("batch", "tensor")))
    with pytest.raises(ValueError, match=r"key 'fc\.weight'.*axis 'tensor', which the DeviceMesh lacks.*"
                                         r"\['batch', 'model'\].*add the axis"):
        mf.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def test_a_batch_dim_name_the_device_mesh_lacks_is_refused():
    import meshfit as mf

    with pytest.raises(ValueError, match=r"axes \['batch', 'model'\], received batch_dim_name='data'.*Pass batch_dim_name='batch'"):
        mf.distribution.ModelParallel(layout_map=mf.distribution.LayoutMap(_mesh(mf)), batch_dim_name="data")


@pytest.mark.parametrize("fully_sharded", [False, True])
def test_an_axis_named_twice_is_refused(fully_sharded):
    import meshfit as mf

    mesh = _mesh(mf)
    layout_map = mf.distribution.LayoutMap.fully_sharded(mesh) if fully_sharded else mf.distribution.LayoutMap(mesh)
    layout_map["fc.weight"] = ("model", "model")
    with pytest.raises(ValueError, match=r"\('model', 'model'\) for LayoutMap key 'fc\.weight'.*'model' twice.*None"):
        mf.distribution.ModelParallel(layout_map=layout_map)


def test_layout_map_fully_sharded_refuses_a_dtensor_mesh_and_bad_blocks():
    import meshfit as mf

    with pytest.raises(ValueError, match=r"expected a meshfit.distribution.DeviceMesh.*DeviceMesh\(shape"):
        mf.distribution.LayoutMap.fully_sharded("batch")
    with pytest.raises(TypeError, match=r"blocks='layers'"):
        mf.distribution.LayoutMap.fully_sharded(_mesh(mf), blocks="layers")
    layout_map = mf.distribution.LayoutMap.fully_sharded(_mesh(mf), blocks=["layers.0"])
    assert layout_map.is_fully_sharded and layout_map.blocks == ["layers.0"]
    assert not mf.distribution.LayoutMap(_mesh(mf)).is_fully_sharded


def test_a_fully_sharded_key_over_the_data_axis_and_a_dtensor_map_are_refused():
    import meshfit as mf

    layout_map = mf.distribution.LayoutMap.fully_sharded(_mesh(mf))
    layout_map["fc.weight"] = ("batch", None)
    with pytest.raises(ValueError, match=r"key 'fc\.weight' in a LayoutMap.fully_sharded map: it names the data "
                                         r"axis 'batch'.*remove the key"):
        mf.distribution.ModelParallel(layout_map=layout_map)
    dtensor_map = mf.dtensor.LayoutMap(mf.dtensor.Mesh(("batch", "model"), (2, 2)))
    with pytest.raises(ValueError, match=r"meshfit.dtensor map .*layout_map.scope\(\).*"
                                         r"mf.distribution.LayoutMap.fully_sharded\(device_mesh\)"):
        mf.distribution.ModelParallel(layout_map=dtensor_map)
