"""``layout_map.scope()``: modules created inside have their layouts when the block ends.

Keras lays a variable out when it is created inside ``layout_map.scope()``. A torch module's
parameters are created in its ``__init__``, before the model that holds it exists, and their
paths (``feature.weight``) are only known from the root module. So while the scope is entered,
torch's global registration hooks (``register_module_parameter_registration_hook`` and
``register_module_module_registration_hook``) record the modules created and which module holds
which; when the block ends the hooks are removed and every *root* (a recorded module no recorded
module holds) gets its layouts (`apply_layouts`) and the boundary hooks of `accept_inputs`.

A root that ``mf.Model`` placed while the scope was open (a plain map's tensor-parallel keys: Keras lays
variables out when they are created) is left as its placement made it (`mark_placed`).

A root with lazy parameters (``nn.LazyLinear``) gets them at its first call instead: the call runs
once on this process's rows to learn the shapes (``eval`` mode, no gradient), the module is laid
out, and the call goes on.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.nn.parameter import is_lazy

from meshfit._lazy_dtensor import is_dtensor
from meshfit._protocols import DistributionStrategy
from meshfit.data import map_structure
from meshfit.distribute import placement_hook
from meshfit.dtensor._inputs import accept_inputs
from meshfit.dtensor._pack import local_rows

# How a map lays out a module's parameters (`apply_layouts`, and `attach_layout` for an empty map);
# set by the package, whose `_apply` module imports the map (a direct import here would be a cycle).
_LAY_OUT: list[Callable[[nn.Module, Any], None]] = []


def set_lay_out(function: Callable[[nn.Module, Any], None]) -> None:
    """Give the scope its layout function: ``function(module, layout_map)`` lays ``module`` out in place."""
    _LAY_OUT[:] = [function]


class _Created:
    """The modules created during one scope entry (weakly held), and which of them hold others."""

    def __init__(self) -> None:
        self.modules: list[weakref.ref] = []
        self.seen: set[int] = set()
        self.held: set[int] = set()
        self.placed: set[int] = set()  # placed by a strategy meanwhile (``mf.Model(module)`` in the scope)

    def add(self, module: nn.Module) -> None:
        if id(module) not in self.seen:
            self.seen.add(id(module))
            self.modules.append(weakref.ref(module))

    def roots(self) -> list[nn.Module]:
        alive = [m for m in (ref() for ref in self.modules) if m is not None]
        return [m for m in alive if id(m) not in self.held]


_ENTRIES: list[_Created] = []
_HANDLES: list[Any] = []
def mark_placed(module: nn.Module) -> None:
    """Tell the open scopes that ``module`` is placed already (``mf.Model(module)`` inside one): their end
    must not lay it out again."""
    for entry in _ENTRIES:
        entry.placed.add(id(module))


def _on_parameter(module: nn.Module, name: str, param: Any) -> None:
    if _ENTRIES and param is not None:
        _ENTRIES[-1].add(module)


def _on_module(parent: nn.Module, name: str, child: Any) -> None:
    if _ENTRIES and isinstance(child, nn.Module):
        entry = _ENTRIES[-1]
        entry.add(parent)
        entry.add(child)
        entry.held.add(id(child))


@contextlib.contextmanager
def laying_out(layout_map: Any, strategy: DistributionStrategy) -> Iterator[None]:
    """Record the modules created inside; at a normal exit lay out each root with ``layout_map``."""
    if not _HANDLES:
        _HANDLES.append(torch_module.register_module_parameter_registration_hook(_on_parameter))
        _HANDLES.append(torch_module.register_module_module_registration_hook(_on_module))
    _ENTRIES.append(_Created())
    ok = False
    try:
        yield
        ok = True
    finally:
        created = _ENTRIES.pop()
        if not _ENTRIES:
            for handle in _HANDLES:
                handle.remove()
            _HANDLES.clear()
    # fully sharded or a pipeline: mf.Model places it at creation (a pipeline's keys apply inside its stages)
    if not ok or layout_map.is_fully_sharded or layout_map.pipeline_spec is not None:
        return
    if _ENTRIES:  # a nested entry: the outermost one lays out the roots
        for module in created.roots():
            _ENTRIES[-1].add(module)
        return
    for root in created.roots():
        params = list(root.parameters())
        if not params or id(root) in created.placed or all(is_dtensor(p) for p in params):  # none, or placed already (e.g. load_model)
            continue
        if any(is_lazy(p) for p in params):
            _lay_out_at_first_call(root, layout_map, strategy)
        else:
            _lay_out(root, layout_map, strategy)


def _lay_out(module: nn.Module, layout_map: Any, strategy: DistributionStrategy) -> Callable[..., Any]:
    if not _LAY_OUT:
        raise RuntimeError("meshfit.dtensor was not imported: import meshfit.dtensor before using a LayoutMap.")
    if any(t.device != strategy.device for t in (*module.parameters(), *module.buffers())):
        module.to(strategy.device)
    _LAY_OUT[0](module, layout_map)
    return accept_inputs(module)


def _lay_out_at_first_call(module: nn.Module, layout_map: Any, strategy: DistributionStrategy) -> None:
    handles: list[Any] = []

    def first_call(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        for handle in handles:
            handle.remove()
        rows = map_structure(lambda leaf: local_rows(leaf) if is_dtensor(leaf) else leaf, (args, kwargs))
        was_training = module.training
        module.eval()
        with torch.no_grad():
            module(*rows[0], **rows[1])  # the lazy parameters learn their shapes
        module.train(was_training)
        convert = _lay_out(module, layout_map, strategy)
        return convert(module, args, kwargs)  # this call's inputs too (the new hook runs from the next call)

    handles.append(module.register_forward_pre_hook(placement_hook(first_call), with_kwargs=True))
