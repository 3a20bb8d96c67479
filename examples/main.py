"""The multi-worker Keras tutorial's ``main.py``, ported to meshfit.

Run on two workers, as in the tutorial, each with its own ``TF_CONFIG``::

    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 0}}' \\
        python examples/main.py &
    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 1}}' \\
        python examples/main.py

or in one command: ``meshfit launch --workers 2 examples/main.py``; add ``--evaluator`` for an
``evaluator`` task that evaluates each checkpoint the workers save (``mf.SidecarEvaluator``). Pass ``--mnist path/to/mnist.npz``
to train on MNIST (Keras's file layout); without it, scikit-learn's bundled digits resized to 28x28.
``MESHFIT_EXAMPLE_TINY=1`` trains 2 epochs of 3 steps (the test suite runs it so).
"""

from __future__ import annotations

import argparse
import os

from torch import nn

import meshfit as mf


def mnist_dataset(batch_size: int, mnist_path: str | None) -> mf.data.Dataset:
    if mnist_path:
        (x_train, y_train), _ = mf.datasets.load_mnist(mnist_path)
        x_train = x_train / 255.0  # the tutorial scales the uint8 images to [0, 1]
    else:
        (x_train, y_train), _ = mf.datasets.load_digits(image_size=28)
    return (mf.data.Dataset.from_tensor_slices((x_train.astype("float32"), y_train.astype("int64")))
            .shuffle(len(x_train), seed=0).repeat().batch(batch_size))


def build_and_compile_cnn_model() -> mf.Model:
    model = mf.Model(nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(),
                                   nn.LazyLinear(128), nn.ReLU(), nn.Linear(128, 10)))
    model.compile(loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=mf.optimizers.SGD(learning_rate=0.001), metrics=["accuracy"])
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mnist", default=None, help="path to a local mnist.npz")
    parser.add_argument("--backup-dir", default="/tmp/meshfit-example-backup")
    parser.add_argument("--checkpoint-dir", default="/tmp/meshfit-example-checkpoints")
    args = parser.parse_args()
    per_worker_batch_size = 64
    strategy = mf.MultiWorkerMirroredStrategy()
    if strategy.cluster_resolver.task_type == "evaluator":
        with strategy.scope():
            model = build_and_compile_cnn_model()
        evaluation_data = mnist_dataset(256, args.mnist)
        mf.SidecarEvaluator(model, evaluation_data, args.checkpoint_dir, steps=4, max_evaluations=3).start()
        return
    # The tutorial counts TF_CONFIG's workers; the strategy's count is the same there and also right
    # under torchrun, PyTorchJob and SLURM (no TF_CONFIG) and with a chief (deploy/).
    num_workers = strategy.num_replicas_in_sync
    multi_worker_dataset = mnist_dataset(per_worker_batch_size * num_workers, args.mnist)
    with strategy.scope():
        multi_worker_model = build_and_compile_cnn_model()
    callbacks = [mf.callbacks.BackupAndRestore(backup_dir=args.backup_dir),
                 mf.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, "ckpt-{epoch}"))]
    epochs, steps_per_epoch = (2, 3) if os.environ.get("MESHFIT_EXAMPLE_TINY") == "1" else (3, 70)
    multi_worker_model.fit(multi_worker_dataset, epochs=epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks)


if __name__ == "__main__":
    main()
