"""Pipeline parallelism behind ``fit``: a model split into stages along the mesh's pipeline axis.

``layout_map.pipeline(split_points, microbatches, schedule)`` records a `PipelineSpec`; a mesh strategy
applying that map places a module with `PipelineBuilder`: a `Placement` whose `StageResidency` says which
rank holds which stage's state (and that the last stage holds the loss, the metrics and the
predictions), and whose step runner (`PipelineStep`) runs one of torch's schedules
(``torch.distributed.pipelining``: GPipe, 1F1B, Interleaved 1F1B) over the batch's microbatches.

The stages come from torch's tracer (``pipeline(module, mb_args, split_spec)``), which splits the
module's ``forward`` where each split point's module starts; its stages hold the user's own parameter
objects, so the optimizer, the checkpoint and ``model.save`` see the user's module. Which state paths
each stage holds is known before tracing (the module's registration order: a split point starts a new
stage) and checked against the traced stages at the first step. One schedule is traced per batch shape
(a last, smaller batch gets its own). Every microbatch's loss is the mean over its rows, and torch's
``scale_grads`` averages the microbatches, so equal microbatches give the gradient of the batch's mean
loss: one process's on the same batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshfit import mixed_precision
from meshfit._lazy_dtensor import local_part
from meshfit.distribute import GradientWeight, StageResidency, untracked
from meshfit.dtensor._stage_gradients import Replicas, ending, give_back, settle, take_gradients
from meshfit.dtensor._stage_unit import StageUnit, follow_modes

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """Where a module splits into stages and how a step runs them (`LayoutMap.pipeline`'s arguments)."""

    split_points: tuple[str, ...]
    microbatches: int
    schedule: str = "1F1B"
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        if not self.split_points or not all(isinstance(p, str) and p for p in self.split_points):
            raise ValueError(f"Invalid `split_points`: expected a non-empty list of module paths where a new stage "
                             f"starts (e.g. ['blocks.2']), received split_points={list(self.split_points)!r}.")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"Invalid `microbatches`: expected a positive int (how many microbatches a batch is "
                             f"split into), received microbatches={self.microbatches!r}.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Invalid `schedule`: expected one of {list(SCHEDULES)}, received "
                             f"schedule={self.schedule!r}.")
        if isinstance(self.stages_per_rank, bool) or not isinstance(self.stages_per_rank, int) \
                or self.stages_per_rank < 1:
            raise ValueError(f"Invalid `stages_per_rank`: expected a positive int, received "
                             f"stages_per_rank={self.stages_per_rank!r}.")
        if self.stages_per_rank > 1 and self.schedule != "Interleaved1F1B":
            raise ValueError(f"Invalid `stages_per_rank={self.stages_per_rank}` with schedule={self.schedule!r}: "
                             "several stages per rank need schedule='Interleaved1F1B'.")

    @property
    def num_stages(self) -> int:
        return len(self.split_points) + 1


def stage_paths(module: nn.Module, split_points: Sequence[str]) -> list[frozenset[str]]:
    """Each stage's state paths (parameters and buffers), by the module's registration order: a split
    point's module starts a new stage. Refuses a split point that is not a module path, or out of order."""
    modules = [name for name, _ in module.named_modules()]
    index = {name: i for i, name in enumerate(modules)}
    starts = []
    for point in split_points:
        if point not in index or not point:
            near = [m for m in modules if m and m.split(".")[-1] == point.split(".")[-1]][:3]
            raise ValueError(f"Invalid split point {point!r}: it is not a module path of {type(module).__name__} "
                             f"(near: {near or modules[1:4]}). Name a submodule where a new stage starts, as "
                             "module.named_modules() lists them.")
        starts.append(index[point])
    if starts != sorted(starts) or len(set(starts)) != len(starts):
        raise ValueError(f"Invalid `split_points`: {list(split_points)} must be distinct and in the module's order "
                         f"(each starts a later stage).")
    stages: list[set[str]] = [set() for _ in range(len(starts) + 1)]
    state = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    stage_of_tensor: dict[int, tuple[int, str]] = {}
    for path, tensor in state:
        owner = path.rsplit(".", 1)[0] if "." in path else ""
        position = index.get(owner, 0)
        stage = sum(1 for s in starts if s <= position)
        first = stage_of_tensor.setdefault(id(tensor), (stage, path))
        if first[0] != stage:
            raise ValueError(f"Invalid `split_points`: {list(split_points)} put the tied weight {first[1]!r} in stage "
                             f"{first[0]} and its other path {path!r} in stage {stage}. A pipeline cannot share a "
                             "weight across stages: choose split points that keep both paths in one stage, or untie it.")
        stages[stage].add(path)
    return [frozenset(s) for s in stages]


@dataclasses.dataclass
class _Outputs:
    y_pred: Any
    loss: torch.Tensor
    size: int


class PipelineStep:
    """The step runner of a pipeline placement: torch's schedule over the batch's microbatches."""

    def __init__(self, source: nn.Module, template: nn.Module, units: Sequence[StageUnit], spec: PipelineSpec,
                 residency: StageResidency, pipe_rank: int, pipe_size: int, group: Any, device: torch.device,
                 world: Any, replicas: Replicas | None = None, sharded: GradientWeight | None = None) -> None:
        self.source, self.template, self.units, self.spec, self.residency = source, template, units, spec, residency
        self.pipe_rank, self.pipe_size, self.group, self.device = pipe_rank, pipe_size, group, device
        self.replicas = replicas
        self.sharded = sharded  # the stages' units are sharded over the data axis: FSDP reduces their gradients
        self.stages = [s for s in range(spec.num_stages) if s % pipe_size == pipe_rank]
        self._schedules: dict[Any, tuple[Any, list[nn.Module]]] = {}  # by key: the schedule, its traced stages
        self._host: Any = None
        self._losses: list[torch.Tensor] = []
        self._training = False
        self._weights: tuple[torch.Tensor, ...] | None = None  # this batch's sample weights, by microbatch
        self._used: set[int] = set()  # the parameters the traced stages' forwards use (ids)
        self._held = [p for name, p in source.named_parameters() if residency.holds(name)]
        self._checked: tuple[int, int] | None = None  # the optimizer and loss checked (by identity)
        self.world = world

    @property
    def first(self) -> bool:
        return 0 in self.stages

    @property
    def last(self) -> bool:
        return self.spec.num_stages - 1 in self.stages

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        """A microbatch's loss (its rows' mean), recorded as computed; in training, the loss the backward
        starts from is the optimizer's scaled one (a `LossScaleOptimizer` under ``mixed_float16``)."""
        weights = self._weights[len(self._losses)] if self._weights is not None else None  # microbatch order
        loss = self._host.compute_loss(None, target, output, weights)
        self._losses.append(loss.detach())
        return self._host.optimizer.scale_loss(loss) if self._training else loss

    def _schedule(self, x: torch.Tensor, with_loss: bool = True) -> Any:
        # traced per batch shape and mode (a traced graph keeps train-mode layers such as dropout)
        key = (tuple(x.shape), x.dtype, self.source.training, with_loss)
        known = self._schedules.get(key)
        if known is None:
            known = self._schedules[key] = self._trace(x, with_loss)
        schedule, graphs = known
        for unit, graph_module in zip(self.units, graphs, strict=True):
            unit.activate(graph_module)
        return schedule

    def _trace(self, x: torch.Tensor, with_loss: bool) -> tuple[Any, list[nn.Module]]:
        """Trace the template at ``x``'s microbatch shape and build this rank's stages: each runs its traced
        graph through the stage's unit (the parameters, bound at each call)."""
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            SplitPoint,
        )
        from torch.distributed.pipelining import pipeline as trace

        n = self.spec.microbatches
        example = x[: x.shape[0] // n]
        follow_modes(self.source, self.template)
        try:
            with torch.enable_grad(), untracked():
                traced = trace(self.template, mb_args=(example,),
                               split_spec={p: SplitPoint.BEGINNING for p in self.spec.split_points})
        finally:
            _unannotate(self.template, self.spec.split_points)
        if traced.num_stages != self.spec.num_stages:
            raise ValueError(f"Invalid `split_points`: {list(self.spec.split_points)} split the traced forward into "
                             f"{traced.num_stages} stages, not {self.spec.num_stages}. Each split point must be a "
                             "module the forward calls.")
        for s in range(self.spec.num_stages):  # every stage, on every rank: all refuse together, by name
            names = {name for name, _ in traced.get_stage_module(s).named_parameters()}
            stray = sorted(names - self.residency.stage_paths[s])
            if stray:
                raise ValueError(f"The traced stage {s} uses {stray[:4]}, which the module's registration order puts "
                                 "in another stage: its forward calls its modules in another order than they are "
                                 "registered. Register the submodules in the order the forward calls them.")
        with untracked():  # the traced stages' weights are placeholders; the unit binds the user's
            stages: list[Any] = [traced.build_stage(s, self.device, self.group) for s in self.stages]
        graphs: list[nn.Module] = []
        for stage, unit in zip(stages, self.units, strict=True):
            graph_module = stage.submod
            # The traced graph reads the parameters its forward uses (an unused one is held, never trained).
            self._used.update(id(unit.current(path)) for path in unit.used(graph_module))
            unit.activate(graph_module)
            stage.submod = unit  # torch's schedule runs (and, sharded, reduces) the unit
            graphs.append(graph_module)
        loss = self._loss if with_loss else None  # predict: outputs only
        schedule: Any
        if self.spec.schedule == "Interleaved1F1B":
            schedule = ScheduleInterleaved1F1B(stages, n_microbatches=n, loss_fn=loss, scale_grads=True)
        else:
            kind = ScheduleGPipe if self.spec.schedule == "GPipe" else Schedule1F1B
            schedule = kind(stages[0], n_microbatches=n, loss_fn=loss, scale_grads=True)
        return schedule, graphs

    def _run(self, host: Any, x: Any, y: Any, sample_weight: Any, train: bool) -> _Outputs | None:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"Invalid input under a pipeline: expected one tensor per batch, received "
                             f"{type(x).__name__}. Feed the model one input tensor.")
        self._host = host
        rows, total = x.shape[0], self._agree_on_rows(x.shape[0])
        held = self._held_parameters()
        earlier = take_gradients(held)  # torch's schedule divides every gradient it finds by the microbatches
        output = None
        try:
            if rows:  # an empty share of a last, small global batch runs no schedule: it joins the reduction
                schedule = self._schedule(x)
                self._losses, self._training = [], train
                # the last stage computes each microbatch's loss in microbatch order, with its rows' weights
                self._weights = None if sample_weight is None or not self.last else \
                    torch.as_tensor(sample_weight).tensor_split(self.spec.microbatches)
                run = schedule.step if train else schedule.eval
                with self._weighted(rows, total), self._on_tensor_axis():
                    output = run(*((x,) if self.first else ()), target=y if self.last else None)
            if train and self.sharded is None:
                settle(held)
            if train and self.replicas is not None and self.sharded is None:  # over the replicas, by rows
                self.replicas.reduce([p for p in held if id(p) in self._used or p.grad is not None], rows, total)
            if train:
                self._agree_on_overflow(held)
        finally:
            give_back(earlier, add=train)  # an accumulation window's sum so far, after this batch's
        if not self.last or not rows:
            return None
        loss = torch.stack(self._losses).mean()
        return _Outputs(output, loss, rows)

    def _agree_on_rows(self, rows: int, predicting: bool = False) -> int:
        """Every replica's rows summed (one small all-reduce over the replicas, before any schedule); a batch
        that does not split into the microbatches on some replica is refused on every replica together.
        An empty share runs no schedule, which only a replicated stage's training or evaluation allows."""
        n = self.spec.microbatches
        # sharded stages all-gather and reduce-scatter over the replicas: every replica runs the schedule;
        # a prediction's outputs come from a schedule on each replica
        needs_rows = self.sharded is not None or predicting
        bad = bool(rows % n) or (needs_rows and not rows)
        total, unsplittable = (rows, bad) if self.replicas is None else self.replicas.agree(rows, bad)
        if unsplittable:
            empty = ""
            if self.sharded is not None:
                empty = " (fully sharded stages need rows on every replica)"
            elif predicting:
                empty = " (a prediction needs rows on every replica)"
            raise ValueError(f"Invalid batch for the pipeline: a batch of {rows} rows on this replica (of {total} "
                             f"in all replicas) does not split into microbatches={n} equal microbatches on every "
                             f"replica{empty}. Use a batch size whose share on each replica is divisible by {n} (and "
                             "a data set whose last batch is too, or drop the remainder), or change `microbatches`.")
        return total

    def _on_tensor_axis(self) -> contextlib.AbstractContextManager[Any]:
        """Stages whose weights are split over a tensor axis run on DTensors, forward and backward: a tensor
        the graph makes itself (``torch.arange`` positions) counts as replicated, also when the backward
        reads it."""
        if all(unit.tensor_mesh is None for unit in self.units):
            return contextlib.nullcontext()
        from torch.distributed.tensor.experimental import implicit_replication

        return implicit_replication()

    def _weighted(self, rows: int, total: int) -> contextlib.AbstractContextManager[None]:
        """Sharded stages: FSDP's reduce-scatter averages the replicas, each weighted by its share of the
        global batch's rows (``rows * replicas / total``), so the result is one process's mean over it."""
        weight = self.sharded
        if weight is None or self.replicas is None:
            return contextlib.nullcontext()
        weight.factor, weight.in_step = rows * self.replicas.size / total, True
        return ending(weight)

    def _agree_on_overflow(self, held: Sequence[nn.Parameter]) -> None:
        """Under loss scaling (``mixed_float16``) every stage skips a step when any stage's gradients overflow,
        as one process skips it: each stage's optimizer then sees a non-finite gradient and halves its scale."""
        if mixed_precision.global_policy().name != "mixed_float16":
            return
        grads = [local_part(p.grad) for p in held if p.grad is not None]
        local = torch.stack([torch.isfinite(g).all() for g in grads]).all().logical_not() if grads else \
            torch.zeros((), dtype=torch.bool, device=self.device)
        flag = local.to(torch.float32).reshape(1)
        self.world.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and grads and not local.item():
            for g in grads:
                g.fill_(float("nan"))

    def _held_parameters(self) -> list[nn.Parameter]:
        """This rank's stages' trainable parameters (``requires_grad`` read at each step: a callback may
        freeze one; which paths a rank holds is fixed, listed once)."""
        return [p for p in self._held if p.requires_grad]

    def train(self, host: Any, x: Any, y: Any, sample_weight: Any) -> _Outputs | None:
        compiled = (id(host.optimizer), id(host.loss))  # checked for each compile's optimizer and loss
        if self._checked != compiled:
            self._check(host)
            self._checked = compiled
        return self._run(host, x, y, sample_weight, True)

    def _check(self, host: Any) -> None:
        """Refuse what the stages cannot train as one process: a norm over every stage's gradients, and a
        summed loss (torch's schedule averages the microbatches' gradients)."""
        if host.optimizer.get_config().get("global_clipnorm") is not None:
            raise ValueError("Invalid `global_clipnorm` under a pipeline: each stage holds only its own "
                             "gradients, so the norm over all of them is not computed yet. Use `clipnorm` "
                             "(each gradient's own norm) or `clipvalue`, or train without a pipeline.")
        if getattr(host.loss, "reduction", None) == "sum" and self.spec.microbatches > 1:
            raise ValueError(f"Invalid `loss`: {type(host.loss).__name__}(reduction='sum') under a pipeline of "
                             f"microbatches={self.spec.microbatches}: the schedule averages the microbatches' "
                             "gradients, so training would use 1/microbatches of the sum's gradient. Use "
                             "reduction='sum_over_batch_size' (the default) and scale the learning rate by the "
                             "batch size instead, or microbatches=1.")

    def shapes_module(self) -> nn.Module:
        """The tracing template (the module's structure, its weights one-element placeholders of their shapes):
        ``model.summary()`` runs it where the user's module holds released, sharded or split weights."""
        follow_modes(self.source, self.template)
        return self.template

    def evaluate(self, host: Any, x: Any, y: Any, sample_weight: Any) -> _Outputs | None:
        with torch.no_grad():
            return self._run(host, x, y, sample_weight, False)

    def predict(self, host: Any, x: Any) -> Any:
        self._host = host
        self._agree_on_rows(x.shape[0], predicting=True)  # a replica that cannot run it fails with the others
        earlier = take_gradients(self._held_parameters())  # the schedule would divide them
        try:
            with torch.no_grad(), self._on_tensor_axis():
                schedule = self._schedule(x, with_loss=False)
                output = schedule.eval(*((x,) if self.first else ()))
        finally:
            give_back(earlier, add=False)
        # Every worker returns the predictions (Keras's predict): the last stage's, sent as CPU tensors.
        holder: list[Any] = [output.cpu() if self.last else None]
        source = dist.get_global_rank(self.group, (self.spec.num_stages - 1) % self.pipe_size)
        dist.broadcast_object_list(holder, src=source, group=self.group)
        return holder[0].to(self.device)


def _unannotate(module: nn.Module, split_points: Sequence[str]) -> None:
    """Give the split points' modules their own ``forward`` back: torch's tracer wraps it in place (an
    instance attribute) and would wrap its own wrapper at the next trace (another batch shape, or mode)."""
    for point in split_points:
        submodule = module.get_submodule(point)
        for name in ("forward", "_orig_forward"):
            submodule.__dict__.pop(name, None)
