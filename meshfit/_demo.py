"""The main job behind ``meshfit demo``: the seed tutorial's ``main.py``, ported to meshfit.

Started by ``meshfit launch`` (each worker gets ``TF_CONFIG``): the seed CNN trained on scikit-learn's
bundled digits resized to 28x28, with the global batch split across workers, a progress bar on the
chief, and ``BackupAndRestore`` so that a killed worker's group resumes exactly where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch import nn

import meshfit as mf


def build_and_compile_cnn_model() -> mf.Model:
    module = nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(),
                           nn.LazyLinear(128), nn.ReLU(), nn.Linear(128, 10))
    model = mf.Model(module)
    model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                  loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=None)
    parser.add_argument("--backup-dir", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tf_config = json.loads(os.environ.get("TF_CONFIG", '{"cluster": {"worker": ["localhost:0"]}}'))
    num_workers = len(tf_config["cluster"]["worker"])
    strategy = mf.MultiWorkerMirroredStrategy()
    (x_train, y_train), (x_test, y_test) = mf.datasets.load_digits(image_size=28)
    per_worker_batch = 32
    dataset = (mf.data.Dataset.from_tensor_slices((x_train, y_train))
               .shuffle(len(x_train), seed=0).repeat().batch(per_worker_batch * num_workers).prefetch())
    steps = args.steps_per_epoch or len(x_train) // (per_worker_batch * num_workers)
    with strategy.scope():
        model = build_and_compile_cnn_model()
    backup_dir = args.backup_dir or os.path.join(tempfile.gettempdir(), "meshfit-demo-backup")
    callbacks = [mf.callbacks.BackupAndRestore(backup_dir=backup_dir)]
    model.fit(dataset, epochs=args.epochs, steps_per_epoch=steps, callbacks=callbacks)
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=128, verbose=0)
    if strategy.is_chief:
        print(f"test accuracy: {accuracy:.4f} (loss {loss:.4f}) on {len(x_test)} held-out digits, "
              f"{strategy.num_replicas_in_sync} workers")


if __name__ == "__main__":
    main()
