"""Keras's guide "Multi-GPU and distributed training", ported: `MirroredStrategy` on local devices,
then restartable training that restores the newest checkpoint the `ModelCheckpoint` callback wrote.

``python examples/keras_distributed.py`` trains on two local CPU replicas: `MirroredStrategy`
starts the second process itself, as it would use every GPU of a machine (``--devices cuda:0 cuda:1``).
On several machines, use `MultiWorkerMirroredStrategy` with ``TF_CONFIG`` or ``meshfit launch``
(examples/main.py). ``MESHFIT_EXAMPLE_TINY=1`` trains a few steps only (the test suite runs it so).
"""

from __future__ import annotations

import argparse
import os
import tempfile

from torch import nn

import meshfit as mf

TINY = os.environ.get("MESHFIT_EXAMPLE_TINY") == "1"


def get_compiled_model() -> mf.Model:
    # Keras: Input(784) -> Dense(256, relu) -> Dense(256, relu) -> Dense(10)
    model = mf.Model(nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                   nn.Linear(256, 10)))
    model.compile(optimizer=mf.optimizers.Adam(),
                  loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[mf.metrics.SparseCategoricalAccuracy()])
    return model


def get_dataset(batch_size: int):
    # 8x8 digits stand in for MNIST; pixels come scaled to [0, 1] (the guide divides MNIST's bytes by 255)
    (x_train, y_train), (x_test, y_test) = mf.datasets.load_digits()
    x_train, x_test = x_train.reshape(-1, 64), x_test.reshape(-1, 64)
    num_val = 200  # the guide reserves 10,000 MNIST examples for validation
    x_val, y_val = x_train[-num_val:], y_train[-num_val:]
    x_train, y_train = x_train[:-num_val], y_train[:-num_val]
    if TINY:
        x_train, y_train = x_train[: 4 * batch_size], y_train[: 4 * batch_size]
    return (mf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(batch_size),
            mf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(batch_size),
            mf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(batch_size))


def make_or_restore_model(checkpoint_dir: str) -> mf.Model:
    checkpoints = [os.path.join(checkpoint_dir, name) for name in os.listdir(checkpoint_dir)]
    if checkpoints:
        latest_checkpoint = max(checkpoints, key=os.path.getctime)
        print("Restoring from", latest_checkpoint)
        return mf.load_model(latest_checkpoint)
    print("Creating a new model")
    return get_compiled_model()


def run_training(strategy, checkpoint_dir: str, epochs: int = 1) -> None:
    with strategy.scope():
        model = make_or_restore_model(checkpoint_dir)
    callbacks = [mf.callbacks.ModelCheckpoint(filepath=os.path.join(checkpoint_dir, "ckpt-{epoch}.keras"),
                                              save_freq="epoch")]
    train_dataset, val_dataset, _ = get_dataset(64 * strategy.num_replicas_in_sync)
    model.fit(train_dataset, epochs=epochs, callbacks=callbacks, validation_data=val_dataset, verbose=2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", nargs="+", default=["cpu:0", "cpu:1"])
    parser.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(), "meshfit-keras-ckpt"))
    args = parser.parse_args()

    strategy = mf.MirroredStrategy(devices=args.devices)  # the replicas run this script from here on
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    with strategy.scope():
        model = get_compiled_model()
    train_dataset, val_dataset, test_dataset = get_dataset(64 * strategy.num_replicas_in_sync)
    model.fit(train_dataset, epochs=1 if TINY else 2, validation_data=val_dataset, verbose=2)
    model.evaluate(test_dataset, verbose=2)

    # Fault tolerance: a run that restarts picks up the newest checkpoint.
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    run_training(strategy, args.checkpoint_dir, epochs=1)
    run_training(strategy, args.checkpoint_dir, epochs=1)


if __name__ == "__main__":
    main()
