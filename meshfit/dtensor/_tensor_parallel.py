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

A dim ``model`` does not divide is split as torch's DTensor splits it (``torch.chunk``: 51 features
over 2 are 26 and 25): a column-wise layer's output is then wider on some processes, and the row-wise
layer it feeds is told the global width (`_row_wise_class`), which torch's own style would guess as
local x processes. A split that cuts an attention's heads is refused (`_check_whole_heads`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from meshfit.distribute import placement_hook
from meshfit.dtensor._layout import UNSHARDED, Layout, shard_size
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
                plan[path] = _column_wise_class()(output_layouts=Replicate())
            else:
                plan[path] = _column_wise_class()() if style == _COLUMN else _row_wise_linear()
                if style == _ROW:
                    layer = module.get_submodule(path)
                    if isinstance(layer, nn.Linear):  # what tensor_parallel_styles keyed
                        _check_row_inputs(layer, path, self.axis, self.sub_mesh.size(),
                                          self.sub_mesh.get_local_rank())
        groups = tied_groups(module)
        before = {path: (set(module.get_submodule(path)._forward_pre_hooks),
                         set(module.get_submodule(path)._forward_hooks)) for path in plan}
        parallelize_module(module, self.sub_mesh, plan)  # one new parameter per holding module
        for path, (pre, post) in before.items():  # torch's input/output hooks move tensors, change no math:
            layer = module.get_submodule(path)  # saving still describes the layer as itself
            for table, known in ((layer._forward_pre_hooks, pre), (layer._forward_hooks, post)):
                for key in [k for k in table if k not in known]:
                    table[key] = placement_hook(table[key])
        retie(module, groups)  # one layout per tie (keyed_layouts): the copies are alike, keep the first
        return module


def tensor_parallel_styles(module: nn.Module, layout_map: Any, batch_axis: str) -> tuple[str | None, dict]:
    """The axis the keyed weights are split over and each keyed module's style; bad keys are refused.

    Every path of a tied weight gets the tie's one layout, so each module holding it gets its style.

    Raises:
        ValueError: a key's layout names ``batch`` or no axis, keys name two different axes, a split
            cuts an attention's heads, a keyed weight belongs to a module tensor parallelism
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
        if isinstance(owner, nn.Linear) and path not in heads:
            _check_whole_heads(module, owner_path, owner, kind, layout, axis, path)
        styles[owner_path] = (_HEAD if kind == _COLUMN and path in heads else kind, type(owner))
    for owner_path, (path, layout) in biases.items():
        style = styles.get(owner_path)
        if style is None or style[0] not in (_COLUMN, _HEAD):
            raise ValueError(f"Invalid layout {list(layout.sharding_specs)} for parameter {path!r}: a bias is split "
                             f"over {layout.sharding_specs[0]!r} only with its column-wise weight. Key "
                             f"{owner_path + '.weight'!r} with Layout([{layout.sharding_specs[0]!r}, UNSHARDED], mesh) "
                             "(its bias follows), or remove the bias key.")
    return (next(iter(axes)) if axes else None), styles


def slices_meet_their_readers(module: nn.Module, styles: dict[str, tuple[str, type]]) -> bool:
    """Whether the keyed ``nn.Linear`` layers pair up as tensor parallelism reads them: each column-wise
    layer's output slice is read by an attention (its parent declares ``head_dim``), a row-wise layer as
    wide as the slice's whole, or a column-wise one (it gathers the slice first); each row-wise layer
    reads a column-wise layer's slice (or an attention's heads). Otherwise a slice may reach the model's
    output, or a whole tensor a row-wise layer, which only the whole-mesh layouts express.
    """
    linears = {path: layer for path in styles if isinstance(layer := module.get_submodule(path), nn.Linear)}
    kinds = {path: styles[path][0] for path in linears}
    column_outs = {linears[p].out_features for p, kind in kinds.items() if kind == _COLUMN}
    readers = {linears[p].in_features for p, kind in kinds.items() if kind in (_ROW, _COLUMN)}
    for path, kind in kinds.items():
        if _in_attention(module, path):
            continue
        if kind == _COLUMN and linears[path].out_features not in readers:
            return False
        if kind == _ROW and linears[path].in_features not in column_outs:
            return False
    return True


def _in_attention(module: nn.Module, path: str) -> bool:
    """Whether the layer at ``path`` is an attention's projection (its parent declares an int ``head_dim``)."""
    head_dim = getattr(module.get_submodule(path.rpartition(".")[0]), "head_dim", None)
    return isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim > 0


def _check_whole_heads(module: nn.Module, owner_path: str, owner: nn.Linear, kind: str, layout: Layout, axis: str,
                       path: str) -> None:
    """Refuse a projection of an attention whose split would cut its heads (torch cannot split those).

    The attention is the ``nn.Linear``'s parent when it declares an int ``head_dim`` (torch's and Hugging
    Face's attention modules do): each process reshapes its slice of the features into whole heads
    (``view(b, t, -1, head_dim)``), so each ``torch.chunk`` share must be a multiple of ``head_dim``.
    """
    parent_path = owner_path.rpartition(".")[0]
    head_dim = getattr(module.get_submodule(parent_path), "head_dim", None)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        return
    features = owner.out_features if kind == _COLUMN else owner.in_features
    pieces = layout.mesh.dim_size(axis)
    shares = [shard_size(features, pieces, index) for index in range(pieces)]
    if all(share % head_dim == 0 for share in shares):
        return
    what = "output" if kind == _COLUMN else "input"
    raise ValueError(f"Invalid layout {list(layout.sharding_specs)} for parameter {path!r} ({kind}): its {features} "
                     f"{what} features split over {axis!r} (size {pieces}) as {shares} (torch.chunk), which cuts the "
                     f"heads of the attention {parent_path or 'at the root'!r} (head_dim {head_dim}) across "
                     "processes; each process computes attention on whole heads only, and torch's tensor parallelism "
                     f"cannot split a head. Use a number of heads that {axis!r} divides (or a {axis!r} axis that "
                     "divides it), or remove the key that matches it (the weight is then sharded over 'batch' only).")


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


@functools.cache
def _row_wise_class() -> type:
    """torch's ``RowwiseParallel`` for an ``nn.Linear`` whose local input carries its global width.

    torch's own makes its input DTensor from the local slice assuming equal slices (global width =
    local x processes): on an uneven split (9 features over 2: 5 and 4) that width is wrong on every
    process and the matmul fails. The global width is the layer's ``in_features``, so it is given.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import RowwiseParallel

    class _RowwiseLinear(RowwiseParallel):
        @staticmethod
        def _prepare_input_fn(input_layouts: Any, desired_input_layouts: Any, mod: Any, inputs: Any,
                              device_mesh: Any) -> Any:
            tensor = inputs[0]
            if not isinstance(tensor, DTensor):
                shape = torch.Size((*tensor.shape[:-1], mod.in_features))
                tensor = DTensor.from_local(tensor, device_mesh, input_layouts, run_check=False, shape=shape,
                                            stride=_contiguous_strides(shape))
            if tuple(input_layouts) != tuple(desired_input_layouts):
                tensor = tensor.redistribute(placements=desired_input_layouts, async_op=True)
            return tensor

    return _RowwiseLinear


@functools.cache
def _column_wise_class() -> type:
    """torch's ``ColwiseParallel`` for an ``nn.Linear`` that may be fed another column-wise layer's slice.

    torch's own takes its local input as the whole (replicated) input. Two column-wise layers in a row
    (``feature`` then ``feature_2``, both ``Layout(["model", UNSHARDED])``) hand the second a slice of
    its ``in_features``: it is gathered over the axis first (``torch.chunk``'s shares, as DTensor splits
    them), and its gradient goes back to each process's slice, as the whole-mesh layouts compute it.
    """
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    class _ColwiseLinear(ColwiseParallel):
        @staticmethod
        def _prepare_input_fn(input_layouts: Any, desired_input_layouts: Any, mod: Any, inputs: Any,
                              device_mesh: Any) -> Any:
            tensor = inputs[0]
            if isinstance(mod, nn.Linear) and not isinstance(tensor, DTensor) and tensor.dim() > 0 \
                    and tensor.shape[-1] != mod.in_features:
                shape = torch.Size((*tensor.shape[:-1], mod.in_features))
                sliced = DTensor.from_local(tensor, device_mesh, [Shard(tensor.dim() - 1)], run_check=False,
                                            shape=shape, stride=_contiguous_strides(shape))
                return sliced.redistribute(placements=desired_input_layouts, async_op=True)
            return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)

    return _ColwiseLinear


def _row_wise_linear() -> Any:
    return _row_wise_class()()


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _check_row_inputs(layer: nn.Linear, path: str, axis: str, size: int, index: int) -> None:
    """A row-wise layer must receive a column-wise layer's slice: say so, rather than a shape error.

    The slice's width is this process's share of the weight's columns (``torch.chunk``'s: 9 over 2 is
    5 on the first process, 4 on the second), known here once rather than read from the sharded weight
    at every forward.
    """
    local = shard_size(layer.in_features, size, index)

    def pre_hook(module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
            width = args[0].shape[-1]
            if width != local:
                raise ValueError(f"Invalid input to {path!r} (row-wise over {axis!r}): expected this process's "
                                 f"slice of {local} features from a column-wise layer, received {width}. Split the "
                                 f"layer that feeds it column-wise (Layout([{axis!r}, UNSHARDED], mesh)), or remove "
                                 f"the key of {path + '.weight'!r}.")

    layer.register_forward_pre_hook(placement_hook(pre_hook))  # saving: no math changes here
