"""`VerifyReplicas`: compare the replicas' state during ``fit``; stop, or roll back in the process.

A bit flipped in one replica's weights (a faulty memory cell, a bad collective) is silent under data
parallel: every replica applies the same averaged gradient to its own copy, and the copies drift
apart for good. Every ``every_n_steps`` optimizer steps (counted across ``fit`` calls, as
``save_freq`` is) this callback compares every replica's digest of the state it should share
(`Strategy.verify_replicas`), after every other callback's ``on_train_batch_end`` and before that
step's backup. With ``on_divergence="restore"`` every worker loads the last backup (each was
verified when taken) into the live model, optimizer, loop, data position, random streams and
metrics, in its own process, and training goes on from there: the run ends bitwise equal to one
never disturbed.
"""

from __future__ import annotations

from meshfit._protocols import DistributionStrategy
from meshfit._validation import positive_int
from meshfit.callbacks._callback import Callback
from meshfit.callbacks._checkpoint_saver import CheckpointSaver
from meshfit.distribute import ReplicaDivergenceError

_ACTIONS = ("restore", "stop")


class VerifyReplicas(Callback):
    """Prove during ``fit`` that every replica holds the same state; on a divergence, stop or roll back.

    Args:
        every_n_steps: check when the optimizer step count reaches a multiple of this.
        on_divergence: ``"restore"``: every worker loads the last backup of the `BackupAndRestore`
            in the same callbacks (which it requires) and training continues; ``"stop"``: raise.

    Attributes:
        checks: how many checks found the replicas equal in this process.
        rollbacks: ``(error, backup path)`` of each roll-back, in order: what was found, where it went back to.

    Raises:
        ReplicaDivergenceError: with ``"stop"`` (or with nothing to roll back to), on every rank,
            naming the step, the first differing tensor's path and the ranks that differ.

    Example:
        >>> callback = VerifyReplicas(every_n_steps=100, on_divergence="stop")
        >>> callback.every_n_steps, callback.on_divergence
        (100, 'stop')
    """

    run_last = True  # after every other callback's on_train_batch_end (and, through the saver, before its save)
    reads_batch_logs = False

    def __init__(self, every_n_steps: int = 100, on_divergence: str = "restore") -> None:
        super().__init__()
        self.every_n_steps = positive_int("every_n_steps", every_n_steps)
        if on_divergence not in _ACTIONS:
            raise ValueError(f"Invalid `on_divergence`: expected 'restore' or 'stop', received "
                             f"on_divergence={on_divergence!r}.")
        self.on_divergence = on_divergence
        self.checks = 0
        self.rollbacks: list[tuple[ReplicaDivergenceError, str]] = []
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

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.before_save()

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
        try:
            self._require_loop().strategy.verify_replicas(self._require_model())
        except ReplicaDivergenceError as error:
            self.diverged(error)
            return False
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
        self._verified_at = loop.counters.iterations
        self._begin = loop.counters.iterations
        self.rollbacks.append((error, restored))
        if strategy.is_chief:
            print(f"VerifyReplicas: {error} Every worker restored {restored} (step {loop.counters.iterations}) "
                  "and training goes on.", flush=True)
