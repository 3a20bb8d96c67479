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

from meshfit.dtensor._layout import Layout
from meshfit.dtensor._mesh import Mesh


class LayoutMap(MutableMapping):
    """A dict of `Layout` by weight path; a lookup tries the exact key, then every key as a regex.

    Args:
        mesh: the mesh of every layout in the map; weights no key matches are replicated on it.

    Example:
        >>> mesh = Mesh(("batch", "model"), (2, 2))
        >>> layout_map = LayoutMap(mesh)
        >>> layout_map["feature.*weight"] = Layout(["model", "unsharded"], mesh)
        >>> layout_map["feature_2.weight"].sharding_specs
        ('model', 'unsharded')
        >>> layout_map["head.bias"] is None
        True
    """

    def __init__(self, mesh: Mesh) -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"Invalid `mesh`: expected a meshfit.dtensor.Mesh (from create_mesh), received "
                            f"mesh={mesh!r}.")
        self.mesh = mesh
        self._layouts: dict[str, Layout] = {}
        self._patterns: dict[str, re.Pattern] = {}
        self.is_fully_sharded = False
        self.blocks: list[str] | None = None

    @classmethod
    def fully_sharded(cls, mesh: Mesh, blocks: Sequence[str] | None = None) -> LayoutMap:
        """A map that shards every weight over the mesh's ``batch`` axis: fully sharded data parallel.

        Each process keeps 1/N of the parameters, gradients and optimizer state; torch's
        ``fully_shard`` (FSDP2) gathers a block's weights for its forward and backward and
        reduce-scatters its gradients. ``fit``, custom loops and checkpoints work unchanged.

        Args:
            mesh: a 1-D mesh ``[("batch", N)]``.
            blocks: submodule paths to shard as one unit each (e.g. ``["layers.0", "layers.1"]``);
                by default the model's direct children that hold parameters.

        Example:
            >>> mesh = mf.dtensor.create_mesh([("batch", 2)])  # doctest: +SKIP
            >>> with mf.dtensor.LayoutMap.fully_sharded(mesh).scope():  # doctest: +SKIP
            ...     model = mf.Model(module)
        """
        layout_map = cls(mesh)
        layout_map.is_fully_sharded = True
        if blocks is not None:
            if isinstance(blocks, str) or not all(isinstance(b, str) for b in blocks):
                raise TypeError(f"Invalid `blocks`: expected a list of submodule paths (str), received "
                                f"blocks={blocks!r}.")
            layout_map.blocks = list(blocks)
        return layout_map

    # ---- dict protocol -------------------------------------------------------------------
    def __setitem__(self, key: str, layout: Layout) -> None:
        if not isinstance(key, str) or not key:
            raise TypeError(f"Invalid LayoutMap key: expected a weight path or regular expression (a non-empty "
                            f"str), received {key!r}.")
        if not isinstance(layout, Layout):
            raise TypeError(f"Invalid layout for key {key!r}: expected a meshfit.dtensor.Layout, received "
                            f"{layout!r}.")
        if layout.mesh != self.mesh:
            raise ValueError(f"Invalid layout for key {key!r}: its mesh {layout.mesh!r} is not this map's mesh "
                             f"{self.mesh!r}. Build the layout on the map's mesh.")
        try:
            pattern = re.compile(key)
        except re.error as error:
            raise ValueError(f"Invalid LayoutMap key {key!r}: it is not a valid regular expression ({error}). "
                             "Escape special characters, e.g. re.escape(path).") from error
        self._layouts[key] = layout
        self._patterns[key] = pattern

    def __getitem__(self, path: str) -> Layout | None:
        """The layout for weight ``path``, or None when no key matches (the weight is replicated).

        Raises:
            ValueError: ``path`` is matched by two keys (and is not itself a key).
        """
        if path in self._layouts:
            return self._layouts[path]
        matches = [key for key, pattern in self._patterns.items() if pattern.search(path)]
        if len(matches) > 1:
            raise ValueError(f"Weight path {path!r} matches several LayoutMap keys: {matches[0]!r} and "
                             f"{matches[1]!r}. Make the keys more specific (e.g. anchor them with ^...$), or add "
                             f"the exact key {path!r}, which takes precedence.")
        return self._layouts[matches[0]] if matches else None

    def __delitem__(self, key: str) -> None:
        del self._layouts[key]
        del self._patterns[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)

    def __contains__(self, key: object) -> bool:
        return key in self._layouts

    def get(self, key: str, default: Any = None) -> Any:
        layout = self[key]
        return default if layout is None else layout

    def unmatched_keys(self, paths: Sequence[str]) -> list[str]:
        """The keys that match none of ``paths`` (exactly or as a regex); Keras ignores them, a
        fully sharded map refuses them."""
        return [key for key, pattern in self._patterns.items()
                if key not in paths and not any(pattern.search(path) for path in paths)]

    def layout_for(self, path: str, rank: int) -> Layout:
        """The layout of weight ``path`` of ``rank`` dims: its match, else replicated."""
        layout = self[path]
        return layout if layout is not None else Layout.replicated(self.mesh, rank)

    # ---- scope -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self) -> Iterator[Any]:
        """Models created inside (``mf.Model(module)``) get these layouts when they are built."""
        strategy = self.mesh.strategy.with_layout_map(self)
        with strategy.scope():
            yield strategy

    def __repr__(self) -> str:
        items = ", ".join(f"{k!r}: {list(v.sharding_specs)}" for k, v in self._layouts.items())
        if self.is_fully_sharded:
            return f"LayoutMap.fully_sharded({self.mesh!r}, blocks={self.blocks!r})"
        return f"LayoutMap({{{items}}}, mesh={self.mesh!r})"
