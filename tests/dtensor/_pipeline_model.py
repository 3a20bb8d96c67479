"""The pipeline tests' model and data: a small sequence classifier whose ``forward`` builds positions with
``torch.arange`` (token and position embeddings, four residual blocks, a head), and 64 seeded rows."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.tokens = nn.Embedding(16, 8)
        self.positions = nn.Embedding(6, 8)
        self.blocks = nn.Sequential(*(Block(8) for _ in range(4)))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))
        return self.head(self.blocks(h).mean(dim=1))


def data(rows: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.integers(0, 16, size=(rows, 6)).astype("int64")
    y = (x[:, 0] % 3).astype("int64")
    return x, y


def compile_model(mf, model) -> None:  # noqa: ANN001  (meshfit is imported by the caller)
    model.compile(optimizer=mf.optimizers.Adam(0.01),
                  loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
