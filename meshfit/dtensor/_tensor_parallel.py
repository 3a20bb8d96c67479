"""Tensor parallelism over the ``model`` axis beside full sharding over ``batch``: the keyed weights of
a ``LayoutMap.fully_sharded`` map.

A key whose layout names the ``model`` axis splits that weight over it, as torch's tensor-parallel
styles do (``parallelize_module`` on the ``model`` sub-mesh, outputs as plain local tensors, the way
torchtitan composes it with FSDP):

- ``nn.Linear`` weight ``["model", UNSHARDED]``: column-wise. Each process computes its slice of the
  output features (its attention heads, for a qkv projection) from the whole input; the input's
  gradient is summed over ``model`` in the backward. Its bias is split with it.
- ``nn.Linear`` weight ``[UNSHARDED, "model"]``: row-wise. Its input is the previous column-wise
  layer's local slice; the partial sums of the output are all-reduced over ``model`` in the forward.
  Its bias is not split.
- ``nn.Embedding`` weight ``["model", UNSHARDED]`` (vocabulary rows, outputs summed over ``model``) or
  ``[UNSHARDED, "model"]`` (embedding columns, gathered over ``model``).
- A weight tied to another (``output.weight = tok_embeddings.weight``) stays one parameter: both
  paths take its one layout (`meshfit.dtensor._ties`), each holding module its style, and the tie is
  restored after ``parallelize_module``, as torch's tensor-parallel transformer ties its output
  projection. A column-wise ``nn.Linear`` tied to an ``nn.Embedding`` is the vocabulary head: its
  logits are gathered over ``model`` (torch's plan for that head), since the loss needs them whole.

Activations between layers stay plain tensors of this process's rows, so a user's reshapes and
``F.scaled_dot_product_attention`` run on local tensors for any batch size (DTensor's reshape rule
fails on an unevenly sharded batch). Anything else keyed on ``model`` is refused before any step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from meshfit.distribute import placement_hook
from meshfit.dtensor._layout import UNSHARDED, Layout
from meshfit.dtensor._ties import keyed_layouts, retie, tied_groups

_COLUMN, _ROW = "column-wise", "row-wise"
_HEAD = "column-wise, gathered"  # a column-wise Linear tied to an Embedding: whole logits out
_FIX = ("Tensor parallelism over {axis!r} splits nn.Linear weights (Layout([{axis!r}, UNSHARDED], mesh) "
        "column-wise, Layout([UNSHARDED, {axis!r}], mesh) row-wise) and nn.Embedding weights")


@dataclasses.dataclass
class TensorParallel:
    """The plan's first transform: each keyed module gets its tensor-parallel style on ``axis``'s sub-mesh.

    Args:
        axis: the mesh axis the weights are split over (``"model"``).
        styles: module path -> ``column-wise`` / ``row-wise``, with the owning module's type.
        sub_mesh: the torch sub-mesh of ``axis`` (from the `World`).
    """

    axis: str
    styles: dict[str, tuple[str, type]]
    sub_mesh: Any
    name: str = "tensor parallel"

    def apply(self, module: nn.Module) -> nn.Module:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan: dict[str, Any] = {}
        for path, (style, kind) in self.styles.items():
            if kind is nn.Embedding:
                plan[path] = RowwiseParallel(input_layouts=Replicate()) if style == _ROW \
                    else ColwiseParallel(output_layouts=Replicate())
            elif style == _HEAD:
                plan[path] = ColwiseParallel(output_layouts=Replicate())
            else:
                plan[path] = ColwiseParallel() if style == _COLUMN else RowwiseParallel()
                if style == _ROW:
                    layer = module.get_submodule(path)
                    if isinstance(layer, nn.Linear):  # what tensor_parallel_styles keyed
                        _check_row_inputs(layer, path, self.axis, self.sub_mesh.size())
        groups = tied_groups(module)
        parallelize_module(module, self.sub_mesh, plan)  # one new parameter per holding module
        retie(module, groups)  # one layout per tie (keyed_layouts): the copies are alike, keep the first
        return module


def tensor_parallel_styles(module: nn.Module, layout_map: Any, batch_axis: str) -> tuple[str | None, dict]:
    """The axis the keyed weights are split over and each keyed module's style; bad keys are refused.

    Every path of a tied weight gets the tie's one layout, so each module holding it gets its style.

    Raises:
        ValueError: a key's layout names ``batch`` or no axis, keys name two different axes, a split
            does not divide its dimension, a keyed weight belongs to a module tensor parallelism
            cannot split that way, a bias is keyed without (or against) its weight, or one tied
            weight is keyed with two layouts.
    """
    axes: dict[str, str] = {}
    styles: dict[str, tuple[str, type]] = {}
    biases: dict[str, tuple[str, Layout]] = {}
    params = dict(module.named_parameters(remove_duplicate=False))
    heads = _vocabulary_heads(module)
    ties = {path: paths for paths in tied_groups(module) for path in paths}
    for path, layout in keyed_layouts(module, layout_map.__getitem__).items():
        param = params[path]
        if layout is None:
            continue
        named = [spec for spec in layout.sharding_specs if spec != UNSHARDED]
        if not named or batch_axis in named:
            what = "splits nothing" if not named else f"names {batch_axis!r}"
            raise ValueError(f"Parameter {path!r} has a hand layout {list(layout.sharding_specs)} in a "
                             f"LayoutMap.fully_sharded map: it {what}, but the map already shards every weight over "
                             f"{batch_axis!r}. Remove the key that matches {path!r}, or split the weight over another "
                             "axis (tensor parallel, e.g. Layout(['model', UNSHARDED], mesh)); a plain "
                             "mf.dtensor.LayoutMap(mesh) takes any hand layout.")
        axis = named[0]
        axes.setdefault(axis, path)
        if len(axes) > 1:
            first, second = list(axes.items())[:2]
            raise ValueError(f"Invalid LayoutMap.fully_sharded map: parameter {first[1]!r} is split over {first[0]!r} "
                             f"and {second[1]!r} over {second[0]!r}; tensor parallelism beside 'batch' uses one axis. "
                             "Split every keyed weight over the same axis.")
        layout.check_shape(param.shape, f"parameter {path!r}")
        owner_path, _, attribute = path.rpartition(".")
        owner = module.get_submodule(owner_path)
        if attribute == "bias" and isinstance(owner, nn.Linear):
            biases[owner_path] = (path, layout)
            continue
        keyed = next((p for p in ties.get(path, [path]) if layout_map[p] is not None), path)
        kind = _style_of(owner, attribute, layout, path, axis, keyed)
        styles[owner_path] = (_HEAD if kind == _COLUMN and path in heads else kind, type(owner))
    for owner_path, (path, layout) in biases.items():
        style = styles.get(owner_path)
        if style is None or style[0] not in (_COLUMN, _HEAD):
            raise ValueError(f"Invalid layout {list(layout.sharding_specs)} for parameter {path!r}: a bias is split "
                             f"over {layout.sharding_specs[0]!r} only with its column-wise weight. Key "
                             f"{owner_path + '.weight'!r} with Layout([{layout.sharding_specs[0]!r}, UNSHARDED], mesh) "
                             "(its bias follows), or remove the bias key.")
    return (next(iter(axes)) if axes else None), styles


def _vocabulary_heads(module: nn.Module) -> set[str]:
    """The ``nn.Linear`` weight paths tied to an ``nn.Embedding`` weight (a language model's head)."""
    heads: set[str] = set()
    for paths in tied_groups(module):
        owners = [(path, module.get_submodule(path.rpartition(".")[0])) for path in paths]
        if any(isinstance(owner, nn.Embedding) for _, owner in owners):
            heads.update(path for path, owner in owners if isinstance(owner, nn.Linear))
    return heads


def _style_of(owner: nn.Module, attribute: str, layout: Layout, path: str, axis: str, keyed: str) -> str:
    """``keyed``: the path whose key gave the layout (another path of a tied weight, or ``path``)."""
    specs = layout.sharding_specs
    if attribute == "weight" and isinstance(owner, (nn.Linear, nn.Embedding)) and len(specs) == 2:
        if specs == (axis, UNSHARDED):
            return _COLUMN if isinstance(owner, nn.Linear) else _ROW
        return _ROW if isinstance(owner, nn.Linear) else _COLUMN
    raise ValueError(f"Invalid layout {list(specs)} for parameter {path!r} ({attribute} of a "
                     f"{type(owner).__name__}): DTensor cannot split that operation over {axis!r} here. "
                     f"{_FIX.format(axis=axis)}. Remove the key that matches {keyed!r}"
                     f"{'' if keyed == path else f' (the weight it is tied to, whose layout {path!r} shares)'} "
                     "(the weight is then sharded over 'batch' only), or key the weight of a Linear or Embedding.")


def _check_row_inputs(layer: nn.Linear, path: str, axis: str, size: int) -> None:
    """A row-wise layer must receive a column-wise layer's slice: say so, rather than a shape error.

    The slice's width is the weight's local columns, ``in_features / size`` (the split divides them:
    `Layout.check_shape`), known here once rather than read from the sharded weight at every forward.
    """
    local = layer.in_features // size

    def pre_hook(module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
            width = args[0].shape[-1]
            if width != local:
                raise ValueError(f"Invalid input to {path!r} (row-wise over {axis!r}): expected this process's "
                                 f"slice of {local} features from a column-wise layer, received {width}. Split the "
                                 f"layer that feeds it column-wise (Layout([{axis!r}, UNSHARDED], mesh)), or remove "
                                 f"the key of {path + '.weight'!r}.")

    layer.register_forward_pre_hook(placement_hook(pre_hook))  # saving: no math changes here
