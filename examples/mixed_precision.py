"""Mixed precision with Keras's names: layers compute in bfloat16, variables stay float32.

``python examples/mixed_precision.py``; ``MESHFIT_EXAMPLE_TINY=1`` trains 2 epochs instead of 5 (the test
suite runs it so). ``"mixed_float16"`` (on a GPU) adds dynamic loss scaling, as Keras does.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import meshfit as mf

TINY = os.environ.get("MESHFIT_EXAMPLE_TINY") == "1"


def main() -> None:
    torch.manual_seed(0)
    mf.mixed_precision.set_global_policy("mixed_bfloat16")
    policy = mf.mixed_precision.global_policy()
    print(f"compute {policy.compute_dtype}, variables {policy.variable_dtype}")

    (x, y), _ = mf.datasets.load_digits()  # pixels already scaled to [0, 1]: use them as they are
    x = x.reshape(-1, 64)
    model = mf.Model(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    model.compile(optimizer="adam", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x, y, batch_size=64, epochs=2 if TINY else 5, verbose=2)
    print("weights:", {p.dtype for p in model.module.parameters()})
    print("predictions:", model.predict(x[:2], verbose=0).dtype)  # float32: numpy has no bfloat16


if __name__ == "__main__":
    main()
