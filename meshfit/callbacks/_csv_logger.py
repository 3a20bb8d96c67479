"""`CSVLogger`: one CSV row of logs per epoch."""

from __future__ import annotations

import collections.abc
import csv
import os
from typing import Any

import numpy as np

from meshfit.callbacks._callback import Callback, _is_chief, _to_float


class CSVLogger(Callback):
    """Streams each epoch's logs to a CSV file, as Keras's `CSVLogger` does.

    The header is ``epoch`` then the sorted log keys (the ``val_`` keys are added even before
    validation first runs, as in Keras); ``epoch`` is 0-based; a missing value is ``NA``. Each
    row is flushed when written. Only the chief writes. A resumed `fit` (its state restored by
    `BackupAndRestore`) keeps the rows of the epochs it had finished and drops any written after
    the backup, so the file ends up as if training had never stopped.

    Args:
        filename: The CSV file.
        separator: The field separator.
        append: Append to an existing file (no second header) instead of overwriting it.

    Raises:
        TypeError: If ``filename`` is not a string or path.
        ValueError: If ``separator`` is not a single character.

    Example:
        >>> logger = CSVLogger("training.log", separator=";")
        >>> logger.separator
        ';'
    """

    def __init__(self, filename: str | os.PathLike, separator: str = ",", append: bool = False) -> None:
        super().__init__()
        if not isinstance(filename, (str, os.PathLike)):
            raise TypeError(
                f"Invalid `filename`: expected a str or os.PathLike, received filename={filename!r}."
            )
        if not isinstance(separator, str) or len(separator) != 1:
            raise ValueError(
                f"Invalid `separator`: expected a single character, received separator={separator!r}."
            )
        self.filename = os.fspath(filename)
        self.separator = separator
        self.append = append
        self.keys: list[str] | None = None
        self._rows_written = 0
        self._resume_rows: int | None = None
        self._file: Any = None
        self._writer: csv.DictWriter | None = None
        self._write_header = True

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Starts a new log, unless state was restored for a resumed run."""
        if self._resume_rows is None:
            self.keys = None
            self._rows_written = 0

    def _open(self) -> None:
        # Opened at the first row rather than in on_train_begin, so that a state restored by
        # any callback's on_train_begin (whatever the order) still decides how to open it.
        self._write_header = True
        if self._resume_rows is not None:
            self._truncate_to(self._resume_rows)
            mode = "a"
        elif self.append and os.path.exists(self.filename):
            with open(self.filename, newline="") as existing:
                self._write_header = not existing.readline()
            mode = "a"
        else:
            mode = "w"
        self._resume_rows = None
        dirname = os.path.dirname(self.filename)
        if dirname:
            os.makedirs(dirname, exist_ok=True)
        self._file = open(self.filename, mode, newline="")  # closed in on_train_end

    def _truncate_to(self, rows: int) -> None:
        # The header plus the rows of the epochs finished before the backup.
        lines: list[str] = []
        if os.path.exists(self.filename):
            with open(self.filename, newline="") as existing:
                lines = existing.readlines()[: rows + 1]
        with open(self.filename, "w", newline="") as rewritten:
            rewritten.writelines(lines)
        self._write_header = not lines

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Writes the epoch's row and flushes it."""
        logs = logs or {}
        if self.keys is None:
            self.keys = sorted(logs)
            if not any(key.startswith("val_") for key in self.keys):
                # Validation may start later (validation_freq): keep room for its columns.
                self.keys.extend("val_" + key for key in list(self.keys))
        self._rows_written += 1
        if not _is_chief(self.model):
            self._resume_rows = None
            return
        if self._file is None:
            self._open()
        if self._writer is None:
            self._writer = csv.DictWriter(
                self._file, fieldnames=["epoch", *self.keys], delimiter=self.separator, extrasaction="ignore"
            )
            if self._write_header:
                self._writer.writeheader()
        row = {"epoch": epoch}
        row.update((key, _csv_value(logs.get(key, "NA"))) for key in self.keys)
        self._writer.writerow(row)
        self._file.flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        """Closes the file."""
        if self._file is not None:
            self._file.close()
        self._file = None
        self._writer = None
        self._resume_rows = None

    def state_dict(self) -> dict[str, Any]:
        """The columns and the number of rows written so far."""
        return {"keys": list(self.keys or []), "rows": self._rows_written}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the columns; the next row written first drops the rows written after the saved ones."""
        self.keys = list(state["keys"]) or None
        self._rows_written = int(state["rows"])
        self._resume_rows = self._rows_written
        if self._file is not None:  # restored during fit (a roll-back): reopened, truncated, at the next row
            self._file.close()
            self._file = None
            self._writer = None


def _csv_value(value: Any) -> Any:
    value = _to_float(value)
    if isinstance(value, (str, float, int)):
        return value
    if isinstance(value, collections.abc.Iterable) and not (
        isinstance(value, np.ndarray) and value.ndim == 0
    ):
        return f"[{', '.join(map(str, value))}]"
    return value
