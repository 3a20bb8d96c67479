"""Sums and concatenations of a structure of tensors over the replicas of a strategy.

The engine of ``ReplicaContext.all_reduce`` / ``all_gather`` and of ``strategy.gather`` /
``strategy.extended.reduce_to``. Both run over the strategy's data-parallel group (the world's under
a collective strategy, the ``batch`` axis's on a mesh), as its `World` names it. Both are
differentiable, as TensorFlow's are: the gradient of a sum over replicas is the sum of the replicas'
gradients, and the gradient reaching a replica's piece of a concatenation is the sum of every
replica's gradient for that piece.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from meshfit.distribute._values import PerReplica, ReduceOp

_ACCEPTED = "a torch.Tensor, a NumPy array, a Python number, or a dict/list/tuple of them"


# ---- structures -----------------------------------------------------------------------------------
def flatten(value: Any) -> list[Any]:
    """The leaves of a dict/list/tuple/namedtuple structure, in a fixed order (dicts by insertion)."""
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in flatten(v)]
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in flatten(v)]
    return [value]


def pack_as(structure: Any, leaves: list[Any]) -> Any:
    """``structure`` rebuilt with ``leaves`` (as many as `flatten` gave) in place of its own."""
    remaining = iter(leaves)

    def rebuild(value: Any) -> Any:
        if isinstance(value, dict):
            return type(value)((k, rebuild(v)) for k, v in value.items())
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
            namedtuple_class: Any = type(value)
            return namedtuple_class(*(rebuild(v) for v in value))
        if isinstance(value, (tuple, list)):
            return type(value)(rebuild(v) for v in value)
        return next(remaining)

    return rebuild(structure)


def as_tensor(leaf: Any, method: str) -> torch.Tensor:
    """A leaf as a dense tensor; anything else is refused naming the value and the fix."""
    if isinstance(leaf, PerReplica):
        leaf = leaf.values[0]
    if isinstance(leaf, torch.Tensor):
        if leaf.layout != torch.strided:
            raise NotImplementedError(f"{method} does not support sparse tensors (received one with layout "
                                      f"{leaf.layout}). Pass a dense tensor: value.to_dense().")
        return leaf
    if isinstance(leaf, (bool, np.bool_)) or (isinstance(leaf, np.ndarray) and leaf.dtype == np.bool_):
        raise TypeError(f"Invalid `value` for {method}: expected numbers, received the boolean {leaf!r}. "
                        "Cast it to a number first (e.g. torch.as_tensor(value, dtype=torch.int64)).")
    if isinstance(leaf, (int, float, np.number, np.ndarray)):
        return torch.as_tensor(leaf)
    raise TypeError(f"Invalid `value` for {method}: expected {_ACCEPTED}, received {leaf!r} "
                    f"({type(leaf).__name__}). Pass the tensors to combine; keep other values out of it.")


def _data_group(strategy: Any) -> Any:
    """The process group of the strategy's replicas (the ``batch`` axis's on a mesh)."""
    return strategy.world.data_group()


def sum_over_replicas(strategy: Any, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed in place over the strategy's replicas, on its device plane; returns it.

    Over the data-parallel group alone: on a ``batch`` x ``model`` mesh, a replica's processes along
    ``model`` may hold different values (their shards), and each sums with its own peers along ``batch``.
    """
    if strategy.num_replicas_in_sync == 1:
        return tensor
    moved = tensor if tensor.device == strategy.device else tensor.to(strategy.device)
    with strategy.guard():  # a dead peer is named, not a raw backend error
        dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=_data_group(strategy))
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


# ---- all-reduce -----------------------------------------------------------------------------------
class _SumOverReplicas(torch.autograd.Function):
    """Sum over replicas; its gradient is the sum of the replicas' gradients (TF's all-reduce gradient)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, strategy: Any) -> torch.Tensor:
        ctx.strategy = strategy
        return sum_over_replicas(strategy, tensor.detach().clone())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return sum_over_replicas(ctx.strategy, grad.detach().clone()), None


def reduce_structure(strategy: Any, op: ReduceOp, value: Any, method: str) -> Any:
    """Every leaf of ``value`` summed (or averaged) over the strategy's replicas; the structure kept.

    One collective per dtype: the leaves of a dtype travel packed in one flat tensor. ``MEAN`` divides
    with true division (an integer leaf's mean is a float tensor), as TensorFlow's.
    """
    leaves = [as_tensor(leaf, method) for leaf in flatten(value)]
    count = strategy.num_replicas_in_sync
    out: list[Any] = list(leaves)
    if count > 1:
        _agree_on_structure(strategy, leaves, method)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for index, leaf in enumerate(leaves):
            by_dtype.setdefault(leaf.dtype, []).append(index)
        for dtype in sorted(by_dtype, key=str):  # the same order on every replica
            indices = by_dtype[dtype]
            parts = [leaves[i] for i in indices]
            flat = torch.cat([p.reshape(-1).to(parts[0].device) for p in parts])
            summed = _SumOverReplicas.apply(flat, strategy) if flat.requires_grad else \
                sum_over_replicas(strategy, flat.detach().clone())
            for i, piece in zip(indices, torch.split(summed, [p.numel() for p in parts]), strict=True):
                out[i] = piece.reshape(leaves[i].shape).to(leaves[i].device)
    if op is ReduceOp.MEAN:
        out = [t / count for t in out]  # true division, integers too (a float tensor), as TensorFlow's
    elif count == 1:
        out = [t.clone() if t.requires_grad else t.detach().clone() for t in out]  # never the caller's tensor
    return pack_as(value, out)


def _agree_on_structure(strategy: Any, leaves: list[torch.Tensor], method: str) -> None:
    """Raise on every replica when the replicas' leaves differ in number, dtype or shape (a collective on
    mismatched sizes would abort the process in gloo, or hang). One 2-integer all-reduce (MAX) of a
    checksum of the structure: a replica whose checksum is not the maximum, or not the minimum, differs."""
    described = repr([(str(leaf.dtype), tuple(leaf.shape)) for leaf in leaves])
    checksum = zlib.crc32(described.encode())
    both = torch.tensor([checksum, -checksum], dtype=torch.int64, device=strategy.device)
    with strategy.guard():
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=_data_group(strategy))
    if both.tolist() != [checksum, -checksum]:
        raise ValueError(f"Invalid `value` for {method}: the replicas pass different structures (the number, "
                         f"dtypes or shapes of their tensors differ); this replica passes (dtype, shape) "
                         f"{described[:300]}. Pass the same structure, dtypes and shapes on every replica.")


# ---- all-gather -----------------------------------------------------------------------------------
def _shape_error(method: str, axis: int, shapes: list[list[tuple[str, tuple[int, ...]]]]) -> str | None:
    """Why the replicas' leaves cannot be concatenated along ``axis`` (None: they can)."""
    first = shapes[0]
    for replica, own in enumerate(shapes):
        if len(own) != len(first):
            return (f"replica 0 passes {len(first)} tensors but replica {replica} passes {len(own)}. "
                    "Pass the same structure on every replica.")
        for leaf, ((dtype0, shape0), (dtype, shape)) in enumerate(zip(first, own, strict=True)):
            if dtype != dtype0:
                return (f"tensor {leaf} is {dtype0} on replica 0 but {dtype} on replica {replica}. "
                        "Cast it to one dtype on every replica.")
            if len(shape) != len(shape0) or any(a != b for d, (a, b) in enumerate(zip(shape0, shape, strict=True))
                                                if d != axis % len(shape0)):
                return (f"Shape mismatch: tensor {leaf} has shape {list(shape0)} on replica 0 but "
                        f"{list(shape)} on replica {replica}; only dimension {axis} (the gathered axis) may "
                        "differ. Give the tensors the same rank and the same sizes on the other dimensions.")
    return None


def _replicas_objects(strategy: Any, own: Any) -> list[Any]:
    """Every replica's ``own`` (those of this process's data-parallel group), by replica; over the control
    plane. On a ``batch`` x ``model`` mesh each group along ``batch`` has its own."""
    with strategy.guard():
        by_rank = strategy.world.all_gather_object(own)
    return [by_rank[rank] for rank in dist.get_process_group_ranks(_data_group(strategy))]


def _gather_padded(strategy: Any, tensor: torch.Tensor, sizes: list[int], axis: int) -> list[torch.Tensor]:
    """Every replica's ``tensor`` (its true size along ``axis`` given by ``sizes``), by replica."""
    device = strategy.device
    longest = max(sizes)
    padded = tensor.detach().to(device)
    if padded.shape[axis] < longest:
        pad_shape = list(padded.shape)
        pad_shape[axis] = longest - padded.shape[axis]
        padded = torch.cat([padded, padded.new_zeros(pad_shape)], dim=axis)
    padded = padded.contiguous()
    pieces = [torch.empty_like(padded) for _ in sizes]
    with strategy.guard():  # a dead peer is named, not a raw backend error
        dist.all_gather(pieces, padded, group=_data_group(strategy))
    return [piece.narrow(axis, 0, size).to(tensor.device) for piece, size in zip(pieces, sizes, strict=True)]


class _ConcatOverReplicas(torch.autograd.Function):
    """Concatenation over replicas; a replica's piece gets the sum of every replica's gradient for it."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, strategy: Any, sizes: list[int], axis: int) -> torch.Tensor:
        ctx.strategy, ctx.sizes, ctx.axis = strategy, sizes, axis
        return torch.cat(_gather_padded(strategy, tensor, sizes, axis), dim=axis)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        total = sum_over_replicas(ctx.strategy, grad.detach().contiguous().clone())
        replica = ctx.strategy.replica_id
        start = sum(ctx.sizes[:replica])
        return total.narrow(ctx.axis, start, ctx.sizes[replica]).contiguous(), None, None, None


def gather_structure(strategy: Any, value: Any, axis: int, method: str) -> Any:
    """Every leaf of ``value`` concatenated over the strategy's replicas along ``axis``, in replica order.

    Sizes along ``axis`` may differ between replicas; the other dimensions, the ranks and the dtypes
    may not (refused on every replica alike: the shapes travel first, over the control plane).
    """
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"Invalid `axis` for {method}: expected an int, received axis={axis!r}.")
    leaves = [as_tensor(leaf, method) for leaf in flatten(value)]
    for leaf in leaves:
        if leaf.dim() == 0:
            raise ValueError(f"Invalid `value` for {method}: expected tensors of rank 1 or more, received the "
                             f"scalar {leaf!r}. Reshape it to one element (value.reshape(1)), or combine scalars "
                             "with all_reduce / strategy.reduce.")
        if not -leaf.dim() <= axis < leaf.dim():
            raise ValueError(f"Invalid `axis` for {method}: expected -{leaf.dim()} <= axis < {leaf.dim()} for a "
                             f"tensor of shape {list(leaf.shape)}, received axis={axis}.")
    if strategy.num_replicas_in_sync == 1:
        return pack_as(value, [leaf.clone() for leaf in leaves])
    shapes = _replicas_objects(strategy, [(str(leaf.dtype), tuple(leaf.shape)) for leaf in leaves])
    problem = _shape_error(method, axis, shapes)
    if problem is not None:
        raise ValueError(f"Invalid `value` for {method}: {problem}")
    out: list[Any] = []
    for index, leaf in enumerate(leaves):
        dim = axis % leaf.dim()
        sizes = [replica[index][1][dim] for replica in shapes]
        concat: Callable[..., Any] = _ConcatOverReplicas.apply
        out.append(concat(leaf, strategy, sizes, dim) if leaf.requires_grad
                   else torch.cat(_gather_padded(strategy, leaf, sizes, dim), dim=dim))
    return pack_as(value, out)
