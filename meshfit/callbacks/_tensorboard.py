"""`TensorBoard`: write training curves and weight histograms as TensorBoard event files."""

from __future__ import annotations

import os
from typing import Any

from meshfit.callbacks._callback import Callback, _is_chief, _to_float


class TensorBoard(Callback):
    """Writes TensorBoard event files, laid out as Keras's `TensorBoard` callback lays them out.

    Only the chief writes. The directory holds::

        log_dir/
          train/events.out.tfevents.*        epoch_loss, epoch_accuracy, epoch_learning_rate, ...
                                             batch_loss, ... (with an int update_freq)
                                             weight histograms (with histogram_freq > 0)
          validation/events.out.tfevents.*   epoch_loss, epoch_accuracy, ... (the val_ logs)

    Epoch scalars are written at step ``epoch`` (0-based); batch scalars at the global step
    (1-based, counted across epochs and kept across a resumed run).

    After a restore (a resumed run, or a roll-back of `VerifyReplicas` in the same process) the steps
    replayed are not shown twice: TensorBoard's purge mark (a session start at the first replayed step,
    which hides the events of the steps from there written before) goes into the open event file, or
    starts the first one a resumed run opens (``purge_step``). In ``train/``
    with batch scalars, whose epoch and batch scalars share one step axis, the mark is at the batch
    axis's step, and an epoch scalar this process already wrote is not written again.

    Args:
        log_dir: The directory to write to; view with ``tensorboard --logdir log_dir``.
        update_freq: ``"epoch"``, or ``"batch"`` or an int N: also write ``batch_<metric>``
            scalars every N training batches.
        write_graph: Write the module's structure as a text summary (tag ``model``); a traced
            graph would need an example input, which callbacks never see.
        histogram_freq: Every this many epochs, write a histogram of every parameter of
            ``model.module``, tagged with its path (``0.weight`` -> ``0/weight``); 0 disables.
            A sharded parameter contributes the chief's local shard.

    Raises:
        ValueError: If ``update_freq`` or ``histogram_freq`` is invalid.
        TypeError: If ``log_dir`` is not a string or path.

    Example:
        >>> board = TensorBoard(log_dir="logs", update_freq=100)
        >>> board.update_freq
        100
    """

    def __init__(
        self,
        log_dir: str | os.PathLike = "logs",
        update_freq: str | int = "epoch",
        write_graph: bool = False,
        histogram_freq: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(
                f"Invalid `log_dir`: expected a str or os.PathLike, received log_dir={log_dir!r}."
            )
        if update_freq == "batch":
            update_freq = 1
        if update_freq != "epoch" and (
            isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1
        ):
            raise ValueError(
                "Invalid `update_freq`: expected 'epoch', 'batch' or a positive int, "
                f"received update_freq={update_freq!r}."
            )
        if isinstance(histogram_freq, bool) or not isinstance(histogram_freq, int) or histogram_freq < 0:
            raise ValueError(
                f"Invalid `histogram_freq`: expected an int >= 0, received histogram_freq={histogram_freq!r}."
            )
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self.write_graph = write_graph
        self.histogram_freq = histogram_freq
        self._global_train_batch = 0
        self._writers: dict[str, Any] = {}
        self._purge: dict[str, int] = {}  # the first step each writer's next event file replays, after a restore
        self._epochs_written: set[int] = set()
        self._writing = False

    @property
    def reads_batch_logs(self) -> bool:
        """Batch logs are written only with an int ``update_freq`` (otherwise it only counts batches)."""
        return self.update_freq != "epoch"

    def _writer(self, name: str) -> Any:
        if name not in self._writers:
            from torch.utils.tensorboard import SummaryWriter

            self._writers[name] = SummaryWriter(log_dir=os.path.join(self.log_dir, name),
                                                purge_step=self._purge.pop(name, None))
        return self._writers[name]

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Starts writing (chief only)."""
        self._writing = _is_chief(self.model)
        if self._writing and self.write_graph:
            module = getattr(self.model, "module", None)  # whatever set_model was given (Keras drives any model)
            if module is not None:
                # Indented four spaces so TensorBoard's markdown shows it as code.
                text = "\n".join("    " + line for line in repr(module).splitlines())
                self._writer("train").add_text("model", text, 0)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Writes ``batch_<metric>`` scalars every ``update_freq`` batches."""
        self._global_train_batch += 1
        if not self._writing or not isinstance(self.update_freq, int):  # "epoch"
            return
        if self._global_train_batch % self.update_freq:
            return
        writer = self._writer("train")
        for key, value in _scalars(logs).items():
            writer.add_scalar("batch_" + key, value, self._global_train_batch)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Writes ``epoch_<metric>`` scalars (``val_`` ones to ``validation``) and histograms."""
        if not self._writing:
            return
        scalars = _scalars(logs)
        train = {k: v for k, v in scalars.items() if not k.startswith("val_")}
        validation = {k[len("val_") :]: v for k, v in scalars.items() if k.startswith("val_")}
        learning_rate = _to_float(getattr(getattr(self.model, "optimizer", None), "learning_rate", None))
        if isinstance(learning_rate, float) and "learning_rate" not in train:
            train["learning_rate"] = learning_rate
        mixed = isinstance(self.update_freq, int)  # train/ holds batch steps too: its purge mark is theirs
        if mixed and epoch in self._epochs_written:
            train = {}
        self._epochs_written.add(epoch)
        for name, values in (("train", train), ("validation", validation)):
            if values:
                writer = self._writer(name)
                for key, value in values.items():
                    writer.add_scalar("epoch_" + key, value, epoch)
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            self._write_histograms(epoch)
        for writer in self._writers.values():
            writer.flush()

    def _write_histograms(self, epoch: int) -> None:
        module = getattr(self.model, "module", None)
        if module is None:
            return
        writer = self._writer("train")
        for name, parameter in module.named_parameters():
            tensor = parameter.detach()
            if hasattr(tensor, "to_local"):
                tensor = tensor.to_local()  # the full tensor would need every rank: not chief-only
            writer.add_histogram(name.replace(".", "/"), tensor.float().cpu(), epoch)

    def on_train_end(self, logs: dict | None = None) -> None:
        """Closes the writers."""
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
        self._writing = False

    def state_dict(self) -> dict[str, Any]:
        """The global batch count, so batch scalars continue at the right step."""
        return {"global_train_batch": self._global_train_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the global batch count; the next events of each writer hide the replayed steps'."""
        self._global_train_batch = int(state["global_train_batch"])
        epoch = int(self.loop.counters.epoch) if self.loop is not None else 0  # restored before the callbacks
        first_batch = self._global_train_batch + 1
        purge = {"train": first_batch if isinstance(self.update_freq, int) else epoch, "validation": epoch}
        for name, step in purge.items():
            file_writer = getattr(self._writers.get(name), "file_writer", None)
            if file_writer is not None:  # restored mid-run: the mark goes into the open file, after what it hides
                from tensorboard.compat.proto.event_pb2 import Event, SessionLog

                file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
            else:  # restored at the start: the first event file opened starts with the mark
                self._purge[name] = step


def _scalars(logs: dict | None) -> dict[str, float]:
    """The logs that are numbers, as floats."""
    values = {key: _to_float(value) for key, value in (logs or {}).items()}
    return {key: value for key, value in values.items() if isinstance(value, float)}
