"""The short example of the README and the Getting started page: Keras's multi-worker tutorial with
PyTorch layers. ``meshfit launch --workers 2 examples/quickstart.py``, or ``python examples/quickstart.py``
for one process: 3 epochs of 70 steps, as the tutorial trains (22 s on two workers and 16 s in one process,
starts included, on a 2-core machine; the test suite runs a copy with 10 steps an epoch)."""

# --8<-- [start:example]
import torch.nn as nn

import meshfit as mf

strategy = mf.MultiWorkerMirroredStrategy()               # roles from TF_CONFIG (or torchrun / SLURM)
(x, y), _ = mf.datasets.load_digits(image_size=28)
ds = mf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0).repeat().batch(64 * 2)
with strategy.scope():
    model = mf.Model(nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(),
                                   nn.LazyLinear(128), nn.ReLU(), nn.Linear(128, 10)))
    model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
model.fit(ds, epochs=3, steps_per_epoch=70, callbacks=[mf.callbacks.BackupAndRestore("backup")])
# --8<-- [end:example]
