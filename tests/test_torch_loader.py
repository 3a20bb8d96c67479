"""A torch DataLoader on 2 workers: every example exactly once per epoch, whatever the loader's shape."""

from __future__ import annotations

import collections
import json
import os
import re

import pytest
import torch
import torch.distributed as dist
from _multiproc import ChildProcessError_, run_distributed
from _procs import child_env, finish, free_ports, start, tf_config
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler

import meshfit as mf

EXAMPLES = 48
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "loader_ids.py")


def _examples() -> torch.utils.data.TensorDataset:
    ids = torch.arange(EXAMPLES, dtype=torch.float32)
    return torch.utils.data.TensorDataset(torch.stack([ids, ids / EXAMPLES], dim=1), (torch.arange(EXAMPLES) % 2))


class _Recorder(nn.Module):
    """Remembers the example ids (column 0) of every batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 2)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.extend(int(i) for i in x[:, 0].tolist())
        return self.linear(x[:, 1:])


class _ByWorker(IterableDataset):
    """Shards itself across the DataLoader's worker processes (torch's documented pattern)."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, EXAMPLES, step):
            yield torch.tensor([float(i), i / EXAMPLES]), torch.tensor(i % 2)

    def __len__(self) -> int:  # a finite stream with a length: its epochs end (see the README)
        return EXAMPLES


class _ByRank(IterableDataset):
    """Shards itself across the distributed ranks (as e.g. Hugging Face's split_dataset_by_node does)."""

    def __iter__(self):
        for i in range(dist.get_rank(), EXAMPLES, dist.get_world_size()):
            yield torch.tensor([float(i), i / EXAMPLES]), torch.tensor(i % 2)

    def __len__(self) -> int:
        return EXAMPLES // dist.get_world_size()


def _loader(shape: str, strategy: mf.distribute.Strategy):
    data = _examples()
    if shape == "shuffle":
        return DataLoader(data, batch_size=8, shuffle=True)
    if shape == "distributed_sampler":
        return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=3))
    if shape == "batch_sampler":
        return DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 8, drop_last=False))
    if shape == "iterable_by_worker":
        return DataLoader(_ByWorker(), batch_size=8, num_workers=2)
    if shape == "iterable_by_rank":
        return strategy.distribute_datasets_from_function(lambda context: DataLoader(_ByRank(), batch_size=4))
    if shape == "iterable_by_rank_undeclared":
        return DataLoader(_ByRank(), batch_size=4)
    raise AssertionError(shape)


def _train(rank: int, world: int, shape: str):
    torch.manual_seed(100 + rank)  # each process's own random stream differs, as in a real job
    strategy = mf.MultiWorkerMirroredStrategy()
    with strategy.scope():
        recorder = _Recorder()
        model = mf.Model(recorder)
        model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    epochs: list[list[int]] = []
    per_epoch = mf.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: recorder.seen.clear(),
                                            on_epoch_end=lambda epoch, logs: epochs.append(list(recorder.seen)))
    try:
        model.fit(_loader(shape, strategy), epochs=2, verbose=0, callbacks=[per_epoch])
    except ValueError as error:
        return str(error)
    return epochs


def _in_worker_processes(shape: str) -> list:
    """The workers as real processes (TF_CONFIG), so their DataLoaders can start worker processes."""
    ports = free_ports(2)
    procs = [start([SCRIPT, shape], child_env(TF_CONFIG=tf_config(ports, i))) for i in range(2)]
    outputs = [finish(proc, timeout=240) for proc in procs]
    for code, out in outputs:
        assert code == 0, out
    return [json.loads(re.search(r"^IDS (.*)$", out, re.M).group(1)) for _, out in outputs]


@pytest.mark.parametrize("shape", ["shuffle", "distributed_sampler", "batch_sampler", "iterable_by_worker",
                                   "iterable_by_rank"])
def test_every_example_once_per_epoch_on_two_workers(shape):
    if shape == "iterable_by_worker":  # DataLoader(num_workers=2): run_distributed's children are daemons
        per_rank = _in_worker_processes(shape)
    else:
        per_rank = run_distributed(_train, world_size=2, args=(shape,), timeout=240)
    assert not isinstance(per_rank[0], str), per_rank[0]
    for epoch in range(2):
        counts = collections.Counter(per_rank[0][epoch] + per_rank[1][epoch])
        assert sorted(counts) == list(range(EXAMPLES)), (shape, epoch, sorted(counts))
        assert set(counts.values()) == {1}, (shape, epoch, [i for i, c in counts.items() if c > 1])
    if shape in ("shuffle", "distributed_sampler", "batch_sampler"):
        assert per_rank[0][0] != per_rank[0][1]  # shuffled again each epoch (DistributedSampler.set_epoch)


def test_data_that_differs_between_workers_unannounced_is_refused_with_the_fix():
    messages = run_distributed(_train, world_size=2, args=("iterable_by_rank_undeclared",), timeout=240)
    for message in messages:
        assert isinstance(message, str), message
        assert "different first batches" in message
        assert "distribute_datasets_from_function" in message


def _wrong_sampler(rank: int, world: int):
    strategy = mf.MultiWorkerMirroredStrategy()
    data = _examples()
    with strategy.scope():
        model = mf.Model(_Recorder())
        model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=4, rank=rank))
    model.fit(loader, epochs=1, verbose=0)


def test_a_distributed_sampler_for_another_world_is_refused():
    with pytest.raises(ChildProcessError_, match=r"expected num_replicas=2 and rank=\d.*received num_replicas=4"):
        run_distributed(_wrong_sampler, world_size=2, timeout=240)


def test_one_process_reads_the_loader_as_given():
    recorder = _Recorder()
    model = mf.Model(recorder)
    model.compile("sgd", mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(DataLoader(_examples(), batch_size=8, shuffle=True), epochs=1, verbose=0)
    assert sorted(recorder.seen) == list(range(EXAMPLES))
