"""The seed's "custom training loop with MultiWorkerMirroredStrategy", ported line by line.

Run under ``meshfit launch`` / TF_CONFIG (several workers) or as a plain script (one worker).
``InputContext`` + ``distribute_datasets_from_function``, ``strategy.run``/``reduce``,
``mf.nn.compute_average_loss``, ``RMSprop``, ``SparseCategoricalAccuracy``, and the tutorial's
``Checkpoint`` + ``CheckpointManager`` fault tolerance (restore the latest, save at each epoch's end).
Beyond the tutorial, the checkpoint also tracks the optimizer and the dataset (its pass), so that a
resumed run is bitwise equal to an uninterrupted one.

Writes ``<out>/weights-<rank>.npz`` and ``<out>/log-<rank>.json`` (per epoch: accuracy, loss).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import numpy as np
import torch
from torch import nn

import meshfit as mf


def mnist_dataset(examples: int) -> mf.data.Dataset:
    (x_train, y_train), _ = mf.datasets.load_digits()  # the bundled 8x8 digits stand in for MNIST
    x_train, y_train = x_train[:examples] / np.float32(16), y_train[:examples].astype(np.int64)
    return mf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(examples).repeat()


def dataset_fn(global_batch_size: int, input_context: mf.InputContext, examples: int) -> mf.data.Dataset:
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = mnist_dataset(examples)
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    dataset = dataset.batch(batch_size)
    return dataset


def build_cnn_model() -> mf.Model:
    return mf.Model(nn.Sequential(
        nn.Unflatten(1, (1, 8)), nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(),
        nn.Linear(8 * 6 * 6, 32), nn.ReLU(), nn.Linear(32, 10)))


def _is_chief(task_type, task_id, cluster_spec) -> bool:
    return (task_type is None or task_type == "chief"
            or (task_type == "worker" and task_id == 0 and "chief" not in cluster_spec.as_dict()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--per-worker-batch", type=int, default=16)
    parser.add_argument("--workers-batch", type=int, default=None, help="global batch = this x per-worker")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=7)
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--learning-rate", type=float, default=0.001)
    parser.add_argument("--kill-at", type=int, default=-1, help="SIGKILL rank --kill-rank at this global step")
    parser.add_argument("--kill-rank", type=int, default=1)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)

    strategy = mf.MultiWorkerMirroredStrategy()
    num_workers = args.workers_batch or strategy.num_replicas_in_sync
    global_batch_size = args.per_worker_batch * num_workers

    with strategy.scope():
        multi_worker_dataset = strategy.distribute_datasets_from_function(
            lambda input_context: dataset_fn(global_batch_size, input_context, args.examples))
        multi_worker_model = build_cnn_model()
        optimizer = mf.optimizers.RMSprop(learning_rate=args.learning_rate)
        train_accuracy = mf.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    loss_object = mf.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def train_step(iterator):
        """Training step function."""

        def step_fn(inputs):
            """Per-Replica step function."""
            x, y = inputs
            predictions = multi_worker_model(x, training=True)
            per_batch_loss = loss_object(y, predictions)
            loss = mf.nn.compute_average_loss(per_batch_loss, global_batch_size=global_batch_size)
            variables = multi_worker_model.trainable_variables
            grads = torch.autograd.grad(loss, variables)  # tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(grads, variables, strict=True))
            train_accuracy.update_state(y, predictions)
            return loss.detach()

        per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(mf.ReduceOp.SUM, per_replica_losses, axis=None)

    epoch = torch.tensor(0, dtype=torch.int64)
    step_in_epoch = torch.tensor(0, dtype=torch.int64)
    task_type, task_id = strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id
    cluster_spec = strategy.cluster_resolver.cluster_spec()

    optimizer.build(multi_worker_model.trainable_variables)  # torch optimizers hold their parameters
    checkpoint = mf.train.Checkpoint(model=multi_worker_model, epoch=epoch, step_in_epoch=step_in_epoch,
                                     optimizer=optimizer, dataset=multi_worker_dataset)
    checkpoint_dir = args.checkpoint_dir or os.path.join(args.out, "ckpt")
    # Every worker may write the same directory: meshfit's saves are collective (no temp-dir dance).
    checkpoint_manager = mf.train.CheckpointManager(checkpoint, directory=checkpoint_dir, max_to_keep=1)
    latest_checkpoint = mf.train.latest_checkpoint(checkpoint_dir)
    if latest_checkpoint:
        checkpoint.restore(latest_checkpoint)
        if _is_chief(task_type, task_id, cluster_spec):
            print(f"resuming from {latest_checkpoint} at epoch {int(epoch)}", flush=True)

    first_round = os.environ.get("MESHFIT_RESTART_COUNT", "0") == "0"
    log = []
    while epoch.item() < args.epochs:
        iterator = iter(multi_worker_dataset)
        total_loss = 0.0
        num_batches = 0
        while step_in_epoch.item() < args.steps_per_epoch:
            global_step = int(epoch) * args.steps_per_epoch + int(step_in_epoch) + 1
            if first_round and global_step == args.kill_at and strategy.replica_id == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            total_loss += float(train_step(iterator))
            num_batches += 1
            step_in_epoch += 1
        train_loss = total_loss / num_batches
        accuracy = float(train_accuracy.result())
        if _is_chief(task_type, task_id, cluster_spec):
            print(f"Epoch: {int(epoch)}, accuracy: {accuracy:f}, train_loss: {train_loss:f}.", flush=True)
        log.append({"epoch": int(epoch), "accuracy": accuracy, "loss": train_loss,
                    "local_accuracy": float(train_accuracy.local_result())})
        train_accuracy.reset_states()
        epoch += 1
        step_in_epoch.zero_()
        checkpoint_manager.save()

    weights = {f"w{i}": w for i, w in enumerate(multi_worker_model.get_weights())}
    np.savez(os.path.join(args.out, f"weights-{strategy.replica_id}.npz"), **weights)
    with open(os.path.join(args.out, f"log-{strategy.replica_id}.json"), "w") as f:
        json.dump(log, f)
    print(f"rank {strategy.replica_id} of {strategy.num_replicas_in_sync} done", flush=True)


if __name__ == "__main__":
    main()
