"""A custom training loop on several workers, as in the multi-worker Keras tutorial's last part.

``strategy.distribute_datasets_from_function`` with an `InputContext`, ``strategy.run`` and
``strategy.reduce``, ``mf.nn.compute_average_loss``, ``RMSprop``, a global accuracy metric, and the
tutorial's fault tolerance: restore the newest `Checkpoint` at start, save one at each epoch's end.
The checkpoint also tracks the optimizer and the dataset, so a resumed run continues exactly.

Run it on two workers: ``meshfit launch --workers 2 examples/custom_loop.py`` (or one ``TF_CONFIG``
per worker, or torchrun); as a plain ``python examples/custom_loop.py`` it is one worker.
``MESHFIT_EXAMPLE_TINY=1`` shortens it to a few steps (the test suite runs it that way).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch import nn

import meshfit as mf

TINY = os.environ.get("MESHFIT_EXAMPLE_TINY") == "1"


def mnist_dataset() -> mf.data.Dataset:
    # The bundled 8x8 digits stand in for MNIST: pixels already in [0, 1], labels int64.
    (x_train, y_train), _ = mf.datasets.load_digits()
    return mf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=0).repeat()


def dataset_fn(global_batch_size: int, input_context: mf.InputContext) -> mf.data.Dataset:
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = mnist_dataset()
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return dataset.batch(batch_size)


def build_cnn_model() -> mf.Model:
    return mf.Model(nn.Sequential(
        nn.Unflatten(1, (1, 8)), nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(),
        nn.Linear(8 * 6 * 6, 32), nn.ReLU(), nn.Linear(32, 10)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(), "meshfit-custom-loop"))
    args = parser.parse_args()
    epochs, steps_per_epoch = (2, 5) if TINY else (3, 70)
    torch.manual_seed(0)

    strategy = mf.MultiWorkerMirroredStrategy()
    global_batch_size = 64 * strategy.num_replicas_in_sync
    with strategy.scope():
        multi_worker_dataset = strategy.distribute_datasets_from_function(
            lambda input_context: dataset_fn(global_batch_size, input_context))
        multi_worker_model = build_cnn_model()
        optimizer = mf.optimizers.RMSprop(learning_rate=0.001)
        train_accuracy = mf.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    loss_object = mf.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def train_step(iterator):
        def step_fn(inputs):
            x, y = inputs
            predictions = multi_worker_model(x, training=True)
            per_batch_loss = loss_object(y, predictions)
            loss = mf.nn.compute_average_loss(per_batch_loss, global_batch_size=global_batch_size)
            variables = multi_worker_model.trainable_variables
            grads = torch.autograd.grad(loss, variables)  # TF: tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(grads, variables, strict=True))  # summed across workers
            train_accuracy.update_state(y, predictions)
            return loss.detach()

        per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(mf.ReduceOp.SUM, per_replica_losses, axis=None)

    epoch = torch.tensor(0, dtype=torch.int64)  # TF: tf.Variable(0, dtype=tf.int64); restored in place
    step_in_epoch = torch.tensor(0, dtype=torch.int64)
    optimizer.build(multi_worker_model.trainable_variables)  # torch optimizers hold their parameters
    checkpoint = mf.train.Checkpoint(model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch,
                                     optimizer=optimizer, dataset=multi_worker_dataset)
    # Every worker passes the same directory: the save is collective, no per-worker temporary folders.
    checkpoint_manager = mf.train.CheckpointManager(checkpoint, directory=args.checkpoint_dir, max_to_keep=1)
    latest_checkpoint = mf.train.latest_checkpoint(args.checkpoint_dir)
    is_chief = strategy.replica_id == 0
    if latest_checkpoint:
        checkpoint.restore(latest_checkpoint)
        if is_chief:
            print(f"resuming from {latest_checkpoint} at epoch {int(epoch)}", flush=True)

    while epoch.item() < epochs:
        iterator = iter(multi_worker_dataset)
        total_loss, num_batches = 0.0, 0
        while step_in_epoch.item() < steps_per_epoch:
            total_loss += float(train_step(iterator))
            num_batches += 1
            step_in_epoch += 1
        if is_chief:
            print(f"Epoch: {int(epoch)}, accuracy: {float(train_accuracy.result()):f}, "
                  f"train_loss: {total_loss / max(num_batches, 1):f}.", flush=True)
        else:
            train_accuracy.result()  # a collective: every worker takes part
        train_accuracy.reset_states()
        epoch += 1  # advanced before saving, so a restored run never starts an empty epoch
        step_in_epoch.zero_()
        checkpoint_manager.save()


if __name__ == "__main__":
    main()
