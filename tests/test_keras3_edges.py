"""Edges of the Keras 3 behaviours: "accuracy" with torch's cross-entropy on numpy one-hot targets and DTensor
scores; a batch-begin hook's stop_evaluating / stop_predicting, on one process and on several; a replica
view's cache forgotten on a resume's reseed; KLDivLoss(reduction='batchmean') with unit sample weights."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf

torch.set_num_threads(1)


def test_cross_entropy_accuracy_with_numpy_one_hot_targets():
    acc = mf.metrics.get("accuracy", loss=nn.CrossEntropyLoss())
    acc.update_state(np.eye(3, dtype=np.float32), torch.eye(3) * 5)
    assert float(acc.result()) == 1.0


def test_cross_entropy_accuracy_with_dtensor_outputs():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        scores = distribute_tensor(torch.eye(3) * 5, mesh, [Replicate()])
        sparse = mf.metrics.get("accuracy", loss=nn.CrossEntropyLoss())
        sparse.update_state(torch.arange(3), scores)  # class indices: works (MeanMetricWrapper's local rows)
        assert float(sparse.result()) == 1.0
        acc = mf.metrics.get("accuracy", loss=nn.CrossEntropyLoss())
        acc.update_state(torch.eye(3), scores)  # class probabilities
        assert float(acc.result()) == 1.0
    finally:
        dist.destroy_process_group()


# ---- stop_evaluating / stop_predicting set in a batch-begin hook: honoured on one process and on several ----
@pytest.mark.parametrize("kind", ["test", "predict"])
def test_a_batch_begin_hook_may_stop_evaluation(kind):
    from meshfit._engine._evaluation import _may_stop

    attribute = "stop_evaluating" if kind == "test" else "stop_predicting"

    class StopAtBegin(mf.callbacks.Callback):
        def _stop(self, batch: int, logs: Any = None) -> None:
            if batch >= 1:
                setattr(self.model, attribute, True)

    setattr(StopAtBegin, f"on_{kind}_batch_begin", StopAtBegin._stop)
    model = mf.Model(nn.Linear(2, 1))
    model.compile(optimizer="sgd", loss="mse")
    assert _may_stop(model, [StopAtBegin()], kind)


# ---- reseed_shuffles: a replica view's cache above a shuffle it shares with the dataset is forgotten ----
def test_resume_forgets_the_view_cache_above_a_shared_shuffle():
    from meshfit._engine._data_handler import DataHandler
    from meshfit.data import AutoShardPolicy, Dataset, Options
    from meshfit.distribute import DistributedDataset, OneDeviceStrategy
    from meshfit.distribute._values import InputContext

    def handler(seed: int) -> DataHandler:
        ds = Dataset.from_tensor_slices(torch.arange(16)).shuffle(16, seed=seed).batch(4).cache()
        ds = ds.with_options(Options(auto_shard_policy=AutoShardPolicy.OFF))
        dd = DistributedDataset(ds, InputContext(num_input_pipelines=2, input_pipeline_id=0, num_replicas_in_sync=2))
        return DataHandler(dd, None, None, None, None, False, OneDeviceStrategy("cpu"))

    resumed, saved = handler(1), handler(2)
    first_before = resumed.source.replica_batch(0, 0)[0].clone()  # fit reads a first batch (build)
    want = saved.source.replica_batch(0, 0)[0]
    assert not torch.equal(first_before, want)  # the two seeds order the rows differently
    resumed.load_state_dict(saved.state_dict())
    from meshfit.data import Shuffle

    assert [n.seed for n in resumed.source.view.node.nodes() if isinstance(n, Shuffle)] == [2]  # reseeded
    assert torch.equal(resumed.source.replica_batch(0, 0)[0], want)


# ---- TorchModuleLoss reduces as the module does, reduction="batchmean" included --------------------
def test_kl_div_batchmean_with_unit_weights_is_the_unweighted_loss():
    torch.manual_seed(0)
    log_p = torch.log_softmax(torch.randn(2, 4), dim=-1)
    target = torch.softmax(torch.randn(2, 4), dim=-1)
    loss = mf.losses.TorchModuleLoss(nn.KLDivLoss(reduction="batchmean"))
    unweighted = loss(target, log_p)
    weighted = loss(target, log_p, sample_weight=torch.ones(2))
    torch.testing.assert_close(weighted, unweighted)
