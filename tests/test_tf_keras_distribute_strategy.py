"""tf-keras's distribute_strategy_test.py, the cases that run on two CPU replicas, on 2 gloo workers.

Source: keras-team/tf-keras at commit dd0a7237b9b24132dba3f491f3c84b0094ab796e,
tf_keras/distribute/distribute_strategy_test.py. Each case keeps its assertions (values, counts,
batch indices, error types and words); models, tensors and datasets are translated (``Dense`` is
``nn.Linear``, ``tf.data`` is ``mf.data.Dataset``, a ``tf.compat.v1`` optimizer its Keras
counterpart). All cases run in ONE 2-process job (``MultiWorkerMirroredStrategy`` over gloo, each
worker one CPU replica); each case is reported as its own test below.

Cases in the source: 61 test methods. Not ported (no meshfit counterpart, or TF internals):
the 4 ``test_calculating_input_params_*`` (``distributed_training_utils_v1.get_input_params``, a TF1
helper), mixed-precision operator overloads and ``test_calling_model_with_mixed_precision`` (Keras
``LossScaleOptimizer`` graph internals), ``test_optimizer_in_cross_replica_context_raises_error`` (TF
replica contexts), nested numpy/dict-of-dataset functional-input cases (Keras functional ``Input``
names), ``test_no_target_model`` and the ``add_loss`` / ``add_metric`` cases (Keras layer APIs
torch modules do not have), sparse and ragged outputs, the unknown-cardinality cases (``Dataset.filter``),
``test_dataset_wrong_input_shape`` / ``test_dataset_external_batch_input_validation`` (Keras input
specs), ``test_learning_phase_value``, ``test_custom_gradient_transformation``
(``gradient_transformers``), ``test_regularizer_loss``, shard-option files, TPU and
parameter-server cases, the two ``test_fit_and_evaluate`` correctness suites and ``test_optimizer``
(Keras-v1/TPU combinations).

Ported: 25 cases (``CASES`` below; ``test_fit_eval_and_predict_with_optimizer`` once per meshfit
optimizer of the source's multi-worker list: adagrad, adam, sgd, rmsprop; the loss-reduction case once per
meshfit reduction: sum_over_batch_size, sum). Passing: 21 of 25 (84 %). Listed differences (``LISTED``,
docs/fragments/keras.md), asserted as the source has them and checked to still differ:
- ``test_gradient_clipping``: tf-keras applies ``clipnorm=2.0`` and ``clipvalue=2.0`` together; meshfit,
  as Keras 3, takes one clipping argument at a time and raises ValueError naming both.
- ``test_host_training_loop_last_partial_execution``, ``test_host_training_loop_truncate_to_epoch``:
  tf-keras ends a last, partial execution at its true last batch (49); meshfit follows Keras 3's
  nominal index (``begin + steps_per_execution - 1``: 59, 499), where Keras 3 and tf-keras disagree.
- ``test_distribution_strategy_with_loss_reduction_types[sum]``: TF sums the replicas' gradients for a
  ``SUM`` loss; meshfit averages them (the global mean's gradient), so a ``reduction="sum"`` loss under
  several replicas would train with 1/N of the gradient: it raises ValueError with the fix instead.
"""

from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf
from tests._multiproc import run_distributed

_INPUT = 3


# ---- models and data (the source's helpers, translated) -------------------------------------------
def get_model() -> nn.Module:
    module = nn.Linear(3, 4)  # Input((3,)) -> Dense(4): Keras's bias starts at zeros
    with torch.no_grad():
        module.bias.zero_()
    return module


def get_sample_weights_model() -> nn.Module:
    module = nn.Linear(1, 1)
    with torch.no_grad():
        module.weight.fill_(1.0)
        module.bias.zero_()
    return module


class MultiInputOutput(nn.Module):
    """multi_input_output_model: inputs a (3) and b (5); outputs dense_2(b) and dropout(dense_1(a))."""

    def __init__(self) -> None:
        super().__init__()
        self.dense_1, self.dense_2, self.dropout = nn.Linear(3, 7), nn.Linear(5, 7), nn.Dropout(0.5)

    def forward(self, inputs):
        a, b = inputs
        return self.dense_2(b), self.dropout(self.dense_1(a))


class SimpleMultiInputsMultiOutputs(nn.Module):
    """simple_multi_inputs_multi_outputs_model: concat(input_a, input_b) -> softmax Dense(3), Dense(2)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense_2, self.dense_3 = nn.Linear(32, 3), nn.Linear(32, 2)

    def forward(self, inputs):
        merged = torch.cat([inputs["input_a"], inputs["input_b"]], dim=-1)
        return torch.softmax(self.dense_2(merged), -1), torch.softmax(self.dense_3(merged), -1)


def get_dataset() -> mf.data.Dataset:
    inputs, targets = np.zeros((10, 3), np.float32), np.zeros((10, 4), np.float32)
    return mf.data.Dataset.from_tensor_slices((inputs, targets)).repeat(100).batch(10)


def get_predict_dataset() -> mf.data.Dataset:
    return mf.data.Dataset.from_tensor_slices(np.zeros((10, 3), np.float32)).repeat(100).batch(10)


def local_model(module: nn.Module, *args, **kwargs) -> mf.Model:
    """The source's model built outside the strategy: in meshfit an explicit one-device strategy (a model of
    no strategy cannot fit in a 2-process job: meshfit refuses it, so that no worker trains alone)."""
    with mf.OneDeviceStrategy("cpu").scope():
        return compiled(module, *args, **kwargs)


def compiled(module: nn.Module, optimizer, loss="mse", metrics=None, **kwargs) -> mf.Model:
    model = mf.Model(module)
    model.compile(optimizer, loss, metrics=metrics, **kwargs)
    return model


class BatchCountingCB(mf.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.train_begin_batches, self.train_end_batches = [], []
        self.test_begin_batches, self.test_end_batches = [], []
        self.predict_begin_batches, self.predict_end_batches = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.train_begin_batches.append(batch)

    def on_train_batch_end(self, batch, logs=None):
        self.train_end_batches.append(batch)

    def on_test_batch_begin(self, batch, logs=None):
        self.test_begin_batches.append(batch)

    def on_test_batch_end(self, batch, logs=None):
        self.test_end_batches.append(batch)

    def on_predict_batch_begin(self, batch, logs=None):
        self.predict_begin_batches.append(batch)

    def on_predict_batch_end(self, batch, logs=None):
        self.predict_end_batches.append(batch)


def close(a, b, atol=1e-5, rtol=1e-5):
    if isinstance(a, dict):
        assert sorted(a) == sorted(b)
        for key in a:
            close(a[key], b[key], atol, rtol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            close(x, y, atol, rtol)
    else:
        np.testing.assert_allclose(a, b, atol=atol, rtol=rtol)


# ---- the cases: each runs on both workers inside the strategy's scope -----------------------------
def case_calling_model_with_numpy_arrays(strategy):
    with strategy.scope():
        model = compiled(get_model(), mf.optimizers.SGD(0.001), "mse", ["mae"])
    inputs, targets = np.zeros((64, 3), np.float32), np.zeros((64, 4), np.float32)
    model.fit(inputs, targets, epochs=1, batch_size=2, verbose=0, validation_data=(inputs, targets))
    model.evaluate(inputs, targets, verbose=0)
    model.evaluate(inputs, targets, batch_size=8, verbose=0)
    model.predict(inputs, verbose=0)
    model.predict(inputs, batch_size=8, verbose=0)


def case_numpy_with_sample_weights(strategy):
    with strategy.scope():
        model = compiled(get_sample_weights_model(), mf.optimizers.RMSprop(learning_rate=0.001), "mse")
    inputs = np.array([[0], [1], [2], [3]], np.float32)
    targets = np.array([[2], [4], [6], [8]], np.float32)
    sample_weights = np.array([0.25, 0.5, 0.75, 1], np.float32)
    result = model.evaluate(inputs, targets, batch_size=2, sample_weight=sample_weights, verbose=0)
    close(result, 10.625)
    result = model.evaluate(inputs, targets, batch_size=2, verbose=0)
    close(result, 13.5)


def case_flatten_predict_outputs(strategy):
    with strategy.scope():
        model = compiled(MultiInputOutput(), mf.optimizers.SGD(learning_rate=0.001), "mse")
    rng = np.random.default_rng(0)
    inputs = [rng.random((6, 3), dtype=np.float32), rng.random((6, 5), dtype=np.float32)]
    outs = model.predict(inputs, verbose=0)
    assert len(outs) == 2
    assert list(outs[0].shape) == [6, 7]
    assert list(outs[1].shape) == [6, 7]


def _partial_batch_models(strategy, metrics=None):
    with strategy.scope():
        model_with_ds_strategy = compiled(get_model(), mf.optimizers.SGD(0.001), "mse", metrics)
    cpu_model = local_model(get_model(), mf.optimizers.SGD(0.001), "mse", metrics)
    cpu_model.set_weights(model_with_ds_strategy.get_weights())
    return model_with_ds_strategy, cpu_model


def case_evaluate_with_partial_batch(strategy):
    for batch_size in (None, 4):  # the source's batch_size parameter ([None] on CPU strategies, 4 on TPU)
        model_with_ds_strategy, cpu_model = _partial_batch_models(strategy, ["mae", "categorical_accuracy"])
        rng = np.random.default_rng(1)
        x, y = rng.random((10, 3), dtype=np.float32), rng.random((10, 4), dtype=np.float32)
        evaluate_ground_truth = cpu_model.evaluate(x, y, batch_size=10, verbose=0)
        steps = int(np.ceil(10.0 / (batch_size or 32)))
        close(model_with_ds_strategy.evaluate(x, y, batch_size=batch_size, steps=steps, verbose=0)[1:],
              evaluate_ground_truth[1:])
        close(model_with_ds_strategy.evaluate(x, y, batch_size=batch_size, verbose=0)[1:], evaluate_ground_truth[1:])


def case_predict_with_partial_batch(strategy):
    model_with_ds_strategy, cpu_model = _partial_batch_models(strategy)
    inputs = np.random.default_rng(2).random((10, 3), dtype=np.float32)
    predict_ground_truth = cpu_model.predict(inputs, batch_size=10, verbose=0)
    close(model_with_ds_strategy.predict(inputs, batch_size=4, steps=3, verbose=0), predict_ground_truth)
    close(model_with_ds_strategy.predict(inputs, batch_size=4, verbose=0), predict_ground_truth)


def _multi_inputs_data():
    rng = np.random.default_rng(1337)
    return {"input_a": rng.random((200, 16), dtype=np.float32), "input_b": rng.random((200, 16), dtype=np.float32)}


def case_predict_multi_output_model_with_partial_batch(strategy):
    with strategy.scope():
        model_with_ds_strategy = compiled(SimpleMultiInputsMultiOutputs(), mf.optimizers.SGD(0.001), "mse")
    cpu_model = local_model(SimpleMultiInputsMultiOutputs(), mf.optimizers.SGD(0.001), "mse")
    input_dict = _multi_inputs_data()
    cpu_model.set_weights(model_with_ds_strategy.get_weights())
    close(model_with_ds_strategy.predict(input_dict, batch_size=18, steps=12, verbose=0),
          cpu_model.predict(input_dict, batch_size=200, verbose=0), atol=1e-4, rtol=1e-4)


class DenseWithExtraWeight(nn.Module):
    """Dense(4) with two extra weights whose gradients are None, in the source's weight order
    (extra_weight_1, kernel, bias, extra_weight_2): ``get_weights()[1]`` is the kernel."""

    def __init__(self) -> None:
        super().__init__()
        dense = nn.Linear(4, 4)
        self.extra_weight_1 = nn.Parameter(torch.ones(()))
        self.kernel = nn.Parameter(dense.weight.detach().t().clone())  # Keras's (in, out) kernel
        self.bias = nn.Parameter(torch.zeros(4))
        self.extra_weight_2 = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x @ self.kernel + self.bias


def case_gradients_are_none(strategy):
    with strategy.scope():
        model = compiled(DenseWithExtraWeight(), "adam", "mse")
    rng = np.random.default_rng(3)
    inputs, targets = rng.normal(size=(64, 4)).astype("float32"), rng.normal(size=(64, 4)).astype("float32")
    old_kernel = model.get_weights()[1]
    model.fit(inputs, targets, verbose=0)
    new_kernel = model.get_weights()[1]
    assert not np.array_equal(old_kernel, new_kernel)


def case_calling_model_on_same_dataset(strategy):
    with strategy.scope():
        model = compiled(get_model(), mf.optimizers.SGD(0.001), "mse", ["mae", "categorical_accuracy"])
    dataset = get_dataset()
    for _ in range(2):
        model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0, validation_data=dataset, validation_steps=2)
    model.predict(get_predict_dataset(), steps=2, verbose=0)


def case_fit_eval_and_predict_methods_on_dataset_without_steps(strategy):
    with strategy.scope():
        model = compiled(get_model(), mf.optimizers.SGD(0.001), "mse", ["mae", "categorical_accuracy"])
    inputs, targets = np.zeros((1000, 3), np.float32), np.zeros((1000, 4), np.float32)
    fit_with_numpy = model.fit(inputs, targets, epochs=1, batch_size=10, verbose=0).history
    eval_with_numpy = model.evaluate(inputs, targets, batch_size=10, verbose=0)
    predict_with_numpy = model.predict(inputs, batch_size=10, verbose=0)
    dataset = mf.data.Dataset.from_tensor_slices((inputs, targets)).batch(10, drop_remainder=True)
    fit_with_ds = model.fit(dataset, epochs=1, verbose=0).history
    eval_with_ds = model.evaluate(dataset, verbose=0)
    predict_dataset = mf.data.Dataset.from_tensor_slices(inputs).batch(10, drop_remainder=True)
    predict_with_ds = model.predict(predict_dataset, verbose=0)
    close(fit_with_numpy, fit_with_ds, atol=1e-4, rtol=1e-4)
    close(eval_with_numpy, eval_with_ds, atol=1e-4, rtol=1e-4)
    close(predict_with_numpy, predict_with_ds, atol=1e-4, rtol=1e-4)


def case_fit_eval_and_predict_methods_on_dataset(strategy):
    with strategy.scope():
        model = compiled(get_model(), mf.optimizers.SGD(0.001), "mse", ["mae", "categorical_accuracy"])
    dataset = get_dataset()
    model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
    model.evaluate(dataset, steps=2, verbose=0)
    model.predict(get_predict_dataset(), steps=2, verbose=0)


def _with_optimizer(name):
    def case(strategy):
        with strategy.scope():
            model = compiled(get_model(), mf.optimizers.get(name), "mse")
        dataset = get_dataset()
        model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
        model.evaluate(dataset, steps=2, verbose=0)
        model.predict(get_predict_dataset(), steps=2, verbose=0)
    return case


def case_optimizer_with_callbacks(strategy):  # testOptimizerWithCallbacks
    with strategy.scope():
        model = compiled(get_model(), mf.optimizers.SGD(0.01), "mse")
    model.fit(get_dataset(), epochs=1, steps_per_epoch=2, verbose=0,
              callbacks=[mf.callbacks.LearningRateScheduler(lambda _: 0.001)])
    close(0.001, model.optimizer.learning_rate)


def case_evaluate_with_dataset_with_partial_batch(strategy):
    model_with_ds_strategy, cpu_model = _partial_batch_models(strategy, ["mae", "categorical_accuracy"])
    rng = np.random.default_rng(4)
    x, y = rng.random((10, 3), dtype=np.float32), rng.random((10, 4), dtype=np.float32)
    dataset_with_partial_batch = mf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    steps = int(np.ceil(10.0 / 4))
    close(model_with_ds_strategy.evaluate(dataset_with_partial_batch, steps=steps, verbose=0)[1:],
          cpu_model.evaluate(dataset_with_partial_batch, steps=steps, verbose=0)[1:])
    close(model_with_ds_strategy.evaluate(dataset_with_partial_batch, verbose=0)[1:],
          cpu_model.evaluate(dataset_with_partial_batch, verbose=0)[1:])


def case_predict_with_dataset_with_partial_batch(strategy):
    model_with_ds_strategy, cpu_model = _partial_batch_models(strategy)
    inputs = np.random.default_rng(5).random((10, 3), dtype=np.float32)
    dataset_with_partial_batch = mf.data.Dataset.from_tensor_slices(inputs).batch(4)
    close(model_with_ds_strategy.predict(dataset_with_partial_batch, steps=3, verbose=0),
          cpu_model.predict(dataset_with_partial_batch, steps=3, verbose=0))


def case_predict_multi_output_model_with_dataset_with_partial_batch(strategy):
    with strategy.scope():
        model_with_ds_strategy = compiled(SimpleMultiInputsMultiOutputs(), mf.optimizers.SGD(0.001), "mse")
    cpu_model = local_model(SimpleMultiInputsMultiOutputs(), mf.optimizers.SGD(0.001), "mse")
    dataset_with_partial_batch = mf.data.Dataset.from_tensor_slices(_multi_inputs_data()).batch(18)
    cpu_model.set_weights(model_with_ds_strategy.get_weights())
    close(model_with_ds_strategy.predict(dataset_with_partial_batch, steps=12, verbose=0),
          cpu_model.predict(dataset_with_partial_batch, steps=12, verbose=0), atol=1e-4, rtol=1e-4)


class ChannelsLastConv(nn.Module):
    """Input((10, 10, 3)) -> Conv2D(3, kernel_size=3) -> Flatten -> Dense(1), channels last as Keras."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.dense = nn.Conv2d(3, 3, 3), nn.Linear(8 * 8 * 3, 1)

    def forward(self, x):
        return self.dense(self.conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1).flatten(1))


def case_host_training_loop(strategy):
    with strategy.scope():
        model = compiled(ChannelsLastConv(), "sgd", "mse", steps_per_execution=10)
    bc = BatchCountingCB()
    x, y = np.ones((100, 10, 10, 3), np.float32), np.ones((100, 1), np.float32)
    model.fit(x, y, batch_size=2, epochs=1, callbacks=[bc], verbose=0)
    assert bc.train_begin_batches == [0, 10, 20, 30, 40]
    assert bc.train_end_batches == [9, 19, 29, 39, 49]
    model.evaluate(x, y, batch_size=2, callbacks=[bc], verbose=0)
    assert bc.test_begin_batches == [0, 10, 20, 30, 40]
    assert bc.test_end_batches == [9, 19, 29, 39, 49]
    model.predict(x, batch_size=2, callbacks=[bc], verbose=0)
    assert bc.predict_begin_batches == [0, 10, 20, 30, 40]
    assert bc.predict_end_batches == [9, 19, 29, 39, 49]


def case_host_training_loop_last_partial_execution(strategy):
    with strategy.scope():
        model = compiled(nn.Linear(10, 1), "sgd", "mse", steps_per_execution=20)
    bc = BatchCountingCB()
    x, y = np.ones((100, 10), np.float32), np.ones((100, 1), np.float32)
    model.fit(x, y, batch_size=2, epochs=1, callbacks=[bc], verbose=0)
    assert bc.train_begin_batches == [0, 20, 40]
    assert bc.train_end_batches == [19, 39, 49]
    model.evaluate(x, y, batch_size=2, callbacks=[bc], verbose=0)
    assert bc.test_begin_batches == [0, 20, 40]
    assert bc.test_end_batches == [19, 39, 49]
    model.predict(x, batch_size=2, callbacks=[bc], verbose=0)
    assert bc.predict_begin_batches == [0, 20, 40]
    assert bc.predict_end_batches == [19, 39, 49]


def case_host_training_loop_truncate_to_epoch(strategy):
    with strategy.scope():
        model = compiled(nn.Linear(10, 1), "sgd", "mse", steps_per_execution=500)
    x, y = np.ones((100, 10), np.float32), np.ones((100, 1), np.float32)
    bc = BatchCountingCB()
    model.fit(x, y, batch_size=2, epochs=2, callbacks=[bc], verbose=0)
    assert bc.train_begin_batches == [0, 0]
    assert bc.train_end_batches == [49, 49]
    x, y = np.ones((50, 10), np.float32), np.ones((50, 1), np.float32)
    model.evaluate(x, y, batch_size=2, callbacks=[bc], verbose=0)
    assert bc.test_begin_batches == [0]
    assert bc.test_end_batches == [24]
    model.predict(np.ones((50, 10), np.float32), batch_size=2, callbacks=[bc], verbose=0)
    assert bc.predict_begin_batches == [0]
    assert bc.predict_end_batches == [24]


class TwoVariables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.v1, self.v2 = nn.Parameter(torch.tensor(1.0)), nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return (3 * self.v1 - 3 * self.v2).expand(x.shape[0], 1)


def case_gradient_clipping(strategy):
    x, y = np.ones((10, 1), np.float32), np.ones((10, 1), np.float32)
    with strategy.scope():
        layer = TwoVariables()
        model = compiled(layer, mf.optimizers.SGD(1.0, clipnorm=2.0, clipvalue=2.0), "mae")
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    close(layer.v1.item(), 3.0)
    close(layer.v2.item(), -1.0)


def case_distribution_strategy_one_dimensional(strategy):
    with strategy.scope():
        module = nn.Sequential(nn.Linear(10, 3), nn.Softmax(-1))
        model = compiled(module, "rmsprop", "sparse_categorical_crossentropy", ["sparse_categorical_accuracy"])
    rng = np.random.default_rng(6)
    x, y = rng.random((64, 10), dtype=np.float32), rng.integers(3, size=64)
    model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)


def _loss_reduction_case(reduction):
    def case(strategy):
        rng = np.random.default_rng(1337)

        def _get_model():
            module = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 1))
            with torch.no_grad():
                for layer in module:
                    layer.weight.zero_()
                    layer.bias.zero_()
            return module

        x, y = rng.random((64, 10), dtype=np.float32), rng.random((64, 1), dtype=np.float32)
        dataset = mf.data.Dataset.from_tensor_slices((x, y)).batch(32)
        with mf.OneDeviceStrategy("cpu").scope():  # the source's model outside any strategy
            model = compiled(_get_model(), "sgd", mf.losses.MeanSquaredError(reduction=reduction))
        history = model.fit(dataset, steps_per_epoch=2, epochs=1, shuffle=False, verbose=0)
        with strategy.scope():
            ds_model = compiled(_get_model(), "sgd", mf.losses.MeanSquaredError(reduction=reduction))
        ds_history = ds_model.fit(dataset, steps_per_epoch=2, epochs=1, shuffle=False, verbose=0)
        close(history.history["loss"], ds_history.history["loss"], atol=1e-5, rtol=0)
    return case


CASES = {
    "test_calling_model_with_numpy_arrays": case_calling_model_with_numpy_arrays,
    "test_numpy_with_sample_weights": case_numpy_with_sample_weights,
    "test_flatten_predict_outputs": case_flatten_predict_outputs,
    "test_evaluate_with_partial_batch": case_evaluate_with_partial_batch,
    "test_predict_with_partial_batch": case_predict_with_partial_batch,
    "test_predict_multi_output_model_with_partial_batch": case_predict_multi_output_model_with_partial_batch,
    "test_gradients_are_none": case_gradients_are_none,
    "test_calling_model_on_same_dataset": case_calling_model_on_same_dataset,
    "test_fit_eval_and_predict_methods_on_dataset_without_steps":
        case_fit_eval_and_predict_methods_on_dataset_without_steps,
    "test_fit_eval_and_predict_methods_on_dataset": case_fit_eval_and_predict_methods_on_dataset,
    **{f"test_fit_eval_and_predict_with_optimizer[{name}]": _with_optimizer(name)
       for name in ("adagrad", "adam", "sgd", "rmsprop")},
    "testOptimizerWithCallbacks": case_optimizer_with_callbacks,
    "test_evaluate_with_dataset_with_partial_batch": case_evaluate_with_dataset_with_partial_batch,
    "test_predict_with_dataset_with_partial_batch": case_predict_with_dataset_with_partial_batch,
    "test_predict_multi_output_model_with_dataset_with_partial_batch":
        case_predict_multi_output_model_with_dataset_with_partial_batch,
    "test_host_training_loop": case_host_training_loop,
    "test_host_training_loop_last_partial_execution": case_host_training_loop_last_partial_execution,
    "test_host_training_loop_truncate_to_epoch": case_host_training_loop_truncate_to_epoch,
    "test_gradient_clipping": case_gradient_clipping,
    "test_distribution_strategy_one_dimensional": case_distribution_strategy_one_dimensional,
    **{f"test_distribution_strategy_with_loss_reduction_types[{r}]": _loss_reduction_case(r)
       for r in ("sum_over_batch_size", "sum")},
}
LISTED = {"test_gradient_clipping", "test_host_training_loop_last_partial_execution",
          "test_host_training_loop_truncate_to_epoch", "test_distribution_strategy_with_loss_reduction_types[sum]"}  # differences, see the module docstring


def _run_all(rank: int, world: int) -> dict[str, str]:
    torch.manual_seed(0)
    np.random.seed(1337)
    strategy = mf.MultiWorkerMirroredStrategy()
    results = {}
    for name, case in CASES.items():
        torch.manual_seed(0)
        try:
            case(strategy)
            results[name] = "ok"
        except Exception:  # reported per case by the parent
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run_all, world_size=2, timeout=900)


@pytest.mark.parametrize("name", sorted(set(CASES) - LISTED))
def test_case_on_two_cpu_replicas(results, name):
    for rank, per_case in enumerate(results):
        assert per_case[name] == "ok", f"rank {rank}:\n{per_case[name]}"


@pytest.mark.parametrize("name", sorted(LISTED))
def test_listed_difference_still_differs(results, name):
    assert all(per_case[name] != "ok" for per_case in results), f"{name} passes now: move it out of LISTED"
