"""`ReplicaState`: what differs between a loop's replicas (random streams, metric accumulators, a
gradient accumulation window's sums), saved once per rank."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from meshfit._engine._state import RandomState
from meshfit._protocols import Trainable
from meshfit.optimizers import AccumulatedGradients


class ReplicaState:
    """The state that differs between replicas: RNG streams, the metrics' running accumulators and,
    inside a gradient accumulation window, the gradients summed so far.

    Saved once per rank (``meshfit.train.PerRank``): each replica's metric sums cover its own
    share of the batches, its random streams are its own, and so are its gradient sums (its own
    batches', not yet all-reduced; `AccumulatedGradients`).
    """

    def __init__(self, trainable: Trainable) -> None:
        self._trainable = trainable
        self._random = RandomState(trainable.strategy.device)
        self._foreign = False  # restored from a rank that held other paths (another pipeline layout)
        self._metrics_foreign = False  # ... and other outputs or another replica: its metric sums are not ours

    def _role(self) -> dict[str, str]:
        """What this rank's sums cover: whether it holds the outputs (its metric sums are its replica's), its
        replica among how many, and (where ranks hold different parts: a pipeline's stages) the paths it holds."""
        residency, strategy = self._trainable.residency, self._trainable.strategy
        role = {"outputs": str(int(residency.holds_outputs)), "replica": str(strategy.replica_id),
                "replicas": str(strategy.num_replicas_in_sync)}
        if not residency.everywhere:
            held = "\n".join(sorted(p for p in self._trainable.module.state_dict() if residency.holds(p)))
            role["holds"] = hashlib.sha256(held.encode()).hexdigest()[:16]
        return role

    def role(self) -> str | None:
        """`_role` as saved (None where every rank holds everything: the rank number says it all)."""
        if self._trainable.residency.everywhere:
            return None
        return ";".join(f"{key}={value}" for key, value in sorted(self._role().items()))

    def choose_saved(self, roles: Sequence[str | None], rank: int) -> int:
        """The saved state this rank restores, where the saved ranks held different parts (a pipeline backup):
        the rank that held the same paths in the same replica (everything restores, bitwise); else one that held
        the outputs (or not) of the same replica out of as many (the metric sums restore; an accumulation
        window's sums cannot: `load_state_dict` refuses them); else ``rank % saved`` with the epoch's metrics
        counting from the resume."""
        self._foreign = self._metrics_foreign = False
        if not any(roles):  # saved where every rank held everything (or before ranks had roles)
            return rank % len(roles)
        mine = self._role()
        saved = [dict(item.split("=", 1) for item in role.split(";")) if role else {} for role in roles]
        if mine in saved:
            return saved.index(mine)
        self._foreign = True
        same = [i for i, theirs in enumerate(saved)
                if all(theirs.get(key) == mine[key] for key in ("outputs", "replica", "replicas"))]
        if same:
            return same[0]
        self._metrics_foreign = True
        return rank % len(roles)

    def state_dict(self) -> dict[str, Any]:
        metrics = {f"{i}:{m.name}": m.state_dict() for i, m in enumerate(self._trainable.metrics)}
        state: dict[str, Any] = {"rng": self._random.state_dict(), "metrics": metrics}
        role = self.role()
        if role is not None:
            state["role"] = role
        gradients = self._gradients()
        if gradients is not None:
            state["gradients"] = gradients.state_dict()
        return state

    def _gradients(self) -> AccumulatedGradients | None:
        optimizer = getattr(self._trainable, "optimizer", None)
        if getattr(optimizer, "gradient_accumulation_steps", None) and getattr(optimizer, "built", False):
            return AccumulatedGradients(optimizer, self._trainable.strategy.num_processes)
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["metrics"]
        for i, metric in enumerate(self._trainable.metrics):
            key = f"{i}:{metric.name}"
            if key not in saved:
                raise ValueError(f"The backup has no state for metric {key!r} (it has {sorted(saved)}): "
                                 "compile the model with the same metrics as the run that made it.")
            if self._metrics_foreign:  # sums of batches another layout's rank saw: the epoch counts from the resume
                metric.reset_state()
            else:
                metric.load_state_dict(saved[key])
        self._random.load_state_dict(state["rng"])
        gradients = self._gradients()
        if gradients is not None and "gradients" in state:
            if self._foreign:
                raise ValueError("The backup was taken inside a gradient accumulation window by processes that "
                                 "held other pipeline stages than this one now holds (another pipeline depth, or "
                                 "one plain process): the window's gradient sums cannot be split anew. Resume on "
                                 "the layout that saved it, or back up at the end of a window (save_freq a "
                                 "multiple of gradient_accumulation_steps).")
            gradients.load_state_dict(state["gradients"])
