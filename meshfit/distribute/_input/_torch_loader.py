"""Which examples each replica reads from a torch ``DataLoader`` (or any iterable of batches).

meshfit splits each global batch across the replicas (the DATA policy), so every replica must
read the same batches in the same order. A loader is recognised by its sampler:

==================================  ====================================================================
the loader                          what each replica reads
==================================  ====================================================================
``shuffle=True`` with a seeded      torch's own order: each worker's generator (seeded alike on every
``generator`` (random, subset,      worker, checked) draws each pass as one process does; its state at
weighted), also in a BatchSampler   the pass's start is saved with the position, so a resume replays it
``shuffle=True``, no generator      the same order everywhere: each pass's generator is seeded from one
                                    seed rank 0 draws from torch's global generator (saved too)
``DistributedSampler`` (also in     already sharded: its own batches, not sliced again;
a ``BatchSampler``)                 ``set_epoch(pass)`` before each pass
``distribute_datasets_from_         its own batches, not sliced again (an ``IterableDataset``
function(lambda ctx: loader)``      that shards itself by rank)
sequential, or anything else        the same batches, sliced; anything meshfit cannot recognise
(``IterableDataset``, a custom      (``IterableDataset``, custom samplers, plain iterables) is
sampler, a list of batches)         checked: the first batch of each pass must agree everywhere
==================================  ====================================================================
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from meshfit._protocols import InputContextLike
from meshfit.data import leaves, to_tensor
from meshfit.distribute._values import InputContext

_SEEDED_SAMPLERS = (torch.utils.data.RandomSampler, torch.utils.data.SubsetRandomSampler,
                    torch.utils.data.WeightedRandomSampler)


class PerReplicaLoader:
    """A loader that ``distribute_datasets_from_function`` built for this replica alone."""

    def __init__(self, loader: Any, context: InputContext) -> None:
        self.loader, self.context = loader, context

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def _index_samplers(loader: Any) -> list[Any]:
    """The samplers that choose a DataLoader's examples, outermost first."""
    if not isinstance(loader, torch.utils.data.DataLoader):
        return []
    if loader.batch_sampler is not None and not isinstance(loader.batch_sampler, torch.utils.data.BatchSampler):
        return [loader.batch_sampler]  # a custom batch sampler: meshfit cannot look inside
    if loader.batch_sampler is not None:
        return [loader.batch_sampler.sampler]
    return [loader.sampler]


def _fingerprint(element: Any) -> str:
    digest = hashlib.blake2b(digest_size=12)
    for leaf in leaves(to_tensor(element)):
        if isinstance(leaf, torch.Tensor):
            leaf = leaf.detach().cpu().contiguous()
            digest.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
            digest.update(leaf.view(-1).view(torch.uint8).numpy().tobytes() if leaf.numel() else b"")
        else:
            digest.update(repr(leaf).encode())
    return digest.hexdigest()


class LoaderPlan:
    """How this replica reads a loader: whether it is sharded already, and how each pass starts.

    Args:
        loader: the user's ``DataLoader`` or iterable of batches.
        context: this replica's ``InputContext``.
        broadcast: the strategy's ``broadcast_object`` (rank 0's value everywhere).
        all_gather: the strategy's ``all_gather_object``.
        per_replica: the loader came from ``distribute_datasets_from_function``.
    """

    def __init__(self, loader: Any, context: InputContextLike, broadcast: Callable[[Any], Any],
                 all_gather: Callable[[Any], list[Any]], per_replica: bool = False) -> None:
        self.loader, self.all_gather = loader, all_gather
        self.num_replicas, self.replica_id = context.num_input_pipelines, context.input_pipeline_id
        samplers = _index_samplers(loader)
        distributed = [s for s in samplers if isinstance(s, torch.utils.data.DistributedSampler)]
        seeded = [s for s in samplers if isinstance(s, _SEEDED_SAMPLERS)]
        self.sharded = per_replica or bool(distributed)
        self._distributed: list[Any] = distributed
        self._seeded: list[Any] = seeded  # samplers with a ``generator`` (RandomSampler and its kin)
        # The user's own generators (DataLoader(..., generator=g)): torch's own order, every pass
        # from where the last one left them; each pass's starting state is kept for replays and backups.
        self._generators: list[torch.Generator] = [s.generator for s in seeded if s.generator is not None]
        if len(self._generators) != len(seeded):
            self._generators = []
        self._pass_starts: dict[int, list[torch.Tensor]] = {}
        self._reading: tuple[int, Iterator[Any]] | None = None  # the pass read last and torch's iterator of it
        self._base_seed: int | None = None  # unseeded shuffles: one seed for all, per pass
        self.check_first_batch = False
        recognised = bool(distributed or seeded) or (
            bool(samplers) and isinstance(samplers[0], torch.utils.data.SequentialSampler))
        # A map-style dataset read by a sampler meshfit knows gives the same batches again on a replay.
        self.replays_exactly = recognised and not isinstance(
            getattr(loader, "dataset", None), torch.utils.data.IterableDataset)
        if per_replica:
            return
        if self.num_replicas > 1:
            for sampler in distributed:
                self._check_distributed_sampler(sampler)
        if self._generators and self.num_replicas > 1:
            self._check_same_generators()
        elif seeded and not self._generators:
            own = int(torch.randint(0, 2**62, (), dtype=torch.int64))
            self._base_seed = int(broadcast(own)) if self.num_replicas > 1 else own
        self.check_first_batch = self.num_replicas > 1 and not recognised

    def _check_same_generators(self) -> None:
        prints = self.all_gather([_fingerprint(g.get_state()) for g in self._generators])
        if len(set(map(tuple, prints))) > 1:
            raise ValueError(
                "The DataLoader's shuffle generator differs between workers (a different seed, or one drawn "
                "per worker), but meshfit splits each global batch across the replicas, so every worker must "
                "shuffle alike: examples would be trained twice or never. Seed it the same on every worker, "
                "DataLoader(dataset, shuffle=True, generator=torch.Generator().manual_seed(seed)), or drop "
                "the generator (meshfit then shuffles the same everywhere).")

    def state_dict(self, pass_index: int) -> dict[str, Any]:
        """What replays pass ``pass_index`` in another process: the generators' states at its start."""
        if pass_index not in self._pass_starts:
            self._finish_pass_before(pass_index)
        states = self._pass_starts.get(pass_index) or [g.get_state() for g in self._generators]
        return {"pass": pass_index, "base_seed": self._base_seed,
                "generator_states": [bytes(state.tolist()).hex() for state in states]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = state.get("generator_states") or []
        if len(states) == len(self._generators) and states:
            self._pass_starts = {int(state["pass"]): [
                torch.tensor(list(bytes.fromhex(text)), dtype=torch.uint8) for text in states]}
        if state.get("base_seed") is not None and self._base_seed is not None:
            self._base_seed = int(state["base_seed"])

    @staticmethod
    def reads_own_shard(loader: Any) -> bool:
        """Whether ``loader`` gives each worker only its part of the data (a ``DistributedSampler``)."""
        if isinstance(loader, PerReplicaLoader):
            return True
        return any(isinstance(s, torch.utils.data.DistributedSampler) for s in _index_samplers(loader))

    def _check_distributed_sampler(self, sampler: Any) -> None:
        n, r = self.num_replicas, self.replica_id
        if sampler.num_replicas != n or sampler.rank != r:
            raise ValueError(
                f"Invalid DistributedSampler: expected num_replicas={n} and rank={r} (this replica of the "
                f"{n} in sync), received num_replicas={sampler.num_replicas}, rank={sampler.rank}. Build it "
                "inside the strategy's process group with the defaults, DistributedSampler(dataset), or "
                "drop it: meshfit splits each global batch across the replicas itself.")

    def iterate(self, pass_index: int) -> Iterator[Any]:
        """The loader's batches for pass ``pass_index``, in the order every replica agrees on."""
        for sampler in self._distributed:
            sampler.set_epoch(pass_index)
        if self._generators:
            starts = self._pass_starts.get(pass_index)
            if starts is None:  # a new pass starts where the last one left the user's generators
                self._finish_pass_before(pass_index)
                self._pass_starts = {pass_index: [g.get_state() for g in self._generators]}
            else:  # a replay (a resume, a restart of the pass): from the pass's first state
                for generator, state in zip(self._generators, starts, strict=True):
                    generator.set_state(state)
            iterator = iter(self.loader)
            self._reading = (pass_index, iterator)
            yield from self._checked(iterator)
            return
        if self._base_seed is None:
            yield from self._checked(iter(self.loader))
            return
        saved = [sampler.generator for sampler in self._seeded]
        for sampler in self._seeded:
            # One generator per pass: the same order on every replica, and a resume replays it.
            sampler.generator = torch.Generator().manual_seed(self._base_seed + 1_000_003 * pass_index)
        try:
            iterator = iter(self.loader)
            first = next(iterator, _END)
        finally:  # the sampler has drawn its permutation by its first batch: its own is back
            for sampler, generator in zip(self._seeded, saved, strict=True):
                sampler.generator = generator
        if first is _END:
            return
        yield first
        yield from iterator

    def _finish_pass_before(self, pass_index: int) -> None:
        """Run torch's iterator of the previous pass to its end, as ``list(loader)`` does: a sampler
        draws from the generator after its last index too (``RandomSampler``'s remainder permutation)."""
        if self._reading is not None and self._reading[0] == pass_index - 1:
            for _ in self._reading[1]:
                pass
        self._reading = None

    def _checked(self, iterator: Iterator[Any]) -> Iterator[Any]:
        if not self.check_first_batch:
            yield from iterator
            return
        first = next(iterator, _END)
        prints = self.all_gather(None if first is _END else _fingerprint(first))
        if len(set(prints)) > 1:
            raise ValueError(
                "The replicas' input yielded different first batches, but meshfit splits each global batch "
                f"across the {self.num_replicas} replicas, so each must read the same batches: examples would be "
                "trained twice or never. If the data shards itself by rank (an IterableDataset reading "
                "torch.distributed.get_rank()), pass strategy.distribute_datasets_from_function(lambda context: "
                "loader) to fit instead; if it shuffles, seed its shuffle the same on every worker; or use "
                "DataLoader(dataset, shuffle=True), which meshfit shuffles the same everywhere.")
        if first is _END:
            return
        yield first
        yield from iterator


_END = object()
