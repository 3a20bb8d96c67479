"""A test-only two-stage "identity pipeline" placement on 2 gloo ranks: the placement plan's contract.

The placement below is written here, outside meshfit, from the plan's public seams alone: a
`Placement` with its own `Residency` (rank 0 holds the first layer, rank 1 the last and the loss) and
its own step runner (rank 0's activations sent to rank 1, rank 1's input gradient sent back, one
microbatch). Nothing in meshfit knows about it; training, logs, backups, ``model.save``, the replica
check and ``state_digest`` must still be right, because each asks the placement's `Residency` instead
of guessing "every rank holds everything". Each assertion fails when one of those readers guesses:
a chief-alone save would write rank 0's stale copy of the second layer, the log reduction would take
rank 0's empty metrics, the digest would sum the wrong copy.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import pytest
import torch
from _multiproc import run_distributed
from torch import nn

TIMEOUT = 240


def _net() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.integers(0, 3, size=64).astype("int64")
    return x, y


@dataclasses.dataclass
class _Outputs:
    y_pred: Any
    loss: torch.Tensor
    size: int


class _TwoStageRunner:
    """Stage 0 (``module[0:2]``) on rank 0, stage 1 (``module[2]``) and the loss on rank 1."""

    def __init__(self, module: nn.Sequential, rank: int) -> None:
        self.first, self.last, self.rank = module[0:2], module[2], rank

    def _forward(self, host: Any, x: torch.Tensor, grad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        import torch.distributed as dist

        if self.rank == 0:
            hidden = self.first(x)
            dist.send(hidden.detach().contiguous(), dst=1)
            return hidden, None
        hidden = torch.empty(x.shape[0], 8)
        dist.recv(hidden, src=0)
        hidden.requires_grad_(grad)
        return hidden, self.last(hidden)

    def train(self, host: Any, x: Any, y: Any, sample_weight: Any) -> _Outputs | None:
        import torch.distributed as dist

        hidden, out = self._forward(host, x, True)
        if self.rank == 0:
            grad = torch.empty_like(hidden)
            dist.recv(grad, src=1)
            hidden.backward(grad)
            return None
        loss = host.compute_loss(x, y, out, sample_weight)
        loss.backward()
        dist.send(hidden.grad.contiguous(), dst=0)
        return _Outputs(out, loss, x.shape[0])

    def evaluate(self, host: Any, x: Any, y: Any, sample_weight: Any) -> _Outputs | None:
        with torch.no_grad():
            _, out = self._forward(host, x, False)
            if out is None:
                return None
            return _Outputs(out, host.compute_loss(x, y, out, sample_weight), x.shape[0])

    def predict(self, host: Any, x: Any) -> Any:
        import torch.distributed as dist

        with torch.no_grad():
            _, out = self._forward(host, x, False)
        out = out if out is not None else torch.empty(x.shape[0], 3)
        dist.broadcast(out, src=1)  # every worker returns the predictions, as Keras's predict does
        return out


class _IdentityPipeline:
    """The `PlacementBuilder`: the module as two stages, each rank holding one."""

    def build(self, module: nn.Module, strategy: Any) -> Any:
        from meshfit.distribute import Placement, ReplicatedSync, StageResidency

        rank = strategy.world.rank
        residency = StageResidency(rank, stage_paths=[frozenset({"0.weight", "0.bias"}),
                                                      frozenset({"2.weight", "2.bias"})],
                                   stage_ranks=[(0,), (1,)], output_ranks=frozenset({1}), log_ranks=frozenset({1}))
        return Placement(module, module, ReplicatedSync(), residency, _TwoStageRunner(module, rank))


def _compiled(model: Any) -> None:
    import meshfit as mf

    model.compile(optimizer=mf.optimizers.Adam(0.05), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])


def _one_process(epochs: int) -> tuple[dict[str, Any], dict[str, list[float]], int]:
    import meshfit as mf

    model = mf.Model(_net())
    _compiled(model)
    x, y = _data()
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return state, history.history, mf.train.state_digest(model).total


def _pipeline_worker(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    import meshfit as mf

    mesh = mf.dtensor.create_mesh([("pipe", 2)])
    strategy = mesh.strategy.with_placement_builder(_IdentityPipeline())
    with strategy.scope():
        model = mf.Model(_net())
    _compiled(model)
    x, y = _data()
    backup = os.path.join(directory, "backup")
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                        callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=2, delete_checkpoint=False),
                                   mf.callbacks.VerifyReplicas(every_n_steps=2, on_divergence="stop")])
    verified = strategy.verify_replicas(model)
    evaluated = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    predicted = model.predict(x, batch_size=16, verbose=0)
    model.save(os.path.join(directory, "model.keras"))  # every worker, as a sharded model needs
    return {"history": history.history, "digest": mf.train.state_digest(model).total,
            "compared": verified.compared, "one_copy": verified.one_copy, "evaluated": evaluated,
            "predicted": predicted,
            "held": {k: v.detach().numpy().copy() for k, v in model.module.state_dict().items()}}


@pytest.mark.timeout(TIMEOUT)
def test_identity_pipeline_trains_logs_verifies_and_saves_as_one_process(tmp_path: Any) -> None:
    import meshfit as mf

    reference, reference_history, reference_digest = _one_process(2)
    results = run_distributed(_pipeline_worker, world_size=2, timeout=TIMEOUT - 60, args=(str(tmp_path),))
    for rank, result in enumerate(results):
        # logs: the loss and accuracy of the stage that holds the outputs, on every worker
        for name in ("loss", "accuracy"):
            np.testing.assert_allclose(result["history"][name], reference_history[name], rtol=1e-6, err_msg=name)
        # the digest of the whole state, each path from the rank that holds it: one process's
        assert result["digest"] == reference_digest, rank
        # each rank holds one stage: no parameter has a second copy (the step count every rank holds has)
        assert result["compared"] == ("optimizer/iterations",)
        assert {"0.weight", "2.weight"} <= set(result["one_copy"])
        np.testing.assert_allclose(result["predicted"], results[1]["predicted"])
    # the stage each rank trains equals one process's layers
    for path, rank in (("0.weight", 0), ("0.bias", 0), ("2.weight", 1), ("2.bias", 1)):
        np.testing.assert_array_equal(results[rank]["held"][path], reference[path].numpy(), err_msg=path)
    # rank 0's copy of the last layer was never trained: a reader that took it would be wrong
    assert not np.array_equal(results[0]["held"]["2.weight"], reference["2.weight"].numpy())
    # model.save wrote the whole state from its holders: one plain process loads one process's weights
    loaded = mf.load_model(str(tmp_path / "model.keras"))
    for path, value in loaded.module.state_dict().items():
        torch.testing.assert_close(value, reference[path], rtol=0, atol=0)
    # a backup restores in one plain process: the last one equals one process's weights at that step
    restored, _, _ = _restore_in_one_process(str(tmp_path / "backup"))
    assert restored == reference_digest


def _restore_in_one_process(backup: str) -> tuple[int, Any, Any]:
    import meshfit as mf

    model = mf.Model(_net())
    _compiled(model)
    x, y = _data()
    # fit resumes from the backup's end (epoch 2 of 2 done): no step runs, the restored state stays
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[mf.callbacks.BackupAndRestore(backup, save_freq=2, delete_checkpoint=False)])
    return mf.train.state_digest(model).total, None, None
