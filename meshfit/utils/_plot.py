"""`plot_history`: training curves from a `History` as a PNG, drawn with matplotlib's Agg canvas."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from meshfit._storage import atomic_write_bytes
from meshfit._validation import path_like


def _record(history: Any) -> tuple[dict[str, list[float]], list[int]]:
    """``(metric -> values, 0-based epochs)`` from a `History`, a ``fit`` result or a plain dict."""
    values = getattr(history, "history", history)
    if not isinstance(values, Mapping) or not values:
        raise ValueError("Invalid `history`: expected a History (what fit returns) or a dict such as "
                         f"{{'loss': [0.9, 0.5]}} with at least one metric, received history={history!r}.")
    lengths = {len(v) for v in values.values() if isinstance(v, Sequence)}
    if len(lengths) != 1 or not all(isinstance(v, Sequence) for v in values.values()):
        raise ValueError(f"Invalid `history`: every metric needs one value per epoch, received lengths "
                         f"{ {k: len(v) if isinstance(v, Sequence) else type(v).__name__ for k, v in values.items()} }.")
    epochs = list(getattr(history, "epoch", None) or range(lengths.pop()))
    return {k: [float(x) for x in v] for k, v in values.items()}, epochs


def plot_history(history: Any, path: str | os.PathLike, title: str | None = None) -> str:
    """Writes a PNG with one panel per metric: training and validation values per epoch.

    Each metric ``m`` of the history gets its own axis, with ``m`` and ``val_m`` (when recorded)
    drawn against the epoch (1-based, as the progress bar counts). Drawn on matplotlib's Agg canvas:
    no display, no global pyplot state. The file is written atomically.

    Args:
        history: What `Model.fit` returns (a `History`), or a dict ``{"loss": [...], "val_loss": [...]}``.
        path: The PNG file to write (its folder is created).
        title: A title over the panels.

    Returns:
        The absolute path written.

    Raises:
        ValueError: If the history is empty or its metrics have different lengths.

    Example:
        >>> import os, tempfile
        >>> path = plot_history({"loss": [0.9, 0.5], "val_loss": [1.0, 0.7]}, tempfile.mkdtemp() + "/h.png")
        >>> open(path, "rb").read(8) == b"\\x89PNG\\r\\n\\x1a\\n"
        True
    """
    target = os.path.abspath(path_like("path", path))
    figure = draw_history(history, title)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    atomic_write_bytes(target, buffer.getvalue())
    return target


def draw_history(history: Any, title: str | None = None) -> Any:
    """The `plot_history` figure (a matplotlib ``Figure`` on an Agg canvas), not yet saved."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    values, epochs = _record(history)
    names = [k for k in values if not (k.startswith("val_") and k[4:] in values)]
    columns = min(len(names), 3)
    rows = math.ceil(len(names) / columns)
    figure = Figure(figsize=(4.8 * columns, 3.6 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    x = [e + 1 for e in epochs]
    for index, name in enumerate(names):
        axis = figure.add_subplot(rows, columns, index + 1)
        axis.plot(x, values[name], marker="o", label="training" if not name.startswith("val_") else name)
        if f"val_{name}" in values:
            axis.plot(x, values[f"val_{name}"], marker="o", label="validation")
        axis.set_title(name)
        axis.set_xlabel("epoch")
        axis.grid(True, alpha=0.3)
        axis.legend()
        if len(x) <= 20:
            axis.set_xticks(x)
    if title:
        figure.suptitle(title)
    return figure
