"""`CheckpointSaverHook`: checkpoints at the start, every N steps or seconds, and at the end.

The Estimator makes one for ``model_dir`` from its `RunConfig` and runs it as meshfit's general
`CheckpointSaver` (the saver behind `BackupAndRestore`), placed after every other hook and
callback, as TF places it: a hook that raises in ``after_run`` leaves that step unsaved and the
previous checkpoint intact. Saving is collective: every worker saves at the same step (time-based
saves are agreed across workers). A checkpoint holds everything a step depends on — module weights,
optimizer, global step, data position, each replica's random streams — so a new Estimator on the
same ``model_dir`` continues exactly. On disk (`meshfit.train.CheckpointManager`, atomic: a
reader never sees a partial checkpoint; the newest ``keep_checkpoint_max`` kept)::

    model_dir/
      checkpoint            {"latest_checkpoint": "model.ckpt-6", "all_checkpoints": [...]}
      model.ckpt-5/         the checkpoint at global step 5
      model.ckpt-6/
      model.ckpt-7.tmp/     a save in progress (ignored by readers)
      eval/                 evaluation results (TensorBoard event files)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshfit._validation import invalid_argument, is_int
from meshfit.callbacks import CheckpointSaver, SavePolicy
from meshfit.estimator._hooks import SessionRunHook, log

CHECKPOINT_NAME = "model.ckpt"


class CheckpointSaverListener:
    """Called around each save of a `CheckpointSaverHook` (``tf.estimator.CheckpointSaverListener``)."""

    def begin(self) -> None:
        """Before the first save."""

    def before_save(self, session: Any, global_step_value: int) -> None:
        """Before each save."""

    def after_save(self, session: Any, global_step_value: int) -> bool | None:
        """After each save; return True to stop training."""
        return None

    def end(self, session: Any, global_step_value: int) -> None:
        """After the last save."""


class CheckpointSaverHook(SessionRunHook):
    """Save the training state every ``save_steps`` steps or ``save_secs`` seconds.

    Args:
        checkpoint_dir: where checkpoints go (all workers must see it).
        save_secs: save every this many seconds; or
        save_steps: every this many global steps. Give exactly one.
        listeners: `CheckpointSaverListener`s.
        max_to_keep: how many checkpoints to keep (None: all).
        saver, checkpoint_basename, scaffold: accepted for TF compatibility (checkpoints are
            always ``model.ckpt-<global step>``).

    Raises:
        ValueError: both or neither of ``save_secs`` and ``save_steps``, or a bad value.

    Example:
        >>> CheckpointSaverHook("/tmp/run", save_steps=100).save_steps
        100
    """

    def __init__(self, checkpoint_dir: str, save_secs: float | None = None, save_steps: int | None = None,
                 saver: Any = None, checkpoint_basename: str = "model.ckpt", scaffold: Any = None,
                 listeners: Sequence[CheckpointSaverListener] | None = None, max_to_keep: int | None = 5) -> None:
        if (save_secs is None) == (save_steps is None):
            raise ValueError(f"Invalid CheckpointSaverHook: give exactly one of save_secs and save_steps, received "
                             f"save_secs={save_secs!r}, save_steps={save_steps!r}.")
        if save_steps is not None and (not is_int(save_steps) or save_steps <= 0):
            raise invalid_argument("save_steps", "a positive int", save_steps)
        if save_secs is not None and (isinstance(save_secs, bool) or not isinstance(save_secs, (int, float))
                                      or save_secs <= 0):
            raise invalid_argument("save_secs", "a number > 0", save_secs)
        if max_to_keep is not None and (not is_int(max_to_keep) or max_to_keep < 0):
            raise invalid_argument("max_to_keep", "None or an int >= 0", max_to_keep)
        self.checkpoint_dir, self.save_secs, self.save_steps = checkpoint_dir, save_secs, save_steps
        self.max_to_keep = max_to_keep or None
        self.listeners = list(listeners or [])

    def saver(self, session: Any) -> EstimatorCheckpointSaver:
        """The training-loop callback that does this hook's saving."""
        return EstimatorCheckpointSaver(self, session)


class EstimatorCheckpointSaver(CheckpointSaver):
    """meshfit's `CheckpointSaver` with TF's Estimator semantics: checkpoints named by global step,
    one at the start and one at the end, listeners, and the Estimator's log lines.

    The Estimator has restored the latest checkpoint before training begins, so this saver does
    not restore again.
    """

    def __init__(self, hook: CheckpointSaverHook, session: Any) -> None:
        policy = SavePolicy(every_steps=hook.save_steps, every_seconds=hook.save_secs, on_preemption=True)
        super().__init__(hook.checkpoint_dir, policy=policy, checkpoint_name=CHECKPOINT_NAME)
        self.hook, self.session = hook, session

    def restore_training(self, loop: Any) -> bool:
        """Make this run's manager; restore nothing (the Estimator restored the latest checkpoint
        before training began, to compute the step to stop at)."""
        self.prepare(loop)
        return False

    def make_manager(self, checkpoint: Any) -> Any:
        from meshfit.train import CheckpointManager  # lazily loaded public subpackage

        loop = self._require_loop()
        return CheckpointManager(checkpoint, self.directory, max_to_keep=self.hook.max_to_keep,
                                 checkpoint_name=CHECKPOINT_NAME, step_counter=lambda: loop.counters.iterations)

    def on_train_begin(self, logs: dict | None = None) -> None:
        super().on_train_begin(logs)
        for listener in self.hook.listeners:
            listener.begin()
        latest = self.manager.latest_checkpoint
        step = self._require_loop().counters.iterations
        if latest is None or not latest.endswith(f"-{step}"):
            self.save()  # TF saves the starting step ("Saving checkpoints for 0")
        else:
            self.reset_clock(saved=True)

    def on_train_end(self, logs: dict | None = None) -> None:
        step = self._require_loop().counters.iterations
        if self.saved_at != step:
            self.save()
        super().on_train_end(logs)
        for listener in self.hook.listeners:
            listener.end(self.session, step)

    def save(self) -> None:
        step = self._require_loop().counters.iterations
        for listener in self.hook.listeners:
            listener.before_save(self.session, step)
        if self.session.is_chief:
            log(f"Saving checkpoints for {step} into {self.directory}/{CHECKPOINT_NAME}.")
        super().save()
        self.wait()  # listeners (an evaluation) read the checkpoint just written
        stop = False
        for listener in self.hook.listeners:
            stop = bool(listener.after_save(self.session, step)) or stop
        if stop:
            self._require_loop().trainable.stop_training = True
