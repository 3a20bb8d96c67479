"""`BackupAndRestore`: Keras's fault-tolerance callback, as a preset of `CheckpointSaver`.

TensorFlow's callback restores the weights and the epoch but starts the data iterator over. This
one restores everything a step depends on (see `CheckpointSaver`), so that a run killed at any step
and resumed with the same number of workers ends with bitwise the same weights as one never
interrupted. Resumed with another number of workers and the same global batch, training continues
at the same step with exactly the examples not yet seen (random streams then come from rank
``r % saved``).
"""

from __future__ import annotations

import os
import warnings

from meshfit._validation import check_bool, epoch_or_positive_int, path_like
from meshfit.callbacks._checkpoint_saver import CheckpointSaver, SavePolicy


class BackupAndRestore(CheckpointSaver):
    """Back up training state to ``backup_dir`` and restore it when ``fit`` starts again.

    Args:
        backup_dir: where backups go; use a different folder per job. All workers must see it.
        save_freq: ``"epoch"`` (at each epoch's end) or an int ``N`` (every ``N`` batches).
        delete_checkpoint: delete the backups when ``fit`` completes.
        async_save: write backups in the background (the default): the training thread copies the
            state into reused CPU buffers (a few ms) and one long-lived thread writes it while
            training goes on; the next save, the end of ``fit`` and a preemption wait for it. A
            failed or killed background write never touches the previous backup, which stays the
            one restored. ``async_save=False`` writes synchronously, inside the saving step.
        double_checkpoint: keep the previous backup beside the newest (Keras's argument); a newest
            backup that fails verification (corrupted, half-written) is then skipped with a warning
            and the previous one restored. meshfit's default is True (Keras's is False): a run
            should survive a damaged backup.

    Example:
        >>> callback = BackupAndRestore("/tmp/backup", save_freq=30)
        >>> callback.save_freq
        30
    """

    directory_argument = "backup_dir"

    def __init__(self, backup_dir: str | os.PathLike, save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True, async_save: bool = True, double_checkpoint: bool = True) -> None:
        if backup_dir is None or (isinstance(backup_dir, (str, os.PathLike)) and not os.fspath(backup_dir)):
            raise ValueError(f"Empty `backup_dir` argument passed. Invalid `backup_dir`: expected a non-empty path "
                             f"(str or os.PathLike), received backup_dir={backup_dir!r}. Name a folder for this "
                             "job's backups.")  # Keras's words and error type first
        path_like("backup_dir", backup_dir)
        try:
            self.save_freq = epoch_or_positive_int("save_freq", save_freq)
        except ValueError as error:  # Keras's words first, then meshfit's
            raise ValueError(f"Invalid value for argument `save_freq`. Received: save_freq={save_freq}. Expected "
                             f"either 'epoch' or an integer value. {error}") from None
        policy = (SavePolicy(every_steps=self.save_freq) if isinstance(self.save_freq, int)
                  else SavePolicy(every_epoch=True))
        self.double_checkpoint = check_bool("double_checkpoint", double_checkpoint)
        super().__init__(backup_dir, policy=policy, max_to_keep=2 if double_checkpoint else 1, checkpoint_name="ckpt",
                         async_save=async_save, delete_on_end=delete_checkpoint)
        self.backup_dir = self.directory
        self.delete_checkpoint = self.delete_on_end

    def agreed_settings(self) -> dict[str, object]:
        return {"save_freq": self.save_freq, "async_save": self.async_save, "delete_checkpoint": self.delete_checkpoint}

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self._require_loop().data.source.replays_exactly:
            warnings.warn("BackupAndRestore: the input is an IterableDataset, a custom sampler or another "
                          "iterable; a resume replays its pass from the start and skips the batches already "
                          "trained on, which is exact only if it yields the same order again. Use a map-style "
                          "Dataset in a DataLoader (shuffled or not), a meshfit.data.Dataset or arrays for an "
                          "exact resume.", stacklevel=2)
        super().on_train_begin(logs)
