"""`Node`: one step of a `Dataset` pipeline, computing its element ``i`` of pass ``t`` directly.

Sources (``_sources.py``) and transformations (``_transforms.py``) are nodes; each holds the node
it reads from in ``_inner``. The public `Dataset` wraps the top node of such a chain.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from meshfit.data._options import Options
from meshfit.data._structure import slice_rows, stack

AUTOTUNE = -1
_N = TypeVar("_N", bound="Node")


class Node:
    """The random-access protocol every pipeline step implements."""

    _inner: Node | None = None
    _options: Options | None = None

    def _length(self) -> int | None:
        """Number of elements per pass; ``None`` when infinite."""
        raise NotImplementedError

    def _get(self, index: int, pass_index: int) -> Any:
        """Element ``index`` of pass ``pass_index``."""
        raise NotImplementedError

    def _gather(self, indices: np.ndarray, pass_index: int) -> Any:
        """Elements ``indices`` of pass ``pass_index``, stacked."""
        if not len(indices):  # none (a replica's empty share of a last batch): the structure, with no rows
            return slice_rows(stack([self._get(0, pass_index)]), 0, 0)
        return stack([self._get(int(i), pass_index) for i in indices])

    def _gather_range(self, start: int, stop: int, pass_index: int) -> Any:
        """Elements ``start`` to ``stop - 1`` of pass ``pass_index``, stacked: `_gather` of those
        indices; a node that reads consecutive elements faster (or passes the range on) overrides it."""
        return self._gather(np.arange(start, stop, dtype=np.int64), pass_index)

    def _prefetch_size(self) -> int:
        return 0 if self._inner is None else self._inner._prefetch_size()

    def _replace_inner(self: _N, inner: Node) -> _N:
        clone = copy.copy(self)
        clone._inner = inner
        return clone

    def _transform_chain(self, fn: Callable[[Node], Node | None]) -> Node:
        """Rebuild the chain, replacing the first node (from the top) for which ``fn`` returns one."""
        replaced = fn(self)
        if replaced is not None:
            return replaced
        if self._inner is None:
            raise LookupError("no node matched")
        return self._replace_inner(self._inner._transform_chain(fn))

    def _nodes(self) -> list[Node]:
        """This node and every node below it, top first."""
        nodes: list[Node] = []
        node: Node | None = self
        while node is not None:
            nodes.append(node)
            node = node._inner
        return nodes

    # ---- the public node API: what meshfit's other packages (distribution, the loop) use --------
    @property
    def inner(self) -> Node | None:
        """The node this one reads from; ``None`` for a source."""
        return self._inner

    def length(self) -> int | None:
        """Number of elements per pass; ``None`` when infinite."""
        return self._length()

    def get(self, index: int, pass_index: int) -> Any:
        """Element ``index`` of pass ``pass_index``."""
        return self._get(index, pass_index)

    def prefetch_size(self) -> int:
        """How many elements ahead a reader should compute (0: none)."""
        return self._prefetch_size()

    def nodes(self) -> list[Node]:
        """This node and every node below it, top first."""
        return self._nodes()

    def transform_chain(self, fn: Callable[[Node], Node | None]) -> Node:
        """The chain rebuilt with the first node (from the top) for which ``fn`` returns one replaced."""
        return self._transform_chain(fn)

    def options(self) -> Options:
        """The options set on this node or the nearest one below it."""
        for node in self._nodes():
            if node._options is not None:
                return node._options
        return Options()

    def with_options(self, options: Options) -> Node:
        clone = copy.copy(self)
        clone._options = options
        return clone


class Transform(Node):
    """A node that reads from another one (every node but a source)."""

    _inner: Node

    @property
    def inner(self) -> Node:
        return self._inner
