"""Keras's guide "Customizing what happens in fit()" (the PyTorch version), ported to meshfit.

Override ``train_step`` (and ``test_step``) and keep everything ``fit`` gives: callbacks,
distribution, checkpoints, the compiled metrics in the logs. Run: ``python examples/custom_train_step.py``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import meshfit as mf


class CustomModel(mf.Model):
    def train_step(self, data):
        x, y = data
        self.optimizer.zero_grad()
        y_pred = self(x, training=True)  # forward pass (through DDP under a multi-worker strategy)
        loss = self.compute_loss(y=y, y_pred=y_pred)  # the loss configured in compile()
        loss.backward()
        self.optimizer.step()
        # Update the metrics (the loss tracker is one of them, named "loss").
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss.detach())
            else:
                metric.update_state(y, y_pred.detach())
        # A dict mapping metric names to their current value; fit logs them (reduced over replicas).
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        self.metrics[0].update_state(loss)  # the loss tracker
        return self.compute_metrics(x, y, y_pred)  # updates the compiled metrics, returns all results


def main() -> dict[str, list[float]]:
    torch.manual_seed(0)
    x = np.random.default_rng(0).random((1000, 32), dtype=np.float32)
    y = np.random.default_rng(1).random((1000, 1), dtype=np.float32)
    model = CustomModel(nn.Linear(32, 1))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    history = model.fit(x, y, epochs=3, verbose=0)
    print({name: [round(v, 4) for v in values] for name, values in history.history.items()})
    print(model.evaluate(x, y, verbose=0, return_dict=True))
    return history.history


if __name__ == "__main__":
    main()
