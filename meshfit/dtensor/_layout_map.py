"""`LayoutMap`: layouts for a model's weights, keyed by exact paths or regular expressions.

A parameter's path is its attribute path in the module (``feature.weight``), the name torch's
``named_parameters()`` gives: submodule attributes for a subclassed model, the children's names
for ``nn.Sequential`` (``0.weight``, or ``feature.weight`` when built from an ``OrderedDict``) and
for a ``ModuleDict`` of named layers (the functional style).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

from meshfit.distribute import AxisRole, ParallelDims
from meshfit.dtensor._layout import Layout
from meshfit.dtensor._mesh import Mesh
from meshfit.dtensor._pipeline import PipelineSpec
from meshfit.dtensor._scope_layouts import laying_out


class LayoutMap(MutableMapping):
    """A dict of `Layout` by weight path; a lookup tries the exact key, then every key as a regex.

    Args:
        mesh: the mesh of every layout in the map; weights no key matches are replicated on it.
            Optional, as in tf-keras: without it the map takes the mesh of its first layout.
        match: how a key that is not the exact path matches it: ``"search"`` (the key is found
            anywhere in the path, so ``"feature.*weight"`` matches ``feature.weight``) or
            ``"fullmatch"`` (the whole path, Keras 3's ``keras.distribution.LayoutMap``).

    Example:
        >>> mesh = Mesh(("batch", "model"), (2, 2))
        >>> layout_map = LayoutMap(mesh)
        >>> layout_map["feature.*weight"] = Layout(["model", "unsharded"], mesh)
        >>> layout_map["feature_2.weight"].sharding_specs
        ('model', 'unsharded')
        >>> layout_map["head.bias"] is None
        True
    """

    def __init__(self, mesh: Mesh | None = None, *, match: str = "search") -> None:
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"Invalid `mesh`: expected a meshfit.dtensor.Mesh (from create_mesh), received "
                            f"mesh={mesh!r}.")
        if match not in ("search", "fullmatch"):
            raise ValueError(f"Invalid `match`: expected 'search' or 'fullmatch', received match={match!r}.")
        self._mesh = mesh
        self.match = match
        self._view: tuple[Any, Any] | None = None  # (the mesh's strategy, its view with this map)
        self._layout_map: dict[str, Layout] = {}
        self._patterns: dict[str, re.Pattern] = {}
        self.is_fully_sharded = False
        self.blocks: list[str] | None = None
        # Keras's ModelParallel: keyed Linear/Embedding weights take the tensor-parallel path (`MeshStrategy`)
        self.tensor_parallel_first = False
        self.pipeline_spec: PipelineSpec | None = None  # `pipeline`: stages along the pipeline axis

    def pipeline(self, split_points: Sequence[str], microbatches: int, schedule: str = "1F1B",
                 stages_per_rank: int = 1) -> LayoutMap:
        """Split the model into pipeline stages along the mesh's pipeline axis (``"pipe"``); returns the map.

        Args:
            split_points: module paths where a new stage starts (``["blocks.2"]``: two stages), one
                fewer than the stages (the pipeline axis's size times ``stages_per_rank``).
            microbatches: how many equal microbatches each batch is split into.
            schedule: ``"GPipe"``, ``"1F1B"`` or ``"Interleaved1F1B"`` (torch's schedules).
            stages_per_rank: stages each rank holds (``"Interleaved1F1B"`` only).

        Example:
            >>> import meshfit as mf
            >>> mesh = mf.dtensor.Mesh(("pipe",), (2,))
            >>> layout_map = mf.dtensor.LayoutMap(mesh).pipeline(["2"], microbatches=4, schedule="GPipe")
            >>> layout_map.pipeline_spec.num_stages
            2
        """
        self.pipeline_spec = PipelineSpec(tuple(split_points), microbatches, schedule, stages_per_rank)
        return self

    @classmethod
    def fully_sharded(cls, mesh: Mesh, blocks: Sequence[str] | None = None) -> LayoutMap:
        """A map that shards every weight over the mesh's data axis: fully sharded data parallel.

        Each process keeps 1/N of the parameters, gradients and optimizer state; torch's
        ``fully_shard`` (FSDP2) gathers a block's weights for its forward and backward and
        reduce-scatters its gradients. ``fit``, custom loops and checkpoints work unchanged. The
        map's `dims` mark the data axis ``shard``.

        Args:
            mesh: a mesh with a data axis (``mesh.dims.data_axis``): 1-D ``[("batch", N)]``, or 2-D
                ``[("batch", B), ("model", M)]`` with keys over ``model``.
            blocks: submodule paths to shard as one unit each (e.g. ``["layers.0", "layers.1"]``);
                by default the model's direct children that hold parameters.

        Raises:
            ValueError: the mesh has no data axis.

        Example:
            >>> mesh = mf.dtensor.create_mesh([("batch", 2)])  # doctest: +SKIP
            >>> with mf.dtensor.LayoutMap.fully_sharded(mesh).scope():  # doctest: +SKIP
            ...     model = mf.Model(module)
            >>> LayoutMap.fully_sharded(Mesh(("batch", "model"), (2, 2))).dims
            ParallelDims(batch=2:shard, model=2:tensor)
        """
        if isinstance(mesh, Mesh) and mesh.dims.data_axis is None:
            raise ValueError(f"Invalid mesh for LayoutMap.fully_sharded: expected a mesh with a data axis (an axis "
                             f"named 'batch', or one given the role 'data'), received {mesh!r}. Create it with "
                             "mf.dtensor.create_mesh([('batch', N)]), or name its data axis: "
                             "create_mesh([('dp', N), ...], roles={'dp': 'data'}).")
        layout_map = cls(mesh)
        layout_map.is_fully_sharded = True
        if blocks is not None:
            if isinstance(blocks, str) or not all(isinstance(b, str) for b in blocks):
                raise TypeError(f"Invalid `blocks`: expected a list of submodule paths (str), received "
                                f"blocks={blocks!r}.")
            layout_map.blocks = list(blocks)
        return layout_map

    @property
    def mesh(self) -> Mesh:
        """The map's mesh (given, or the mesh of its first layout)."""
        if self._mesh is None:
            raise ValueError("Invalid LayoutMap: it has no mesh yet. Pass one, LayoutMap(mesh), or add a layout "
                             "first.")
        return self._mesh

    @property
    def dims(self) -> ParallelDims:
        """The parallelism this map places: its mesh's `ParallelDims`, the data axis marked ``shard`` in a
        fully sharded map (every weight sharded over it)."""
        dims = self.mesh.dims
        if self.is_fully_sharded and dims.data_axis is not None:
            return dims.with_role(dims.data_axis, AxisRole.SHARD)
        return dims

    # ---- dict protocol -------------------------------------------------------------------
    def __setitem__(self, key: str, layout: Layout) -> None:
        if not isinstance(key, str) or not key:
            raise TypeError(f"Invalid LayoutMap key: expected a weight path or regular expression (a non-empty "
                            f"str), received {key!r}.")
        if key in self._layout_map:
            raise ValueError(f"{key} already exist in the LayoutMap with value {self._layout_map[key]!r}. Please make "
                             f"sure to not use duplicated keys: delete the old layout first (del layout_map[{key!r}]) "
                             "to replace it.")
        if not isinstance(layout, Layout):
            raise ValueError(f"Invalid layout for key {key!r}: {layout!r} should be a dtensor.Layout (expected a "
                             f"meshfit.dtensor.Layout), received {type(layout).__name__}.")
        if self._mesh is None:
            self._mesh = layout.mesh
        if layout.mesh != self.mesh:
            raise ValueError(f"Invalid layout for key {key!r}: its mesh {layout.mesh!r} is not this map's mesh "
                             f"{self.mesh!r}. Build the layout on the map's mesh.")
        try:
            pattern = re.compile(key)
        except re.error as error:
            raise ValueError(f"Invalid LayoutMap key {key!r}: it is not a valid regular expression ({error}). "
                             "Escape special characters, e.g. re.escape(path).") from error
        self._layout_map[key] = layout
        self._patterns[key] = pattern

    def __getitem__(self, path: str) -> Layout | None:
        """The layout for weight ``path``, or None when no key matches (the weight is replicated).

        Raises:
            ValueError: ``path`` is matched by two keys (and is not itself a key).
        """
        if path in self._layout_map:
            return self._layout_map[path]
        matches = [key for key, pattern in self._patterns.items() if self._matches(pattern, path)]
        if len(matches) > 1:
            raise ValueError(f"Weight path {path!r} matches several LayoutMap keys: {matches[0]!r} and "
                             f"{matches[1]!r}. Make the keys more specific (e.g. anchor them with ^...$), or add "
                             f"the exact key {path!r}, which takes precedence.")
        return self._layout_map[matches[0]] if matches else None

    def __delitem__(self, key: str) -> None:
        del self._layout_map[key]
        del self._patterns[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout_map)

    def __len__(self) -> int:
        return len(self._layout_map)

    def __contains__(self, key: object) -> bool:
        return key in self._layout_map

    def get(self, key: str, default: Any = None) -> Any:
        layout = self[key]
        return default if layout is None else layout

    def unmatched_keys(self, paths: Sequence[str]) -> list[str]:
        """The keys that match none of ``paths`` (exactly or as a regex); Keras ignores them, a
        fully sharded map refuses them."""
        return [key for key, pattern in self._patterns.items()
                if key not in paths and not any(self._matches(pattern, path) for path in paths)]

    def _matches(self, pattern: re.Pattern, path: str) -> bool:
        return (pattern.fullmatch(path) if self.match == "fullmatch" else pattern.search(path)) is not None

    def layout_for(self, path: str, rank: int) -> Layout:
        """The layout of weight ``path`` of ``rank`` dims: its match, else replicated."""
        layout = self[path]
        return layout if layout is not None else Layout.replicated(self.mesh, rank)

    # ---- scope -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator[Any]:
        """Modules created inside have these layouts when the block ends, as Keras lays variables out.

        A module whose parameters were created inside (``SubclassedModel()``, ``mf.Model(module)``)
        gets its layouts when the ``with`` block ends: its parameters become DTensors (replicated
        ones stay plain tensors for an empty map, with ``.layout`` set), and it accepts plain
        tensors (this process's rows) and `pack`ed DTensors alike. A lazy module gets them at its
        first call, once the shapes are known. ``mf.Model`` builds (places) the module at its first
        call or ``fit``.
        """
        base = self.mesh.strategy
        if not len(self) and not self.is_fully_sharded and self.pipeline_spec is None:
            strategy = base  # every weight replicated: the mesh's own strategy (it outlives the map)
        else:  # one view per map and mesh: models made in two entries of this scope share a strategy
            if self._view is None or self._view[0] is not base:
                self._view = (base, base.with_layout_map(self))
            strategy = self._view[1]
        with laying_out(self, strategy), strategy.scope():
            yield strategy

    def __repr__(self) -> str:
        items = ", ".join(f"{k!r}: {list(v.sharding_specs)}" for k, v in self._layout_map.items())
        if self.is_fully_sharded:
            return f"LayoutMap.fully_sharded({self._mesh!r}, blocks={self.blocks!r})"
        return f"LayoutMap({{{items}}}, mesh={self._mesh!r})"
