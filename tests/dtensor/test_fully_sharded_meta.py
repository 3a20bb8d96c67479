"""Fully sharded data parallel on a model built on the meta device (issue 21: larger than one process).

``mf.Model(module)`` under ``LayoutMap.fully_sharded`` with a module built under
``torch.device("meta")``: each block is given storage, initialised (``reset_parameters()``, in module
order), given rank 0's values and sharded before the next block, so a process never holds more than
one block's full weights. On 2 gloo processes the weights equal an eagerly built model's bitwise,
before and after ``fit``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tests._multiproc import run_distributed

WIDTH, BLOCKS = 16, 3


def _build():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, 4))


def _fit(rank, world, meta):
    from torch.distributed.tensor import DTensor

    import meshfit as mf

    if meta:
        with torch.device("meta"):
            module = _build()
    else:
        module = _build()
    full_seen: list[int] = []  # numel of the full (unsharded, materialised) parameters at each init
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            original = sub.reset_parameters

            def reset(original=original):
                full_seen.append(sum(p.numel() for p in module.parameters()
                                     if not p.is_meta and not isinstance(p, DTensor)))
                original()
            sub.reset_parameters = reset
    mesh = mf.dtensor.create_mesh([("batch", world)])
    with mf.dtensor.LayoutMap.fully_sharded(mesh).scope():
        model = mf.Model(module)
        model.compile(optimizer=mf.optimizers.Adam(0.01),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    initial = model.get_weights()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, WIDTH)).astype("float32")
    y = rng.integers(0, 4, size=(40,)).astype("int64")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    local = tuple(model.module[0][0].weight.to_local().shape)
    return initial, model.get_weights(), full_seen, local


def test_a_meta_built_model_shards_block_by_block_and_equals_the_eager_build():
    eager = run_distributed(_fit, world_size=2, args=(False,), timeout=300)
    meta = run_distributed(_fit, world_size=2, args=(True,), timeout=300)
    for (e_init, e_trained, _, _), (m_init, m_trained, full_seen, local) in zip(eager, meta, strict=True):
        for got, want in zip([*m_init, *m_trained], [*e_init, *e_trained], strict=True):
            np.testing.assert_array_equal(got, want)  # same initial values and same training, bitwise
        assert local == (WIDTH // 2, WIDTH)
        # Each Linear is initialised with at most its own block's full weights materialised.
        assert len(full_seen) == BLOCKS + 1
        assert max(full_seen) <= WIDTH * WIDTH + WIDTH


class _NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x):
        return x * self.scale


def _no_reset(rank, world):
    import meshfit as mf

    with torch.device("meta"):
        module = nn.Sequential(nn.Linear(WIDTH, WIDTH), _NoReset())
    with mf.dtensor.LayoutMap.fully_sharded(mf.dtensor.create_mesh([("batch", world)])).scope():
        try:
            mf.Model(module)
        except ValueError as e:
            return str(e), module[0].weight.is_meta
    return None, None


def test_a_meta_module_without_reset_parameters_is_refused_before_anything_is_sharded():
    message, still_meta = run_distributed(_no_reset, world_size=1, timeout=120)[0]
    assert message is not None and "'1'" in message and "_NoReset" in message and "reset_parameters()" in message
    assert still_meta  # refused before the first block was materialised
