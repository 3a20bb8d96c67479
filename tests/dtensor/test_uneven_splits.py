"""Uneven splits along ``model``: a dim that the axis does not divide is split as torch's DTensor splits
it (``torch.chunk``: 9 features over 2 are 5 and 4), on the 2-D path (tensor parallel, then fully
sharded over ``batch``) and on a plain ``LayoutMap``.

The 2-D case ports PyTorch's ``TestFullyShard2DTraining.test_train_parity_2d_mlp``
(test/distributed/_composable/test_composability/test_2d_composability.py at commit
01008820dfcc78c037fb2a008d4e2e745eb30f45; it lived in test/distributed/_composable/fsdp/
test_fully_shard_training.py before): a stack of three MLPs of ``mlp_dim`` 3 and 17 (hidden widths
3x and 4x, so 9 and 51 features split over 2), column-wise ``in_proj``, row-wise ``out_proj``, on a
``(2, 2)`` mesh of 4 gloo processes, trained by ``fit``: every step's loss and the final weights equal
one process (torch asserts the losses of each of 10 steps; here SGD within 1e-5 relative, AdamW rtol
1e-5), every parameter is a DTensor on the 2-D mesh, and each process holds its ``torch.chunk`` share.
The same runs check that the state digest equals one process's, that ``VerifyReplicas`` raises no false
alarm, that ``model.save`` writes full tensors and that a backup reshards onto one process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._multiproc import run_distributed

# 4 gloo processes a run, several runs a test, on a shared 2-core machine
pytestmark = [pytest.mark.timeout(1500), pytest.mark.crowded]

BATCH, STEPS = 8, 10
EXAMPLES = BATCH * (STEPS - 1) + 5  # the last batch holds 5 rows: 3 and 2 on the two replicas


class _Perceptron(nn.Module):
    """Widen, ReLU, narrow, ReLU (the block torch's MLPStack repeats)."""

    def __init__(self, dim: int, widen: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, widen * dim)
        self.out_proj = nn.Linear(widen * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.out_proj(F.relu(self.in_proj(x))))


def _stack(mlp_dim: int) -> nn.Sequential:
    torch.manual_seed(42)
    return nn.Sequential(_Perceptron(mlp_dim, 3), _Perceptron(mlp_dim, 4), _Perceptron(mlp_dim, 3))


def _data(mlp_dim: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(mlp_dim)
    return (rng.normal(size=(EXAMPLES, mlp_dim)).astype("float32"),
            rng.normal(size=(EXAMPLES, mlp_dim)).astype("float32"))


def _two_d_map(mf, mesh):
    U = mf.dtensor.UNSHARDED
    layout_map = mf.dtensor.LayoutMap.fully_sharded(mesh)
    layout_map[r"in_proj\.weight"] = mf.dtensor.Layout(["model", U], mesh)  # column-wise (its bias follows)
    layout_map[r"out_proj\.weight"] = mf.dtensor.Layout([U, "model"], mesh)  # row-wise
    return layout_map


def _optimizer(mf, name):
    return mf.optimizers.SGD(0.05) if name == "sgd" else mf.optimizers.AdamW(1e-2)


def _build(mf, mlp_dim, name, shape):
    if shape is None:
        scope = mf.get_strategy().scope()
    else:  # a lenient heartbeat: 4 processes on a shared 2-core machine may be starved for seconds
        mesh = mf.dtensor.create_mesh([("batch", shape[0]), ("model", shape[1])],
                                      communication_options=mf.CommunicationOptions(heartbeat_timeout_seconds=60))
        scope = _two_d_map(mf, mesh).scope()
    with scope:
        model = mf.Model(_stack(mlp_dim))
        model.compile(optimizer=_optimizer(mf, name), loss="mse")
    return model


def _fit(rank, world, shape, mlp_dim, save_dir=None):
    """For SGD and AdamW: each step's loss, the final weights and digest; on a mesh also local shapes,
    the parameters' meshes, `VerifyReplicas`' verdict, and ``model.save`` (SGD)."""
    from torch.distributed.tensor import DTensor

    import meshfit as mf
    from meshfit.train import state_digest

    class Losses(mf.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.losses = []

        def on_train_batch_end(self, batch, logs=None):
            self.losses.append(float(logs["loss"]))

    x, y = _data(mlp_dim)
    out = {}
    for name in ("sgd", "adamw"):
        model = _build(mf, mlp_dim, name, shape)
        initial = dict(state_digest(model.module))
        losses = Losses()
        callbacks = [losses]
        verify = None
        if shape is not None:
            verify = mf.callbacks.VerifyReplicas(every_n_steps=1, on_divergence="stop")
            callbacks.append(verify)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        params = dict(model.module.named_parameters())
        result = {"losses": losses.losses, "weights": model.get_weights(), "initial": initial,
                  "digest": dict(state_digest(model.module)), "iterations": model.optimizer.iterations}
        if shape is not None:
            result["local"] = {p: tuple(params[p].to_local().shape) for p in ("0.in_proj.weight", "0.in_proj.bias",
                                                                              "0.out_proj.weight", "1.in_proj.weight")}
            result["meshes"] = {(isinstance(p, DTensor), p.device_mesh.mesh_dim_names if isinstance(p, DTensor)
                                 else None, len(p.placements) if isinstance(p, DTensor) else 0)
                                for p in params.values()}
            result["coverage"] = (set(verify.coverage.compared), set(verify.coverage.one_copy),
                                  set(verify.coverage.gathered))
            if save_dir and name == "sgd":
                model.save(f"{save_dir}/model.keras")
        out[name] = result
    return out


@pytest.mark.parametrize("mlp_dim", [3, 17])
def test_uneven_two_d_mlp_trains_like_one_process(mlp_dim, tmp_path):
    import meshfit as mf
    from meshfit.train import state_digest

    (plain,) = run_distributed(_fit, world_size=1, args=(None, mlp_dim), timeout=300)
    results = run_distributed(_fit, world_size=4, args=((2, 2), mlp_dim, str(tmp_path)), timeout=600)
    hidden3, hidden4 = 3 * mlp_dim, 4 * mlp_dim  # 9 / 12, or 51 / 68
    for rank, result in enumerate(results):
        for name in ("sgd", "adamw"):
            got, want = result[name], plain[name]
            assert got["iterations"] == STEPS
            assert got["initial"] == want["initial"]  # the uneven shards digest as the whole tensors
            np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
            if name == "sgd":
                rel = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
                          for a, b in zip(got["weights"], want["weights"], strict=True))
                assert rel <= 1e-5, rel
            else:
                for a, b in zip(got["weights"], want["weights"], strict=True):
                    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
            assert got["meshes"] == {(True, ("batch", "model"), 2)}
            # VerifyReplicas stopped nothing, and checked: row-wise biases across their 2 copies (over
            # 'model'), the uneven shards at rest and after gathering
            compared, one_copy, gathered = got["coverage"]
            assert {f"{i}.out_proj.bias" for i in range(3)} <= compared, compared
            assert {"0.in_proj.weight", "0.in_proj.bias", "0.out_proj.weight"} <= one_copy & gathered
            # torch.chunk's shares over 'model', then fully_shard's over 'batch' (dim 0): 9 rows -> 5 | 4 -> 3, 2 | 2, 2
            m, b = rank % 2, rank // 2  # the coordinates of a (batch, model) mesh
            rows = _share(hidden3, m)
            assert got["local"] == {"0.in_proj.weight": (_share(rows, b), mlp_dim), "0.in_proj.bias": (_share(rows, b),),
                                    "0.out_proj.weight": (_share(mlp_dim, b), rows),
                                    "1.in_proj.weight": (_share(_share(hidden4, m), b), mlp_dim)}, got["local"]
        if mlp_dim == 17:  # 51 rows: 26 and 25 over 'model', 13 + 13 and 13 + 12 over 'batch'
            assert [r["sgd"]["local"]["0.in_proj.weight"][0] for r in results] == [13, 13, 13, 12]
    for other in results[1:]:
        for a, b in zip(results[0]["sgd"]["weights"], other["sgd"]["weights"], strict=True):
            np.testing.assert_array_equal(a, b)  # every process gathers the same full weights
    # the trained (2, 2) state digests as the same weights in one plain process
    module = _stack(mlp_dim)
    with torch.no_grad():
        for param, value in zip(module.parameters(), results[0]["sgd"]["weights"], strict=True):
            param.copy_(torch.from_numpy(value))
    assert dict(state_digest(module)) == results[0]["sgd"]["digest"]
    # model.save on (2, 2) writes the full tensors; one process loads them
    loaded = mf.load_model(f"{tmp_path}/model.keras", module=_stack(mlp_dim))
    for got, want in zip(loaded.get_weights(), results[0]["sgd"]["weights"], strict=True):
        np.testing.assert_array_equal(got, want)


def _share(size: int, index: int, pieces: int = 2) -> int:
    """The ``index``-th of ``torch.chunk(size, pieces)``'s sizes (DTensor's Shard)."""
    chunk = -(-size // pieces)
    return max(0, min(chunk, size - index * chunk))


class _Stop(Exception):
    pass


def _stage(rank, world, shape, backup, stop_at):
    """SGD with step backups every 3 steps; raise before step ``stop_at``."""
    import meshfit as mf

    class Interrupt(mf.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if stop_at is not None and self.model.optimizer.iterations + 1 == stop_at:
                raise _Stop

    model = _build(mf, 17, "sgd", shape)
    x, y = _data(17)
    callbacks = [Interrupt()]
    if backup:
        callbacks.insert(0, mf.callbacks.BackupAndRestore(backup, save_freq=3, delete_checkpoint=False,
                                                          async_save=False))
    try:
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    except _Stop:
        return None
    return {"iterations": model.optimizer.iterations, "weights": model.get_weights()}


def test_an_uneven_two_d_backup_reshards_onto_one_process(tmp_path):
    backup = str(tmp_path / "backup")
    (uninterrupted,) = run_distributed(_stage, world_size=1, args=(None, None, None), timeout=300)
    assert run_distributed(_stage, world_size=4, args=((2, 2), backup, 8), timeout=600) == [None] * 4  # at 6
    (resumed,) = run_distributed(_stage, world_size=1, args=(None, backup, None), timeout=300)
    assert resumed["iterations"] == uninterrupted["iterations"] == 2 * STEPS
    rel = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
              for a, b in zip(resumed["weights"], uninterrupted["weights"], strict=True))
    assert rel <= 1e-5, rel


# ---- a plain LayoutMap: whole-mesh DTensor parameters, 2 processes -----------------------------------
def _plain_fit(rank, world, sharded):
    from torch.distributed.tensor import DTensor

    import meshfit as mf
    from meshfit.train import state_digest

    U = mf.dtensor.UNSHARDED
    x, y = _data(3)
    if sharded:
        mesh = mf.dtensor.create_mesh([("batch", 1), ("model", 2)])
        layout_map = mf.dtensor.LayoutMap(mesh)
        layout_map[r"in_proj\.weight"] = mf.dtensor.Layout(["model", U], mesh)  # 9 or 12 rows over 2
        layout_map[r"in_proj\.bias"] = mf.dtensor.Layout(["model"], mesh)
        layout_map[r"out_proj\.weight"] = mf.dtensor.Layout([U, "model"], mesh)
        scope = layout_map.scope()
    else:
        scope = mf.get_strategy().scope()
    with scope:
        model = mf.Model(_stack(3))
        model.compile(optimizer=mf.optimizers.SGD(0.05), loss="mse")
    initial = dict(state_digest(model.module))
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    first = model.module[0].in_proj.weight
    local = tuple(first.to_local().shape) if isinstance(first, DTensor) else tuple(first.shape)
    return model.get_weights(), history.history["loss"], local, initial


def test_an_uneven_plain_layout_map_trains_like_one_process():
    want = run_distributed(_plain_fit, world_size=1, args=(False,), timeout=300)[0]
    results = run_distributed(_plain_fit, world_size=2, args=(True,), timeout=300)
    assert [r[2] for r in results] == [(5, 3), (4, 3)]  # 9 rows over 2: torch.chunk's 5 and 4
    for weights, losses, _, initial in results:
        assert initial == want[3]
        np.testing.assert_allclose(losses, want[1], rtol=1e-5)
        rel = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-12))
                  for a, b in zip(weights, want[0], strict=True))
        assert rel <= 1e-5, rel


# ---- what torch cannot split: an attention's heads (refused at creation, without processes) ---------
def test_uneven_keys_are_accepted_and_a_cut_head_is_refused_by_name():
    from _two_d_model import TransformerLM, two_d_map

    import meshfit as mf
    from meshfit.dtensor._tensor_parallel import tensor_parallel_styles

    mesh = mf.dtensor.Mesh(("batch", "model"), (2, 2))
    axis, styles = tensor_parallel_styles(_stack(17), _two_d_map(mf, mesh), "batch")  # 51 and 68 rows over 2
    assert axis == "model" and styles["0.in_proj"][0] == "column-wise" and styles["2.out_proj"][0] == "row-wise"
    torch.manual_seed(0)
    tensor_parallel_styles(TransformerLM(d_model=16, heads=4), two_d_map(mf, mesh), "batch")  # 2 whole heads each
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.qkv\.weight' \(column-wise\): its 36 output features "
                                         r"split over 'model' \(size 2\) as \[18, 18\].*'layers\.0\.attn' "
                                         r"\(head_dim 4\).*a number of heads that 'model' divides"):
        tensor_parallel_styles(TransformerLM(d_model=12, heads=3), two_d_map(mf, mesh), "batch")
