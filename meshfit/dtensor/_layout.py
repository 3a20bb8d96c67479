"""`Layout`: how a tensor is split over a `Mesh`, one mesh-axis name or `UNSHARDED` per tensor dim.

A layout maps onto torch DTensor placements, one per *mesh axis*: the axis that names tensor dim
``d`` becomes ``Shard(d)``; an axis no dim names becomes ``Replicate()``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from meshfit.dtensor._mesh import RESERVED_AXIS, Mesh

UNSHARDED = RESERVED_AXIS
"""The sharding spec of a tensor dim that is not split (every device holds all of it)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """A tensor's layout on a mesh, as ``tf.experimental.dtensor.Layout``.

    Args:
        sharding_specs: one entry per tensor dim: a mesh axis name (the dim is split into that
            axis's size of shards, the last ones smaller when it does not divide evenly, as
            ``torch.chunk``) or `UNSHARDED`. A mesh axis names at most one dim.
        mesh: the `Mesh` the tensor lives on.

    Raises:
        ValueError: an entry is not an axis of ``mesh`` nor `UNSHARDED`, or an axis is used twice.

    Example:
        >>> mesh = Mesh(("batch", "model"), (2, 2))
        >>> layout = Layout(["model", UNSHARDED], mesh)
        >>> layout
        Layout(['model', 'unsharded'], mesh=Mesh(batch=2, model=2, device_type='cpu'))
        >>> layout.placements
        (Replicate(), Shard(dim=0))
        >>> Layout.from_string(layout.to_string()) == layout
        True
    """

    sharding_specs: tuple[str, ...]
    mesh: Mesh

    def __post_init__(self) -> None:
        specs = self.sharding_specs
        if isinstance(specs, str) or not isinstance(specs, Sequence):
            raise ValueError(f"Invalid `sharding_specs`: expected a list with one mesh axis name or UNSHARDED per "
                             f"tensor dim, such as ['batch', UNSHARDED], received sharding_specs={specs!r}.")
        object.__setattr__(self, "sharding_specs", tuple(specs))
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"Invalid `mesh`: expected a meshfit.dtensor.Mesh, received mesh={self.mesh!r}.")
        seen: dict[str, int] = {}
        for dim, spec in enumerate(self.sharding_specs):
            if spec == UNSHARDED:
                continue
            if not isinstance(spec, str) or not self.mesh.contains(spec):
                raise ValueError(f"Invalid layout {list(self.sharding_specs)}: dim {dim} names mesh axis {spec!r}, "
                                 f"which is not in the mesh's axes {list(self.mesh.axis_names)}. Use one of them, "
                                 "or UNSHARDED.")
            if spec in seen:
                raise ValueError(f"Invalid layout {list(self.sharding_specs)}: mesh axis {spec!r} is used twice "
                                 f"(dims {seen[spec]} and {dim}); a mesh axis can split only one dim. Set one of "
                                 "them to UNSHARDED.")
            seen[spec] = dim

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def replicated(cls, mesh: Mesh, rank: int) -> Layout:
        """Every dim unsharded: each device holds the whole tensor."""
        return cls((UNSHARDED,) * _rank("rank", rank), mesh)

    @classmethod
    def batch_sharded(cls, mesh: Mesh, axis: str, rank: int, dim: int = 0) -> Layout:
        """Dim ``dim`` (the batch, by default) split over mesh axis ``axis``, the rest unsharded."""
        rank = _rank("rank", rank)
        if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < rank:
            raise ValueError(f"Invalid `dim`: expected a tensor dim in [0, {rank}), received dim={dim!r}.")
        specs = [UNSHARDED] * rank
        specs[dim] = axis
        return cls(tuple(specs), mesh)

    # ---- properties --------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """The number of tensor dims this layout describes."""
        return len(self.sharding_specs)

    @property
    def placements(self) -> tuple[Any, ...]:
        """The torch DTensor placements, one per mesh axis (``Shard(dim)`` or ``Replicate()``)."""
        from torch.distributed.tensor import Replicate, Shard

        dims = {spec: dim for dim, spec in enumerate(self.sharding_specs) if spec != UNSHARDED}
        return tuple(Shard(dims[axis]) if axis in dims else Replicate() for axis in self.mesh.axis_names)

    def is_fully_replicated(self) -> bool:
        """True when no dim is sharded."""
        return all(spec == UNSHARDED for spec in self.sharding_specs)

    def num_shards(self, dim: int) -> int:
        """Into how many pieces tensor dim ``dim`` is split."""
        spec = self.sharding_specs[dim]
        return 1 if spec == UNSHARDED else self.mesh.dim_size(spec)

    def check_shape(self, shape: Sequence[int], name: str = "tensor") -> None:
        """Raise unless a tensor of ``shape`` fits: one spec per dim.

        A sharded dim need not divide evenly: as torch's DTensor (``torch.chunk``), each of the first
        devices holds ``ceil(size / pieces)`` of it and the last ones fewer (9 over 2: 5 and 4).

        Args:
            shape: the tensor's (global) shape.
            name: what the tensor is, for the message (e.g. a parameter path).
        """
        shape = tuple(shape)
        if len(shape) != self.rank:
            raise ValueError(f"Invalid layout for {name} of shape {list(shape)}: the layout "
                             f"{list(self.sharding_specs)} has rank {self.rank} but the tensor has rank "
                             f"{len(shape)}. Give one spec per dim, e.g. Layout.replicated(mesh, rank={len(shape)}).")

    def local_shape(self, shape: Sequence[int], coordinate: Sequence[int] | None = None) -> tuple[int, ...]:
        """The shape of one device's shard of a tensor of (global) ``shape``.

        Args:
            shape: the tensor's (global) shape.
            coordinate: the device's index along each mesh axis (``mesh.axis_names`` order); None: the
                first device, which holds the largest shard of an uneven split.
        """
        self.check_shape(shape)
        index = dict.fromkeys(self.mesh.axis_names, 0) if coordinate is None \
            else dict(zip(self.mesh.axis_names, coordinate, strict=True))
        return tuple(size if spec == UNSHARDED else shard_size(size, self.num_shards(dim), index[spec])
                     for dim, (size, spec) in enumerate(zip(shape, self.sharding_specs, strict=True)))

    def __deepcopy__(self, memo: dict[int, Any]) -> Layout:
        """The layout itself: an immutable value (a copied parameter shares its layout and mesh)."""
        return self

    # ---- text ------------------------------------------------------------------------------
    def to_string(self) -> str:
        """``sharding_specs:model,unsharded, mesh:|batch=2,model=2|cpu`` (TF's form)."""
        return f"sharding_specs:{','.join(self.sharding_specs)}, mesh:{self.mesh.to_string()}"

    @classmethod
    def from_string(cls, text: str) -> Layout:
        """The layout written by `to_string`; also accepts TF's ``Layout.from_string(...)`` wrapper."""
        if isinstance(text, str):
            text = re.sub(r"^Layout\.from_string\((.*)\)$", r"\1", text.strip())
        match = re.fullmatch(r"sharding_specs:([^ ]*), mesh:(.*)", text) if isinstance(text, str) else None
        if match is None:
            raise ValueError("Invalid layout string: expected 'sharding_specs:model,unsharded, "
                             f"mesh:|batch=2,model=2|cpu', received {text!r}.")
        specs = tuple(s for s in match.group(1).split(",") if s)
        return cls(specs, Mesh.from_string(match.group(2)))

    def __repr__(self) -> str:
        return f"Layout({list(self.sharding_specs)!r}, mesh={self.mesh!r})"


def shard_size(size: int, pieces: int, index: int) -> int:
    """How much of a dim of ``size`` split into ``pieces`` the ``index``-th device holds (``torch.chunk``,
    DTensor's ``Shard``): ``ceil(size / pieces)`` each until the dim runs out, so the last may hold 0."""
    chunk = -(-size // pieces)
    return max(0, min(chunk, size - index * chunk))


def _rank(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"Invalid `{name}`: expected the tensor's number of dims (an int >= 0), "
                         f"received {name}={value!r}.")
    return value
