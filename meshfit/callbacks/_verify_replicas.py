"""`VerifyReplicas`: compare the replicas' state during ``fit``; stop, or roll back in the process.

A bit flipped in one replica's weights (a faulty memory cell, a bad collective) is silent under data
parallel: every replica applies the same averaged gradient to its own copy, and the copies drift
apart for good. Every ``every_n_steps`` optimizer steps (counted across ``fit`` calls, as
``save_freq`` is) this callback compares every replica's digest of the state it should share
(`Strategy.verify_replicas`), after every other callback's ``on_train_batch_end`` and before that
step's backup. With ``on_divergence="restore"`` every worker loads the last backup (each was
verified when taken) into the live model, optimizer, loop, data position, random streams and
metrics, in its own process, and training goes on from there: the run ends bitwise equal to one
never disturbed. A divergence found again at the same step after ``max_rollbacks`` roll-backs is not
a transient fault: every worker stops.

A tensor a layout keeps in one copy (fully sharded, or any tensor of one process) has no replica to
compare with: the callback says so when ``fit`` starts and checks it at rest and after gathering
instead (`meshfit.distribute._proof._one_copy`).
"""

from __future__ import annotations

import warnings

from meshfit._protocols import DistributionStrategy
from meshfit._validation import positive_int
from meshfit.callbacks._callback import Callback
from meshfit.callbacks._checkpoint_saver import CheckpointSaver
from meshfit.distribute import (
    AtRest,
    ReplicaCoverage,
    ReplicaDivergenceError,
    ReplicaHistory,
    coverage,
    first_changed,
    named_state,
    resolve_residency,
    resolve_state,
    verify_replicas,
)

_ACTIONS = ("restore", "stop")


class VerifyReplicas(Callback):
    """Prove during ``fit`` that every replica holds the same state; on a divergence, stop or roll back.

    Args:
        every_n_steps: check when the optimizer step count reaches a multiple of this.
        on_divergence: ``"restore"``: every worker loads the last backup of the `BackupAndRestore`
            in the same callbacks (which it requires) and training continues; ``"stop"``: raise.
        max_rollbacks: with ``"restore"``, how many times a divergence found at the same step is
            rolled back; found there once more, it stops every worker (a fault that comes back at the
            same step is in the computation or the data, not a transient flip).

    Attributes:
        checks: how many checks passed in this process (see ``coverage`` for what they compared).
        rollbacks: ``(error, backup path)`` of each roll-back, in order: what was found, where it went back to.
        coverage: which tensors of the state have copies to compare and which are held in one
            copy (``.compared``, ``.one_copy``, ``.gathered``: tuples of paths), once known (when ``fit``
            starts).

    Raises:
        ReplicaDivergenceError: with ``"stop"`` (or with nothing to roll back to, or after
            ``max_rollbacks`` roll-backs at the same step), on every rank, naming the step, every
            differing tensor's path, the ranks that differ and when each was last seen equal.

    Example:
        >>> callback = VerifyReplicas(every_n_steps=100, on_divergence="stop")
        >>> callback.every_n_steps, callback.on_divergence
        (100, 'stop')
    """

    run_last = True  # after every other callback's on_train_batch_end (and, through the saver, before its save)
    reads_batch_logs = False

    def __init__(self, every_n_steps: int = 100, on_divergence: str = "restore", max_rollbacks: int = 3) -> None:
        super().__init__()
        self.every_n_steps = positive_int("every_n_steps", every_n_steps)
        if on_divergence not in _ACTIONS:
            raise ValueError(f"Invalid `on_divergence`: expected 'restore' or 'stop', received "
                             f"on_divergence={on_divergence!r}.")
        self.on_divergence = on_divergence
        self.max_rollbacks = positive_int("max_rollbacks", max_rollbacks)
        self.checks = 0
        self.rollbacks: list[tuple[ReplicaDivergenceError, str]] = []
        self.coverage: ReplicaCoverage | None = None
        self._history = ReplicaHistory()
        self._found_at: list[int] = []  # the loop's batch count at each roll-back's finding
        self._at_rest: AtRest | None = None
        self._saver: CheckpointSaver | None = None
        self._savers: list[CheckpointSaver] = []
        self._begin = 0  # the step count when the current execution began
        self._verified_at: int | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        loop = self._require_loop()
        savers = [c for c in loop.callbacks if isinstance(c, CheckpointSaver)]
        self._savers = savers
        if self.on_divergence == "restore" and not savers:
            raise ValueError(
                "Invalid `on_divergence`: 'restore' rolls every worker back to the last backup, but fit's callbacks "
                "hold no BackupAndRestore to restore from. Add meshfit.callbacks.BackupAndRestore(backup_dir, "
                "save_freq=...) to the callbacks, or use on_divergence='stop'.")
        self._agree_settings(loop.strategy)
        self._saver = savers[0] if savers else None
        for saver in savers:
            saver.guard = self
        self._verified_at = None
        self._at_rest = None
        self.coverage = None
        self._announce()

    def _announce(self) -> None:
        """Say, on the chief, what the checks compare and what is held in one copy (once the model is built)."""
        loop = self._require_loop()
        strategy = loop.strategy
        model = self._require_model()
        module, optimizer = resolve_state(model)
        residency = resolve_residency(model)
        try:
            state, _ = named_state(module, optimizer, residency)
        except ValueError:  # a lazy module: built by its first step, announced at the first check
            return
        parameters = {name for name, _ in module.named_parameters()}
        self.coverage = coverage(state, parameters, strategy.num_processes, residency)
        if strategy.is_chief:
            print(self.coverage.describe(repr(strategy)), flush=True)
            if not self.coverage.compared and self.on_divergence == "restore":
                warnings.warn(
                    "VerifyReplicas(on_divergence='restore'): no tensor of the training state has a second copy "
                    f"under {strategy!r}, so no check compares replicas; only the at-rest and gathered checks of "
                    "one-copy tensors can find a fault to roll back. To compare replicas, keep copies along an "
                    "axis (e.g. a mesh axis the parameters are replicated on), or use on_divergence='stop'.",
                    stacklevel=2)

    def _agree_settings(self, strategy: DistributionStrategy) -> None:
        """Every worker must check at the same steps and act the same way: a worker that checks alone
        would wait in a collective its peers never enter. One gather when ``fit`` starts."""
        if strategy.num_replicas_in_sync <= 1:
            return
        settings = strategy.all_gather_object((self.every_n_steps, self.on_divergence))
        if len(set(settings)) > 1:
            seen = ", ".join(f"worker {rank}: every_n_steps={n}, on_divergence={a!r}"
                             for rank, (n, a) in enumerate(settings))
            raise ValueError(f"Invalid `VerifyReplicas`: every worker must pass the same `every_n_steps` and "
                             f"`on_divergence`, received {seen}. Build the callback from the same values on "
                             "every worker.")

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._begin = self._require_loop().counters.iterations
        self._check_at_rest()

    def _check_at_rest(self) -> None:
        """Before the next step uses them: the one-copy shards recorded at the last check are unchanged
        on every rank (one gather of each rank's changed paths, so every worker acts alike)."""
        record, self._at_rest = self._at_rest, None
        if record is None:
            return
        strategy = self._require_loop().strategy
        model = self._require_model()
        module, optimizer = resolve_state(model)
        changed = record.changed(named_state(module, optimizer, resolve_residency(model))[0], strategy.world.rank)
        world = strategy.world  # every process, whatever axes the mesh has: each holds its own shards
        gathered = world.all_gather_object(changed) if world.distributed else [changed]
        found = first_changed(gathered)
        if found is None:
            return
        differing, ranks = found
        path = differing[0][0]
        error = ReplicaDivergenceError(
            record.step, path, differing[0][1],
            f": it is held in one copy, so no replica holds it to compare, and it changed at rest on rank(s) "
            f"{', '.join(map(str, ranks))}: after step {record.step}'s check passed and before step "
            f"{record.step + 1} used it (no training step writes it there; a callback that changes weights "
            "in on_train_batch_begin would, and is found the same way).",
            differing=differing)
        self.diverged(error)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.before_save()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """An epoch's end may change weights on purpose (a callback that averages or prunes them, or loads
        weights): the at-rest record is not carried across it."""
        self._at_rest = None

    def on_train_end(self, logs: dict | None = None) -> None:
        for saver in self._savers:
            if saver.guard is self:
                saver.guard = None

    # ---- SaveGuard: a saver asks before saving, and reports a divergence found while saving ----
    def before_save(self) -> bool:
        """Check the replicas if a check is due at this step and has not run; False after a roll-back."""
        iterations = self._require_loop().counters.iterations
        due = iterations // self.every_n_steps > self._begin // self.every_n_steps
        if not due or self._verified_at == iterations:
            return True
        strategy = self._require_loop().strategy
        model = self._require_model()
        try:
            digest = verify_replicas(strategy, model, history=self._history)
        except ReplicaDivergenceError as error:
            self.diverged(error)
            return False
        if self.coverage is None:
            self._announce()
        module, optimizer = resolve_state(model)
        state, _ = named_state(module, optimizer, resolve_residency(model))
        self._at_rest = AtRest.record(iterations, state, digest.one_copy, strategy.world.rank) \
            if digest.one_copy else None
        self._verified_at = iterations
        self.checks += 1
        return True

    def diverged(self, error: ReplicaDivergenceError) -> None:
        """Stop (raise), or roll every worker back to the last backup, which was verified when taken."""
        if self.on_divergence == "stop":
            raise error
        saver = self._saver
        if saver is None:
            raise error
        found_at = self._require_loop().counters.iterations  # batches: the optimizer's step may count updates
        repeats = self._found_at.count(found_at)
        if repeats >= self.max_rollbacks:
            raise ReplicaDivergenceError(
                error.step, error.path, error.ranks,
                f"{error.detail} Found at the same batch ({found_at}) again after {repeats} roll-back(s) there "
                f"(max_rollbacks={self.max_rollbacks}): a fault that comes back at the same step is in the computation "
                "or the data, not a transient flip, so every worker stops. Look for what differs between the "
                "workers at that step (a rank's hardware, its data, a non-deterministic op).",
                error.prefix, error.differing, error.last_equal) from error
        loop = self._require_loop()
        strategy = loop.strategy
        saver.wait()  # a backup still being written lands first (it was verified when it was taken)
        candidates = strategy.broadcast_object(saver.manager.checkpoints)
        restored = loop.resume(candidates) if candidates else None
        if restored is None:
            raise ReplicaDivergenceError(
                error.step, error.path, error.ranks,
                f"{error.detail} There is no backup to roll back to yet: the first backup comes at step "
                f"{saver.policy.every_steps or 'the epoch end'}.") from error
        saver.reset_clock(saved=True)
        self._at_rest = None
        self._verified_at = loop.counters.iterations
        self._begin = loop.counters.iterations
        self.rollbacks.append((error, restored))
        self._found_at.append(found_at)
        if strategy.is_chief:
            print(f"VerifyReplicas: {error} Every worker restored {restored} (step {loop.counters.iterations}) "
                  "and training goes on.", flush=True)
