"""The one builder of placements: every `Placement` is a `PlacementPlan` of transforms built here.

A strategy says *what* it places; this module composes the transforms and applies the plan, in one
order for every spelling (torchtitan's ``parallelize``: each parallelism a function of the module and
its sub-mesh, applied in turn):

- one device, or a custom loop's replicated module: move to the device, then ``torch.compile`` if asked
  (`place_replicated`; the optimizer step sums the gradients: `ReplicatedSync`);
- data parallel: move, any layout transforms the strategy adds (a mesh's replicated ``.layout``, rank 0's
  weights), compile, then DDP (`place_data_parallel`; `DataParallelSync`);
- layouts: move, the strategy's layout transforms (DTensor parameters on the whole mesh and their
  boundary hooks), compile (`place_laid_out`);
- tensor parallel and fully sharded, and their composition: the strategy's transforms (tensor-parallel
  styles over the tensor axis, then ``fully_shard`` over the data axis) and the sync that remains
  (`place_sharded`);
- a placement that declares its own step and residency (a pipeline's stages): `place_staged`.

``tests/test_placement_builder.py`` reads the sources: no other module constructs a `Placement` or a
`PlacementPlan`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from meshfit._protocols import Residency, StepRunner
from meshfit.distribute._gradient_sync import DataParallelSync, ReplicatedSync
from meshfit.distribute._placement import GradientSync, Placement, PlacementPlan, Transform
from meshfit.distribute._residency import EVERYWHERE


def compiled(module: nn.Module, jit_compile: bool) -> nn.Module:
    """``module`` compiled with ``torch.compile`` when asked (it shares the module's parameters). torch
    compiles at the first call; a failure there says which module and how to train it eagerly."""
    if not jit_compile:
        return module
    optimized: Any = torch.compile(module)  # an OptimizedModule (a Module); its stub says a Callable
    optimized.forward = _naming_compile_failures(optimized.forward, type(module).__name__)
    return cast(nn.Module, optimized)


def _naming_compile_failures(forward: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``forward`` (a compiled module's), re-raising torch.compile's own failures with what to do: where
    ``jit_compile=True`` was asked for, meshfit does not fall back to eager (``"auto"`` never compiles)."""
    def forward_compiled(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except RuntimeError as error:
            import torch._dynamo.exc as dynamo_errors  # loaded already: torch.compile ran

            # torch.compile's own failures; an error of the model's own code or inputs met while tracing
            # (TorchRuntimeError: it fails eagerly too) or of the user's call (UserError) passes as it is
            if not isinstance(error, (dynamo_errors.BackendCompilerFailed, dynamo_errors.InternalTorchDynamoError,
                                      dynamo_errors.Unsupported)):
                raise
            # torch's first paragraph ("backend='inductor' raised:" and the cause), not its hints after it
            reason = " ".join(str(error).strip().split("\n\n")[0].split()) or "no message"
            reason = reason if len(reason) <= 400 else reason[:397] + "..."
            raise RuntimeError(
                f"jit_compile=True: torch.compile could not compile {name} ({type(error).__name__}: {reason}). "
                "meshfit does not fall back to eager execution where compiling was asked for: compile the model "
                "with jit_compile=False (or 'auto', the default) to train it eagerly.") from error
    return forward_compiled


@dataclasses.dataclass
class MoveTo:
    """Parameters and buffers onto the strategy's device (in place)."""

    device: torch.device
    name: str = "move to device"

    def apply(self, module: nn.Module) -> nn.Module:
        return module.to(self.device)


@dataclasses.dataclass
class Compile:
    """``torch.compile`` of the module (a wrapper sharing its parameters)."""

    name: str = "torch.compile"

    def apply(self, module: nn.Module) -> nn.Module:
        return compiled(module, True)


@dataclasses.dataclass
class DataParallel:
    """DDP's wrapper (``wrap`` builds it) whose gradients ``sync`` answers for."""

    wrap: Callable[[nn.Module], nn.Module]
    sync: DataParallelSync
    name: str = "data parallel"

    def apply(self, module: nn.Module) -> nn.Module:
        wrapped = self.wrap(module)
        self.sync.install(wrapped)  # a meshfit optimizer must not reduce these gradients again
        return wrapped


@dataclasses.dataclass
class InPlace:
    """A strategy's own in-place step (``function(module)``), named for messages and tests."""

    name: str
    function: Callable[[nn.Module], Any]

    def apply(self, module: nn.Module) -> nn.Module:
        self.function(module)
        return module


def _placed(device: torch.device | None, transforms: Sequence[Transform], jit_compile: bool) -> list[Transform]:
    moved: list[Transform] = [MoveTo(device)] if device is not None else []
    return [*moved, *transforms, *([Compile()] if jit_compile else [])]


def place_replicated(module: nn.Module, device: torch.device | None, jit_compile: bool = False,
                     transforms: Sequence[Transform] = ()) -> Placement:
    """``module`` on ``device`` (after ``transforms``), compiled if asked; the optimizer step sums its gradients."""
    return PlacementPlan(_placed(device, transforms, jit_compile), ReplicatedSync()).apply(module)


def place_data_parallel(module: nn.Module, device: torch.device, jit_compile: bool, wrap: Callable[[nn.Module], nn.Module],
                        sync: DataParallelSync, transforms: Sequence[Transform] = ()) -> Placement:
    """``module`` on ``device`` (after ``transforms``), compiled if asked, in the DDP wrapper ``wrap`` makes."""
    return PlacementPlan([*_placed(device, transforms, jit_compile), DataParallel(wrap, sync)], sync).apply(module)


def place_laid_out(module: nn.Module, device: torch.device | None, jit_compile: bool,
                   transforms: Sequence[Transform]) -> Placement:
    """``module`` with whole-mesh DTensor parameters (``transforms`` lay it out); their layouts reduce the
    gradients in the optimizer step."""
    return place_replicated(module, device, jit_compile, transforms)


def place_sharded(module: nn.Module, transforms: Sequence[Transform], sync: GradientSync) -> Placement:
    """``module`` through tensor-parallel and fully sharded ``transforms``; ``sync`` is what remains."""
    return PlacementPlan(list(transforms), sync).apply(module)


def place_staged(module: nn.Module, sync: GradientSync, residency: Residency = EVERYWHERE,
                 step: StepRunner | None = None, transforms: Sequence[Transform] = ()) -> Placement:
    """``module`` placed by ``transforms`` with its own `Residency` and step runner (a pipeline's stages)."""
    return PlacementPlan(list(transforms), sync, residency, step).apply(module)
