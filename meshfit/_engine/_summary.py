"""``Model.summary()`` as Keras prints it, and the weight lists Keras users expect on a model.

Keras's words mapped onto a torch module:

- **trainable weights**: parameters with ``requires_grad``;
- **non-trainable weights**: frozen parameters plus floating-point buffers that are saved with the
  module (batch-norm running mean and variance, as Keras's ``moving_mean`` / ``moving_variance``);
  integer counters such as ``num_batches_tracked`` have no Keras counterpart and are left out;
- **layers**: the module's direct children (the module itself when it has none).

Output shapes come from `torchinfo`'s forward hooks, run on one example of the batch the model was
built on (eval mode, no gradients, RNG streams untouched); the batch dimension prints as ``None``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshfit.data import map_structure

__all__ = [
    "count_params",
    "example_of",
    "layers",
    "non_trainable_weights",
    "summary_text",
    "trainable_weights",
]


def _is_lazy(tensor: torch.Tensor) -> bool:
    return nn.parameter.is_lazy(tensor)


def trainable_weights(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that the optimizer updates (``requires_grad``), in ``parameters()`` order."""
    return [p for p in module.parameters() if p.requires_grad]


def non_trainable_weights(module: nn.Module) -> list[torch.Tensor]:
    """Frozen parameters, then saved floating-point buffers (running statistics)."""
    frozen = [p for p in module.parameters() if not p.requires_grad]
    saved = set(module.state_dict(keep_vars=True))
    buffers = [b for name, b in module.named_buffers() if name in saved and not _is_lazy(b)
               and b.is_floating_point()]
    return frozen + buffers


def _require_built(module: nn.Module, what: str) -> None:
    if any(_is_lazy(t) for t in (*module.parameters(), *module.buffers())):
        raise ValueError(f"This model has not yet been built: {what} needs its lazy layers' shapes. Build it "
                         "first by calling fit, evaluate or predict, or model.build(sample_x).")


def count_params(module: nn.Module) -> int:
    """Trainable plus non-trainable weights' element count (Keras's ``count_params``).

    Raises:
        ValueError: If lazy layers have not been materialised yet.
    """
    _require_built(module, "count_params()")
    return sum(t.numel() for t in (*trainable_weights(module), *non_trainable_weights(module)))


def layers(module: nn.Module) -> list[nn.Module]:
    """The module's direct children, or ``[module]`` for a module without children."""
    children = list(module.children())
    return children or [module]


def example_of(batch_x: Any) -> Any:
    """The first example of a batch, kept as a batch of one (detached CPU copies) for summaries."""
    def first(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf[:1].detach().to("cpu", copy=True)
        return leaf

    return map_structure(first, batch_x)


def _output_shapes(module: nn.Module, example: Any) -> dict[int, Any]:
    """``id(submodule) -> output size`` from torchinfo's hooks on one forward pass of ``example``."""
    import torchinfo

    device = next((t.device for t in module.parameters()), torch.device("cpu"))
    modes = {m: m.training for m in module.modules()}
    try:
        with torch.random.fork_rng(devices=[]):
            stats = torchinfo.summary(module, input_data=[example], device=device, mode="eval", verbose=0,
                                      depth=64)
    finally:
        for submodule, training in modes.items():  # torchinfo restores only one flag for the whole tree
            submodule.training = training
        # torchinfo keeps its last forward pass per class name, holding the module: let it go.
        getattr(torchinfo.torchinfo, "_cached_forward_pass", {}).pop(type(module).__name__, None)
    shapes: dict[int, Any] = {}
    for info in stats.summary_list:
        shapes.setdefault(info.layer_id, info.output_size)
    return shapes


def _format_shape(size: Any) -> str:
    if not size:
        return "?"
    if isinstance(size[0], (list, tuple)):
        return ", ".join(_format_shape(part) for part in size)
    dims = ["None", *(str(d) for d in size[1:])]
    return "(" + ", ".join(dims) + (",)" if len(dims) == 1 else ")")


def _rows(module: nn.Module, expand_nested: bool) -> list[tuple[str, nn.Module, int]]:
    """``(name, submodule, depth)`` for each row of the table."""
    children = list(module.named_children())
    if not children:
        return [(type(module).__name__.lower(), module, 0)]
    if not expand_nested:
        return [(name, child, 0) for name, child in children]
    rows = []
    for name, child in module.named_modules():
        if child is not module and name:
            rows.append((name, child, name.count(".")))
    return rows


def _trainable_flag(module: nn.Module) -> str:
    params = list(module.parameters())
    if not params:
        return "-"
    flags = {p.requires_grad for p in params}
    return "Y" if flags == {True} else "N" if flags == {False} else "Partial"


def summary_text(module: nn.Module, name: str, example: Any = None, *, line_length: int | None = None,
                 expand_nested: bool = False, show_trainable: bool = False) -> str:
    """Keras's summary table for ``module``: layer (type), output shape, parameter count, and totals.

    Args:
        module: The module to describe.
        name: The model's name, shown on the first line.
        example: One example batch (see `example_of`) to trace output shapes with; without it the
            shapes print as ``?``.
        line_length: Total width of the table (default 65, or 77 with ``show_trainable``).
        expand_nested: One row per submodule at every depth (indented), not only the direct children.
        show_trainable: Add a column saying whether each layer's parameters train (``Y``/``N``/``Partial``).

    Returns:
        The table, lines joined by newlines.

    Raises:
        ValueError: If lazy layers have not been materialised yet.

    Example:
        >>> print(summary_text(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), "tiny"))  # doctest: +ELLIPSIS
        Model: "tiny"
        _________________________________________________________________
         Layer (type)                Output Shape              Param #
        =================================================================
         0 (Linear)                  ?                         15
        ...
        Total params: 15
        Trainable params: 15
        Non-trainable params: 0
        _________________________________________________________________
    """
    _require_built(module, "summary()")
    shapes = _output_shapes(module, example) if example is not None else {}
    line_length = line_length or (77 if show_trainable else 65)
    positions = [int(line_length * p) for p in ((0.45, 0.85, 1.0) if not show_trainable else (0.4, 0.7, 0.86, 1.0))]
    headers = ["Layer (type)", "Output Shape", "Param #"] + (["Trainable"] if show_trainable else [])

    def line(fields: list[str]) -> str:
        # Like Keras's print_row: each field starts one space into its column; text too long for
        # its column wraps onto the next line instead of being cut off.
        left, out = list(fields), []
        while any(left):
            text, start = "", 0
            for column, end in enumerate(positions):
                # The last column never wraps: a big count may run past the line's end.
                width = end - start - 2 if column < len(positions) - 1 else len(left[column])
                text = text.ljust(start) + " " + left[column][:width]
                left[column] = left[column][width:]
                start = end
            out.append(text.rstrip())
        return "\n".join(out)

    lines = [f'Model: "{name}"', "_" * line_length, line(headers), "=" * line_length]
    rows = _rows(module, expand_nested)
    for index, (row_name, child, depth) in enumerate(rows):
        count = count_params(child)
        fields = ["  " * depth + f"{row_name} ({type(child).__name__})", _format_shape(shapes.get(id(child))),
                  f"{count:,}"]
        if show_trainable:
            fields.append(_trainable_flag(child))
        lines.append(line(fields))
        lines.append("" if index < len(rows) - 1 else "=" * line_length)
    trainable = sum(p.numel() for p in trainable_weights(module))
    non_trainable = sum(t.numel() for t in non_trainable_weights(module))
    lines += [f"Total params: {trainable + non_trainable:,}", f"Trainable params: {trainable:,}",
              f"Non-trainable params: {non_trainable:,}", "_" * line_length]
    return "\n".join(lines)


def print_summary(text: str, print_fn: Callable[[str], Any] | None) -> None:
    """Prints the table line by line with ``print_fn`` (Keras's hook), or all at once with ``print``."""
    if print_fn is None:
        print(text)
        return
    for row in text.split("\n"):
        print_fn(row)
