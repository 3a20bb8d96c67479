"""TensorFlow's tests of the replica context and the cross-replica surface, on a chief and a worker.

Sources (tensorflow/tensorflow): ``tensorflow/python/distribute/strategy_gather_test.py`` (commit
0304934138cbfabd338ec432a630a9c3c1191564), ``strategy_common_test.py`` (the version with
``AllReduceTest``), ``strategy_test_lib.py`` (``TwoDeviceDistributionTestBase`` /
``OneDeviceDistributionTestBase``), ``collective_all_reduce_strategy_test.py`` and
``cluster_resolver/tfconfig_cluster_resolver_test.py`` (commit 00f0938ae85c7dd68b44b4d80a873f42b1dca16a),
``values_test.py`` (commit 010f3edcdc25a44755a4fc439a31be2282e9e9db; its ``test_util.gather`` helper).
Each case names its source test and keeps its assertions; TF's tensors are torch tensors, its
``multi_worker_mirrored_2x1_cpu`` combination is `MultiWorkerMirroredStrategy` on 2 gloo processes (a
chief and a worker, from their own ``TF_CONFIG``), and one-device combinations are `OneDeviceStrategy`
and the default strategy in this process.

Not ported: ``IndexedSlices`` cases (torch has no such value: meshfit refuses sparse tensors, see
``test_sparse_values_are_refused``), ``tf.function`` variants (no graphs), ``ReplicaCtxUpdateTest``
(``ReplicaContext._update``, private), TPU and ``CentralStorageStrategy`` branches. The private
``strategy.extended._replica_ctx_all_reduce`` of ``ReplicaCtxAllReduceTest`` is ported through the public
``get_replica_context().all_reduce``.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import meshfit as mf
from tests._multiproc import run_distributed

CASES: dict[str, Callable[[mf.distribute.Strategy, str], None]] = {}


def case(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def register(fn: Callable[..., None]) -> Callable[..., None]:
        CASES[name] = fn
        return fn
    return register


def expect_raises(kind: type[BaseException], words: str, fn: Callable[[], object]) -> str:
    try:
        fn()
    except kind as error:
        assert words in str(error), str(error)
        return str(error)
    raise AssertionError(f"expected {kind.__name__} with {words!r}")


# ---- strategy_gather_test.py: GatherTest ---------------------------------------------------------
def _gather_same_shape_and_verify(strategy, value_on_replica, axis):
    distributed_values = strategy.experimental_distribute_values_from_function(lambda _: value_on_replica.clone())
    expected = torch.cat([value_on_replica] * strategy.num_replicas_in_sync, dim=axis)
    assert torch.equal(strategy.gather(distributed_values, axis=axis), expected)


def _all_gather_same_shape_and_verify(strategy, value_on_replica, axis):
    per_replica_value = strategy.experimental_distribute_values_from_function(lambda _: value_on_replica.clone())

    def replica_fn(value):
        return mf.distribute.get_replica_context().all_gather(value.clone(), axis=axis)

    result = strategy.experimental_local_results(strategy.run(replica_fn, args=(per_replica_value,)))
    expected = torch.cat([value_on_replica] * strategy.num_replicas_in_sync, dim=axis)
    assert len(result) == 1 and torch.equal(result[0], expected)  # one replica per process


_DENSE = {"1D0Axis": (torch.tensor([1, 2, 3]), 0), "2D0Axis": (torch.tensor([[1, 2, 3]]), 0),
          "2D1Axis": (torch.tensor([[1, 2, 3]]), 1), "3D0Axis": (torch.tensor([[[1, 2], [1, 2]]]), 0),
          "3D1Axis": (torch.tensor([[[1, 2], [1, 2]]]), 1), "3D2Axis": (torch.tensor([[[1, 2], [1, 2]]]), 2)}
for _suffix, (_value, _axis) in _DENSE.items():
    case(f"strategy_gather_test.py::GatherTest::testGatherPerReplicaDense{_suffix}")(
        lambda strategy, task, v=_value, a=_axis: _gather_same_shape_and_verify(strategy, v, a))
    case(f"strategy_gather_test.py::GatherTest::testAllGatherPerReplicaDense{_suffix}")(
        lambda strategy, task, v=_value, a=_axis: _all_gather_same_shape_and_verify(strategy, v, a))


@case("strategy_gather_test.py::GatherTest::testGatherDiffShapeAtAxis0")
def gather_diff_shape_at_axis0(strategy, task):
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.ones(ctx.replica_id_in_sync_group + 1, 1, dtype=torch.int32))
    expected = torch.ones(sum(range(strategy.num_replicas_in_sync + 1)), 1, dtype=torch.int32)
    assert torch.equal(strategy.gather(values, axis=0), expected)


@case("strategy_gather_test.py::GatherTest::testGatherDiffShapeAtAxis1")
def gather_diff_shape_at_axis1(strategy, task):
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.ones(1, ctx.replica_id_in_sync_group + 1, dtype=torch.int32))
    expected = torch.ones(1, sum(range(strategy.num_replicas_in_sync + 1)), dtype=torch.int32)
    assert torch.equal(strategy.gather(values, axis=1), expected)


@case("strategy_gather_test.py::GatherTest::testGatherRaiseDiffShapeAtNonAxis")
def gather_raise_diff_shape_at_non_axis(strategy, task):
    if strategy.num_replicas_in_sync <= 1:
        return  # the source skips: "Test for more than 1 replica only."
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.ones(1, ctx.replica_id_in_sync_group + 1))
    expect_raises(ValueError, "Shape mismatch", lambda: strategy.gather(values, axis=0))


@case("strategy_gather_test.py::GatherTest::testGatherRaiseDifferentRank")
def gather_raise_different_rank(strategy, task):
    if strategy.num_replicas_in_sync <= 1:
        return  # the source skips: "Test for more than 1 replicas."
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.ones(*range(1, ctx.replica_id_in_sync_group + 2)))
    expect_raises(ValueError, "Shape mismatch", lambda: strategy.gather(values, axis=0))


@case("strategy_gather_test.py::GatherTest::testAllGatherDiffShapeAtAxis0")
def all_gather_diff_shape_at_axis0(strategy, task):
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.ones(ctx.replica_id_in_sync_group + 1, 1, dtype=torch.int32))
    expect = torch.ones(sum(range(strategy.num_replicas_in_sync + 1)), 1, dtype=torch.int32)

    def run(value):
        return mf.distribute.get_replica_context().all_gather(value.clone(), axis=0)

    result = strategy.experimental_local_results(strategy.run(run, args=(values,)))
    assert len(result) == 1 and torch.equal(result[0], expect)


@case("strategy_gather_test.py::GatherTest::testAllGatherDiffShapeAtAxis1")
def all_gather_diff_shape_at_axis1(strategy, task):
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.ones(1, ctx.replica_id_in_sync_group + 1, dtype=torch.int32))
    expect = torch.ones(1, sum(range(strategy.num_replicas_in_sync + 1)), dtype=torch.int32)

    def run(value):
        return mf.distribute.get_replica_context().all_gather(value.clone(), axis=1)

    result = strategy.experimental_local_results(strategy.run(run, args=(values,)))
    assert len(result) == 1 and torch.equal(result[0], expect)


@case("strategy_gather_test.py::GatherTest::testAllGatherNest")
def all_gather_nest(strategy, task):
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.ones(1, ctx.replica_id_in_sync_group + 1, dtype=torch.int32))
    expect_1 = torch.ones(1, sum(range(strategy.num_replicas_in_sync + 1)), dtype=torch.int32)
    value_2 = torch.tensor([[[1, 2], [1, 2]]])
    expect_2 = torch.cat([value_2] * strategy.num_replicas_in_sync, dim=1)

    def run(value):
        return mf.distribute.get_replica_context().all_gather([value.clone(), value_2.clone()], axis=1)

    result = strategy.run(run, args=(values,))
    assert torch.equal(strategy.experimental_local_results(result[0])[0], expect_1)
    assert torch.equal(strategy.experimental_local_results(result[1])[0], expect_2)


@case("strategy_gather_test.py::GatherTest::testAllGatherNest1D0Axis")
def all_gather_nest_1d0(strategy, task):
    single_value = torch.tensor([1, 2, 3])

    def run():
        return mf.distribute.get_replica_context().all_gather([single_value.clone(), single_value.clone()], axis=0)

    expect = torch.cat([single_value] * strategy.num_replicas_in_sync, dim=0)
    for gathered in strategy.run(run):
        assert torch.equal(strategy.experimental_local_results(gathered)[0], expect)


@case("strategy_gather_test.py::GatherTest::testAllGatherRaiseDiffShapeAtNonAxis")
def all_gather_raise_diff_shape(strategy, task):
    if strategy.num_replicas_in_sync <= 1:
        return
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.ones(1, ctx.replica_id_in_sync_group + 1))

    def run(value):
        return mf.distribute.get_replica_context().all_gather(value.clone(), axis=0)

    expect_raises(ValueError, "Shape mismatch", lambda: strategy.run(run, args=(values,)))


@case("strategy_gather_test.py::GatherTest::testAllGatherRaiseDifferentRank")
def all_gather_raise_different_rank(strategy, task):
    if strategy.num_replicas_in_sync <= 1:
        return
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.ones(*range(1, ctx.replica_id_in_sync_group + 2)))

    def run(value):
        return mf.distribute.get_replica_context().all_gather(value.clone(), axis=0)

    expect_raises(ValueError, "Shape mismatch", lambda: strategy.run(run, args=(values,)))


def _all_gather_gradient(strategy, nest: bool):
    n = strategy.num_replicas_in_sync
    gradient_comp = sum(range(1, n + 1))
    expected = torch.tensor([[float(gradient_comp)], [float(gradient_comp)]])

    def step(c):
        x = torch.tensor([[3.0], [5.0]], requires_grad=True)
        y = torch.tensor([[2.0], [4.0]], requires_grad=True)
        context = mf.distribute.get_replica_context()
        mid = context.all_gather([x, y], 1)[0] if nest else context.all_gather(x, 1)
        (grad,) = torch.autograd.grad((mid * c).sum(), [x])  # tf.gradients sums the targets
        return grad

    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0][ctx.replica_id_in_sync_group]]))
    result = strategy.experimental_local_results(strategy.run(step, args=(values,)))
    assert len(result) == 1 and torch.equal(result[0], expected), result


case("strategy_gather_test.py::GatherTest::testAllGatherGradient")(
    lambda strategy, task: _all_gather_gradient(strategy, nest=False))
case("strategy_gather_test.py::GatherTest::testAllGatherGradientNest")(
    lambda strategy, task: _all_gather_gradient(strategy, nest=True))


# ---- strategy_common_test.py -----------------------------------------------------------------------
@case("strategy_common_test.py::StrategyTest::testCaptureReplicaId")
def capture_replica_id(strategy, task):
    got = strategy.run(lambda: mf.distribute.get_replica_context().replica_id_in_sync_group)
    assert strategy.experimental_local_results(got) == (strategy.replica_id,)


@case("strategy_common_test.py::StrategyTest::testMergeCallInitScope")
def merge_call_init_scope(strategy, task):
    with strategy.scope():
        def merge_fn(unused_strat):
            assert unused_strat is strategy and mf.distribute.in_cross_replica_context()
            return torch.tensor(11)

        def replica_fn():
            y = mf.distribute.get_replica_context().merge_call(merge_fn)
            return y + 1

        result = strategy.experimental_local_results(strategy.run(replica_fn))
    assert [int(r) for r in result] == [12]  # one replica per process


@case("strategy_common_test.py::StrategyLocalResultTest::testLocalResultForNestedStruct")
def local_result_for_nested_struct(strategy, task):
    with strategy.scope():
        result = strategy.run(lambda: ({"a": torch.tensor(1.0), "b": torch.tensor(2.0)},
                                       {"a": torch.tensor(4.0), "b": torch.tensor(6.0)}))
        got = strategy.experimental_local_results(result)
    assert got == (({"a": 1.0, "b": 2.0}, {"a": 4.0, "b": 6.0}),)


@case("strategy_common_test.py::StrategyLocalResultTest::testLocalResultForDictionaryDifferentReplicas")
def local_result_different_replicas(strategy, task):
    def model_fn():
        replica_id = mf.distribute.get_replica_context().replica_id_in_sync_group
        return {"a": torch.tensor(replica_id + 1.0), "b": torch.tensor(replica_id + 2.0)}

    with strategy.scope():
        got = strategy.experimental_local_results(strategy.run(model_fn))
    rid = strategy.replica_id
    assert got == ({"a": rid + 1.0, "b": rid + 2.0},)


@case("strategy_common_test.py::ReduceTest::testBasic")
def reduce_basic(strategy, task):
    per_replica_value = strategy.experimental_distribute_values_from_function(lambda _: torch.ones(()))

    def fn_eager():
        return strategy.reduce(mf.ReduceOp.SUM, value=per_replica_value, axis=None)

    with strategy.scope():
        assert float(fn_eager()) == 1.0 * strategy.num_replicas_in_sync
    assert float(fn_eager()) == 1.0 * strategy.num_replicas_in_sync


@case("strategy_common_test.py::ReduceTest::testAxis")
def reduce_axis(strategy, task):
    x = strategy.run(lambda: torch.tensor([1.0, 2.0]))
    assert float(strategy.reduce(mf.ReduceOp.MEAN, x, axis=0)) == 1.5
    assert float(strategy.reduce(mf.ReduceOp.SUM, x, axis=0)) == 3 * strategy.num_replicas_in_sync


@case("strategy_common_test.py::AllReduceTest::testDense")
def all_reduce_dense(strategy, task):
    def replica_fn():
        return mf.distribute.get_replica_context().all_reduce(mf.ReduceOp.SUM, torch.tensor(1.0))

    got = strategy.experimental_local_results(strategy.run(replica_fn))[0]
    assert float(got) == 1.0 * strategy.num_replicas_in_sync


@case("strategy_common_test.py::ReplicaCtxAllReduceTest::testDense")
def replica_ctx_all_reduce_dense(strategy, task):  # the private extended._replica_ctx_all_reduce, publicly
    def replica_fn():
        return mf.distribute.get_replica_context().all_reduce("SUM", torch.tensor(1.0))

    got = strategy.experimental_local_results(strategy.run(replica_fn))[0]
    assert float(got) == 1.0 * strategy.num_replicas_in_sync


@case("strategy_common_test.py::AllReduceTest::testNestedInput (its dense leaves)")
def all_reduce_nested(strategy, task):
    def replica_fn():
        value = (torch.tensor(1.0), torch.tensor([[1.0]]), torch.tensor(2.0), {"b": torch.tensor([[2.0]])})
        return mf.distribute.get_replica_context().all_reduce(mf.ReduceOp.SUM, value)

    got = strategy.experimental_local_results(strategy.run(replica_fn))[0]
    n = strategy.num_replicas_in_sync
    assert float(got[0]) == 1.0 * n and got[1].tolist() == [[1.0 * n]]
    assert float(got[2]) == 2.0 * n and got[3]["b"].tolist() == [[2.0 * n]]


@case("strategy_common_test.py::ReplicaCtxAllReduceTest::testSyncOnReadVariableInput")
def all_reduce_sync_on_read(strategy, task):
    def replica_fn():
        context = mf.distribute.get_replica_context()
        var = torch.tensor(float(context.replica_id_in_sync_group) * 3.0)
        return context.all_reduce(mf.ReduceOp.SUM, var)

    expected_sum = sum(range(strategy.num_replicas_in_sync)) * 3.0
    for value in strategy.experimental_local_results(strategy.run(replica_fn)):
        assert float(value) == expected_sum


@case("strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest::testDatasetFromFunction")
def dataset_from_function(strategy, task):
    if strategy.num_replicas_in_sync != 2:
        return  # the source's expectations are a chief's and a worker's

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(10)
        d = mf.data.Dataset.range(100).repeat().batch(batch_size)
        return d.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

    expected_sum_on_workers = {"chief": 10, "worker": 35}
    result = strategy.experimental_local_results(next(iter(strategy.distribute_datasets_from_function(dataset_fn))))
    assert int(sum(torch.as_tensor(r).sum() for r in result)) == expected_sum_on_workers[task]


def _reduce_cases():
    def host(strategy, task):
        """testReduceHostTensor"""
        assert float(strategy.reduce(mf.ReduceOp.SUM, torch.tensor(1.0), axis=None)) == 2.0

    def reduce_to_host(strategy, task):
        value = torch.tensor(1.0)
        assert float(strategy.extended.reduce_to(mf.ReduceOp.SUM, value, value)) == 2.0

    def batch_reduce_to_host(strategy, task):
        value = torch.tensor(1.0)
        reduced = strategy.extended.batch_reduce_to(mf.ReduceOp.SUM, [(value, value), (value, value)])
        assert [float(r) for r in reduced] == [2.0, 2.0]

    def device(strategy, task):
        value = strategy.run(lambda: torch.tensor(1.0))
        assert float(strategy.reduce(mf.ReduceOp.SUM, value, axis=None)) == 2.0

    def reduce_to_device(strategy, task):
        value = strategy.run(lambda: torch.tensor(1.0))
        assert float(strategy.extended.reduce_to(mf.ReduceOp.SUM, value, value)) == 2.0

    def batch_reduce_to_device(strategy, task):
        value = strategy.run(lambda: torch.tensor(1.0))
        reduced = strategy.extended.batch_reduce_to(mf.ReduceOp.SUM, [(value, value), (value, value)])
        assert [float(r) for r in reduced] == [2.0, 2.0]

    return {"testReduceHostTensor": host, "testReduceToHostTensor": reduce_to_host,
            "testBatchReduceToHostTensor": batch_reduce_to_host, "testReduceDeviceTensors": device,
            "testReduceToDeviceTensors": reduce_to_device, "testBatchReduceToDeviceTensors": batch_reduce_to_device}


_TWO_WORKER_ONLY = set()
for _name, _fn in _reduce_cases().items():
    _full = f"strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest::{_name}"
    case(_full)(_fn)
    _TWO_WORKER_ONLY.add(_full)


@case("strategy_common_test.py::StrategyClusterResolverTest::testClusterResolverProperty")
def cluster_resolver_property(strategy, task):
    resolver = strategy.cluster_resolver
    with strategy.scope():
        assert strategy.cluster_resolver is resolver
    for name in ("cluster_spec", "master", "num_accelerators", "task_id", "task_type"):
        assert hasattr(resolver, name), name
    if isinstance(strategy, mf.MultiWorkerMirroredStrategy) and strategy.num_replicas_in_sync > 1:
        assert resolver.task_id == 0
        assert resolver.task_type in ["chief", "worker"]
        assert resolver.master() == json.loads(os.environ["TF_CONFIG"])["cluster"][task][0]


# ---- strategy_test_lib.py (Two/OneDeviceDistributionTestBase), collective_all_reduce_strategy_test.py ----
@case("strategy_test_lib.py::_test_run")
def run_per_replica_arguments(strategy, task):
    rid, n = strategy.replica_id, strategy.num_replicas_in_sync
    out1 = strategy.run(lambda: torch.tensor(mf.distribute.get_replica_context().replica_id_in_sync_group + 1))
    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    local = strategy.experimental_local_results
    if n == 2:  # the source's two replicas: [1, 2], [2, 4], [1, 4], [6, 14]
        assert int(local(out1)[0]) == [1, 2][rid] and int(local(out2["a"])[0]) == [2, 4][rid]
        assert int(local(out2["b"])[0]) == [1, 4][rid] and int(local(out3)[0]) == [6, 14][rid]
    else:
        assert (int(local(out1)[0]), int(local(out3)[0])) == (1, 6)


def _collective_comms(strategy, op, inputs, expected):
    rid = strategy.replica_id

    def fn(scalar, vector):
        return mf.distribute.get_replica_context().all_reduce(op, (scalar, vector))

    got = strategy.run(fn, args=(torch.tensor(inputs[0][rid]), torch.tensor(inputs[1][rid])))
    scalar, vector = (strategy.experimental_local_results(v)[0] for v in got)
    assert float(scalar) == expected[0] and vector.tolist() == expected[1]


def _collective_comms_gradients(strategy, op, inputs, expected_grads):
    def step(c):
        x = torch.tensor(42.0, requires_grad=True)
        y = mf.distribute.get_replica_context().all_reduce(op, x) * c
        return torch.autograd.grad(y, [x])[0]

    got = strategy.run(step, args=(torch.tensor(inputs[strategy.replica_id]),))
    assert float(strategy.experimental_local_results(got)[0]) == expected_grads[strategy.replica_id]


def _two_or_one(two, one):
    def run(strategy, task):
        (two if strategy.num_replicas_in_sync == 2 else one)(strategy)
    return run


case("strategy_test_lib.py::_test_all_reduce_sum")(_two_or_one(
    lambda s: _collective_comms(s, "SUM", ([1.0, 3.0], [[39.0, 2.0], [3.0, 41.0]]), (4.0, [42.0, 43.0])),
    lambda s: _collective_comms(s, "SUM", ([4.0], [[42.0, 43.0]]), (4.0, [42.0, 43.0]))))
case("strategy_test_lib.py::_test_all_reduce_mean")(_two_or_one(
    lambda s: _collective_comms(s, "MEAN", ([1.0, 3.0], [[39.0, 2.0], [3.0, 41.0]]), (2.0, [21.0, 21.5])),
    lambda s: _collective_comms(s, "MEAN", ([2.0], [[21.0, 22.0]]), (2.0, [21.0, 22.0]))))
case("strategy_test_lib.py::_test_all_reduce_sum_gradients")(_two_or_one(
    lambda s: _collective_comms_gradients(s, "SUM", [1.0, 3.0], [4.0, 4.0]),
    lambda s: _collective_comms_gradients(s, "SUM", [4.0], [4.0])))
case("strategy_test_lib.py::_test_all_reduce_mean_gradients")(_two_or_one(
    lambda s: _collective_comms_gradients(s, "MEAN", [1.0, 3.0], [2.0, 2.0]),
    lambda s: _collective_comms_gradients(s, "MEAN", [5.0], [5.0])))


@case("collective_all_reduce_strategy_test.py::DistributedCollectiveAllReduceStrategyTest::"
      "testVariableInitialization")
def variable_initialization(strategy, task):
    torch.manual_seed(strategy.replica_id)  # each worker draws its own initial value
    with strategy.scope():
        holder = nn.Module()
        holder.x = nn.Parameter(torch.empty(2, 3).uniform_(1.0, 10.0))
    x = strategy.run(lambda: holder.x.detach().clone())
    reduced_x = strategy.reduce(mf.ReduceOp.MEAN, x, axis=None)
    x_value = strategy.experimental_local_results(x)[0]
    assert torch.allclose(x_value, reduced_x, atol=1e-5), (x_value, reduced_x)


@case("collective_all_reduce_strategy_test.py::DistributedCollectiveAllReduceStrategyTest::testMinimizeLossGraph")
def minimize_loss(strategy, task):
    torch.manual_seed(0)
    kernel = torch.empty(1, 1)
    nn.init.xavier_uniform_(kernel)  # GlorotUniform

    def grad_fn(x):
        k = kernel.clone().requires_grad_(True)
        loss = ((x @ k).reshape(()) - 1.0) ** 2
        return torch.autograd.grad(loss, [k])[0]

    one = torch.tensor([[1.0]])
    before = float(kernel)
    for _ in range(10):
        g = strategy.run(grad_fn, args=(one,))
        g = strategy.extended.reduce_to(mf.ReduceOp.SUM, g, destinations=kernel)
        kernel -= 0.05 * g
    assert abs(float(kernel) - 1) < abs(before - 1)  # error should go down


# ---- values_test.py: DistributedValuesTest -------------------------------------------------------------
def _test_util_gather(strategy, value):
    """tensorflow/python/distribute/test_util.py's ``gather``: each leaf's replicas stacked along a new axis 0."""
    if isinstance(value, (tuple, list)):
        return type(value)(_test_util_gather(strategy, v) for v in value)
    leaf = value.values[0] if isinstance(value, mf.distribute.PerReplica) else value
    return strategy.gather(torch.as_tensor(leaf).unsqueeze(0), axis=0)


@case("values_test.py::DistributedValuesTest::testMakeDistributedValueFromTensor")
def make_from_tensor(strategy, task):
    values = strategy.experimental_distribute_values_from_function(lambda ctx: torch.tensor(1))
    assert _test_util_gather(strategy, values).tolist() == [1.0] * strategy.num_replicas_in_sync


@case("values_test.py::DistributedValuesTest::testMakeDistributedValueSingleNumpyArrayConstant")
def make_from_numpy(strategy, task):
    array_value = np.array([1.0, 2.0, 3.0])
    values = strategy.experimental_distribute_values_from_function(lambda ctx: array_value)
    assert _test_util_gather(strategy, values).tolist() == [[1.0, 2.0, 3.0]] * strategy.num_replicas_in_sync


@case("values_test.py::DistributedValuesTest::testMakeDistributedValueTupleConstant")
def make_from_tuple(strategy, task):
    tuple_value = (1.0, 2.0, 3.0)
    values = _test_util_gather(strategy, strategy.experimental_distribute_values_from_function(lambda ctx: tuple_value))
    expected = tuple([v for _ in range(strategy.num_replicas_in_sync)] for v in tuple_value)
    assert tuple(v.tolist() for v in values) == expected


@case("values_test.py::DistributedValuesTest::testMakeDistributedValueNestedStructurePerReplica")
def make_nested_per_replica(strategy, task):
    tuple_value = (1.0, 2.0, 3.0)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tuple(v * ctx.replica_id_in_sync_group for v in tuple_value))
    expected = tuple([v * i for i in range(strategy.num_replicas_in_sync)] for v in tuple_value)
    assert tuple(v.tolist() for v in _test_util_gather(strategy, values)) == expected


@case("values_test.py::DistributedValuesTest::testMakeDistributedValueExtractFromArray")
def make_extract_from_array(strategy, task):
    multiple_values = range(strategy.num_replicas_in_sync)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: multiple_values[ctx.replica_id_in_sync_group])
    assert _test_util_gather(strategy, values).tolist() == list(range(strategy.num_replicas_in_sync))


@case("values_test.py::DistributedValuesTest::testMakeDistributedValueAndRun")
def make_and_run(strategy, task):
    multiple_values = range(strategy.num_replicas_in_sync)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(multiple_values[ctx.replica_id_in_sync_group]))
    outputs = _test_util_gather(strategy, strategy.run(torch.square, args=(values,)))
    assert outputs.tolist() == [i ** 2 for i in range(strategy.num_replicas_in_sync)]


# ---- meshfit's own: worker devices, the default context, bad input --------------------------------
@case("worker_devices and the cross-replica / default contexts")
def contexts(strategy, task):
    assert strategy.extended.worker_devices == (str(strategy.device),)
    with strategy.scope():
        assert mf.distribute.get_replica_context() is None and mf.distribute.in_cross_replica_context()
        assert mf.distribute.get_cross_replica_context() is strategy
        inside = strategy.run(lambda: (mf.distribute.get_replica_context(), mf.distribute.in_cross_replica_context(),
                                       mf.distribute.get_cross_replica_context()))
        context, cross, cross_strategy = (strategy.experimental_local_results(v)[0] for v in inside)
    assert context.strategy is strategy and context.num_replicas_in_sync == strategy.num_replicas_in_sync
    assert cross is False and cross_strategy is None
    default = mf.distribute.get_replica_context()
    assert default is not None and default.num_replicas_in_sync == 1 and default.replica_id_in_sync_group == 0
    assert not mf.distribute.in_cross_replica_context()
    if strategy.num_processes > 1:  # TF's default context would sum this worker's value alone: refused
        message = expect_raises(RuntimeError, "strategy.run", lambda: default.all_reduce("SUM", torch.tensor(1.0)))
        assert "2 processes" in message and "strategy.reduce" in message
    else:  # a process alone: TF's default context returns the value
        assert float(default.all_reduce("SUM", torch.tensor(3.0))) == 3.0


@case("cross_device_utils.divide_by_n_tensors_or_indexed_slices: MEAN is value / n, for integers too")
def integer_mean(strategy, task):
    def replica_fn():
        context = mf.distribute.get_replica_context()
        value = torch.tensor([context.replica_id_in_sync_group, 3])
        return context.all_reduce("MEAN", value), context.all_reduce("SUM", value)

    mean, total = (strategy.experimental_local_results(v)[0] for v in strategy.run(replica_fn))
    n = strategy.num_replicas_in_sync
    assert mean.dtype.is_floating_point and mean.tolist() == [sum(range(n)) / n, 3.0]
    assert total.dtype == torch.int64 and total.tolist() == [sum(range(n)), 3 * n]
    reduced = strategy.extended.reduce_to("MEAN", torch.tensor(strategy.replica_id), "cpu")
    assert float(reduced) == sum(range(n)) / n


@case("all_reduce of different shapes on the replicas is refused on every replica, which stay in step")
def all_reduce_mismatch(strategy, task):
    if strategy.num_replicas_in_sync <= 1:
        return
    rid = strategy.replica_id

    def replica_fn():
        context = mf.distribute.get_replica_context()
        return context.all_reduce("SUM", {"a": torch.ones(rid + 1), "b": torch.tensor(1)})

    message = expect_raises(ValueError, "different structures", lambda: strategy.run(replica_fn))
    assert f"({rid + 1},)" in message
    assert float(strategy.reduce("SUM", torch.tensor(1.0))) == strategy.num_replicas_in_sync


@case("gather and reduce_to belong to the cross-replica context")
def cross_replica_only(strategy, task):
    expect_raises(RuntimeError, "get_replica_context().all_gather",
                  lambda: strategy.run(lambda: strategy.gather(torch.ones(1), axis=0)))
    expect_raises(RuntimeError, "get_replica_context().all_reduce",
                  lambda: strategy.run(lambda: strategy.extended.reduce_to("SUM", torch.ones(1), "cpu")))


@case("bad input to gather, all_reduce, all_gather and reduce_to is refused")
def bad_input(strategy, task):
    message = expect_raises(TypeError, "Invalid `value` for strategy.gather",
                            lambda: strategy.gather({"logits": torch.ones(2)}, axis=0))
    assert "{'logits'" in message and "all_gather(value, axis)" in message
    expect_raises(TypeError, "received str 'abc'", lambda: strategy.gather("abc", axis=0))
    expect_raises(TypeError, "number 3.0", lambda: strategy.gather(3.0, axis=0))
    expect_raises(ValueError, "scalar", lambda: strategy.gather(torch.tensor(1.0), axis=0))
    expect_raises(ValueError, "axis=2", lambda: strategy.gather(torch.ones(2, 2), axis=2))
    expect_raises(ValueError, "Invalid `reduce_op`", lambda: strategy.extended.reduce_to("MAX", torch.ones(1), "cpu"))
    expect_raises(ValueError, "destinations=None", lambda: strategy.extended.reduce_to("SUM", torch.ones(1), None))
    expect_raises(ValueError, "destinations=''", lambda: strategy.extended.reduce_to("SUM", torch.ones(1), ""))
    expect_raises(TypeError, "'a string'",
                  lambda: strategy.run(lambda: mf.distribute.get_replica_context().all_reduce("SUM", "a string")))
    expect_raises(TypeError, "boolean",
                  lambda: strategy.run(lambda: mf.distribute.get_replica_context().all_reduce("SUM", True)))
    # the refusals above come before any collective: the workers are still in step
    assert float(strategy.reduce("SUM", torch.tensor(1.0))) == strategy.num_replicas_in_sync


@case("strategy_gather_test.py::GatherTest::testGatherRaiseSparse / testAllGatherRaiseSparse")
def sparse_refused(strategy, task):
    t0 = torch.sparse_coo_tensor([[2]], [[1.0, 2.0]], (5, 2), check_invariants=True)
    expect_raises(NotImplementedError, "gather does not support sparse tensors", lambda: strategy.gather(t0, axis=0))
    expect_raises(NotImplementedError, "all_gather does not support sparse tensors",
                  lambda: strategy.run(lambda: mf.distribute.get_replica_context().all_gather(t0, axis=0)))


# ---- the chief and the worker -------------------------------------------------------------------------
def _run_all(rank: int, world: int) -> dict[str, str]:
    task = ("chief", "worker")[rank]
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"chief": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]},
                                          "task": {"type": task, "index": 0}})
    strategy = mf.MultiWorkerMirroredStrategy()
    assert strategy.cluster_resolver.task_type == task  # the group took each worker's TF_CONFIG
    results = {}
    for name, fn in CASES.items():
        try:
            fn(strategy, task)
            results[name] = "ok"
        except Exception:  # reported per case by the parent
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def two_workers():
    return run_distributed(_run_all, world_size=2, timeout=600)


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_on_a_chief_and_a_worker(two_workers, name):
    """Each case of ``CASES`` (its name: source file, class and test) on MultiWorkerMirroredStrategy, 2 workers."""
    for rank, per_case in enumerate(two_workers):
        assert per_case[name] == "ok", f"{('chief', 'worker')[rank]}:\n{per_case[name]}"


@pytest.mark.parametrize("strategy_kind", ["one_device", "default"])
@pytest.mark.parametrize("name", sorted(set(CASES) - _TWO_WORKER_ONLY))
def test_case_on_one_process(strategy_kind, name):
    """Each case of ``CASES`` (its name: source file, class and test) on TF's one-device combinations."""
    strategy = mf.OneDeviceStrategy("cpu") if strategy_kind == "one_device" else mf.get_strategy()
    CASES[name](strategy, "worker")


# ---- cluster_resolver/tfconfig_cluster_resolver_test.py ---------------------------------------------
# The source's cluster has a "ps" job, which meshfit refuses (no parameter-server training): its
# "ps" tasks are "chief" / "worker" tasks here, with the same addresses.
_CLUSTER = {"chief": ["ps0:2222"], "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]}


def test_automatic_master_read():
    """tfconfig_cluster_resolver_test.py::testAutomaticMasterRead"""
    resolver = mf.cluster.TFConfigClusterResolver({"cluster": _CLUSTER, "task": {"type": "chief", "index": 0}})
    assert resolver.master() == "ps0:2222"


def test_a_cluster_of_one_task_has_no_master():
    """tfconfig_cluster_resolver.py's master(): "Return an empty string if we are the only job in the
    ClusterSpec" (one job of one task), before any task type or index is read."""
    resolver = mf.cluster.TFConfigClusterResolver({"cluster": {"worker": ["h1:2222"]},
                                                   "task": {"type": "worker", "index": 0}, "rpc_layer": "grpc"})
    assert resolver.master() == "" and resolver.master("worker", 0) == ""
    two = mf.cluster.TFConfigClusterResolver({"cluster": {"worker": ["h1:2222", "h2:2222"]},
                                              "task": {"type": "worker", "index": 0}})
    assert two.master() == "h1:2222"


def test_specified_task_type_and_index_master_read():
    """tfconfig_cluster_resolver_test.py::testSpecifiedTaskTypeAndIndexMasterRead"""
    resolver = mf.cluster.TFConfigClusterResolver({"cluster": _CLUSTER, "task": {"type": "chief", "index": 0}})
    assert resolver.master("worker", 1) == "worker1:2222"


def test_session_master_read():
    """tfconfig_cluster_resolver_test.py::testSessionMasterRead"""
    resolver = mf.cluster.TFConfigClusterResolver({"cluster": _CLUSTER, "session_master": "sessionmaster:2222",
                                                   "task": {"type": "chief", "index": 0}})
    assert resolver.master() == "sessionmaster:2222"


def test_rpc_layer_read_and_task_type_index_rpc_read():
    """tfconfig_cluster_resolver_test.py::testRpcLayerRead and ::testTaskTypeIndexRpcRead"""
    resolver = mf.cluster.TFConfigClusterResolver({"cluster": _CLUSTER, "rpc_layer": "grpc",
                                                   "task": {"type": "chief", "index": 0}})
    assert resolver.master() == "grpc://ps0:2222"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("chief", 0, "grpc")


def test_parameter_overrides_rpc_layer():
    """tfconfig_cluster_resolver_test.py::testParameterOverrides (the rpc_layer part; meshfit's task_type /
    task_id come from TF_CONFIG only)"""
    resolver = mf.cluster.TFConfigClusterResolver({"cluster": _CLUSTER, "rpc_layer": "grpc",
                                                   "task": {"type": "chief", "index": 0}})
    resolver.rpc_layer = "test"
    assert resolver.master("worker", 1) == "test://worker1:2222" and resolver.rpc_layer == "test"
    assert mf.cluster.TFConfigClusterResolver({"cluster": _CLUSTER, "task": {"type": "worker", "index": 1}},
                                              rpc_layer="grpc").master() == "grpc://worker1:2222"


def test_master_of_a_process_alone_is_empty():
    """tfconfig_cluster_resolver_test.py::testZeroItemsInClusterSpecMasterRead: no cluster, ``''`` (meshfit's
    resolver of a process no TF_CONFIG describes)."""
    assert mf.cluster.SingleProcessClusterResolver().master() == ""
    assert mf.OneDeviceStrategy("cpu").cluster_resolver.master() == ""


def test_master_of_an_unknown_task_is_refused():
    resolver = mf.cluster.TFConfigClusterResolver({"cluster": _CLUSTER, "task": {"type": "chief", "index": 0}})
    expect_raises(ValueError, "['chief', 'worker']", lambda: resolver.master("ps", 0))
    expect_raises(ValueError, "0 <= index < 3", lambda: resolver.master("worker", 3))
    expect_raises(ValueError, "rpc_layer=3", lambda: mf.cluster.TFConfigClusterResolver(
        {"cluster": _CLUSTER, "rpc_layer": 3, "task": {"type": "chief", "index": 0}}))
    # torchrun knows rank 0's address alone: the others are unknown, as TF's resolvers say with ''
    torchrun = mf.cluster.TorchrunClusterResolver({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h0",
                                                   "MASTER_PORT": "29500"})
    assert torchrun.master() == "" and torchrun.master("worker", 0) == "h0:29500"


# ---- on a mesh: the replicas are the ``batch`` axis's ---------------------------------------------------
def _on_a_mesh(rank: int, world: int, shape: tuple[int, int]) -> dict[str, object]:
    # a lenient heartbeat: 4 processes on a shared 2-core machine may be starved for seconds
    mesh = mf.dtensor.create_mesh([("batch", shape[0]), ("model", shape[1])],
                                  communication_options=mf.CommunicationOptions(heartbeat_timeout_seconds=60))
    strategy = mesh.strategy

    def step():
        context = mf.distribute.get_replica_context()
        own = torch.tensor([float(rank)])  # differs along ``model`` too
        return (context.replica_id_in_sync_group, context.num_replicas_in_sync,
                context.all_reduce("SUM", own), context.all_gather(own.repeat(rank + 1), axis=0))

    replica, count, total, gathered = (strategy.experimental_local_results(v)[0] for v in strategy.run(step))
    return {"replica": replica, "count": count, "total": total.tolist(), "gathered": gathered.tolist(),
            "gather": strategy.gather(torch.tensor([rank]), axis=0).tolist()}


def test_on_a_batch_mesh_the_replicas_combine():
    """On a ("batch", 2) mesh each process is a replica: the sum and the (uneven) gather take both."""
    r0, r1 = run_distributed(_on_a_mesh, args=((2, 1),), timeout=240)
    assert (r0["replica"], r1["replica"], r0["count"]) == (0, 1, 2)
    assert r0["total"] == r1["total"] == [1.0]
    assert r0["gathered"] == r1["gathered"] == [0.0, 1.0, 1.0]
    assert r0["gather"] == r1["gather"] == [0, 1]


def test_on_a_model_mesh_one_replica_keeps_its_values():
    """On a ("batch", 1) x ("model", 2) mesh both processes are one replica: nothing is summed across
    ``model`` (its processes may hold different shards), and a gather is the replica's own value."""
    r0, r1 = run_distributed(_on_a_mesh, args=((1, 2),), timeout=240)
    assert (r0["replica"], r1["replica"], r0["count"], r1["count"]) == (0, 0, 1, 1)
    assert (r0["total"], r1["total"]) == ([0.0], [1.0])
    assert (r0["gathered"], r1["gathered"]) == ([0.0], [1.0, 1.0])
    assert (r0["gather"], r1["gather"]) == ([0], [1])


def test_on_a_two_d_mesh_each_replica_group_sums_along_batch_only():
    """On a ("batch", 2) x ("model", 2) mesh, the processes along ``model`` of a replica may hold different
    values (shards): each combines with its peers along ``batch`` alone (ranks 0+2 and 1+3)."""
    results = run_distributed(_on_a_mesh, world_size=4, args=((2, 2),), timeout=300)
    assert [r["replica"] for r in results] == [0, 0, 1, 1] and {r["count"] for r in results} == {2}
    assert [r["total"] for r in results] == [[2.0], [4.0], [2.0], [4.0]]
    assert [r["gathered"] for r in results] == [[0.0, 2.0, 2.0, 2.0], [1.0, 1.0, 3.0, 3.0, 3.0, 3.0]] * 2
    assert [r["gather"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_run_hands_arguments_without_per_replica_values_as_they_are():
    """``strategy.run`` unwraps `PerReplica` arguments only: other containers reach ``fn`` as the same objects
    (a list it appends to, a dict subclass such as a tokenizer's batch)."""
    class Batch(dict):
        pass

    strategy = mf.OneDeviceStrategy("cpu")
    seen, batch = [], Batch(input_ids=torch.ones(2))
    assert strategy.run(lambda s, b: (s.append(1), b)[1], args=(seen,), kwargs={"b": batch}) is batch
    assert seen == [1]
    per_replica = mf.distribute.PerReplica((torch.tensor(3.0),))
    assert float(strategy.run(lambda x: x[0] * 2, args=([per_replica],))) == 6.0  # unwrapped inside the list


def _default_context_in_a_bare_group(rank: int, world: int) -> str:
    context = mf.distribute.get_replica_context()  # no strategy: the group run_distributed formed
    try:
        context.all_reduce("SUM", torch.tensor(1.0))
    except RuntimeError as error:
        return str(error)
    return "returned"


def test_the_default_context_refuses_in_a_group_formed_without_a_strategy():
    """A torch process group of 2 formed by hand: the default context's all_reduce would be this process's
    value alone, so it is refused as in a strategy's job."""
    for message in run_distributed(_default_context_in_a_bare_group, timeout=120):
        assert "2 processes" in message and "strategy.run" in message, message


def _steps_in_replica_context(rank: int, world: int) -> dict[str, float]:
    """TF Keras runs each step of ``fit`` and ``evaluate`` in ``strategy.run``: an overridden step reaches
    the replica context and its cross-replica sums."""
    strategy = mf.MultiWorkerMirroredStrategy()
    seen: dict[str, float] = {}

    class Summing(mf.Model):
        def train_step(self, data):
            context = mf.distribute.get_replica_context()
            seen["train"] = float(context.all_reduce(mf.ReduceOp.SUM, torch.tensor(float(context.replica_id_in_sync_group + 1))))
            return super().train_step(data)

        def test_step(self, data):
            context = mf.distribute.get_replica_context()
            seen.setdefault("test", []).append(float(context.all_reduce(mf.ReduceOp.SUM, torch.ones(()))))
            return super().test_step(data)

    with strategy.scope():
        model = Summing(nn.Linear(2, 1))
        model.compile(optimizer=mf.optimizers.SGD(0.1), loss="mse")
    x, y = np.ones((8, 2), "float32"), np.ones((8, 1), "float32")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, validation_data=(x, y))  # validation: every worker
    model.evaluate(x, y, batch_size=4, verbose=0)  # outside fit, a replicated model: this worker alone
    return seen


def test_fit_and_evaluate_run_each_step_in_the_replica_context():
    """tf-keras ``Model.make_train_function`` runs ``train_step`` through ``strategy.run``. meshfit's
    ``evaluate`` of a replicated model outside ``fit`` runs on the calling worker alone (one replica)."""
    for seen in run_distributed(_steps_in_replica_context, world_size=2, timeout=300):
        assert seen == {"train": 3.0, "test": [2.0, 2.0, 1.0, 1.0]}


def test_the_replica_context_is_per_thread():
    """TensorFlow's replica context is per thread: a thread started inside ``strategy.run`` (a data
    prefetch, a checkpoint writer) is not inside that step's replica context."""
    import threading

    strategy = mf.OneDeviceStrategy("cpu")
    seen = {}

    def step():
        seen["main"] = mf.distribute.in_replica_context()
        worker = threading.Thread(target=lambda: seen.setdefault("thread", mf.distribute.in_replica_context()))
        worker.start()
        worker.join(timeout=30)

    strategy.run(step)
    assert seen == {"main": True, "thread": False}
