"""`ParallelDims`: each mesh axis has a name, a degree and a role, and the role (not the spelling
``"batch"``) decides which axis splits the batches.

The value's questions and every bad input need no process. On 4 gloo processes, a ``(2, 2)`` mesh whose
data axis is called ``"dp"`` (its role given) beside a ``"tp"`` tensor axis trains ``fit`` to weights
bitwise equal to the same mesh spelled ``("batch", "model")``, in both placements (whole-mesh layouts,
and fully sharded with tensor-parallel keys, also through Keras's ``ModelParallel(batch_dim_name="dp")``).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf
from meshfit.dtensor import AxisRole, Layout, LayoutMap, Mesh, ParallelDims
from tests._multiproc import run_distributed

# ---- the value's questions (no process) ------------------------------------------------------------


def test_roles_come_from_the_names_unless_given():
    dims = ParallelDims(names=("batch", "model"), degrees=(2, 4))
    assert dims.roles == (AxisRole.DATA, AxisRole.TENSOR)
    assert (dims.data_axis, dims.dp_degree, dims.tp_degree, dims.pp_degree) == ("batch", 2, 4, 1)
    assert ParallelDims(names=("pipe", "batch"), degrees=(2, 3)).axis_of("pipeline") == "pipe"
    named = ParallelDims(names=("dp", "tp"), degrees=(2, 2), roles={"dp": "data"})
    assert (named.data_axis, named.role_of("tp"), named.axis_of(AxisRole.TENSOR)) == ("dp", AxisRole.TENSOR, "tp")
    # without a role, "dp" is a tensor axis: the name alone decides nothing but "batch" and "pipe"
    assert ParallelDims(names=("dp", "tp"), degrees=(2, 2)).data_axis is None
    every = ParallelDims(names=("dp", "tp", "pp"), degrees=(2, 3, 5), roles=["shard", "tensor", "pipeline"])
    assert (every.data_axis, every.degree("shard"), every.degree("data"), every.dp_degree, every.tp_degree,
            every.pp_degree, every.size) == ("dp", 2, 1, 2, 3, 5, 30)
    assert every.axis_of("data") is None and every.axis_of("shard") == "dp"
    assert repr(every) == "ParallelDims(dp=2:shard, tp=3:tensor, pp=5:pipeline)"


def test_degree_of_an_absent_role_is_one_and_several_tensor_axes_multiply():
    dims = ParallelDims(names=("a", "b"), degrees=(2, 3))
    assert (dims.data_axis, dims.dp_degree, dims.tp_degree, dims.pp_degree) == (None, 1, 6, 1)
    with pytest.raises(ValueError, match=r"axes \['a', 'b'\] all have that role"):
        dims.axis_of("tensor")


def test_validate_against_the_world_size():
    dims = ParallelDims(names=("dp", "tp"), degrees=(2, 2), roles={"dp": "data"})
    dims.validate(4)
    with pytest.raises(ValueError, match=r"multiply to 4 processes, but the job has 8.*--workers 4"):
        dims.validate(8)
    with pytest.raises(ValueError, match=r"Invalid `world_size`.*world_size=0"):
        dims.validate(0)


def test_with_role_marks_an_axis_and_keeps_the_value_frozen():
    dims = ParallelDims(names=("batch", "model"), degrees=(2, 2))
    sharded = dims.with_role("batch", "shard")
    assert sharded.data_axis == "batch" and sharded.role_of("batch") is AxisRole.SHARD
    assert dims.role_of("batch") is AxisRole.DATA and dims != sharded
    assert sharded.explicit_roles() == {"batch": "shard"} and dims.explicit_roles() == {}
    with pytest.raises(AttributeError):
        dims.names = ("x",)  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(sharded)) == sharded


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"names": ("dp", "dp"), "degrees": (2, 2)}, r"axis 'dp' is named twice"),
    ({"names": ("dp", "tp"), "degrees": (2, 2), "roles": {"dp": "data", "tp": "data"}},
     r"axes 'dp' and 'tp' both split the batches.*roles=\{'tp': 'tensor'\}"),
    ({"names": ("batch", "dp"), "degrees": (2, 2), "roles": {"dp": "shard"}},
     r"axes 'batch' and 'dp' both split the batches"),
    ({"names": ("pipe", "stages"), "degrees": (2, 2), "roles": {"stages": "pipeline"}},
     r"both hold pipeline stages"),
    ({"names": ("dp", "tp"), "degrees": (2, 2), "roles": {"dp": "replicate"}},
     r"Invalid role of mesh axis 'dp'.*received 'replicate'"),
    ({"names": ("dp", "tp"), "degrees": (2, 2), "roles": ["data"]}, r"one role per axis \['dp', 'tp'\]"),
    ({"names": ("dp", "tp"), "degrees": (2, 2), "roles": {"dq": "data"}},
     r"axis 'dq' is not one of the mesh's axes \['dp', 'tp'\]"),
    ({"names": ("dp", "tp"), "degrees": (2, 0)}, r"degree of mesh axis 'tp'.*received 0"),
    ({"names": ("dp", "tp"), "degrees": (-1, 2)}, r"degree of mesh axis 'dp'.*received -1"),
    ({"names": ("dp",), "degrees": (2.0,)}, r"degree of mesh axis 'dp'.*received 2.0"),
    ({"names": ("dp",), "degrees": (True,)}, r"degree of mesh axis 'dp'.*received True"),
    ({"names": ("dp", "tp"), "degrees": (2,)}, r"2 axis names \['dp', 'tp'\] but 1 degrees"),
    ({"names": "dp", "degrees": (2,)}, r"Invalid `names`.*received names='dp'"),
])
def test_bad_input_is_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_an_unknown_role_asked_for_is_refused():
    with pytest.raises(ValueError, match=r"Invalid role: .*received 'model'"):
        ParallelDims(names=("batch",), degrees=(2,)).degree("model")


# ---- the mesh values that carry it (no process) -------------------------------------------------------


def test_a_mesh_carries_its_roles_through_text_pickle_and_equality():
    mesh = Mesh(("dp", "tp"), (2, 2), roles={"dp": "data"})
    assert mesh.dims == ParallelDims(names=("dp", "tp"), degrees=(2, 2), roles={"dp": "data"})
    assert repr(mesh) == "Mesh(dp=2, tp=2, device_type='cpu', roles={'dp': 'data'})"
    assert mesh.to_string() == "|dp=2:data,tp=2|cpu" and Mesh.from_string(mesh.to_string()) == mesh
    assert pickle.loads(pickle.dumps(mesh)) == mesh and pickle.loads(pickle.dumps(mesh)).dims.data_axis == "dp"
    assert mesh != Mesh(("dp", "tp"), (2, 2))  # the same axes, another role: another value
    plain = Mesh(("batch", "model"), (2, 2))
    assert plain == Mesh(("batch", "model"), (2, 2), roles={"batch": "data"}) and plain.to_string() == \
        "|batch=2,model=2|cpu"
    layout = Layout(["tp", mf.dtensor.UNSHARDED], mesh)
    assert Layout.from_string(layout.to_string()) == layout
    with pytest.raises(ValueError, match=r"Invalid role of mesh axis 'dp'"):
        Mesh(("dp",), (2,), roles={"dp": "dta"})


def test_fully_sharded_marks_the_data_axis_shard_and_needs_one():
    mesh = Mesh(("dp", "tp"), (2, 2), roles={"dp": "data"})
    assert LayoutMap.fully_sharded(mesh).dims == mesh.dims.with_role("dp", "shard")
    assert LayoutMap(mesh).dims == mesh.dims
    with pytest.raises(ValueError, match=r"expected a mesh with a data axis.*Mesh\(dp=2, tp=2, device_type='cpu'\)"):
        LayoutMap.fully_sharded(Mesh(("dp", "tp"), (2, 2)))


def test_create_mesh_refuses_bad_roles_before_forming_processes():
    with pytest.raises(ValueError, match=r"axes 'dp' and 'batch' both split the batches"):
        mf.dtensor.create_mesh([("dp", 2), ("batch", 2)], devices=[f"cpu:{i}" for i in range(4)],
                               roles={"dp": "data"})
    with pytest.raises(ValueError, match=r"Invalid `roles`: expected a dict.*received roles=\['data'\]"):
        mf.dtensor.create_mesh([("dp", 2)], devices=["cpu:0", "cpu:1"], roles=["data"])


def test_keras_distributions_construct_the_dims():
    devices = [f"cpu:{i}" for i in range(4)]
    mesh = mf.distribution.DeviceMesh((2, 2), ["dp", "tp"], devices)
    assert mesh.dims_for("dp") == ParallelDims(names=("dp", "tp"), degrees=(2, 2), roles={"dp": "data"})
    assert mesh.dims_for(None).data_axis is None
    # an axis named "batch" that is not the data axis is a tensor axis there
    other = mf.distribution.DeviceMesh((2, 2), ["x", "batch"], devices)
    assert other.dims_for("x").role_map() == {"x": "data", "batch": "tensor"}
    assert mf.distribution.DataParallel(devices=["cpu:0", "cpu:1"]).dims == ParallelDims(names=("batch",),
                                                                                          degrees=(2,))
    layout_map = mf.distribution.LayoutMap(mesh)
    layout_map["0.weight"] = ("tp", None)
    assert mf.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="dp").dims.data_axis == "dp"
    sharded = mf.distribution.LayoutMap.fully_sharded(mesh)
    assert mf.distribution.ModelParallel(layout_map=sharded, batch_dim_name="dp").dims.role_map() == \
        {"dp": "shard", "tp": "tensor"}
    with pytest.raises(ValueError, match=r"Invalid `batch_dim_name`.*received batch_dim_name='batch'"):
        mf.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def test_model_parallel_refuses_a_map_naming_an_axis_the_mesh_lacks():
    devices = [f"cpu:{i}" for i in range(4)]
    mesh = mf.distribution.DeviceMesh((2, 2), ["dp", "tp"], devices)
    layout_map = mf.distribution.LayoutMap(mesh)
    with pytest.raises(ValueError, match=r"Valid axis names: .*Got \{'model'\}"):
        layout_map["0.weight"] = ("model", None)  # refused where the layout meets the map's mesh
    elsewhere = mf.distribution.DeviceMesh((2, 2), ["dp", "model"], devices)
    layout_map["0.weight"] = mf.distribution.TensorLayout(("model", None), elsewhere)
    with pytest.raises(ValueError, match=r"it names axis 'model', which the DeviceMesh lacks"):
        mf.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="dp")


# ---- the role decides, on 4 processes -----------------------------------------------------------------

STEPS, BATCH = 4, 8


def _module():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _keys(mf, layout_map, tensor_axis):
    layout_map[r"^0\.weight$"] = mf.dtensor.Layout([tensor_axis, mf.dtensor.UNSHARDED], layout_map.mesh)
    layout_map[r"^2\.weight$"] = mf.dtensor.Layout([mf.dtensor.UNSHARDED, tensor_axis], layout_map.mesh)
    return layout_map


def _fit(mf, scope):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 8)).astype("float32")
    y = rng.integers(0, 4, size=(STEPS * BATCH,)).astype("int64")
    with scope:
        model = mf.Model(_module())
        model.compile(optimizer=mf.optimizers.Adam(0.01),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    strategy = model.strategy
    context = strategy.input_context()
    return (model.get_weights(), history.history["loss"],
            (strategy.num_replicas_in_sync, context.num_input_pipelines, context.input_pipeline_id))


def _both_spellings(rank, world):
    import torch.distributed as dist

    import meshfit as mf
    from meshfit.dtensor import local_rows

    out = {}
    for names, roles in ((("batch", "model"), None), (("dp", "tp"), {"dp": "data"})):
        mesh = mf.dtensor.create_mesh(list(zip(names, (2, 2), strict=True)), roles=roles)
        data_group = mesh.strategy.world.data_group()
        rows = torch.arange(6.0).reshape(3, 2) + 10 * (rank // 2)  # a shard of the data axis
        packed = mf.dtensor.pack([rows], mf.dtensor.Layout.batch_sharded(mesh, names[0], 2))
        facts = (mesh.dims.data_axis, dist.get_world_size(data_group), torch.equal(local_rows(packed), rows))
        out[names[0], "layouts"] = (*_fit(mf, _keys(mf, mf.dtensor.LayoutMap(mesh), names[1]).scope()), facts)
        out[names[0], "fully_sharded"] = _fit(mf, _keys(mf, mf.dtensor.LayoutMap.fully_sharded(mesh),
                                                        names[1]).scope())
    device_mesh = mf.distribution.DeviceMesh((2, 2), ["dp", "tp"], mf.distribution.list_devices())
    keras_map = mf.distribution.LayoutMap(device_mesh)
    keras_map["0.weight"] = ("tp", None)
    keras_map["2.weight"] = (None, "tp")
    mf.distribution.set_distribution(mf.distribution.ModelParallel(layout_map=keras_map, batch_dim_name="dp"))
    try:
        out["keras"] = _fit(mf, mf.get_strategy().scope())
    finally:
        mf.distribution.set_distribution(None)
    return out


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y), float(np.max(np.abs(x - y)))


@pytest.mark.timeout(660)
def test_a_data_axis_named_dp_trains_as_the_batch_axis():
    results = run_distributed(_both_spellings, world_size=4, timeout=600)
    for rank, out in enumerate(results):
        # the data axis splits the batches over its 2 coordinates, whatever its name
        for name in ("batch", "dp"):
            assert out[name, "layouts"][3] == (name, 2, True), (rank, name, out[name, "layouts"][3])
            assert out[name, "layouts"][2] == (2, 2, rank // 2), (rank, name, out[name, "layouts"][2])
            assert out[name, "fully_sharded"][2] == (2, 2, rank // 2), (rank, name)
        for placement in ("layouts", "fully_sharded"):
            _assert_bitwise(out["dp", placement][0], out["batch", placement][0])
            assert out["dp", placement][1] == out["batch", placement][1]
        # Keras's spelling keeps the axis called "dp" and splits the batches over it
        assert out["keras"][2] == (2, 2, rank // 2)
        _assert_bitwise(out["keras"][0], out["batch", "fully_sharded"][0])
    _assert_bitwise(results[0]["dp", "layouts"][0], results[3]["dp", "layouts"][0])
