"""Training state that is not a module or an optimizer: loop counters and random number streams."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import torch


@dataclasses.dataclass
class LoopState:
    """Where ``fit`` is: ``epoch`` (0-based), ``step`` (next batch within it), ``iterations`` done."""

    epoch: int = 0
    step: int = 0
    iterations: int = 0

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.step, self.iterations = int(state["epoch"]), int(state["step"]), int(state["iterations"])


class RandomState:
    """This process's random streams: torch's CPU one, its GPU's CUDA one, numpy's global one, Python's ``random``.

    Args:
        device: the device this replica trains on; on a GPU its CUDA generator is saved too (one
            process per GPU: each rank saves its own). A CPU replica never touches CUDA.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state(legacy=True)
        if isinstance(np_state, dict):  # only when numpy's global generator is not MT19937
            raise TypeError(f"numpy's global random generator is {np_state.get('bit_generator')}, expected MT19937.")
        py_version, py_internal, py_gauss = random.getstate()
        state = {
            "torch": torch.get_rng_state(),
            "numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "numpy_pos": int(np_state[2]),
            "numpy_has_gauss": int(np_state[3]),
            "numpy_gauss": float(np_state[4]),
            "python_internal": torch.tensor(py_internal, dtype=torch.int64),
            "python_version": int(py_version),
            "python_gauss": py_gauss,
        }
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
        keys = np.asarray(state["numpy_keys"]).astype(np.uint32)
        np.random.set_state(("MT19937", keys, int(state["numpy_pos"]), int(state["numpy_has_gauss"]),
                             float(state["numpy_gauss"])))
        internal = tuple(int(v) for v in torch.as_tensor(state["python_internal"]).tolist())
        random.setstate((int(state["python_version"]), internal, state["python_gauss"]))
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(torch.as_tensor(state["cuda"], dtype=torch.uint8).cpu(), self.device)
