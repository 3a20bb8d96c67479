"""`ParallelDims`: what each mesh axis does (its role) and how many processes it spans (its degree).

A mesh axis's name is the user's; its **role** decides behaviour: which axis splits the batches and
reduces the gradients (``data``, or ``shard`` when the weights are sharded over it too), which one
splits weights (``tensor``), which one holds stages (``pipeline``). Code asks the roles
(``dims.data_axis``, ``dims.degree("tensor")``), never the spelling of a name. Names that say their
role need none given: ``"batch"`` is the data axis, ``"pipe"`` the pipeline axis, and any other name a
tensor axis, so ``[("batch", 2), ("model", 2)]`` means what it always meant.

The value needs no processes (it is checked without them); the `World` forms the device mesh of its
axes and keeps the value, so anything holding the world asks it by role.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any

# Names whose role is not "tensor" when none is given (the spellings meshfit has always read this way).
_ROLE_OF_NAME = {"batch": "data", "pipe": "pipeline"}


class AxisRole(str, enum.Enum):
    """What a mesh axis does; a plain string (``"data"``) is accepted wherever a role is.

    - ``DATA``: data parallel with replicated weights: each coordinate reads its own rows, the
      gradients are summed over the axis.
    - ``SHARD``: data parallel with every weight sharded over the axis (what
      ``LayoutMap.fully_sharded`` makes of the data axis).
    - ``TENSOR``: weights split over the axis (tensor parallel); every coordinate reads the same rows.
    - ``PIPELINE``: the model's stages, one per coordinate.

    Example:
        >>> AxisRole("data") is AxisRole.DATA, AxisRole.SHARD == "shard"
        (True, True)
        >>> [role.value for role in AxisRole]
        ['data', 'shard', 'tensor', 'pipeline']
    """

    DATA = "data"
    SHARD = "shard"
    TENSOR = "tensor"
    PIPELINE = "pipeline"

    @property
    def is_data_parallel(self) -> bool:
        """Whether the axis splits the batches (``data`` or ``shard``)."""
        return self in (AxisRole.DATA, AxisRole.SHARD)


def default_role(name: str) -> AxisRole:
    """The role of an axis nobody gave one: ``"batch"`` data, ``"pipe"`` pipeline, any other tensor."""
    return AxisRole(_ROLE_OF_NAME.get(name, "tensor"))


def _role(value: Any, axis: str | None = None) -> AxisRole:
    """``value`` as an `AxisRole`; an unknown one is an error naming it (and the axis it was given to)."""
    try:
        return AxisRole(value)
    except ValueError:
        where = f" of mesh axis {axis!r}" if axis is not None else ""
        raise ValueError(f"Invalid role{where}: expected one of {[r.value for r in AxisRole]}, received "
                         f"{value!r}. Use e.g. 'data' for the axis that splits the batches, 'tensor' for one "
                         "that splits weights.") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The parallelism of a mesh: each axis's name, degree (size) and `AxisRole`, as torchtitan's ``ParallelDims``.

    Args:
        names: one name per mesh axis, e.g. ``("dp", "tp")``.
        degrees: the number of processes along each axis, e.g. ``(2, 2)``; their product is the
            number of processes the mesh needs.
        roles: the role of each axis: a mapping from axis name to role for some axes (the others
            take the role their name implies: ``"batch"`` data, ``"pipe"`` pipeline, else tensor),
            a sequence with one role per axis, or None (every role from its name).

    Raises:
        ValueError: names and degrees differ in number, an axis is named twice, a degree is not a
            positive int, a role is unknown or names an axis the mesh lacks, or two axes split the
            batches (``data``/``shard``) or hold pipeline stages.

    Example:
        >>> dims = ParallelDims(names=("dp", "tp"), degrees=(2, 4), roles={"dp": "data"})
        >>> dims
        ParallelDims(dp=2:data, tp=4:tensor)
        >>> dims.data_axis, dims.dp_degree, dims.tp_degree, dims.pp_degree
        ('dp', 2, 4, 1)
        >>> dims.axis_of("tensor"), dims.axis_of("pipeline")
        ('tp', None)
        >>> ParallelDims(names=("batch", "model"), degrees=(2, 2)).data_axis  # roles from the names
        'batch'
        >>> dims.validate(world_size=8)
    """

    names: tuple[str, ...]
    degrees: tuple[int, ...]
    roles: Any = None  # normalised to tuple[AxisRole, ...]: one per axis

    def __post_init__(self) -> None:
        names, degrees = self.names, self.degrees
        if isinstance(names, str) or not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"Invalid `names`: expected a list of axis names such as ['batch', 'model'], received "
                             f"names={names!r}.")
        if isinstance(degrees, (int, str)) or not isinstance(degrees, Sequence):
            raise ValueError(f"Invalid `degrees`: expected one degree per axis such as [2, 2], received "
                             f"degrees={degrees!r}.")
        object.__setattr__(self, "names", tuple(names))
        object.__setattr__(self, "degrees", tuple(degrees))
        if len(self.names) != len(self.degrees):
            raise ValueError(f"Invalid parallel dims: {len(self.names)} axis names {list(self.names)} but "
                             f"{len(self.degrees)} degrees {list(self.degrees)}; give one degree per axis.")
        twice = next((n for n in self.names if self.names.count(n) > 1), None)
        if twice is not None:
            raise ValueError(f"Invalid parallel dims: axis {twice!r} is named twice in {list(self.names)}; give "
                             "every axis its own name.")
        for name, degree in zip(self.names, self.degrees, strict=True):
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise ValueError(f"Invalid degree of mesh axis {name!r}: expected a positive int (the number of "
                                 f"processes along it), received {degree!r}. Use 1 for an axis that does not split.")
        object.__setattr__(self, "roles", self._normalise_roles(self.roles))
        data = [n for n, r in zip(self.names, self.roles, strict=True) if r.is_data_parallel]
        stages = [n for n, r in zip(self.names, self.roles, strict=True) if r is AxisRole.PIPELINE]
        for kind, axes in (("split the batches ('data' or 'shard')", data), ("hold pipeline stages", stages)):
            if len(axes) > 1:
                raise ValueError(f"Invalid roles {self.role_map()}: axes {axes[0]!r} and {axes[1]!r} both {kind}; "
                                 "at most one axis may. Give the other one the role 'tensor', e.g. "
                                 f"roles={{{axes[1]!r}: 'tensor'}}, or rename it.")

    def _normalise_roles(self, roles: Any) -> tuple[AxisRole, ...]:
        if roles is None:
            return tuple(default_role(n) for n in self.names)
        if isinstance(roles, Mapping):
            unknown = [axis for axis in roles if axis not in self.names]
            if unknown:
                raise ValueError(f"Invalid `roles`: axis {unknown[0]!r} is not one of the mesh's axes "
                                 f"{list(self.names)}, received roles={dict(roles)!r}. Name one of the axes.")
            return tuple(_role(roles[n], n) if n in roles else default_role(n) for n in self.names)
        if isinstance(roles, str) or not isinstance(roles, Sequence) or len(roles) != len(self.names):
            raise ValueError(f"Invalid `roles`: expected a dict from axis name to role, or one role per axis "
                             f"{list(self.names)}, received roles={roles!r}.")
        return tuple(_role(r, n) for n, r in zip(self.names, roles, strict=True))

    # ---- questions ----------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """The number of processes the axes span (the product of the degrees)."""
        return math.prod(self.degrees)

    @property
    def data_axis(self) -> str | None:
        """The axis that splits the batches (role ``data`` or ``shard``), or None when none does."""
        return next((n for n, r in zip(self.names, self.roles, strict=True) if r.is_data_parallel), None)

    def role_of(self, axis: str) -> AxisRole:
        """The role of axis ``axis``.

        Raises:
            ValueError: the mesh has no such axis.
        """
        if axis not in self.names:
            raise ValueError(f"Invalid mesh axis {axis!r}: the axes are {list(self.names)}. Use one of them.")
        return self.roles[self.names.index(axis)]

    def axis_of(self, role: AxisRole | str) -> str | None:
        """The axis with role ``role``, or None when no axis has it.

        Raises:
            ValueError: an unknown role, or several axes have it (tensor axes may be several).
        """
        role = _role(role)
        axes = [n for n, r in zip(self.names, self.roles, strict=True) if r is role]
        if len(axes) > 1:
            raise ValueError(f"Invalid question axis_of({role.value!r}): axes {axes} all have that role. Ask "
                             "role_of(axis) for each axis instead.")
        return axes[0] if axes else None

    def degree(self, role: AxisRole | str) -> int:
        """The number of processes along the axes of role ``role`` (1 when no axis has it)."""
        role = _role(role)
        return math.prod(d for d, r in zip(self.degrees, self.roles, strict=True) if r is role)

    @property
    def dp_degree(self) -> int:
        """The number of data-parallel replicas: the degree of the data axis (``data`` or ``shard``)."""
        return self.degree(AxisRole.DATA) * self.degree(AxisRole.SHARD)

    @property
    def tp_degree(self) -> int:
        """The number of processes a weight's tensor-parallel split spans (1 without a tensor axis)."""
        return self.degree(AxisRole.TENSOR)

    @property
    def pp_degree(self) -> int:
        """The number of pipeline stages (1 without a pipeline axis)."""
        return self.degree(AxisRole.PIPELINE)

    def validate(self, world_size: int) -> None:
        """Check that the axes span exactly ``world_size`` processes.

        Raises:
            ValueError: the degrees multiply to another number (the message says how to fix it).
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"Invalid `world_size`: expected a positive int, received world_size={world_size!r}.")
        if self.size != world_size:
            raise ValueError(f"Invalid parallel dims {self!r}: the degrees multiply to {self.size} processes, but "
                             f"the job has {world_size}. Start {self.size} processes (e.g. `meshfit launch "
                             f"--workers {self.size}`), or change the degrees so that their product is {world_size}.")

    # ---- new values ---------------------------------------------------------------------------
    def with_role(self, axis: str, role: AxisRole | str) -> ParallelDims:
        """The same axes with ``axis``'s role set to ``role`` (e.g. the data axis marked ``shard``)."""
        self.role_of(axis)
        roles = tuple(_role(role, axis) if n == axis else r for n, r in zip(self.names, self.roles, strict=True))
        return ParallelDims(names=self.names, degrees=self.degrees, roles=roles)

    def role_map(self) -> dict[str, str]:
        """``{axis: role}`` for every axis, as plain strings."""
        return {n: r.value for n, r in zip(self.names, self.roles, strict=True)}

    def explicit_roles(self) -> dict[str, str]:
        """``{axis: role}`` for the axes whose role is not the one their name implies (what to pass again)."""
        return {n: r.value for n, r in zip(self.names, self.roles, strict=True) if r is not default_role(n)}

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={d}:{r.value}" for n, d, r in zip(self.names, self.degrees, self.roles, strict=True))
        return f"ParallelDims({axes})"


def data_axis_of(device_mesh: Any, dims: ParallelDims | None = None) -> str | None:
    """The data axis among ``device_mesh``'s axes: by ``dims`` when they name them all (the roles of the
    mesh a `World` formed), else by the roles the names imply. None: none of its axes splits the batches."""
    names = tuple(device_mesh.mesh_dim_names or ())
    if dims is not None and set(names) <= set(dims.names):
        return dims.data_axis if dims.data_axis in names else None
    return next((name for name in names if default_role(name).is_data_parallel), None)
