"""Seed 002's Estimator flow with the seed's unseeded ``shuffle``: ``uninterrupted`` trains to step 10;
``interrupted`` raises at step 5 from a hook, then a new Estimator in the same process continues.
Prints the final weights as JSON. Each ``input_fn`` call draws a new shuffle seed; the resume must
read the order the checkpoint saved."""

import json
import os
import sys

import numpy as np
import torch
from torch import nn

import meshfit as mf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for its helpers
from _interrupt import InterruptHook  # noqa: E402

mode_name, model_dir = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
x = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int64)


def input_fn(mode):
    return mf.data.Dataset.from_tensor_slices((x, y)).shuffle(96).repeat().batch(8)  # no seed, as the seed


def model_fn(features, labels, mode):
    model = mf.estimator.once(lambda: nn.Linear(4, 2))
    optimizer = mf.estimator.once(lambda: mf.optimizers.Adam(learning_rate=0.05))
    loss = nn.functional.cross_entropy(model(features), labels)
    return mf.estimator.EstimatorSpec(mode, loss=loss, train_op=optimizer.minimize(loss))


def estimator():
    config = mf.estimator.RunConfig(tf_random_seed=0, save_checkpoints_steps=1, log_step_count_steps=None)
    return mf.estimator.Estimator(model_fn, model_dir=model_dir, config=config)


if mode_name == "interrupted":
    try:
        estimator().train(input_fn, hooks=[InterruptHook()], max_steps=10)
    except RuntimeError as error:
        print(f"raised: {error}")
classifier = estimator()
classifier.train(input_fn, max_steps=10)
print(json.dumps({n: classifier.get_variable_value(n).tolist() for n in classifier.get_variable_names()}))
