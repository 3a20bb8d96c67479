"""TensorFlow's tutorial "Using DTensors with Keras", ported: a mesh, a `LayoutMap` whose keys are
regular expressions over weight paths, and the same ``fit`` with ``BackupAndRestore``.

``python examples/dtensor_keras.py`` creates a ``batch`` x ``model`` mesh of 4 local processes (the
mesh starts the other three itself); ``MESHFIT_EXAMPLE_TINY=1`` uses a 1 x 2 mesh and one epoch (the
test suite runs it so). Under ``meshfit launch --workers 4``, torchrun or ``TF_CONFIG`` the mesh is
made of the job's workers.
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn

import meshfit as mf

TINY = os.environ.get("MESHFIT_EXAMPLE_TINY") == "1"


class SubclassedModel(nn.Module):
    """The tutorial's subclassed model: two Dense layers named ``feature`` and ``feature_2``."""

    def __init__(self):
        super().__init__()
        self.feature = nn.Linear(64, 16)
        self.dropout = nn.Dropout(0.1)
        self.feature_2 = nn.Linear(16, 10)

    def forward(self, inputs):
        x = torch.relu(self.feature(inputs))
        x = self.dropout(x)
        return self.feature_2(x)


def main() -> None:
    torch.manual_seed(1337)  # every process starts from the same seed, as the tutorial asks
    batch, model_axis = (1, 2) if TINY else (2, 2)
    mesh = mf.dtensor.create_mesh([("batch", batch), ("model", model_axis)],
                                  devices=[f"cpu:{i}" for i in range(batch * model_axis)])

    layout_map = mf.dtensor.LayoutMap(mesh=mesh)
    layout_map["feature.*weight"] = mf.dtensor.Layout(["model", mf.dtensor.UNSHARDED], mesh)
    layout_map["feature.*bias"] = mf.dtensor.Layout(["model"], mesh)
    with layout_map.scope():
        model = mf.Model(SubclassedModel())
        model.compile(optimizer=mf.optimizers.Adam(0.01),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    (x, y), _ = mf.datasets.load_digits()  # the bundled 8x8 digits stand in for MNIST, pixels in [0, 1]
    x = x.reshape(-1, 64)
    ds_train = mf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=7).batch(32)
    backup_dir = os.path.join(tempfile.gettempdir(), "meshfit-dtensor-backup")
    model.fit(ds_train, epochs=1 if TINY else 3, callbacks=[mf.callbacks.BackupAndRestore(backup_dir)],
              verbose=2)
    for path, parameter in model.module.named_parameters():  # laid out when the model was built
        print(f"{path}: {parameter.layout.to_string()}")


if __name__ == "__main__":
    main()
