"""`BackupAndRestore`: back up *all* training state; a restarted ``fit`` continues at the next batch.

TensorFlow's callback restores the weights and the epoch but starts the data iterator over. This
one restores everything a step depends on, so that a run killed at any step and resumed with the
same number of workers ends with bitwise the same weights as one never interrupted:

- the module's weights and the optimizer's state,
- the loop counters (epoch, step in the epoch, iterations),
- the data position (pass and batch: the next batch is the one that was never trained on),
- every random stream of every rank (torch, numpy, Python), one saved per rank,
- the metric accumulators and the state of the other callbacks (History, EarlyStopping...).

A backup is taken after every other callback has run for that step or epoch (this callback always
runs last), so a failure raised by another callback at an epoch's end re-runs that epoch.

Resumed with another number of workers and the same global batch, training continues at the same
step with exactly the examples not yet seen (random streams then come from rank ``r % saved``).

Backups are `meshfit.train.CheckpointManager` checkpoints in ``backup_dir`` (atomic, two kept, so a
crash during a save leaves the previous one usable)::

    backup_dir/
      checkpoint        {"latest_checkpoint": "ckpt-12", ...}
      ckpt-11/          the previous complete backup
      ckpt-12/          the newest complete backup
      ckpt-13.tmp/      a save in progress (ignored until renamed)
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

from meshfit._state import RandomState
from meshfit.callbacks._callback import Callback


class _MetricsState:
    """The model's metric accumulators as one Stateful object."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def state_dict(self) -> dict[str, Any]:
        return {f"{i}:{m.name}": m.state_dict() for i, m in enumerate(self._model.metrics)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, metric in enumerate(self._model.metrics):
            key = f"{i}:{metric.name}"
            if key not in state:
                raise ValueError(f"The backup has no state for metric {key!r} (it has {sorted(state)}): "
                                 "compile the model with the same metrics as the run that made it.")
            metric.load_state_dict(state[key])


class BackupAndRestore(Callback):
    """Back up training state to ``backup_dir`` and restore it when ``fit`` starts again.

    Args:
        backup_dir: where backups go; use a different folder per job. All workers must see it.
        save_freq: ``"epoch"`` (at each epoch's end) or an int ``N`` (every ``N`` batches).
        delete_checkpoint: delete ``backup_dir`` when ``fit`` completes.
        async_save: write backups in the background (DCP async save) so training does not wait;
            a failed background write never touches the previous backup.

    Example:
        >>> callback = BackupAndRestore("/tmp/backup", save_freq=30)
        >>> callback.save_freq
        30
    """

    handles_preemption = True
    run_last = True  # back up only once every other callback has finished the step or epoch

    def __init__(self, backup_dir: str | os.PathLike, save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True, async_save: bool = False) -> None:
        super().__init__()
        if not backup_dir:
            raise ValueError(f"Invalid `backup_dir`: expected a folder path, received backup_dir={backup_dir!r}.")
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq <= 0):
            raise ValueError("Invalid `save_freq`: expected 'epoch' or a positive int, received "
                             f"save_freq={save_freq!r}.")
        self.backup_dir = os.path.abspath(os.fspath(backup_dir))
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.async_save = async_save
        self._manager: Any = None
        self._pending: Any = None
        self.restored_from: str | None = None
        self._saved_at: int | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        from meshfit.train import Checkpoint, CheckpointManager, PerRank

        model = self.model
        context = model.fit_context
        if not hasattr(context["data"].source, "view"):
            warnings.warn("BackupAndRestore: the input is a torch DataLoader or another iterable; a resume "
                          "replays its pass from the start and skips the batches already trained on, which "
                          "is exact only if the iterable yields the same order again. Use a meshfit.data."
                          "Dataset, arrays or a map-style torch Dataset for an exact resume.", stacklevel=2)
        checkpoint = Checkpoint(module=model.module, optimizer=model.optimizer, loop=context["loop"],
                                data=context["data"], metrics=_MetricsState(model),
                                callbacks=context["callbacks"], rng=PerRank(RandomState()))
        self._manager = CheckpointManager(checkpoint, self.backup_dir, max_to_keep=2, checkpoint_name="ckpt")
        strategy = model.strategy
        strategy.failure.backup_dir = self.backup_dir
        latest = strategy.broadcast_object(self._manager.latest_checkpoint)
        self.restored_from = latest
        if latest is None:
            return
        checkpoint.restore(latest)
        loop = context["loop"]
        if strategy.is_chief:
            print(f"BackupAndRestore: resuming from {latest} at epoch {loop.epoch + 1}, "
                  f"batch {loop.step + 1} (iteration {loop.iterations})", flush=True)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.save_freq != "epoch" and self.model.loop_state.iterations % self.save_freq == 0:
            self._save()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.save_freq == "epoch":
            self._save()

    def save_for_preemption(self) -> None:
        """Called by ``fit`` when a worker got SIGTERM: every replica saves at the same step."""
        if self._saved_at != self.model.loop_state.iterations:  # not already backed up at this step
            self._save()
        self._wait()

    def on_train_end(self, logs: dict | None = None) -> None:
        self._wait()
        if self.delete_checkpoint:
            strategy = self.model.strategy
            strategy.barrier()
            if strategy.is_chief:
                shutil.rmtree(self.backup_dir, ignore_errors=True)
            strategy.barrier()

    def _save(self) -> None:
        self._wait()
        self._saved_at = self.model.loop_state.iterations
        if self.async_save:
            self._pending = self._manager.save(async_save=True)
        else:
            self._manager.save()

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
