"""`WeightsMixin`: Keras's weight API on a `Model` — get/set, save/load, summary and the weight lists."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from meshfit._engine import _summary
from meshfit._lazy_dtensor import placed_like, whole
from meshfit._protocols import ShapesModule
from meshfit._saving import (
    load_weights,
    require_every_worker,
    save_model,
    save_weights,
    split_across_workers,
)

_SPLIT = "the model's weights are split across the workers (layouts or pipeline stages), so reading them gathers"


class WeightsMixin:
    """The weight side of `meshfit.Model`: needs ``self.module``, ``self.name`` and ``self._input_example``."""

    module: nn.Module
    name: str
    _input_example: Any
    saveable_parts: Callable[[], dict[str, Any]]
    strategy: Any
    placement: Any

    def get_weights(self) -> list[np.ndarray]:
        """The module's ``state_dict`` values (parameters, then buffers, per submodule) as numpy.

        Sharded (DTensor) weights are gathered, and a pipeline stage's taken from the process that
        trains it: every process gets the full arrays (a collective).
        """
        if split_across_workers(self):  # a collective: every worker calls it, or this one is told at once
            with self.strategy.guard():
                require_every_worker(self.strategy, "model.get_weights", _SPLIT)
        state = self.saveable_parts()["module"].state_dict()  # completed from its holders (pipeline stages)
        return [whole(t).detach().cpu().numpy().copy() for t in state.values()]

    def set_weights(self, weights: list[Any]) -> None:
        """Set the values ``get_weights`` returns, in the same order; shapes must match."""
        state = self.module.state_dict()
        if len(weights) != len(state):
            raise ValueError(f"Invalid `weights`: the module has {len(state)} weight tensors, received "
                             f"{len(weights)}.")
        new_state = {}
        for (key, current), value in zip(state.items(), weights, strict=True):
            tensor = torch.as_tensor(np.asarray(value))
            if tuple(tensor.shape) != tuple(current.shape):
                raise ValueError(f"Invalid `weights`: {key!r} has shape {tuple(current.shape)}, received "
                                 f"shape {tuple(tensor.shape)}.")
            new_state[key] = placed_like(tensor.to(current.dtype), current)
        self.saveable_parts()["module"].load_state_dict(new_state)  # a pipeline's: this rank's stages

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's weights (Stateful, for `meshfit.train.Checkpoint`): each pipeline stage's from the
        process that trains it (every worker calls it, as every worker saves a checkpoint)."""
        return self.saveable_parts()["module"].state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.saveable_parts()["module"].load_state_dict(state)

    def save(self, filepath: str) -> None:
        """Save architecture (when rebuildable), weights, compile config and optimizer state.

        Call it on the chief alone or on every worker (same path): the chief writes one copy. A
        model whose weights are split across the workers (``mf.dtensor`` layouts) needs every worker;
        called on some only, it raises at once naming the fix. A ``.h5`` path is refused.
        """
        save_model(self, filepath)

    def save_weights(self, filepath: str) -> None:
        """Save the module's weights to a safetensors file (the chief writes; see ``save``)."""
        save_weights(self, filepath)

    def load_weights(self, filepath: str) -> None:
        """Load weights saved by ``save_weights`` or ``save``."""
        load_weights(self, filepath)

    def summary(self, line_length: int | None = None, print_fn: Any = None, expand_nested: bool = False,
                show_trainable: bool = False) -> None:
        """Print Keras's table: each layer, its output shape and parameter count, then the totals.

        Output shapes appear once the model was built on data (fit, evaluate, predict or
        ``build(sample_x)``). Arguments as in Keras; ``print_fn`` receives the table line by line.

        Raises:
            ValueError: If lazy layers have not been materialised yet.
        """
        runner = self.placement.step if self.placement is not None else None
        # a pipeline's stages: the user's module holds other stages' weights released, its own sharded or split
        module = runner.shapes_module() if isinstance(runner, ShapesModule) else self.module
        text = _summary.summary_text(module, self.name, self._input_example, line_length=line_length,
                                     expand_nested=expand_nested, show_trainable=show_trainable)
        _summary.print_summary(text, print_fn)

    def count_params(self) -> int:
        """The number of weights, trainable and not (Keras's ``count_params``)."""
        return _summary.count_params(self.module)

    @property
    def layers(self) -> list[nn.Module]:
        """The module's direct children (the module itself when it has none)."""
        return _summary.layers(self.module)

    @property
    def trainable_weights(self) -> list[nn.Parameter]:
        """Parameters the optimizer updates (``requires_grad``)."""
        return _summary.trainable_weights(self.module)

    trainable_variables = trainable_weights

    @property
    def non_trainable_weights(self) -> list[torch.Tensor]:
        """Frozen parameters, then saved floating-point buffers (e.g. batch-norm running statistics)."""
        return _summary.non_trainable_weights(self.module)

    @property
    def weights(self) -> list[torch.Tensor]:
        """``trainable_weights + non_trainable_weights``, as in Keras."""
        return [*self.trainable_weights, *self.non_trainable_weights]
