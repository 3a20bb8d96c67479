"""The "Multi-worker training with Estimator" tutorial, ported to meshfit (seed 001).

Run on two workers, as in the tutorial, each with its own ``TF_CONFIG``::

    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 0}}' \\
        python examples/estimator_multiworker.py &
    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 1}}' \\
        python examples/estimator_multiworker.py

or ``meshfit launch --workers 2 [--evaluator] examples/estimator_multiworker.py``: with ``--evaluator``
an ``evaluator`` task evaluates each checkpoint the workers write. Without ``--mnist path/to/mnist.npz``
the data is scikit-learn's bundled digits resized to MNIST's 28x28 (nothing is downloaded).
The other options exist for the tests (a short run, a fault to inject); the tutorial's code is unchanged
apart from the edits named in the README ("Estimator: the seed's model_fn and its port").
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import numpy as np
from torch import nn

import meshfit as mf

parser = argparse.ArgumentParser()
parser.add_argument("--mnist", default=None, help="path to a local mnist.npz")
parser.add_argument("--model-dir", default="/tmp/multiworker")
parser.add_argument("--learning-rate", type=float, default=1e-4)
parser.add_argument("--max-steps", type=int, default=None)
parser.add_argument("--save-checkpoints-steps", type=int, default=None)
parser.add_argument("--keep-checkpoint-max", type=int, default=5)
parser.add_argument("--eval-steps", type=int, default=100)
parser.add_argument("--log-steps", type=int, default=100)
parser.add_argument("--throttle-secs", type=float, default=600)
parser.add_argument("--start-delay-secs", type=float, default=120)
parser.add_argument("--train-examples", type=int, default=None)
parser.add_argument("--kill-worker-at-step", type=int, default=None, help="SIGKILL worker 1 there (first round)")
parser.add_argument("--results", default=None, help="write this task's results as JSON here")
args = parser.parse_args()

if args.mnist:
    (x_train, y_train), (x_test, y_test) = mf.datasets.load_mnist(args.mnist)
else:  # uint8 images as tfds gives them; the tutorial's scale() divides by 255
    (x_train, y_train), (x_test, y_test) = mf.datasets.load_digits(image_size=28)
    x_train, x_test = (np.round(x_train * 255).astype(np.uint8), np.round(x_test * 255).astype(np.uint8))
if args.train_examples:
    x_train, y_train = x_train[:args.train_examples], y_train[:args.train_examples]
datasets = {"train": (x_train, y_train), "test": (x_test, y_test)}

# ---- the tutorial -----------------------------------------------------------------------------
BUFFER_SIZE = 10000
BATCH_SIZE = 64


def input_fn(mode, input_context=None):
    mnist_dataset = mf.data.Dataset.from_tensor_slices(datasets["train"] if mode == mf.estimator.ModeKeys.TRAIN
                                                       else datasets["test"])

    def scale(image, label):
        image = image.float()
        image /= 255
        return image, label

    if input_context:
        mnist_dataset = mnist_dataset.shard(input_context.num_input_pipelines,
                                            input_context.input_pipeline_id)
    return mnist_dataset.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)


LEARNING_RATE = args.learning_rate


def model_fn(features, labels, mode):
    model = mf.estimator.once(lambda: nn.Sequential(
        nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 32, 3), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.LazyLinear(64), nn.ReLU(),
        nn.Linear(64, 10)
    ))
    logits = model(features)

    if mode == mf.estimator.ModeKeys.PREDICT:
        predictions = {'logits': logits}
        return mf.estimator.EstimatorSpec(mode, predictions=predictions)

    optimizer = mf.estimator.once(lambda: mf.optimizers.SGD(
        learning_rate=LEARNING_RATE))
    loss = mf.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none")(labels, logits)
    loss = loss.sum() * (1. / BATCH_SIZE)
    if mode == mf.estimator.ModeKeys.EVAL:
        return mf.estimator.EstimatorSpec(mode, loss=loss)

    return mf.estimator.EstimatorSpec(
        mode=mode,
        loss=loss,
        train_op=optimizer.minimize(
            loss, mf.estimator.get_or_create_global_step()))


strategy = mf.MultiWorkerMirroredStrategy()
config = mf.estimator.RunConfig(train_distribute=strategy)
# ---- end of the tutorial's code; test knobs below -------------------------------------------------
if args.save_checkpoints_steps:
    config = config.replace(save_checkpoints_steps=args.save_checkpoints_steps)
config = config.replace(keep_checkpoint_max=args.keep_checkpoint_max, log_step_count_steps=args.log_steps)


class KillAtStep(mf.estimator.SessionRunHook):
    """Fault injection for the tests: worker 1 dies (SIGKILL) at a step, in the first round only."""

    def before_run(self, run_context):
        return mf.estimator.SessionRunArgs("global_step")

    def after_run(self, run_context, run_values):
        if run_values.results >= args.kill_worker_at_step:
            os.kill(os.getpid(), signal.SIGKILL)


hooks = []
if (args.kill_worker_at_step is not None and config.task_type == "worker" and config.task_id == 1
        and os.environ.get("MESHFIT_RESTART_COUNT", "0") == "0"):
    hooks.append(KillAtStep())

classifier = mf.estimator.Estimator(
    model_fn=model_fn, model_dir=args.model_dir, config=config)
result = mf.estimator.train_and_evaluate(
    classifier,
    train_spec=mf.estimator.TrainSpec(input_fn=input_fn, max_steps=args.max_steps, hooks=hooks),
    eval_spec=mf.estimator.EvalSpec(input_fn=input_fn, steps=args.eval_steps, throttle_secs=args.throttle_secs,
                                    start_delay_secs=args.start_delay_secs)
)
eval_result, _ = result  # (None, []) on a training worker of a cluster: the evaluator task evaluates
if eval_result is not None:
    print(f"{config.task_type or 'local'} {config.task_id}: evaluation of the final checkpoint: {eval_result}")

if args.results:
    results = {"task": [config.task_type, config.task_id], "train_and_evaluate": result[0]}
    if config.task_type != "evaluator":
        results["evaluate"] = classifier.evaluate(input_fn, steps=args.eval_steps)
        predictions = list(classifier.predict(input_fn))
        results["predictions"] = {"count": len(predictions), "keys": sorted(predictions[0]),
                                  "logits_shape": list(predictions[0]["logits"].shape)}
    with open(f"{args.results}.{config.task_type}{config.task_id}.json", "w") as file:
        json.dump(results, file)
