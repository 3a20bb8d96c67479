"""Mesh, Layout and LayoutMap as values: no processes needed."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from meshfit.dtensor import UNSHARDED, Layout, LayoutMap, Mesh
from meshfit.dtensor._apply import resolve_layouts
from meshfit.dtensor._create import _mesh_value

MESH = Mesh(("batch", "model"), (2, 2))


def test_mesh_value():
    assert MESH.size == 4 and MESH.ndim == 2 and MESH.dim_size("model") == 2
    assert MESH == Mesh(["batch", "model"], [2, 2])
    assert Mesh.from_string(MESH.to_string()) == MESH
    assert repr(MESH) == "Mesh(batch=2, model=2, device_type='cpu')"
    assert MESH.num_local_devices() == 4


@pytest.mark.parametrize("names, shape, needle", [
    (("batch", "batch"), (2, 2), "'batch' is used twice"),
    (("batch",), (2, 2), "1 axis names"),
    (("batch",), (0,), "positive int"),
    (("unsharded",), (2,), "Invalid axis name 'unsharded'"),
])
def test_mesh_errors(names, shape, needle):
    with pytest.raises(ValueError, match=needle):
        Mesh(names, shape)


def test_create_mesh_argument_errors():
    with pytest.raises(ValueError, match=r"needs 4 devices, received 3"):
        _mesh_value([("batch", 2), ("model", 2)], ["cpu:0", "cpu:1", "cpu:2"])
    with pytest.raises(ValueError, match="'model' is used twice"):
        _mesh_value([("model", 2), ("model", 2)], None)
    with pytest.raises(ValueError, match=r"Invalid `mesh_dims`"):
        _mesh_value({"batch": 2}, None)
    with pytest.raises(ValueError, match=r"Invalid mesh axis 'data'.*axes \['batch', 'model'\]"):
        MESH.dim_size("data")


def test_layout_value_and_placements():
    layout = Layout(["model", UNSHARDED], MESH)
    assert layout.sharding_specs == ("model", "unsharded") and layout.rank == 2
    assert layout.placements == (Replicate(), Shard(0))
    assert Layout(sharding_specs=("model", UNSHARDED), mesh=MESH) == layout
    assert Layout.replicated(MESH, 2) == Layout([UNSHARDED, UNSHARDED], MESH)
    assert Layout.replicated(MESH, 2).is_fully_replicated()
    assert Layout.batch_sharded(MESH, "batch", rank=4) == Layout(["batch"] + [UNSHARDED] * 3, MESH)
    assert Layout.batch_sharded(MESH, "batch", 2).placements == (Shard(0), Replicate())
    assert Layout([UNSHARDED, "batch"], MESH).placements == (Shard(1), Replicate())
    text = layout.to_string()
    assert text == "sharding_specs:model,unsharded, mesh:|batch=2,model=2|cpu"
    assert Layout.from_string(text) == layout
    assert Layout.from_string(f"Layout.from_string({text})") == layout
    assert repr(layout) == "Layout(['model', 'unsharded'], mesh=Mesh(batch=2, model=2, device_type='cpu'))"
    assert hash(layout) == hash(Layout(["model", UNSHARDED], MESH))
    with pytest.raises(dataclasses_error()):
        layout.mesh = MESH


def dataclasses_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("specs, needle", [
    (["model", "model"], r"mesh axis 'model' is used twice \(dims 0 and 1\).*UNSHARDED"),
    (["data", UNSHARDED], r"names mesh axis 'data', which is not in the mesh's axes \['batch', 'model'\]"),
    ("model", r"Invalid `sharding_specs`"),
])
def test_bad_layouts(specs, needle):
    with pytest.raises(ValueError, match=needle):
        Layout(specs, MESH)


def test_shape_checks_name_the_tensor_and_the_fix():
    layout = Layout(["model", UNSHARDED], MESH)
    with pytest.raises(ValueError, match=r"feature.bias of shape \[16\].*rank 2 but the tensor has rank 1.*"
                                         r"Layout.replicated\(mesh, rank=1\)"):
        layout.check_shape((16,), "feature.bias")
    layout.check_shape((5, 3), "w")  # uneven: split as torch.chunk splits it
    assert layout.local_shape((8, 3)) == (4, 3)
    assert layout.local_shape((5, 3)) == (3, 3)  # the first device's share: ceil(5 / 2)
    assert layout.local_shape((5, 3), coordinate=(1, 1)) == (2, 3)
    assert Layout(["batch", "model"], MESH).local_shape((3, 1), coordinate=(1, 1)) == (1, 0)  # 1 over 2: 1 and 0


class Subclassed(nn.Module):
    def __init__(self):
        super().__init__()
        self.feature = nn.Linear(16, 16)
        self.dropout = nn.Dropout(0.1)
        self.feature_2 = nn.Linear(16, 24)
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        return self.head(self.feature_2(self.dropout(self.feature(x))))


def test_layout_map_lookup_exact_then_regex():
    layout_map = LayoutMap(mesh=MESH)
    sharded = Layout(["model", UNSHARDED], MESH)
    layout_map["feature.*weight"] = sharded
    layout_map["feature.*bias"] = Layout(["model"], MESH)
    layouts = resolve_layouts(Subclassed(), layout_map)
    assert layouts["feature.weight"] == sharded and layouts["feature_2.weight"] == sharded
    assert layouts["feature.bias"].sharding_specs == ("model",)
    assert layouts["head.weight"] == Layout.replicated(MESH, 2)
    assert layout_map["head.weight"] is None
    assert len(layout_map) == 2 and list(layout_map) == ["feature.*weight", "feature.*bias"]
    layout_map["feature_2.weight"] = Layout.replicated(MESH, 2)  # an exact key wins over the regexes
    assert resolve_layouts(Subclassed(), layout_map)["feature_2.weight"].is_fully_replicated()
    del layout_map["feature_2.weight"]
    assert "feature_2.weight" not in layout_map


def test_layout_map_sequential_keys():
    from collections import OrderedDict

    layout_map = LayoutMap(MESH)
    layout_map["feature.*weight"] = Layout.batch_sharded(MESH, "batch", rank=2)
    model = nn.Sequential(OrderedDict(feature=nn.Linear(16, 16), dropout=nn.Dropout(0.1),
                                      feature_2=nn.Linear(16, 32)))
    layouts = resolve_layouts(model, layout_map)
    assert layouts["feature.weight"].sharding_specs == ("batch", UNSHARDED)
    assert layouts["feature_2.weight"].sharding_specs == ("batch", UNSHARDED)
    assert layouts["feature.bias"].is_fully_replicated()
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    layout_map = LayoutMap(MESH)
    layout_map[r"^0\.weight$"] = Layout(["model", UNSHARDED], MESH)
    assert resolve_layouts(plain, layout_map)["0.weight"].sharding_specs == ("model", UNSHARDED)


def test_a_hand_map_key_that_matches_nothing_is_ignored_as_in_keras():
    # Keras 3's LayoutMap returns None for a path no key matches and never checks the keys themselves
    # (one map serves several layers/models); a fully sharded map refuses such a key (test_fully_sharded).
    layout_map = LayoutMap(MESH)
    layout_map["feature.*weight"] = Layout(["model", UNSHARDED], MESH)
    layout_map["encoder.*weight"] = Layout(["model", UNSHARDED], MESH)
    layouts = resolve_layouts(Subclassed(), layout_map)
    assert layouts["feature.weight"].sharding_specs == ("model", UNSHARDED)
    assert layouts["head.weight"].is_fully_replicated()
    assert layout_map.unmatched_keys(list(layouts)) == ["encoder.*weight"]


def test_two_keys_matching_one_path_is_an_error_naming_both():
    layout_map = LayoutMap(MESH)
    layout_map["feature"] = Layout(["model", UNSHARDED], MESH)
    layout_map["weight$"] = Layout([UNSHARDED, "model"], MESH)
    with pytest.raises(ValueError, match=r"'feature.weight' matches several LayoutMap keys: 'feature' and "
                                         r"'weight\$'.*exact key"):
        resolve_layouts(Subclassed(), layout_map)


def test_layout_map_value_errors():
    layout_map = LayoutMap(MESH)
    with pytest.raises(ValueError, match="should be a dtensor.Layout.*expected a meshfit.dtensor.Layout"):
        layout_map["x"] = "model"  # ValueError, as tf-keras and Keras 3 raise
    with pytest.raises(ValueError, match="not a valid regular expression"):
        layout_map["feature.(weight"] = Layout(["model", UNSHARDED], MESH)
    with pytest.raises(ValueError, match="is not this map's mesh"):
        layout_map["x"] = Layout(["model"], Mesh(("model",), (4,)))
    with pytest.raises(TypeError, match="Invalid `mesh`"):
        LayoutMap(mesh="mesh")
    layout_map["feature.*weight"] = Layout(["model"], MESH)  # rank 1 for a rank-2 weight
    with pytest.raises(ValueError, match=r"parameter 'feature.weight' of shape \[16, 16\].*rank 1"):
        resolve_layouts(Subclassed(), layout_map)


def test_lazy_parameters_need_a_forward_pass_first():
    with pytest.raises(ValueError, match="'0.weight' is still lazy"):
        resolve_layouts(nn.Sequential(nn.LazyLinear(4)), LayoutMap(MESH))


def test_mesh_without_processes_says_how_to_get_them():
    with pytest.raises(RuntimeError, match="create_mesh"):
        MESH.device_mesh  # noqa: B018


def test_a_parameter_that_does_not_split_evenly_is_split_as_torch_chunk():
    layout_map = LayoutMap(MESH)
    layout_map["head.weight"] = Layout(["model", UNSHARDED], MESH)
    model = nn.Sequential()
    model.add_module("head", nn.Linear(4, 5))  # 5 output rows over a model axis of size 2: 3 and 2
    layouts = resolve_layouts(model, layout_map)
    assert layouts["head.weight"].local_shape((5, 4)) == (3, 4)
    assert layouts["head.weight"].local_shape((5, 4), coordinate=(0, 1)) == (2, 4)


def test_assigning_a_key_twice_is_an_error_as_in_keras():
    # Keras 3 and tf-keras raise; a silent replacement would drop the first layout unnoticed.
    layout_map = LayoutMap(MESH)
    layout_map["feature.*weight"] = Layout(["model", UNSHARDED], MESH)
    with pytest.raises(ValueError, match=r"feature.\*weight already exist in the LayoutMap.*del layout_map"):
        layout_map["feature.*weight"] = Layout.replicated(MESH, 2)
    assert layout_map["feature.weight"].sharding_specs == ("model", UNSHARDED)  # the first one is kept
    del layout_map["feature.*weight"]
    layout_map["feature.*weight"] = Layout.replicated(MESH, 2)  # the fix the message names
    assert layout_map["feature.weight"].is_fully_replicated()


def test_fullmatch_keys_match_whole_paths_as_keras_3():
    layout_map = LayoutMap(MESH, match="fullmatch")
    layout_map["feature.*weight"] = Layout(["model", UNSHARDED], MESH)
    assert layout_map["feature_2.weight"].sharding_specs == ("model", UNSHARDED)
    assert layout_map["head.feature.weight"] is None  # found inside the path, but not the whole of it
    assert LayoutMap(MESH)["x"] is None
    layout_map = LayoutMap(MESH)
    layout_map["feature.*weight"] = Layout(["model", UNSHARDED], MESH)
    assert layout_map["head.feature.weight"] is not None  # the default: searched in the path
    with pytest.raises(ValueError, match="Invalid `match`"):
        LayoutMap(MESH, match="prefix")


def test_layouts_and_meshes_copy_and_pickle_as_values():
    # A parameter's state dict (and async checkpoint staging) deep-copies its layout: the mesh's
    # processes must not be copied or pickled with it.
    import copy
    import pickle

    layout = Layout(["model", UNSHARDED], MESH)
    assert copy.deepcopy(layout) is layout and copy.deepcopy(MESH) is MESH
    assert pickle.loads(pickle.dumps(layout)) == layout
