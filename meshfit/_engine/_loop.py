"""`TrainingLoop`: the one training loop, behind `Model.fit` and the Estimator's ``train``.

A strategy changes how a step runs (module placement, data split, reductions); nothing here
branches on which strategy it is, and nothing here knows `Model`: the loop drives a `Trainable`.
The loop is `Stateful`: a backup is its state plus its trainable's parts (see `checkpoint_items`).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from meshfit._engine._executions import (
    accumulates,
    batch_hooks,
    builtin_train_step,
    ends_unknown,
    next_batch,
    only_bars_read_batch_ends,
    stopping_batch_hooks,
    warn_hooks_per_execution,
)
from meshfit._engine._preemption import PreemptionChecks, PreemptionWatch
from meshfit._engine._replica_state import ReplicaState
from meshfit._engine._state import LoopState
from meshfit._engine._step_logs import (
    LazyLogs,
    MetricResults,
    agree,
    as_logs,
    may_own_logs,
    mean_over_processes,
    merge_returned,
    reduce_logs,
    replaces_metrics,
    sum_flags,
)
from meshfit._protocols import CallbackListLike, PlacementLike, Stateful, Trainable
from meshfit._runtime import PREEMPTED_EXIT_CODE, keep_freed_memory
from meshfit.data import batch_size_of
from meshfit.distribute import agree_buffers, replica_context_scope
from meshfit.optimizers import defers_update, inside_window


class TrainingLoop:
    """Runs training steps over a trainable's data, with callbacks; its position is saveable.

    Args:
        trainable: what is trained (`meshfit.Model`, or the Estimator's model).
        data: this replica's batches with a saveable position (`meshfit._engine._data_handler.DataHandler`).
        callbacks: the `CallbackList` to call; each callback gets this loop through ``set_loop``.
        counters: the epoch / step / iterations counters to continue (default: fresh ones).

    Attributes:
        counters: where training is: ``epoch`` (0-based), ``step`` within it, ``iterations`` done.
    """

    def __init__(self, trainable: Trainable, data: Any, callbacks: CallbackListLike,
                 counters: LoopState | None = None) -> None:
        self.trainable = trainable
        self.strategy = trainable.strategy
        self.data = data
        self.callbacks = callbacks
        self._snapshot: Any = None
        self.counters = counters if counters is not None else LoopState()
        self.replica_state = ReplicaState(trainable)
        self._preemption: PreemptionWatch | None = None
        self._resumed = False  # a resume during run: the epoch loop starts over from the restored counters
        self._agree_each_step = True  # several processes: share the stop / preemption flags after each execution
        self._flags_pending = False  # ... or once, at the epoch's first execution (see `_step_needs`)
        self._checks: PreemptionChecks | None = None  # ... and at these steps, where only preemption can stop
        self._scope: AbstractContextManager[Any] = nullcontext()  # these four: set by `run` for its steps
        self._failure: Any = None
        self._single, self._agree_end = True, False
        self._hooks = (True, True)  # whether a callback implements on_train_batch_begin / _end (`_step_needs`)
        self._lazy_logs = False  # one process whose batch logs only progress bars read: `LazyLogs`
        self._own_logs = False  # the last step returned a dict of its own names (`replaces_metrics`)
        self._edited: MetricResults | None = None  # the last step's results, where an override edited them
        callbacks.set_loop(self)

    # ---- Stateful: the state every replica shares ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters, data position and callback state (identical on every replica)."""
        return {"counters": self.counters.state_dict(), "data": self.data.state_dict(),
                "callbacks": self.callbacks.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters.load_state_dict(state["counters"])
        self.data.load_state_dict(state["data"])
        self.callbacks.load_state_dict(state["callbacks"])

    # ---- resume: the loop owns its state and restores it ------------------------------------
    def snapshot(self) -> Any:
        """The `meshfit.train.Checkpoint` of everything a resume needs: `checkpoint_items` (built once,
        so async saves reuse their staging buffers), in the strategy's `World`."""
        if self._snapshot is None:
            from meshfit.train import Checkpoint  # lazily loaded public subpackage

            self._snapshot = Checkpoint(**self.checkpoint_items())
            self._snapshot.world = self.strategy.world
        return self._snapshot

    def resume(self, candidates: Sequence[str], *, fall_back: bool = True) -> str | None:
        """Restore the newest of ``candidates`` (oldest first; collective) into this loop's state.

        Args:
            candidates: checkpoint paths every process agrees on, oldest first.
            fall_back: skip a checkpoint that fails verification (a warning on the chief names it)
                and try the previous one; False restores the newest or raises.

        Returns:
            The path restored, or None (no candidate, or none intact).
        """
        if not candidates:
            return None
        if not fall_back:
            self.snapshot().restore(candidates[-1])
            self._resumed = True
            return candidates[-1]
        from meshfit.train import restore_newest_intact  # lazily loaded public subpackage

        restored = restore_newest_intact(self.snapshot(), list(candidates), self.strategy.is_chief)
        self._resumed = self._resumed or restored is not None
        return restored

    def agree(self, flag: bool) -> bool:
        """True on every process when ``flag`` is true on any (one collective on the control plane)."""
        return agree(self.trainable, flag)

    def checkpoint_items(self) -> dict[str, Stateful]:
        """Everything a backup holds: the trainable's parts, this loop, and each replica's own state."""
        from meshfit.train import PerRank  # a lazily loaded public subpackage (torch.distributed.checkpoint)

        items: dict[str, Any] = dict(self.trainable.saveable_parts())
        items.update(loop=self, replica=PerRank(self.replica_state))
        return items

    def agree_buffers(self) -> None:
        """Give every replica rank 0's module buffers (collective; see `meshfit.distribute._buffers`).

        Called at each epoch's end, at the end of ``run`` and by savers before each save.
        """
        if self.strategy.num_replicas_in_sync > 1:
            agree_buffers(self.trainable.module, self.strategy, self.trainable.residency)

    # ---- running ---------------------------------------------------------------------------
    def run(self, *, epochs: int | None = None, initial_epoch: int = 0, until_step: int | None = None,
            validate: Callable[[int], dict[str, float]] | None = None) -> dict[str, float]:
        """Train until ``epochs`` epochs are done or ``until_step`` optimizer steps, whichever first.

        Args:
            epochs: the epoch index to stop at (Keras's ``epochs``); None: no epoch limit.
            initial_epoch: the epoch to start at (a restored backup may move it on: the callbacks'
                restorer, `RestoresTraining`, runs after the metrics are reset and before any hook).
            until_step: stop once ``counters.iterations`` reaches it (the Estimator's ``max_steps``);
                it may end mid-epoch, and a resume continues inside that epoch.
            validate: called after each completed epoch with its index; returns ``val_`` logs.

        Returns:
            The last epoch's logs (or the last step's when training stopped inside an epoch).
        """
        if epochs is None and until_step is None:
            raise ValueError("TrainingLoop.run needs `epochs` or `until_step`; received neither.")
        keep_freed_memory()  # no page-fault tax on the tensors every step re-allocates
        trainable, cbs, counters = self.trainable, self.callbacks, self.counters
        counters.epoch, counters.step = initial_epoch, 0
        trainable.stop_training = False
        handles_preemption = any(c.handles_preemption for c in cbs)
        self._preemption = PreemptionWatch(handles_preemption, self.strategy.failure)
        # Fixed for the run, looked up once: the strategy's replica scope and failure record, whether
        # this is one process and whether several agree on the end of data of unknown length.
        self._scope, self._failure = replica_context_scope(self.strategy), self.strategy.failure
        self._single, self._agree_end = self.strategy.num_processes == 1, ends_unknown(trainable, self.data)
        logs: MutableMapping[str, Any] = {}
        epoch_logs: dict[str, float] = {}
        try:
            trainable.reset_metrics()
            restorer = cbs.restorer()
            if restorer is not None:  # resume before any hook: every callback's on_train_begin sees the restored state
                restorer.restore_training(self)
            cbs.on_train_begin()
            # After on_train_begin, which may give a callback a batch hook (one that may stop training)
            batch_logs, self._agree_each_step, preemption = self._step_needs(handles_preemption)
            self._checks = PreemptionChecks() if preemption and not self._agree_each_step else None
            self._lazy_logs = self._single and only_bars_read_batch_ends(cbs)
            self._resumed = False  # a resume at the start is where the epoch loop begins anyway
            while not self._done(epochs, until_step) and not trainable.stop_training:
                epoch = counters.epoch
                if counters.step == 0:
                    trainable.reset_metrics()
                    self.data.start_epoch()
                cbs.on_epoch_begin(epoch)
                self._flags_pending = True  # a stop asked for before the epoch's first step
                trainable.module.train()
                stopped = False
                while not stopped and (until_step is None or counters.iterations < until_step):
                    count = self.data.execution_size(counters.step, trainable.steps_per_execution)
                    if until_step is not None:
                        count = min(count, until_step - counters.iterations)
                    if count <= 0:
                        break
                    logs, stopped = self._train_steps(batch_logs, count, logs)
                    if self._resumed:
                        break
                if self._resumed:  # a callback rolled back to a backup (VerifyReplicas): go on from its step
                    self._resumed = False
                    continue
                ended = self.data.exhausted
                if not stopped and self.data.execution_size(counters.step, 1) > 0:
                    break  # until_step reached inside the epoch: no epoch end
                epoch_logs = self._end_epoch(epoch, logs, validate)
                if ended and epochs is None:
                    break  # the Estimator trains until its input ends
            # Keras's fit: the optimizer's moving averages (use_ema) replace the weights before on_train_end.
            trainable.finish_training()
            self.agree_buffers()
            logs = as_logs(epoch_logs or logs)
            cbs.on_train_end(logs)
            self.strategy.barrier()
        finally:
            self._preemption.close()
            self._preemption = None
        return logs

    def _step_needs(self, handles_preemption: bool) -> tuple[bool, bool, bool]:
        """What the steps of this run share between processes, agreed by all of them in one collective:
        whether a callback reads batch logs (Keras's rule: logs are reduced only for a reader), whether
        anything may ask to stop inside an epoch, so that the stop and preemption flags are summed after
        every execution, and whether a process handles preemption.

        Stopping inside an epoch: a callback with a training batch hook that may set ``stop_training``
        (every one but those saying ``stops_in_batch_hooks = False``: savers) or a ``train_step``
        other than the built-in one. Otherwise the flags are summed once an epoch, at its first
        execution (a stop asked for in ``on_train_begin`` or ``on_epoch_begin``), and the epoch's end
        agrees on ``stop_training`` as always: a several-process step then has no collective besides the
        gradients' own. A preemption handler (SIGTERM: `BackupAndRestore`) adds a check about every
        `CHECK_SECONDS` of training (`PreemptionChecks`), not one at every step."""
        cbs, trainable = self.callbacks, self.trainable
        self._hooks = batch_hooks(cbs)
        warn_hooks_per_execution(cbs, trainable.steps_per_execution)
        may_stop = not builtin_train_step(trainable) or stopping_batch_hooks(cbs)
        reads, stops, preemption = sum_flags(self.strategy, [float(cbs.batch_logs_needed()), float(may_stop),
                                                              float(handles_preemption)])
        return reads > 0, stops > 0, preemption > 0

    def _done(self, epochs: int | None, until_step: int | None) -> bool:
        return ((epochs is not None and self.counters.epoch >= epochs)
                or (until_step is not None and self.counters.iterations >= until_step))

    def _train_steps(self, batch_logs: bool, count: int,
                     logs: MutableMapping[str, Any]) -> tuple[MutableMapping[str, Any], bool]:
        """One execution: up to ``count`` steps between two batch-callback calls (fewer where data of
        unknown length ends); returns the logs and whether every replica agreed to stop."""
        trainable, strategy, counters, cbs, data = self.trainable, self.strategy, self.counters, self.callbacks, self.data
        agree_end, single = self._agree_end, self._single
        if not single:  # one process has no peer to watch
            strategy.check_alive()
        fetched = next_batch(trainable, data, agree_end)
        if fetched is None:
            return logs, False  # the data ended before this execution: Keras calls no hook for it
        begin = counters.step
        if self._hooks[0]:
            cbs.on_train_batch_begin(begin)
        if self._resumed:  # a callback rolled back before the step (VerifyReplicas' at-rest check): not run
            return logs, False
        returned = None
        scope, failure = self._scope, self._failure
        window_possible = accumulates(trainable)
        for done in range(count):
            if done:
                if not single:
                    strategy.check_alive()
                fetched = next_batch(trainable, data, agree_end)
                if fetched is None:
                    break
            returned = _train_step(trainable, scope, *fetched, accumulates=window_possible)
            counters.step += 1
            counters.iterations += 1
            failure.step = counters.iterations
        # A dict of an override's own names is the step's logs alone, and the last one the epoch's (Keras)
        owns = may_own_logs(returned)
        self._own_logs = owns and replaces_metrics(trainable, returned)
        self._edited = returned if owns and returned.__class__ is MetricResults else None
        preemption_requested = self._preemption is not None and self._preemption.requested
        last = begin + trainable.steps_per_execution - 1  # Keras's nominal index, also when fewer ran
        if single and (not batch_logs or self._lazy_logs):
            # The usual step of one process: without a reader of batch logs nothing to reduce or read;
            # where only a progress bar reads them, they are reduced at the steps it redraws.
            if batch_logs:
                logs = LazyLogs(trainable, returned)
            else:
                logs = merge_returned(trainable, {}, returned, convert=False) if owns else {}
            if self._hooks[1]:  # (LazyLogs reach progress bars only: a Mapping where Keras passes a dict)
                hook_logs: Any = logs
                cbs.on_train_batch_end(last, hook_logs)
            if preemption_requested:
                self._stop_for_preemption()
            return logs, trainable.stop_training
        checks = self._checks
        if batch_logs or single or (
                (self._agree_each_step or self._flags_pending or (checks is not None and checks.due(counters.iterations)))
                and not inside_window(getattr(trainable, "optimizer", None))):
            proposal = checks.proposal(counters.iterations, strategy.is_chief) if checks is not None else 0.0
            logs, (preempt, stop, interval) = reduce_logs(
                trainable, [float(preemption_requested), float(trainable.stop_training), proposal],
                with_metrics=batch_logs)
            trainable.stop_training = stop > 0
            self._flags_pending = False
            if checks is not None:
                checks.agreed(counters.iterations, interval)
        else:  # inside a gradient accumulation window (the replicas agree at its last batch), or nothing
            # can ask to stop inside this epoch (the epoch's end agrees) and no preemption check is due:
            # no collective
            logs, preempt, stop = {}, 0.0, 0.0
        if owns:  # (`super().train_step`'s results alone hold nothing to merge)
            merge_returned(trainable, logs, returned, convert=batch_logs)  # read (a host sync) only where logs are
        if self._hooks[1]:
            cbs.on_train_batch_end(last, logs)
        if preempt > 0:
            self._stop_for_preemption()
        # A stop asked for in on_train_batch_end reaches the other replicas with the next step's
        # reduction; stopping on it alone here would leave them waiting.
        return logs, stop > 0 or (trainable.stop_training and single)

    def _end_epoch(self, epoch: int, logs: MutableMapping[str, Any],
                   validate: Callable[[int], dict[str, float]] | None) -> dict[str, float]:
        if self._own_logs:  # the last step returned a dict of its own: the epoch's logs (Keras)
            epoch_logs = mean_over_processes(self.strategy, as_logs(logs))
        else:  # the epoch's metrics from their (possibly restored) accumulators, on every replica
            epoch_logs, _ = reduce_logs(self.trainable)
            epoch_logs.update({k: v for k, v in as_logs(logs).items() if k not in epoch_logs})
            if self._edited is not None:  # what an override set or deleted in the last step's results (Keras)
                for name in self._edited.deleted():
                    epoch_logs.pop(name, None)
                # each number the processes' mean, as an override's own dict: every process's callbacks see one
                epoch_logs.update(mean_over_processes(self.strategy, as_logs(self._edited.entries())))
        self.agree_buffers()  # validation and epoch-end saves read the same statistics everywhere
        if validate is not None:
            epoch_logs.update(validate(epoch))
        self.data.end_epoch()
        self.counters.epoch, self.counters.step = epoch + 1, 0
        self.callbacks.on_epoch_end(epoch, epoch_logs)
        # The agreed stop, and a preemption request not yet shared by a step's check (`PreemptionChecks`):
        # every replica saves here (an epoch's backup is this step's already) and exits.
        requested = self._preemption is not None and self._preemption.requested
        stop, preempt = sum_flags(self.strategy, [float(self.trainable.stop_training), float(requested)])
        self.trainable.stop_training = stop > 0
        if preempt > 0:
            self._stop_for_preemption()
        return epoch_logs

    def _stop_for_preemption(self) -> None:
        """Every replica reached the same step: save a backup there and exit with the restart code."""
        for callback in self.callbacks:
            if callback.handles_preemption:
                callback.save_for_preemption()
        self.strategy.barrier()
        raise SystemExit(PREEMPTED_EXIT_CODE)


def run_train_step(trainable: Trainable, batch: Any, global_size: int) -> Any:
    """One training step on this replica's ``batch`` of a global batch of ``global_size`` examples (the
    replicas' gradients weighted by their shares); returns what ``train_step`` returned. ``fit``'s loop
    and ``train_on_batch`` both step through here."""
    return _train_step(trainable, replica_context_scope(trainable.strategy), batch, global_size)


def _train_step(trainable: Trainable, scope: AbstractContextManager[Any], batch: Any, global_size: int, *,
                accumulates: bool = True) -> Any:
    """`run_train_step` inside the strategy's replica ``scope``, which the loop looks up once per execution
    (and whether the optimizer accumulates gradients at all: False, no window is looked for)."""
    strategy = trainable.strategy
    with strategy.batch_weight(batch_size_of(batch), global_size), scope:
        window = _gradient_window(trainable) if accumulates else None
        if window is None:  # the common case: no third context manager entered at every step
            return trainable.train_step(strategy.distribute_batch(batch))
        with window:
            return trainable.train_step(strategy.distribute_batch(batch))


def _gradient_window(trainable: Trainable) -> AbstractContextManager[None] | None:
    """Where the optimizer's next step only accumulates (``gradient_accumulation_steps``), the step's
    gradients stay on this replica (its placement's `deferred`: DDP's ``no_sync``), so that the
    replicas reduce once per update; None where the step updates."""
    placement: PlacementLike | None = getattr(trainable, "placement", None)
    if placement is None or not defers_update(getattr(trainable, "optimizer", None)):
        return None
    return placement.gradient_sync.deferred()


def resolve_verbose(verbose: Any, is_chief: bool) -> int:
    """Keras's ``verbose``: ``"auto"`` is 1; workers other than the chief stay quiet."""
    if verbose == "auto":
        verbose = 1
    if verbose not in (0, 1, 2) or isinstance(verbose, bool):
        raise ValueError(f"Invalid `verbose`: expected 'auto', 0, 1 or 2, received verbose={verbose!r}.")
    return verbose if is_chief else 0
