"""2-D parallelism: ``LayoutMap.fully_sharded(mesh)`` on ``[("batch", 2), ("model", 2)]`` with the attention
and MLP weights keyed on ``model`` (tensor parallel, then ``fully_shard`` over ``batch``), behind ``fit``.

On 4 gloo processes: ``fit`` equals one plain process on the same global batch (SGD and AdamW, 20
steps, the last batch uneven: 3 and 2 sequences on the two replicas), each keyed weight holds a
quarter of its rows or columns per process, evaluate/predict work, a mid-epoch backup resumes on
(2, 2) and reshards onto a plain process, and ``model.save`` writes full tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _two_d_model import (
    BATCH,
    D_MODEL,
    EXAMPLES,
    STEPS,
    VOCAB,
    assert_weights_match,
    data,
    max_rel,
    module,
    optimizer,
    scope,
)

from tests._multiproc import run_distributed

# 4 gloo processes a run, several runs a test, on a shared 2-core machine
pytestmark = [pytest.mark.timeout(1200), pytest.mark.crowded]


def _fit(rank, world, shape, name, backup_dir=None, epochs=1, clip=None):
    from torch.distributed.tensor import DTensor

    import meshfit as mf

    kwargs = {"global_clipnorm": clip} if clip else {}
    with scope(mf, shape):
        model = mf.Model(module())
        model.compile(optimizer=optimizer(mf, name, **kwargs),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data()
    callbacks = [mf.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)] if backup_dir else []
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    qkv, fc2 = model.module.layers[0].attn.qkv.weight, model.module.layers[0].mlp.fc2.weight
    local = [tuple(w.to_local().shape) if isinstance(w, DTensor) else tuple(w.shape) for w in (qkv, fc2)]
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    predicted = model.predict(x[:13], batch_size=BATCH, verbose=0)
    weights = model.get_weights()
    return weights, history.history["loss"], local, model.optimizer.iterations, evaluated, predicted, \
        _training_bytes(model, x)


def _training_bytes(model, x):
    """Bytes of parameters + gradients + optimizer state held by this process (local shards): the weights
    keyed on ``model`` and the others, each beside its replicated (whole) figure."""
    import re

    from torch.distributed.tensor import DTensor

    def local(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    model.module(torch.from_numpy(x[:4])).sum().backward()  # the gradients a step holds (fit frees them)
    state = model.optimizer.torch_optimizer.state
    out = {"keyed": [0, 0], "other": [0, 0]}
    for path, p in model.module.named_parameters():
        moments = [v for v in state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        kind = "keyed" if re.search(r"attn\.(qkv|out)\.weight|mlp\.fc[12]\.weight", path) else "other"
        out[kind][0] += local(p) + local(p.grad) + sum(local(v) for v in moments)
        out[kind][1] += (2 + len(moments)) * p.numel() * p.element_size()
    return out


@pytest.fixture(scope="module")
def plain():
    return {name: run_distributed(_fit, world_size=1, args=(None, name), timeout=300)[0] for name in ("sgd", "adamw")}


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_fit_on_a_two_by_two_mesh_equals_one_plain_process(name, plain):
    want = plain[name]
    results = run_distributed(_fit, world_size=4, args=((2, 2), name), timeout=400)
    for weights, losses, local, iterations, evaluated, predicted, held in results:
        # qkv (48, 16) split over model (rows) then batch: 12 rows; fc2 (16, 32) over model (cols), batch (rows)
        assert local == [(3 * D_MODEL // 4, D_MODEL), (D_MODEL // 2, D_MODEL)]
        assert iterations == STEPS
        assert_weights_match(weights, want[0], name)
        np.testing.assert_allclose(losses, want[1], rtol=1e-5)
        np.testing.assert_allclose(evaluated, want[4], rtol=1e-5)
        assert predicted.shape == (13, 8, VOCAB)
        np.testing.assert_allclose(predicted, want[5], rtol=1e-4, atol=1e-5)
        # memory: keyed weights 1/(B*M) of their replicated bytes, the others 1/B (+ 5 %)
        assert held["keyed"][0] <= held["keyed"][1] / 4 * 1.05, held
        assert held["other"][0] <= held["other"][1] / 2 * 1.05, held
    for other in results[1:]:
        for a, b in zip(results[0][0], other[0], strict=True):
            np.testing.assert_array_equal(a, b)  # every process gathers the same full weights


@pytest.mark.parametrize("shape", [(1, 4), (4, 1)])
def test_fit_on_one_by_four_and_four_by_one_equals_one_plain_process(shape, plain):
    want = plain["sgd"]
    results = run_distributed(_fit, world_size=4, args=(shape, "sgd"), timeout=400)
    batch, model = shape
    for weights, losses, local, iterations, evaluated, *_ in results:
        assert local == [(3 * D_MODEL // 4, D_MODEL), (D_MODEL // batch, 2 * D_MODEL // model)]
        assert iterations == STEPS
        assert_weights_match(weights, want[0], "sgd")
        np.testing.assert_allclose(losses, want[1], rtol=1e-5)
        np.testing.assert_allclose(evaluated, want[4], rtol=1e-5)


def test_global_clipnorm_clips_the_norm_over_both_axes(plain):
    clipped = run_distributed(_fit, world_size=1, args=(None, "sgd", None, 1, 0.5), timeout=300)[0]
    assert max_rel(clipped[0], plain["sgd"][0]) > 1e-3  # the limit is hit: clipping changes the run
    for weights, losses, *_ in run_distributed(_fit, world_size=4, args=((2, 2), "sgd", None, 1, 0.5), timeout=400):
        assert_weights_match(weights, clipped[0], "sgd")
        np.testing.assert_allclose(losses, clipped[1], rtol=1e-5)


# ---- the seed's custom loop: strategy.run, compute_average_loss, apply_gradients -----------------
def _custom_loop(rank, world, shape, name):
    import meshfit as mf

    x, y = (torch.from_numpy(a) for a in data())
    with scope(mf, shape) as strategy:
        model = mf.Model(module())
        opt = optimizer(mf, name)
    context = strategy.input_context() if shape else None
    replicas, replica = (context.num_input_pipelines, context.input_pipeline_id) if context else (1, 0)
    loss_object = mf.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    variables = model.trainable_variables
    opt.build(variables)

    def step_fn(inputs, global_batch_size):
        features, labels = inputs
        per_example = loss_object(labels, model(features, training=True)).mean(dim=-1)
        loss = mf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
        loss.backward()
        opt.apply_gradients(zip([v.grad for v in variables], variables, strict=True))
        opt.zero_grad()
        return loss.detach()

    losses = []
    for start in range(0, EXAMPLES, BATCH):
        gx, gy = x[start:start + BATCH], y[start:start + BATCH]
        shard = (torch.tensor_split(gx, replicas)[replica], torch.tensor_split(gy, replicas)[replica])
        per_replica = strategy.run(step_fn, args=(shard, len(gx)))
        losses.append(float(strategy.reduce(mf.ReduceOp.SUM, per_replica, axis=None)))
    return model.get_weights(), losses, opt.iterations


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_seed_custom_loop_on_a_two_by_two_mesh_equals_one_plain_process(name):
    want = run_distributed(_custom_loop, world_size=1, args=(None, name), timeout=300)[0]
    for weights, losses, iterations in run_distributed(_custom_loop, world_size=4, args=((2, 2), name),
                                                       timeout=400):
        assert iterations == STEPS
        assert_weights_match(weights, want[0], name)
        np.testing.assert_allclose(losses, want[1], rtol=1e-5)


# ---- mixed_bfloat16 ---------------------------------------------------------------------------------
def _fit_mixed(rank, world, shape):
    import meshfit as mf

    mf.mixed_precision.set_global_policy("mixed_bfloat16")
    with scope(mf, shape):
        model = mf.Model(module())
        model.compile(optimizer=mf.optimizers.SGD(0.1),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data()
    computed = set()
    model.module.layers[0].attn.qkv.register_forward_hook(lambda m, args, output: computed.add(str(output.dtype)))
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    dtypes = sorted({str(p.dtype) for p in model.module.parameters()})
    return model.get_weights(), history.history["loss"], dtypes, sorted(computed)


@pytest.mark.filterwarnings("ignore")
def test_mixed_bfloat16_trains_on_a_two_by_two_mesh_like_one_process():
    plain = run_distributed(_fit_mixed, world_size=1, args=(None,), timeout=300)[0]
    initial = [p.detach().numpy() for p in module().parameters()]
    for weights, losses, dtypes, computed in run_distributed(_fit_mixed, world_size=4, args=((2, 2),), timeout=400):
        assert dtypes == ["torch.float32"]  # variables stay float32
        assert computed == ["torch.bfloat16"]  # the split layers compute in bfloat16
        assert max_rel(weights, plain[0]) <= 2e-2  # bfloat16 sums in another order (see the Guide)
        np.testing.assert_allclose(losses, plain[1], rtol=1e-2)
        assert max_rel(weights, initial) > 1e-2  # and it trained
