"""Which parameters a strategy replicates, and how their gradients are kept in sync in custom loops.

TensorFlow mirrors every variable created inside ``strategy.scope()``: replicas start with the same
values, and ``optimizer.apply_gradients`` inside ``strategy.run`` *sums* the replicas' gradients
before the update (the user divides the per-example loss by the *global* batch with
``compute_average_loss``). meshfit does the same for torch modules:

- **Which parameters.** While a strategy's scope is entered, torch's global parameter and buffer
  registration hooks (``torch.nn.modules.module.register_module_{parameter,buffer}_registration_hook``)
  record every parameter and buffer a module registers, with the strategy of the innermost scope.
  ``Model(module)`` created in a scope adopts the module's parameters too (a module built outside
  and wrapped inside). The record is a weak mapping: nothing is kept alive by it.
- **Same start.** When the outermost scope of a multi-replica strategy exits normally, rank 0's
  values of the parameters and buffers created in it are broadcast (TF's ``MirroredVariable``
  starts identical). Lazy parameters are broadcast when the optimizer is built on them (after
  the forward pass that materialises them).
- **Gradient sync.** `synchronize_gradients` all-reduces (SUM) the gradients of recorded
  parameters over their strategy's replicas, in one flat buffer per dtype. Parameters whose
  gradients were already reduced during this step (a forward through ``Model``'s DDP wrapper marks
  them: see `meshfit.distribute._placement`) are skipped, so nothing is reduced twice.
- **DTensor parameters** follow their layout: a gradient with ``Partial`` placements is
  redistributed to the parameter's placements (DTensor's own all-reduce); a ``Replicate``
  gradient over the mesh's data axis (the axis whose role is data parallel, asked of the strategy's
  `World`; computed from per-replica local batches) is summed over that axis only. Sharded axes
  are left alone: each shard owns its gradient.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parameter import is_lazy
from torch.utils.weak import WeakIdKeyDictionary

from meshfit._lazy_dtensor import is_dtensor
from meshfit._protocols import DistributionStrategy
from meshfit.distribute._placement import take_reduced
from meshfit.distribute._proof._model_agreement import agree_on_tensors, describe
from meshfit.distribute._scope import current_scope_strategy, is_default_strategy, process_world

# tensor -> strategy that created it (weak on both sides, keyed by identity: tensors' == is elementwise;
# not an attribute of the tensor, which must stay picklable)
_OWNER = WeakIdKeyDictionary()
# per scope entry: the tensors created in it, to broadcast when it exits
_CREATED: list[list[weakref.ref]] = []
_HOOKS: list[Any] = []
# Set on a tensor once its value was broadcast from rank 0 (created in a scope: replicas start equal).
_BROADCAST = "_meshfit_broadcast"
_DISTRIBUTED = dist.is_available()  # a build of torch has torch.distributed or not, for good
_LABEL = "_meshfit_label"  # how error messages name a tensor


def _record(tensor: torch.Tensor | None, strategy: DistributionStrategy) -> None:
    if tensor is None or tensor in _OWNER:
        return
    _OWNER[tensor] = weakref.ref(strategy)
    if _CREATED:
        _CREATED[-1].append(weakref.ref(tensor))


def _on_registration(module: torch.nn.Module, name: str, tensor: Any) -> None:
    strategy = current_scope_strategy()
    if strategy is not None and isinstance(tensor, torch.Tensor):
        _record(tensor, strategy)
        if not hasattr(tensor, _LABEL):  # how messages name it; `adopt` names it better
            setattr(tensor, _LABEL, f"{name!r} of a {type(module).__name__}")


@contextlib.contextmanager
def tracking_scope(strategy: DistributionStrategy) -> Iterator[None]:
    """Record the parameters created inside; broadcast rank 0's values when the scope exits."""
    _hook()
    _CREATED.append([])
    ok = False
    try:
        yield
        ok = True
    finally:
        created = _CREATED.pop()
        if not _CREATED:
            for handle in _HOOKS:
                handle.remove()
            _HOOKS.clear()
        if ok:
            tensors = [t for t in (ref() for ref in created) if t is not None]
            broadcast_initial_values(tensors, strategy)


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Register parameters inside without recording them as the scope's: modules meshfit builds for
    itself (a pipeline's traced stages, whose weights are the user's, bound at each call)."""
    tracking = bool(_HOOKS)
    for handle in _HOOKS:
        handle.remove()
    _HOOKS.clear()
    try:
        yield
    finally:
        if tracking and _CREATED:
            _hook()


def _hook() -> None:
    """torch's registration hooks, once: every parameter and buffer a module registers is recorded."""
    from torch.nn.modules import module as torch_module

    if not _HOOKS:
        _HOOKS.append(torch_module.register_module_parameter_registration_hook(_on_registration))
        _HOOKS.append(torch_module.register_module_buffer_registration_hook(_on_registration))


def adopt(module: torch.nn.Module, strategy: DistributionStrategy) -> None:
    """Record ``module``'s parameters and buffers as ``strategy``'s (``Model(module)`` in a scope)."""
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in named:
            _record(tensor, strategy)
            setattr(tensor, _LABEL, f"{kind} {name!r}")


def owner_of(tensor: torch.Tensor) -> DistributionStrategy | None:
    """The strategy in whose scope ``tensor`` was created, or None."""
    ref = _OWNER.get(tensor)
    return ref() if ref is not None else None


def broadcast_initial_values(tensors: Iterable[torch.Tensor], strategy: DistributionStrategy) -> None:
    """Give every replica rank 0's values of ``tensors`` (lazy and already broadcast ones skipped)."""
    if strategy.num_replicas_in_sync <= 1:
        return
    pending = [t for t in tensors if not is_lazy(t) and not getattr(t, _BROADCAST, False)
               and not is_dtensor(t)]
    if not pending:
        return
    # Tensors of other sizes on another worker would abort gloo: name the first difference instead.
    agree_on_tensors(strategy.all_gather_object,
                     describe([(getattr(t, _LABEL, f"tensor #{i + 1}"), t) for i, t in enumerate(pending)]),
                     "models in strategy.scope()", "Build the same model on every worker.")
    with torch.no_grad():
        for group in _by_dtype(pending):
            flat = torch.cat([t.detach().reshape(-1).to("cpu") for t in group])
            strategy.broadcast_tensor(flat)
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
    for t in pending:
        setattr(t, _BROADCAST, True)


def synchronize_gradients(params: Iterable[torch.Tensor]) -> None:
    """Sum the gradients of ``params`` over their strategy's replicas, in place (TF's semantics).

    Parameters created outside any strategy scope are left alone; so are the ones DDP reduced.

    Raises:
        ValueError: a parameter created outside ``strategy.scope()`` is trained while a
            multi-replica strategy is running in this process (it would train alone on each worker).
    """
    if not _DISTRIBUTED or not dist.is_initialized():
        return  # one process, no group: no replica, DDP or DTensor to reduce with (the common fast path)
    by_strategy: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    for p in params:
        if p.grad is None:
            continue
        if take_reduced(p):
            continue
        strategy = owner_of(p)
        if is_dtensor(p):  # its layout says how its gradient is reduced
            _synchronize_dtensor_gradient(p, strategy.world if strategy is not None else None)
            continue
        if strategy is None:
            _refuse_if_unreplicated(p)
            continue
        if strategy.num_replicas_in_sync > 1:
            by_strategy.setdefault(id(strategy), (strategy, []))[1].append(p)
    for strategy, group in by_strategy.values():
        for same_dtype in _by_dtype([g for p in group if (g := p.grad) is not None]):
            flat = torch.cat([g.reshape(-1) for g in same_dtype])
            strategy.all_reduce_sum(flat)
            offset = 0
            for g in same_dtype:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def _refuse_if_unreplicated(param: torch.Tensor) -> None:
    world = process_world()
    if world is not None:
        raise ValueError(
            f"A parameter of shape {tuple(param.shape)} was created outside `strategy.scope()`, but "
            f"this job runs {world.size} processes: each worker would train it alone. "
            "Create the model inside `with strategy.scope():` (and the optimizer and metrics with it).")


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def _synchronize_dtensor_gradient(param: Any, world: Any) -> None:
    """Make a DTensor gradient follow its parameter's layout (the seam for sharded parameters).

    A ``Partial`` gradient is always reduced to the parameter's placements. A ``Replicate``
    gradient over the data axis (by the roles of ``world``, the `World` of the strategy whose scope
    created the parameter) is summed over that axis only for parameters created in a strategy's
    scope (``world`` is None for the others): a loop that fed each replica its own local batch.
    Whoever replaces a module's parameters by DTensors in a custom loop should `adopt` the module
    again so that the new parameters are recorded.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import Partial, Replicate

    grad = param.grad
    if not is_dtensor(grad):
        return
    if any(isinstance(p, Partial) for p in grad.placements):
        param.grad = grad.redistribute(grad.device_mesh, param.placements)
        return
    if world is None:
        return
    mesh = grad.device_mesh
    names = mesh.mesh_dim_names or ()
    data_axis = world.data_axis_of(mesh)
    for dim, placement in enumerate(grad.placements):
        if isinstance(placement, Replicate) and dim < len(names) and names[dim] == data_axis:
            dist.all_reduce(grad.to_local(), group=mesh.get_group(dim))


def check_training_strategy(model: Any, what: str) -> None:
    """Refuse to compile or fit a model under a strategy other than the one it was created in.

    Keras raises when ``compile`` runs in a strategy's scope that the model's variables were not
    created in; meshfit does too, and also when ``fit`` would train a model created outside every
    scope while a multi-replica strategy runs in this process (each worker would train alone).
    """
    active = current_scope_strategy()
    if active is not None and active is not model.strategy:
        raise ValueError(
            f"Invalid model: it was created under {model.strategy!r}, but {what}() runs in the scope of "
            f"{active!r}. Create the model inside `with strategy.scope():` of the strategy that trains it, "
            "e.g.\n    with strategy.scope():\n        model = mf.Model(build_module())\n"
            "        model.compile(...)")
    world = process_world()
    if what == "fit" and world is not None and is_default_strategy(model.strategy):
        raise ValueError(
            f"Invalid model: it was created outside `strategy.scope()`, but this job runs {world.size} "
            "processes (replicas), so fit() would train each worker alone. "
            "Create the model inside `with strategy.scope():`, e.g.\n    with strategy.scope():\n"
            "        model = mf.Model(build_module())\n        model.compile(...)")
