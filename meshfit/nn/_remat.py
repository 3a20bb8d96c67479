"""Activation checkpointing as Keras 3 spells it: `RematScope` and `remat`.

A rematerialized module keeps only its inputs for the backward pass and runs its forward again there
(torch's non-reentrant ``torch.utils.checkpoint``, random state preserved): activation memory for
compute, values unchanged (bitwise on a CPU). The module keeps its class, its parameters and their
paths, so layouts, checkpoints and digests see the same model.

`RematScope` chooses the modules of a `meshfit.Model` built inside it, by Keras's modes, in torch's
terms of a layer:

- ``"full"``: every layer: each child of the model, and of each container inside it
  (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``), with a ``nn.Sequential``'s
  parameter-free modules joined to the layer before them (``Linear`` then ``GELU`` is one layer, as
  Keras's ``Dense(activation=...)``);
- ``"activations"``: the activation modules (``torch.nn.modules.activation``);
- ``"larger_than"``: the layers of ``"full"`` whose output has more than ``output_size_threshold``
  elements (measured on their first call, which runs plainly);
- ``layer_names``: the modules whose path or class name is listed (with any mode, or alone).

The scope is applied where the model is made, before the strategy places it (as torchtitan orders
tensor parallel, then activation checkpointing, then fully sharded): checkpointed blocks compose with
``LayoutMap.fully_sharded`` and ``model`` keys.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_MODES = ("full", "activations", "larger_than", None)
_ACTIVE: contextvars.ContextVar[RematScope | None] = contextvars.ContextVar("meshfit_remat_scope", default=None)
_REMAT_ATTRIBUTE = "_meshfit_remat"  # the original forward of a rematerialized module


@dataclasses.dataclass
class RematScope:
    """Rematerialize (activation checkpointing) the layers of the models made inside: Keras 3's ``RematScope``.

    Args:
        mode: ``"full"`` (every layer), ``"activations"`` (the activation modules), ``"larger_than"``
            (layers whose output has more than ``output_size_threshold`` elements) or None (only
            ``layer_names``; with neither, nothing: a scope that turns remat off inside another).
        output_size_threshold: with ``"larger_than"``, the output size (elements) above which a
            layer is rematerialized.
        layer_names: module paths (``"blocks.0"``) or class names (``"Block"``) to rematerialize,
            whatever the mode.

    Raises:
        ValueError: an unknown ``mode``, a threshold that is not a positive int, or ``layer_names``
            that is not a list of strings.

    Example:
        >>> import torch, meshfit as mf
        >>> with mf.nn.RematScope(mode="full"):
        ...     model = mf.Model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)))
        >>> [name for name in mf.nn.rematerialized(model.module)]
        ['0', '2']
    """

    mode: str | None = "full"
    output_size_threshold: int = 1024
    layer_names: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"Invalid `mode`: expected 'full', 'activations', 'larger_than' or None, received "
                             f"mode={self.mode!r}. Keras 3's RematScope modes are these four; list modules by "
                             "name with layer_names=[...].")
        threshold = self.output_size_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold <= 0:
            raise ValueError(f"Invalid `output_size_threshold`: expected a positive int (elements), received "
                             f"output_size_threshold={threshold!r}.")
        names = self.layer_names
        if names is not None and (isinstance(names, str) or not all(isinstance(n, str) for n in names)):
            raise ValueError(f"Invalid `layer_names`: expected a list of module paths or class names, received "
                             f"layer_names={names!r}. Pass e.g. layer_names=['blocks.0', 'Block'].")
        self._token: contextvars.Token[RematScope | None] | None = None

    def __enter__(self) -> RematScope:
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None

    def apply(self, module: nn.Module) -> list[str]:
        """Rematerialize the modules of ``module`` this scope chooses; returns their paths (a joined
        ``nn.Sequential`` segment by its first module's path)."""
        done: list[str] = []
        threshold = self.output_size_threshold if self.mode == "larger_than" else None
        if self.mode in ("full", "larger_than"):
            done += _remat_layers(module, "", threshold)
        elif self.mode == "activations":
            for path, child in module.named_modules():
                if path and type(child).__module__ == "torch.nn.modules.activation":
                    _rematerialize(child, None)
                    done.append(path)
        if self.layer_names:
            wanted = set(self.layer_names)
            for path, child in module.named_modules():
                if path and (path in wanted or type(child).__name__ in wanted) and path not in done:
                    _rematerialize(child, None)
                    done.append(path)
        return done


def current_remat_scope() -> RematScope | None:
    """The `RematScope` whose ``with`` block is running, if any."""
    return _ACTIVE.get()


def remat(module: nn.Module) -> nn.Module:
    """Rematerialize ``module`` (Keras 3's ``keras.remat``): keep its inputs, run its forward again in backward.

    Returns the same module (its class, parameters and paths unchanged).

    Example:
        >>> import torch, meshfit as mf
        >>> block = mf.nn.remat(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()))
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> block(x).sum().backward()
        >>> x.grad.shape
        torch.Size([2, 4])
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"Invalid `module`: expected a torch.nn.Module, received {type(module).__name__}. "
                        "meshfit.nn.remat rematerializes a module's forward.")
    _rematerialize(module, None)
    return module


def rematerialized(module: nn.Module) -> Iterator[str]:
    """The paths of the modules inside ``module`` that are rematerialized (a segmented ``nn.Sequential``:
    the first module of each checkpointed segment).

    Example:
        >>> import torch, meshfit as mf
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> _ = mf.remat(net[0])
        >>> list(mf.nn.rematerialized(net))
        ['0']
    """
    for path, child in module.named_modules():
        plan = vars(child).get(_REMAT_ATTRIBUTE)
        if not isinstance(plan, _Plan):
            continue
        if plan.segments is None:
            yield path
            continue
        names = list(child._modules)
        for start, _, decision in plan.segments:
            if decision is not None:
                yield f"{path}.{names[start]}" if path else names[start]


def _remat_layers(module: nn.Module, prefix: str, threshold: int | None) -> list[str]:
    """Rematerialize Keras's layers of a torch module (see the module doc); returns their paths."""
    if isinstance(module, nn.Sequential):
        return _remat_sequential(module, prefix, threshold)
    done = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            done += _remat_layers(child, f"{path}.", threshold)
        elif _has_parameters(child):
            _rematerialize(child, threshold)
            done.append(path)
    return done


def _remat_sequential(module: nn.Sequential, prefix: str, threshold: int | None) -> list[str]:
    """A ``nn.Sequential`` runs in segments: each layer with the parameter-free modules after it, as
    one checkpoint; nested containers are layers of their own."""
    segments: list[list[nn.Module]] = []
    done = []
    for name, child in module.named_children():
        if isinstance(child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            done += _remat_layers(child, f"{prefix}{name}.", threshold)
            segments.append([child])
        elif _has_parameters(child) or not segments:
            segments.append([child])
            if _has_parameters(child):
                done.append(f"{prefix}{name}")
        else:
            segments[-1].append(child)
    if _REMAT_ATTRIBUTE in vars(module) or "forward" in vars(module):  # done, or wrapped by another: its layers
        return done
    plan: list[tuple[int, int, _Decision | None]] = []
    start = 0
    for segment in segments:
        head = segment[0]
        joined = _has_parameters(head) and not isinstance(head, (nn.Sequential, nn.ModuleList, nn.ModuleDict))
        plan.append((start, start + len(segment), _Decision(threshold) if joined else None))
        start += len(segment)
    _install(module, _Plan(None, plan), _segmented_forward)
    return done


@dataclasses.dataclass
class _Plan:
    """How a rematerialized module runs, kept in the module (copied with it: a deep copy runs its own
    weights). ``decision``: one checkpoint around the module's forward; ``segments``: a
    ``nn.Sequential``'s children ``[start, stop)`` run as one checkpoint each (None: run plainly)."""

    decision: _Decision | None
    segments: list[tuple[int, int, _Decision | None]] | None = None


def _install(module: nn.Module, plan: _Plan, forward: Any) -> None:
    """Run ``module`` through ``forward`` bound to it (a method: ``copy.deepcopy`` binds it to the copy)."""
    setattr(module, _REMAT_ATTRIBUTE, plan)
    module.forward = types.MethodType(forward, module)


def _remat_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    plan: _Plan = vars(self)[_REMAT_ATTRIBUTE]
    forward = functools.partial(type(self).forward, self)
    return plan.decision.call(forward, args, kwargs) if plan.decision is not None else forward(*args, **kwargs)


def _segmented_forward(self: nn.Module, x: Any) -> Any:
    plan: _Plan = vars(self)[_REMAT_ATTRIBUTE]
    children = list(self.children())
    for start, stop, decision in plan.segments or []:
        run = functools.partial(_run, children[start:stop])
        x = decision.call(run, (x,), {}) if decision is not None else run(x)
    return x


def _run(modules: list[nn.Module], x: Any) -> Any:
    for module in modules:
        x = module(x)
    return x


class _Decision:
    """Whether to checkpoint: always, or (``"larger_than"``) once the first call's output is measured."""

    def __init__(self, threshold: int | None) -> None:
        self.threshold = threshold
        self.use: bool | None = True if threshold is None else None

    def call(self, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not torch.is_grad_enabled() or self.use is False:
            return forward(*args, **kwargs)
        if self.use is None:  # the first call runs plainly and measures the output
            output = forward(*args, **kwargs)
            self.use = _numel(output) > int(self.threshold or 0)
            return output
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _rematerialize(module: nn.Module, threshold: int | None) -> None:
    if _REMAT_ATTRIBUTE in vars(module):
        return
    if "forward" in vars(module):
        raise ValueError(f"Cannot rematerialize {type(module).__name__}: its forward was replaced on the instance "
                         "(another wrapper). Apply meshfit.nn.remat (or RematScope) to the module before that wrapper.")
    _install(module, _Plan(_Decision(threshold)), _remat_forward)


def _numel(output: Any) -> int:
    if isinstance(output, torch.Tensor):
        return output.numel()
    if isinstance(output, (list, tuple)):
        return sum(_numel(o) for o in output)
    if isinstance(output, dict):
        return sum(_numel(o) for o in output.values())
    return 0
