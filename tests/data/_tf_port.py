"""What the ported ``tf.data`` kernel tests share: TensorFlow's test-base checks, in torch/numpy terms.

Translation rules used by every ``test_tf_data_*.py`` here (only tensors and error types translate):

- ``self.getNext(ds)`` / ``get_next()`` -> ``it = iter(ds)`` / ``next(it)``; ``errors.OutOfRangeError`` at
  the end -> ``StopIteration``.
- ``assertDatasetProduces(ds, expected)`` -> `produces` (values and shapes equal, then the end).
- ``errors.InvalidArgumentError`` for a bad argument -> ``ValueError`` (meshfit raises when the dataset is
  built, TensorFlow when it is first evaluated; the TF tests build inside their ``assertRaises``).
- an error raised inside a map function stays that error (``check_numerics`` -> a check raising
  ``ValueError``); ``StopIteration`` raised by a map function -> ``RuntimeError`` (PEP 479's rule).
- ``checkpoint_test_base.default_test_combinations()`` -> `VERIFY_FNS`: TensorFlow's eager checkpoint
  checks, with ``tf.train.Checkpoint(iterator=...)`` save/restore translated to the iterator's
  ``state_dict()`` (through JSON, as a backup stores it) and ``load_state_dict`` on a new iterator of a
  freshly built dataset. (``verify_reset_restored_iterator`` skips itself in eager mode in TF, so it is
  not translated; ``symbolic_checkpoint`` and ``apply_default_optimizations`` are TF-only options.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from meshfit.data import Dataset


def as_numpy(value: Any) -> Any:
    """Tensors as numpy arrays, structure kept (what ``self.evaluate`` returns)."""
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, dict):
        return {k: as_numpy(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return type(value)(*(as_numpy(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(as_numpy(v) for v in value)
    return value


def assert_same(actual: Any, expected: Any) -> None:
    """TensorFlow's ``assertValuesEqual``/``match``: same structure, same shapes, same values."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"expected a dict, got {actual!r}"
        assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
        for key in expected:
            assert_same(actual[key], expected[key])
        return
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected), f"expected {expected!r}, got {actual!r}"
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e)
        return
    if expected is None:
        assert actual is None, f"expected None, got {actual!r}"
        return
    a, e = np.asarray(as_numpy(actual)), np.asarray(expected)
    assert a.shape == e.shape, f"shape {a.shape} != expected {e.shape} (value {a!r} vs {e!r})"
    np.testing.assert_array_equal(a, e)


def produces(dataset: Dataset, expected: Any) -> None:
    """``assertDatasetProduces``: exactly ``expected``, in order, then the end (twice, as TF checks)."""
    it = iter(dataset)
    for i, want in enumerate(expected):
        try:
            got = next(it)
        except StopIteration:
            raise AssertionError(f"ended after {i} elements, expected {len(list(expected))}") from None
        assert_same(got, want)
    for _ in range(2):
        try:
            extra = next(it)
        except StopIteration:
            continue
        raise AssertionError(f"expected the end, got another element {extra!r}")


def output(dataset: Dataset) -> list[Any]:
    """``getDatasetOutput``: every element of a new iterator, as numpy."""
    return [as_numpy(e) for e in dataset]


def ints(values: Any) -> list[Any]:
    """Scalars as Python ints (for order comparisons)."""
    return [int(v) for v in values]


# ---- checkpoint_test_base, eager mode ----------------------------------------------------------------


def _round_trip(state: dict) -> dict:
    return json.loads(json.dumps(state))


def gen_outputs(ds_fn: Callable[[], Dataset], break_points: list[int], num_outputs: int, *,
                ckpt: dict | None = None, verify_exhausted: bool = True,
                save_checkpoint_at_end: bool = True) -> tuple[list[Any], dict | None]:
    """``CheckpointTestBase.gen_outputs`` (eager): a new dataset and iterator per segment, restored from
    the last saved position. Returns the outputs and the last saved position."""
    outputs: list[Any] = []
    for i in range(len(break_points) + 1):
        it = iter(ds_fn())
        if ckpt is not None:
            it.load_state_dict(ckpt)
        start = break_points[i - 1] if i > 0 else 0
        end = break_points[i] if i < len(break_points) else num_outputs
        for _ in range(end - start):
            outputs.append(as_numpy(next(it)))
        if i == len(break_points) and verify_exhausted:
            try:
                extra = next(it)
            except StopIteration:
                pass
            else:
                raise AssertionError(f"expected the end after {num_outputs} elements, got {extra!r}")
        if save_checkpoint_at_end or i < len(break_points):
            ckpt = _round_trip(it.state_dict())
        it.close()
    return outputs, ckpt


def match(expected: list[Any], actual: list[Any]) -> None:
    assert len(expected) == len(actual), (len(expected), len(actual))
    for e, a in zip(expected, actual, strict=True):
        assert_same(a, e)


def verify_run_with_breaks(ds_fn: Callable[[], Dataset], break_points: list[int], num_outputs: int,
                           verify_exhausted: bool = True) -> None:
    expected, _ = gen_outputs(ds_fn, [], num_outputs, verify_exhausted=verify_exhausted)
    actual, _ = gen_outputs(ds_fn, break_points, num_outputs, verify_exhausted=verify_exhausted)
    match(expected, actual)


def verify_unused_iterator(ds_fn: Callable[[], Dataset], num_outputs: int) -> None:
    verify_run_with_breaks(ds_fn, [0], num_outputs)


def verify_fully_used_iterator(ds_fn: Callable[[], Dataset], num_outputs: int) -> None:
    verify_run_with_breaks(ds_fn, [num_outputs], num_outputs)


def verify_exhausted_iterator(ds_fn: Callable[[], Dataset], num_outputs: int) -> None:
    _, ckpt = gen_outputs(ds_fn, [], num_outputs, verify_exhausted=True)
    actual, _ = gen_outputs(ds_fn, [], 0, ckpt=ckpt, verify_exhausted=True)
    assert len(actual) == 0


def verify_multiple_breaks(ds_fn: Callable[[], Dataset], num_outputs: int, num_breaks: int = 10) -> None:
    break_points = [int(b) for b in np.linspace(0, num_outputs, num_breaks, dtype=int)]
    verify_run_with_breaks(ds_fn, break_points, num_outputs)


VERIFY_FNS = {
    "verify_unused_iterator": verify_unused_iterator,
    "verify_fully_used_iterator": verify_fully_used_iterator,
    "verify_exhausted_iterator": verify_exhausted_iterator,
    "verify_multiple_breaks": verify_multiple_breaks,
}
