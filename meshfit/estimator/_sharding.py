"""The Estimator on fully sharded data parallel: ``model_fn``'s modules placed by ``LayoutMap.fully_sharded``.

A mesh strategy whose map is ``LayoutMap.fully_sharded(mesh)`` (``train_distribute``, or the
strategy ``layout_map.scope()`` yields) shards each module ``model_fn`` uses in place, through the
same ``strategy.setup_module`` that places a `Model`'s module (the strategy asks the one plan builder,
`meshfit.distribute._plan_builder`, as every strategy does): ``model_fn`` keeps calling the same
module object, now torch's ``fully_shard`` module, which all-gathers a block's weights for its
forward and backward and reduce-scatters its gradients. The train op then neither averages the
gradients again (FSDP's reduce-scatter averages them over the replicas, TF's Estimator semantics)
nor lets an optimizer reduce them. Evaluation and prediction need every process (the weights are
split over them), so they run under the training strategy unless ``eval_distribute`` is given.
A hand ``LayoutMap`` (per-weight layouts) is refused: the Estimator does not lay those out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshfit._protocols import DistributionStrategy


def is_fully_sharded(strategy: DistributionStrategy) -> bool:
    """Whether ``strategy`` carries a ``LayoutMap.fully_sharded`` map (hand maps are refused here)."""
    layout_map = strategy.layout_map
    if layout_map is None:
        return False
    if not layout_map.is_fully_sharded:
        raise ValueError(f"Invalid `train_distribute`: a mesh strategy with a hand LayoutMap (layout_map.scope(), "
                         f"received {layout_map!r}) is not supported by the Estimator yet: its modules would train "
                         "replicated, not laid out. Use mf.dtensor.LayoutMap.fully_sharded(mesh) (every weight "
                         "sharded over 'batch'), the mesh without a LayoutMap, or MultiWorkerMirroredStrategy.")
    return True


def is_sharded_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` has already placed ``module`` (an earlier run of this Estimator)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def shard_modules(strategy: DistributionStrategy, modules: dict[str, nn.Module], optimizer: Any) -> Any:
    """Shard the modules not sharded yet, in place; returns the gradient sync of one (None when none was new).

    Raises:
        ValueError: ``optimizer`` is a ``torch.optim.Optimizer`` already built on the unsharded
            parameters (``fully_shard`` replaces them, so it would update stale tensors).
    """
    before = {id(p) for m in modules.values() for p in m.parameters()}
    sync = None
    for module in modules.values():
        if not is_sharded_module(module):
            sync = strategy.setup_module(module).gradient_sync
    if isinstance(optimizer, torch.optim.Optimizer):
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if any(id(p) in before for p in held) and sync is not None:
            raise ValueError(f"Invalid optimizer for LayoutMap.fully_sharded: a {type(optimizer).__name__} built on "
                             "the module's parameters before they were sharded would update stale tensors. Use a "
                             "meshfit optimizer, e.g. mf.estimator.once(lambda: mf.optimizers.SGD(0.1)), which the "
                             "Estimator builds on the sharded parameters.")
    return sync
