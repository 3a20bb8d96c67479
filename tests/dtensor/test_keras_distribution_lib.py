"""Keras 3's ``keras/src/distribution/distribution_lib_test.py``, ported to ``mf.distribution``.

Source: keras-team/keras at commit 3422977a5e38fb2f7709aaa9a08e47f0c43d0f60. Assertions are kept
(values, types, error messages); only tensors are translated: ``backend.Variable(initializer=...,
name=...)`` becomes a torch ``nn.Parameter`` carrying Keras's ``path`` (the name a `LayoutMap` is
looked up with), and the mocks patch meshfit's backend functions (``meshfit.distribution._devices``)
where Keras patches its backend's. None of these cases starts a process: a `DeviceMesh` of 8 CPU
devices is a value until a model trains on it.

Cases in source: 32 (MultiProcessInitializeTest 3, DeviceMeshTest 2, TensorLayoutTest 4,
DistributionTest 3, DataParallelDistributionTest 8, ModelParallelDistributionTest 6, LayoutMapTest 5,
DataShardingIntegrationTest 1; the commented-out TensorflowDistributionLibTest is not counted).
Ported: 28. Passing: 28 (100 %). Not ported (listed in docs/fragments/layouts.md, "Differences"):
the 3 ``initialize()`` cases (meshfit forms its processes from ``meshfit launch``, torchrun, SLURM
or ``TF_CONFIG``; there is no ``keras.distribution.initialize``) and the JAX-only
``DataShardingIntegrationTest`` (it drives Keras's ``TFDatasetAdapter`` on 4 JAX devices).
"""

from __future__ import annotations

import unittest
from unittest import mock

import numpy as np
import torch
from torch import nn

from meshfit import distribution as distribution_lib
from meshfit.distribution import _devices as backend_dlib


def _variable(initializer, name=None):
    """``backend.Variable(initializer=..., name=...)``: a torch parameter with Keras's ``path``."""
    variable = nn.Parameter(torch.as_tensor(np.asarray(initializer, dtype="float32")))
    variable.path = name or "variable"
    return variable


class TestCase(unittest.TestCase):
    def assertLen(self, container, expected_len):  # noqa: N802 (Keras's testing.TestCase name)
        self.assertEqual(len(container), expected_len)


class DeviceMeshTest(TestCase):
    def test_mesh_creation(self):
        devices = [f"cpu:{i}" for i in range(8)]
        shape = (4, 2)
        axis_names = ["batch", "model"]

        mesh = distribution_lib.DeviceMesh(shape, axis_names, devices)
        self.assertEqual(mesh.shape, shape)
        self.assertEqual(mesh.axis_names, axis_names)
        self.assertEqual(mesh.devices.shape, shape)

    def test_input_validation(self):
        devices = [f"cpu:{i}" for i in range(4)]
        with self.assertRaisesRegex(ValueError, "Shape and axis_names cannot be empty"):
            distribution_lib.DeviceMesh((4,), "", devices)

        with self.assertRaisesRegex(ValueError, "Shape and axis_names should have same size"):
            distribution_lib.DeviceMesh((4, 2), ["batch"], devices)

        with self.assertRaisesRegex(ValueError, "Shape does not match the number of devices"):
            distribution_lib.DeviceMesh((4, 2), ["batch", "model"], devices)


class TensorLayoutTest(TestCase):
    def setUp(self):
        super().setUp()
        self.mesh = distribution_lib.DeviceMesh((4, 2), ["data", "model"], [f"cpu:{i}" for i in range(8)])

    def test_tensor_layout_creation(self):
        axes = ("data", None)
        layout = distribution_lib.TensorLayout(axes, self.mesh)

        self.assertEqual(layout.device_mesh, self.mesh)
        self.assertEqual(layout.axes, axes)

    def test_tensor_layout_validation(self):
        axes = ("data", "unknown", None)
        with self.assertRaisesRegex(ValueError, "Invalid axis names for Layout"):
            distribution_lib.TensorLayout(axes, self.mesh)

    def test_lazy_device_mesh_injection(self):
        axes = ("data", None)
        layout = distribution_lib.TensorLayout(axes, None)

        self.assertIsNone(layout.device_mesh)
        self.assertEqual(layout.axes, axes)

        layout.device_mesh = self.mesh

        self.assertEqual(layout.device_mesh, self.mesh)
        self.assertEqual(layout.axes, axes)

    def test_lazy_device_mesh_validation(self):
        axes = ("data", "unknown", None)
        layout = distribution_lib.TensorLayout(axes, None)

        self.assertIsNone(layout.device_mesh)
        self.assertEqual(layout.axes, axes)

        with self.assertRaisesRegex(ValueError, "Invalid axis names for Layout"):
            layout.device_mesh = self.mesh


class DistributionTest(TestCase):
    def setUp(self):
        super().setUp()
        devices = [f"cpu:{i}" for i in range(8)]
        shape = (4, 2)
        axis_names = ["batch", "model"]

        self.device_mesh = distribution_lib.DeviceMesh(shape, axis_names, devices)

    def test_init_with_device_mesh(self):
        distribution = distribution_lib.Distribution(self.device_mesh)
        self.assertIs(distribution.device_mesh, self.device_mesh)

    def test_scope(self):
        distribution_1 = distribution_lib.Distribution(self.device_mesh)
        distribution_2 = distribution_lib.Distribution(self.device_mesh)

        self.assertIsNone(distribution_lib.distribution())
        with distribution_1.scope():
            self.assertIs(distribution_lib.distribution(), distribution_1)
            with distribution_2.scope():
                self.assertIs(distribution_lib.distribution(), distribution_2)

            self.assertIs(distribution_lib.distribution(), distribution_1)

        self.assertIsNone(distribution_lib.distribution())

    def test_data_shard_id(self):
        # Case 1: num_model_replicas >= num_processes
        # data_shard_id should be process_id
        distribution = distribution_lib.Distribution(self.device_mesh)
        with (
            mock.patch.object(distribution.__class__, "num_model_replicas", new_callable=mock.PropertyMock,
                              return_value=8),
            mock.patch.object(distribution.__class__, "num_processes", new_callable=mock.PropertyMock,
                              return_value=4),
        ):
            for process_id in range(4):
                with mock.patch.object(distribution, "_process_id", process_id):
                    self.assertEqual(distribution.data_shard_id, process_id)

        # Case 2: num_model_replicas < num_processes
        # data_shard_id should be process_id //
        # (num_processes // num_model_replicas)
        with (
            mock.patch.object(distribution.__class__, "num_model_replicas", new_callable=mock.PropertyMock,
                              return_value=2),
            mock.patch.object(distribution.__class__, "num_processes", new_callable=mock.PropertyMock,
                              return_value=4),
        ):
            expected_data_shard_ids = [0, 0, 1, 1]
            for process_id, expected in enumerate(expected_data_shard_ids):
                with mock.patch.object(distribution, "_process_id", process_id):
                    self.assertEqual(distribution.data_shard_id, expected)


class DataParallelDistributionTest(TestCase):
    def setUp(self):
        super().setUp()
        self.devices = [f"cpu:{i}" for i in range(8)]
        shape = (8,)
        axis_names = ["data"]

        self.device_mesh = distribution_lib.DeviceMesh(shape, axis_names, self.devices)

    def test_create_with_device_mesh(self):
        distribution = distribution_lib.DataParallel(device_mesh=self.device_mesh)

        device_mesh = distribution.device_mesh
        self.assertEqual(len(device_mesh.devices), 8)
        self.assertEqual(device_mesh.axis_names, ["data"])
        self.assertEqual(distribution.batch_dim_name, "data")

        self.assertFalse(distribution._is_multi_process)
        self.assertEqual(distribution._process_id, 0)
        self.assertEqual(distribution.num_processes, 1)

    def test_create_with_devices(self):
        distribution = distribution_lib.DataParallel(devices=self.devices)
        device_mesh = distribution.device_mesh
        self.assertEqual(len(device_mesh.devices), 8)
        self.assertEqual(device_mesh.axis_names, ["batch"])
        self.assertEqual(distribution.batch_dim_name, "batch")

    @mock.patch.object(backend_dlib, "list_devices", return_value=[f"cpu:{i}" for i in range(8)])
    def test_create_with_list_devices(self, mock_list_devices):
        distribution = distribution_lib.DataParallel()
        mock_list_devices.assert_called_once()

        device_mesh = distribution.device_mesh
        self.assertEqual(len(device_mesh.devices), 8)
        self.assertEqual(device_mesh.axis_names, ["batch"])
        self.assertEqual(distribution.batch_dim_name, "batch")

    def test_get_data_layout(self):
        distribution = distribution_lib.DataParallel(device_mesh=self.device_mesh)

        data = np.arange(16).reshape((4, 2, 2))
        data_layout = distribution.get_data_layout(data.shape)
        self.assertIs(data_layout.device_mesh, self.device_mesh)
        self.assertEqual(data_layout.axes, ("data", None, None))

    def test_get_variable_layout(self):
        distribution = distribution_lib.DataParallel(device_mesh=self.device_mesh)

        variable = _variable(initializer=[1.0, 2.0, 3.0])
        variable_layout = distribution.get_variable_layout(variable)
        self.assertIs(variable_layout.device_mesh, self.device_mesh)
        self.assertEqual(variable_layout.axes, (None,))

    def test_get_variable_layout_with_explicit_layout(self):
        distribution = distribution_lib.DataParallel(device_mesh=self.device_mesh)

        explicit_mesh = distribution_lib.DeviceMesh((8,), ["x"], self.devices)
        explicit_layout = distribution_lib.TensorLayout(["x"], explicit_mesh)

        variable = _variable(initializer=[1.0, 2.0, 3.0])
        variable._layout = explicit_layout
        variable_layout = distribution.get_variable_layout(variable)
        self.assertIs(variable_layout.device_mesh, explicit_mesh)
        self.assertEqual(variable_layout.axes, explicit_layout.axes)

    @mock.patch.object(backend_dlib, "num_processes", return_value=2)
    def test_num_model_replicas(self, mock_backend_num_processes):
        distribution = distribution_lib.DataParallel(device_mesh=self.device_mesh)
        self.assertEqual(distribution.num_model_replicas, 8)
        self.assertEqual(distribution.num_processes, 2)

    def test_get_tensor_layout(self):
        distribution = distribution_lib.DataParallel(device_mesh=self.device_mesh)

        path = "path/to/tensor"
        tensor_layout = distribution.get_tensor_layout(path)
        self.assertIsNone(tensor_layout)


class ModelParallelDistributionTest(TestCase):
    def setUp(self):
        super().setUp()
        self.devices = [f"cpu:{i}" for i in range(8)]
        shape = (2, 4)
        axis_names = ["data", "model"]

        self.device_mesh = distribution_lib.DeviceMesh(shape, axis_names, self.devices)

    def test_distribute_weights(self):
        layout_map = distribution_lib.LayoutMap(self.device_mesh)
        layout_map[".*kernel"] = distribution_lib.TensorLayout([None, "model"])
        layout_map[".*bias"] = distribution_lib.TensorLayout(["model"])

        distribution = distribution_lib.ModelParallel(layout_map=layout_map, batch_dim_name="data")
        kernel = _variable(initializer=np.arange(8, 4), name="kernel")
        bias = _variable(initializer=np.arange(4), name="bias")
        rng_seed = _variable(initializer=[0, 1], name="seed")

        kernel_layout = distribution.get_variable_layout(kernel)
        self.assertIs(kernel_layout.device_mesh, self.device_mesh)
        self.assertEqual(kernel_layout.axes, (None, "model"))

        bias_layout = distribution.get_variable_layout(bias)
        self.assertIs(bias_layout.device_mesh, self.device_mesh)
        self.assertEqual(bias_layout.axes, ("model",))

        rng_seed_layout = distribution.get_variable_layout(rng_seed)
        self.assertIs(rng_seed_layout.device_mesh, self.device_mesh)
        self.assertEqual(rng_seed_layout.axes, (None,))

    def test_distribute_data(self):
        layout_map = distribution_lib.LayoutMap(self.device_mesh)
        distribution = distribution_lib.ModelParallel(layout_map=layout_map, batch_dim_name="data")

        data = np.arange(16).reshape((4, 2, 2))
        data_layout = distribution.get_data_layout(data.shape)
        self.assertIs(data_layout.device_mesh, self.device_mesh)
        self.assertEqual(data_layout.axes, ("data", None, None))

    def test_get_tensor_layout(self):
        layout_map = distribution_lib.LayoutMap(self.device_mesh)
        layout_map[".*kernel"] = distribution_lib.TensorLayout([None, "model"])
        layout_map[".*bias"] = distribution_lib.TensorLayout(["model"])
        layout_map["/model/layer/tensor"] = ("data", None)

        distribution = distribution_lib.ModelParallel(layout_map=layout_map, batch_dim_name="data")
        layout = distribution.get_tensor_layout("/model/layer/tensor")
        self.assertIs(layout.device_mesh, self.device_mesh)
        self.assertEqual(layout.axes, ("data", None))

        layout = distribution.get_tensor_layout("/model/layer/other_tensor")
        self.assertIsNone(layout)

    def test_get_variable_layout_with_explicit_layout(self):
        layout_map = distribution_lib.LayoutMap(self.device_mesh)
        layout_map[".*kernel"] = distribution_lib.TensorLayout([None, "model"])
        distribution = distribution_lib.ModelParallel(layout_map=layout_map, batch_dim_name="data")

        explicit_mesh = distribution_lib.DeviceMesh((8,), ["x"], self.devices)
        explicit_layout = distribution_lib.TensorLayout(["x"], explicit_mesh)
        variable = _variable(initializer=[1, 2, 3], name="kernel")
        variable._layout = explicit_layout
        variable_layout = distribution.get_variable_layout(variable)
        self.assertIs(variable_layout.device_mesh, explicit_mesh)
        self.assertEqual(variable_layout.axes, explicit_layout.axes)

    @mock.patch.object(backend_dlib, "num_processes", return_value=4)
    def test_num_processes_validation(self, mock_backend_num_processes):
        device_mesh = distribution_lib.DeviceMesh(
            (3, 2), ["data", "model"], ["cpu:0", "cpu:1", "cpu:2", "cpu:3", "cpu:4", "cpu:5"])
        layout_map = distribution_lib.LayoutMap(device_mesh)
        with self.assertRaisesRegex(ValueError, "`num_processes` must be divisible by `num_model_replicas`"):
            distribution_lib.ModelParallel(layout_map=layout_map, batch_dim_name="data", auto_shard_dataset=True)

    @mock.patch.object(backend_dlib, "num_processes", return_value=2)
    def test_num_model_replicas(self, mock_backend_num_processes):
        device_mesh = distribution_lib.DeviceMesh((4, 2), ["data", "model"], [f"cpu:{i}" for i in range(8)])
        layout_map = distribution_lib.LayoutMap(device_mesh)
        distribution = distribution_lib.ModelParallel(layout_map=layout_map, batch_dim_name="data")
        self.assertEqual(distribution.num_model_replicas, 4)
        self.assertEqual(distribution.num_processes, 2)


class LayoutMapTest(TestCase):
    def setUp(self):
        super().setUp()
        self.devices = [f"cpu:{i}" for i in range(8)]
        shape = (4, 2)
        axis_names = ["data", "model"]

        self.device_mesh = distribution_lib.DeviceMesh(shape, axis_names, self.devices)
        self.sharded_2d = distribution_lib.TensorLayout([None, "model"])
        self.sharded_1d = distribution_lib.TensorLayout(["model"])

        self.replicated_2d = distribution_lib.TensorLayout([None, None])
        self.replicated_1d = distribution_lib.TensorLayout([None])

    def test_add(self):
        layout_map = distribution_lib.LayoutMap(self.device_mesh)
        layout_map["dense/kernel"] = self.sharded_2d
        layout_map["dense/bias"] = self.sharded_1d
        # Test for adding list/tuple as shortcut for TensorLayout
        layout_map["conv/bias"] = ("model",)

        # Make there are two items in the map, and we access them via the
        # underlying container at layout_map._layout_map
        self.assertLen(layout_map, 3)

        kernel_layout = layout_map["dense/kernel"]
        self.assertEqual(kernel_layout.axes, (None, "model"))
        self.assertIs(kernel_layout.device_mesh, self.device_mesh)

        bias_layout = layout_map["dense/bias"]
        self.assertEqual(bias_layout.axes, ("model",))
        self.assertIs(bias_layout.device_mesh, self.device_mesh)

        conv_bias_layout = layout_map["conv/bias"]
        self.assertEqual(conv_bias_layout.axes, ("model",))
        self.assertIs(bias_layout.device_mesh, self.device_mesh)

        with self.assertRaisesRegex(ValueError, "dense/kernel already exist"):
            layout_map["dense/kernel"] = self.sharded_2d

        with self.assertRaisesRegex(ValueError, "should be a TensorLayout"):
            layout_map["conv.kernel"] = ["a", "b"]

    def test_get(self):
        layout_map = distribution_lib.LayoutMap(self.device_mesh)
        layout_map["dense/kernel"] = self.sharded_2d
        layout_map["dense/bias"] = self.sharded_1d

        layout_map[".*dense.*kernel"] = self.replicated_2d
        layout_map[".*dense.*bias"] = self.replicated_1d

        layout_map[".*bias"] = self.sharded_1d

        self.assertEqual(layout_map["dense/kernel"], self.sharded_2d)
        self.assertEqual(layout_map["dense/bias"], self.sharded_1d)

        self.assertEqual(layout_map["dense_2/kernel"], self.replicated_2d)
        # Map against the wildcard bias rule for dense. This will cause a
        # ValueError
        with self.assertRaisesRegex(ValueError, "Path 'dense_2/bias' matches multiple layout"):
            layout_map["dense_2/bias"]

        self.assertIsNone(layout_map["conv2d/kernel"])
        self.assertEqual(layout_map["conv2d/bias"], self.sharded_1d)

    def test_delete(self):
        layout_map = distribution_lib.LayoutMap(self.device_mesh)

        layout_map["dense/kernel"] = self.sharded_2d
        layout_map["dense/bias"] = self.sharded_1d

        self.assertEqual(layout_map.pop("dense/kernel"), self.sharded_2d)
        # Make sure to match against the exact string, not the regex
        with self.assertRaises(KeyError):
            layout_map.pop(".*bias")

        # Make sure del also works
        del layout_map["dense/bias"]

        self.assertLen(layout_map, 0)

    def test_len(self):
        layout_map = distribution_lib.LayoutMap(self.device_mesh)
        self.assertLen(layout_map, 0)

        layout_map["dense/kernel"] = self.sharded_2d
        layout_map["dense/bias"] = self.sharded_1d

        self.assertLen(layout_map, 2)

    def test_iter(self):
        layout_map = distribution_lib.LayoutMap(self.device_mesh)

        layout_map["dense/kernel"] = self.sharded_2d
        layout_map["dense/bias"] = self.sharded_1d

        # Make sure the items are ordered based on the insertion order.
        self.assertEqual(list(layout_map.keys()), ["dense/kernel", "dense/bias"])

        keys = []
        values = []
        for k, v in layout_map.items():
            keys.append(k)
            values.append(v)

        self.assertEqual(keys, ["dense/kernel", "dense/bias"])
        self.assertEqual(values, [self.sharded_2d, self.sharded_1d])


def test_no_case_started_a_process():
    """The cases above build meshes of 8 CPU devices as values: no process group was formed."""
    import torch.distributed as dist

    assert not dist.is_initialized()
