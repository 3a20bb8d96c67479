"""Count the calls that read a tensor's values on the host (``.item()``, ``.cpu()``, ``.tolist()``,
numpy conversion, ``float()``...) while a fit runs its steps.

On a GPU each of them waits for the device; on the CPU they are the same calls, so counting them
there shows what a GPU step would wait for. A read is recorded with the function that made it and
the device of the tensor read.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

import meshfit as mf

READS = ("item", "cpu", "tolist", "numpy", "__array__", "__float__", "__int__", "__bool__", "__index__")


class HostReads:
    """The reads made while `counting` is on: ``(method, caller's file:function, device)`` tuples."""

    def __init__(self) -> None:
        self.counting = False
        self.calls: list[tuple[str, str, str]] = []

    def record(self, name: str, tensor: torch.Tensor) -> None:
        if self.counting:
            frame = sys._getframe(2)
            where = f"{frame.f_code.co_filename}:{frame.f_code.co_name}"
            self.calls.append((name, where, tensor.device.type))

    def outside_control_plane(self) -> list[tuple[str, str, str]]:
        """Every read except the control plane's: its flags are CPU tensors summed over gloo."""
        return [c for c in self.calls if not c[1].endswith("_step_logs.py:sum_flags")]


@contextlib.contextmanager
def counting_host_reads() -> Iterator[HostReads]:
    """Patch the reading methods of ``torch.Tensor`` for the duration; yields the recorder."""
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def patched(name: str, original: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            reads.record(name, self)
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, patched(name, original))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class CountDuringSteps(mf.callbacks.Callback):
    """Counts from each ``on_train_batch_begin`` to its ``on_train_batch_end``: the steps themselves."""

    reads_batch_logs = False

    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads
        self.steps = 0

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.reads.counting = True

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.reads.counting = False
        self.steps += 1
