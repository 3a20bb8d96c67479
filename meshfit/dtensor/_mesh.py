"""`Mesh`: devices arranged in named axes, as ``tf.experimental.dtensor.Mesh``.

A `Mesh` is a value (axis names, sizes, their roles, device type) that layouts refer to; it needs no
processes, so layout logic is checked without them. Its `ParallelDims` (``mesh.dims``) says what each
axis does: the data axis is the one whose role is data parallel, whatever its name. `create_mesh`
also forms the process group, builds the torch ``DeviceMesh`` over it and attaches both, with the
strategy that trains on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

from meshfit._protocols import MeshStrategyLike
from meshfit.distribute import ParallelDims

_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED_AXIS = "unsharded"


@dataclasses.dataclass(frozen=True)
class Mesh:
    """Named axes over ``prod(shape)`` devices, one process per device.

    Args:
        axis_names: one name per axis, e.g. ``("batch", "model")``.
        shape: the size of each axis; their product is the number of devices (processes).
        device_type: ``"cpu"`` or ``"cuda"``.
        roles: what each axis does (`ParallelDims`): ``{axis: role}`` for some axes, e.g.
            ``{"dp": "data"}``; the others take the role their name implies (``"batch"`` data,
            ``"pipe"`` pipeline, any other name tensor). The data axis is the data-parallel axis:
            processes that differ only along other axes read the same rows.

    Raises:
        ValueError: names and sizes differ in number, a name is repeated or not an identifier,
            a size is not a positive int, or a role is bad (see `ParallelDims`).

    Example:
        >>> mesh = Mesh(("batch", "model"), (2, 2))
        >>> mesh.size, mesh.dim_size("model")
        (4, 2)
        >>> mesh
        Mesh(batch=2, model=2, device_type='cpu')
        >>> mesh.dims.data_axis
        'batch'
        >>> Mesh(("dp", "tp"), (2, 2), roles={"dp": "data"})
        Mesh(dp=2, tp=2, device_type='cpu', roles={'dp': 'data'})
    """

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    device_type: str = "cpu"
    # Attached by create_mesh: the torch DeviceMesh and the strategy (not part of the value).
    _device_mesh: Any = dataclasses.field(default=None, compare=False, repr=False)
    _strategy: MeshStrategyLike | None = dataclasses.field(default=None, compare=False, repr=False)
    # given: {axis: role} or one role per axis; kept as one role name per axis (the value's roles)
    roles: Any = dataclasses.field(default=None, kw_only=True)
    _dims: ParallelDims = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        names, shape = self.axis_names, self.shape
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise ValueError(f"Invalid `axis_names`: expected a list of axis names such as ['batch', 'model'], "
                             f"received axis_names={names!r}.")
        if isinstance(shape, int) or not isinstance(shape, (list, tuple)):
            raise ValueError(f"Invalid `shape`: expected a list of axis sizes such as [2, 2], received shape={shape!r}.")
        object.__setattr__(self, "axis_names", tuple(names))
        object.__setattr__(self, "shape", tuple(shape))
        if len(self.axis_names) != len(self.shape):
            raise ValueError(f"Invalid mesh: {len(self.axis_names)} axis names {list(self.axis_names)} but "
                             f"{len(self.shape)} sizes {list(self.shape)}; give one size per axis.")
        if not self.axis_names:
            raise ValueError("Invalid mesh: expected at least one axis, such as [('batch', 2)], received none.")
        for name in self.axis_names:
            if not isinstance(name, str) or not _AXIS_NAME.match(name) or name == RESERVED_AXIS:
                raise ValueError(f"Invalid axis name {name!r}: expected an identifier such as 'batch' or "
                                 f"'model' (not {RESERVED_AXIS!r}, which marks an unsharded dim).")
        repeated = sorted({n for n in self.axis_names if self.axis_names.count(n) > 1})
        if repeated:
            raise ValueError(f"Invalid mesh: axis name {repeated[0]!r} is used twice in "
                             f"{list(self.axis_names)}; give every axis its own name.")
        for name, size in zip(self.axis_names, self.shape, strict=True):
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise ValueError(f"Invalid size of mesh axis {name!r}: expected a positive int, received {size!r}.")
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"Invalid `device_type`: expected 'cpu' or 'cuda', received "
                             f"device_type={self.device_type!r}.")
        roles = self.roles
        if roles is None and self._strategy is not None:
            roles = self._formed_roles()
        dims = ParallelDims(names=self.axis_names, degrees=self.shape, roles=roles)
        object.__setattr__(self, "_dims", dims)
        object.__setattr__(self, "roles", tuple(role.value for role in dims.roles))

    def _formed_roles(self) -> Any:
        """The roles of the axes the strategy's `World` formed (``create_mesh`` declared them there)."""
        formed = getattr(self._strategy, "world", None)
        dims = getattr(formed, "dims", None)
        if isinstance(dims, ParallelDims) and (dims.names, dims.degrees) == (self.axis_names, self.shape):
            return dims.roles
        return None

    # ---- roles -----------------------------------------------------------------------------
    @property
    def dims(self) -> ParallelDims:
        """What each axis does and its degree: ``mesh.dims.data_axis`` is the data-parallel axis (or None)."""
        return self._dims

    # ---- shape -----------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """The number of devices (processes) in the mesh."""
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        """The number of axes."""
        return len(self.shape)

    def dim_size(self, axis: str) -> int:
        """The size of mesh axis ``axis``."""
        return self.shape[self.axis_index(axis)]

    def axis_index(self, axis: str) -> int:
        """The position of ``axis`` among the mesh's axes; an unknown name is an error naming the axes."""
        if axis not in self.axis_names:
            raise ValueError(f"Invalid mesh axis {axis!r}: this mesh has axes {list(self.axis_names)}. Use one "
                             f"of them, or UNSHARDED for a dim that is not split.")
        return self.axis_names.index(axis)

    def contains(self, axis: str) -> bool:
        """Whether the mesh has an axis named ``axis``."""
        return axis in self.axis_names

    # ---- processes ---------------------------------------------------------------------------
    @property
    def device_mesh(self) -> Any:
        """The torch ``DeviceMesh`` (only on a mesh made by `create_mesh`)."""
        if self._device_mesh is None:
            raise RuntimeError(f"{self!r} has no processes: it is a plain value. Use "
                               "meshfit.dtensor.create_mesh([...]) to build a mesh that can hold tensors.")
        return self._device_mesh

    @property
    def strategy(self) -> MeshStrategyLike:
        """The strategy that trains on this mesh (only on a mesh made by `create_mesh`)."""
        self.device_mesh  # noqa: B018  (raises the clear error for a plain value)
        if self._strategy is None:
            raise RuntimeError(f"{self!r} has no strategy: only a mesh made by meshfit.dtensor.create_mesh([...]) "
                               "trains.")
        return self._strategy

    def num_local_devices(self) -> int:
        """How many of the mesh's devices are on this host (each driven by its own process)."""
        if self._strategy is None:
            return self.size
        return self._strategy.local_device_count

    def local_device_index(self) -> int:
        """This process's position among the mesh devices of its host."""
        if self._strategy is None:
            return 0
        return self._strategy.local_device_index

    def coordinate(self, axis: str) -> int:
        """This process's index along ``axis``."""
        self.axis_index(axis)
        return self.device_mesh.get_local_rank(axis)

    @contextlib.contextmanager
    def scope(self) -> Iterator[Any]:
        """Models created inside train on this mesh, with every weight replicated."""
        with self.strategy.scope() as strategy:
            yield strategy

    # ---- copies ----------------------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> Mesh:
        """The mesh itself: a value, and its processes are not copied (a copied layout shares its mesh)."""
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its value (axes, sizes, device type, roles), without this process's group."""
        return (_rebuild, (self.axis_names, self.shape, self.device_type, self.dims.explicit_roles() or None))

    # ---- text ------------------------------------------------------------------------------
    def to_string(self) -> str:
        """``|batch=2,model=2|cpu``: the axes and the device type; `from_string` reads it back.

        An axis whose role is not the one its name implies carries it: ``|dp=2:data,tp=2|cpu``.
        """
        explicit = self.dims.explicit_roles()
        axes = ",".join(f"{n}={s}" + (f":{explicit[n]}" if n in explicit else "")
                        for n, s in zip(self.axis_names, self.shape, strict=True))
        return f"|{axes}|{self.device_type}"

    @classmethod
    def from_string(cls, text: str) -> Mesh:
        """The mesh value written by `to_string`."""
        match = re.fullmatch(r"\|([^|]*)\|(\w+)", text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"Invalid mesh string: expected '|batch=2,model=2|cpu', received {text!r}.")
        names, sizes, roles = [], [], {}
        for part in match.group(1).split(","):
            name, _, rest = part.partition("=")
            size, _, role = rest.partition(":")
            if not size.isdigit():
                raise ValueError(f"Invalid mesh string {text!r}: axis {part!r} is not 'name=size' or 'name=size:role'.")
            names.append(name.strip())
            sizes.append(int(size))
            if role:
                roles[name.strip()] = role.strip()
        return cls(tuple(names), tuple(sizes), match.group(2), roles=roles or None)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape, strict=True))
        explicit = self.dims.explicit_roles()
        return f"Mesh({axes}, device_type={self.device_type!r}" + (f", roles={explicit!r})" if explicit else ")")


def _rebuild(axis_names: tuple[str, ...], shape: tuple[int, ...], device_type: str, roles: Any) -> Mesh:
    """A pickled `Mesh` value again (its roles are keyword-only)."""
    return Mesh(axis_names, shape, device_type, roles=roles)
