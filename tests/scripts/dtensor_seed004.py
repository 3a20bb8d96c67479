"""Seed 004 ("DTensor with Keras") as written: its names, its order of calls, its train and eval steps.

Translated only where torch differs: ``tf.split`` is ``torch.tensor_split``, ``tf.GradientTape`` is
``torch.autograd.grad``, Keras layers are torch modules (``Dense(kernel_layout=...)`` is a torch
layer given its layouts with ``mf.dtensor.apply_layouts``), MNIST is the 8 x 8 digits, and a plain
module's ``training=`` flag is ``module.train(...)``. The loop runs four times in the same
processes: ``mf.Model`` and a plain module, each with the seed's per-layer layouts and with its
``LayoutMap``. ``--devices 0`` runs the per-layer loop in this one process without a mesh (the
reference). Writes ``<out>/results-<rank>.json``.

Runs as a plain ``python dtensor_seed004.py --out DIR`` (the mesh starts the other local process
itself, as ``MirroredStrategy`` does) or under ``meshfit launch --workers 2``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

import meshfit as mf
from meshfit import dtensor

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--steps", type=int, default=6)
cli = parser.parse_args()
os.makedirs(cli.out, exist_ok=True)
torch.set_num_threads(1)

devices = [f"CPU:{i}" for i in range(cli.devices)]
mesh = dtensor.create_mesh([("batch", cli.devices)], devices=devices) if cli.devices else None
rank = mesh.device_mesh.get_rank() if mesh is not None else 0

# ---- the data: MNIST becomes the 8 x 8 digits, batched by the global batch ---------------------
(x, y), (x_test, y_test) = mf.datasets.load_digits()
batch_size = 16
images_all = torch.from_numpy(x[: batch_size * cli.steps].reshape(-1, 8, 8, 1) / 16.0).float()
labels_all = torch.from_numpy(y[: batch_size * cli.steps].astype("int64"))
ds_train = [(images_all[i:i + batch_size], labels_all[i:i + batch_size])
            for i in range(0, len(images_all), batch_size)]
ds_test = [(torch.from_numpy(x_test[:32].reshape(-1, 8, 8, 1) / 16.0).float(),
            torch.from_numpy(y_test[:32].astype("int64")))]


def sparse_categorical_crossentropy(y, logits, from_logits=True):
    return mf.losses.SparseCategoricalCrossentropy(from_logits=from_logits, reduction="none")(y, logits)


def call(model, x, training):
    """``model(x, training=...)``: a plain torch module takes the flag as its mode."""
    if isinstance(model, mf.Model):
        return model(x, training=training)
    model.train(training)
    return model(x)


def trainable_variables(model):
    return model.trainable_variables if isinstance(model, mf.Model) else \
        [p for p in model.parameters() if p.requires_grad]


def train_step(model, x, y, optimizer, metrics):
    logits = call(model, x, training=True)
    # torch.sum sums the batch sharded per-example loss to a replicated global loss (scalar).
    loss = torch.sum(sparse_categorical_crossentropy(y, logits, from_logits=True))

    gradients = torch.autograd.grad(loss, trainable_variables(model))
    optimizer.apply_gradients(zip(gradients, trainable_variables(model), strict=True))

    for metric in metrics.values():
        metric.update_state(y_true=y, y_pred=logits)

    loss_per_sample = loss / len(x)
    results = {'loss': loss_per_sample}
    return results


def eval_step(model, x, y, metrics):
    with torch.no_grad():
        logits = call(model, x, training=False)
        loss = torch.sum(sparse_categorical_crossentropy(y, logits, from_logits=True))

    for metric in metrics.values():
        metric.update_state(y_true=y, y_pred=logits)

    loss_per_sample = loss / len(x)
    results = {'eval_loss': loss_per_sample}
    return results


def pack_dtensor_inputs(images, labels, image_layout, label_layout):
    num_local_devices = image_layout.mesh.num_local_devices()
    images = torch.tensor_split(images, num_local_devices)
    labels = torch.tensor_split(labels, num_local_devices)
    images = dtensor.pack(images, image_layout)
    labels = dtensor.pack(labels, label_layout)
    return images, labels


class SubclassedModel(nn.Module):

    def __init__(self, name=None):
        super().__init__()
        self.feature = nn.Linear(64, 16)
        self.feature_2 = nn.Linear(16, 24)
        self.dropout = nn.Dropout(0.1)

    def forward(self, inputs):
        x = self.feature(inputs.flatten(1))
        x = self.dropout(x)
        return self.feature_2(x)


def build(kind, spelling):
    """The seed's two ways of giving layouts; ``kind`` wraps the module in mf.Model or not."""
    torch.manual_seed(1337)  # tf.keras.utils.set_random_seed(1337): every client the same seed
    if spelling == "per_layer":
        if mesh is None:
            module = nn.Sequential(OrderedDict(flatten=nn.Flatten(), d1=nn.Linear(64, 128), relu=nn.ReLU(),
                                               d2=nn.Linear(128, 10)))
            return mf.Model(module) if kind == "model" else module
        unsharded_layout_2d = dtensor.Layout.replicated(mesh, 2)
        unsharded_layout_1d = dtensor.Layout.replicated(mesh, 1)
        module = nn.Sequential(OrderedDict(
            flatten=nn.Flatten(),
            d1=dtensor.apply_layouts(nn.Linear(64, 128), {"weight": unsharded_layout_2d,
                                                          "bias": unsharded_layout_1d}),
            relu=nn.ReLU(),
            d2=dtensor.apply_layouts(nn.Linear(128, 10), {"weight": unsharded_layout_2d,
                                                          "bias": unsharded_layout_1d}),
        ))
        return mf.Model(module) if kind == "model" else module
    layout_map = dtensor.LayoutMap(mesh=mesh)
    layout_map['feature.*weight'] = dtensor.Layout.batch_sharded(mesh, 'batch', rank=2)
    layout_map['feature.*bias'] = dtensor.Layout.batch_sharded(mesh, 'batch', rank=1)
    with layout_map.scope():
        subclassed_model = mf.Model(SubclassedModel()) if kind == "model" else SubclassedModel()
    return subclassed_model


def module_of(model):
    return model.module if isinstance(model, mf.Model) else model


def run(kind, spelling):
    model = build(kind, spelling)
    record = {"layouts": {}}
    if mesh is not None:
        record["layouts"] = {path: p.layout.to_string() for path, p in module_of(model).named_parameters()}
        record["kinds"] = sorted({type(p).__mro__[1].__name__ for p in module_of(model).parameters()})
    if spelling == "layout_map":  # the seed calls the model on a copy_to_mesh input first
        unsharded_layout_2d = dtensor.Layout.replicated(mesh, 2)
        dtensor_input = dtensor.copy_to_mesh(torch.zeros((16, 64)), layout=unsharded_layout_2d)
        call(model, dtensor_input, training=False)
        record["feature_kernel_layout"] = module_of(model).feature.weight.layout.to_string()
    optimizer = mf.optimizers.Adam(0.01, mesh=mesh)
    metrics = {'accuracy': mf.metrics.SparseCategoricalAccuracy(mesh=mesh)}
    eval_metrics = {'eval_accuracy': mf.metrics.SparseCategoricalAccuracy(mesh=mesh)}

    num_epochs = 2
    if mesh is not None:
        image_layout = dtensor.Layout.batch_sharded(mesh, 'batch', rank=4)
        label_layout = dtensor.Layout.batch_sharded(mesh, 'batch', rank=1)
    losses = []
    for epoch in range(num_epochs):
        print("============================")
        print("Epoch: ", epoch)
        for metric in metrics.values():
            metric.reset_state()
        step = 0
        results = {}
        pbar = mf.callbacks.Progbar(target=None, stateful_metrics=[], stream=io.StringIO())
        for input in ds_train:
            images, labels = input[0], input[1]
            if mesh is not None:
                images, labels = pack_dtensor_inputs(images, labels, image_layout, label_layout)

            results.update(train_step(model, images, labels, optimizer, metrics))
            for metric_name, metric in metrics.items():
                results[metric_name] = metric.result()

            pbar.update(step, values=[(k, _number(v)) for k, v in results.items()], finalize=False)
            losses.append(_number(results["loss"]))
            step += 1
        pbar.update(step, values=[(k, _number(v)) for k, v in results.items()], finalize=True)

        for metric in eval_metrics.values():
            metric.reset_state()
        for input in ds_test:
            images, labels = input[0], input[1]
            if mesh is not None:
                images, labels = pack_dtensor_inputs(images, labels, image_layout, label_layout)
            results.update(eval_step(model, images, labels, eval_metrics))

        for metric_name, metric in eval_metrics.items():
            results[metric_name] = metric.result()

        for metric_name, metric in results.items():
            print(f"{metric_name}: {_number(metric)}")
    record.update(losses=losses, results={k: _number(v) for k, v in results.items()},
                  weights=[_full(p).tolist() for p in module_of(model).parameters()])
    return record


def _number(value):
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def _full(param):
    value = param.full_tensor() if hasattr(param, "full_tensor") else param
    return np.asarray(value.detach().numpy(), dtype="float64")


combos = [("model", "per_layer"), ("plain", "per_layer")]
if mesh is not None:
    combos += [("model", "layout_map"), ("plain", "layout_map")]
records = {f"{kind}/{spelling}": run(kind, spelling) for kind, spelling in combos}
with open(os.path.join(cli.out, f"results-{rank}.json"), "w") as f:
    json.dump(records, f)
print("done")
