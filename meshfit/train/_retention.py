"""Which checkpoints a `CheckpointManager` keeps: its managed list, timestamps, and the preserved ones.

TF's rules (``tf.train.CheckpointManager``): each save is stamped with ``time.time()`` and joins the
managed list; past ``max_to_keep``, the oldest leaves the list and is deleted, unless
``keep_checkpoint_every_n_hours`` have passed since the last preserved checkpoint: then it is
preserved (kept on disk, out of the list, never deleted by a manager). If the clock reads earlier
than the last preservation, a new manager warns and keeps every recorded checkpoint out of the list
rather than risk deleting one it should keep.

The manager's state file ``<directory>/checkpoint`` (JSON, written by rank 0) carries this across
managers::

    {"latest_checkpoint": "ckpt-7", "all_checkpoints": ["ckpt-6", "ckpt-7"],
     "all_checkpoint_timestamps": [1700000000.0, 1700000600.0], "last_preserved_timestamp": 1699990000.0,
     "preserved_checkpoints": ["ckpt-2"]}

The checkpoint directories on disk stay the truth: a recorded name that is gone is dropped, and a
complete one the record does not know yet (a save that finished just before a crash) is adopted.
"""

from __future__ import annotations

import collections
import json
import os
import time
import warnings
from typing import Any

STATE_FILE_NAME = "checkpoint"


def read_state(directory: str) -> dict[str, Any] | None:
    """The manager state recorded in ``directory``, or None when there is none or it is unreadable (the
    checkpoints on disk are then all there is to go by)."""
    path = os.path.join(directory, STATE_FILE_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        warnings.warn(f"CheckpointManager ignores its unreadable state file {path!r} ({error}); the complete "
                      "checkpoints in the folder are all managed.", RuntimeWarning, stacklevel=4)
        return None
    return state if isinstance(state, dict) else None


def _names(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


class Retention:
    """The managed checkpoints (oldest first, with their timestamps) and the preservation state.

    Args:
        max_to_keep: managed checkpoints to keep (None: all).
        keep_hours: ``keep_checkpoint_every_n_hours`` (None: preserve none).
    """

    def __init__(self, max_to_keep: int | None, keep_hours: float | None) -> None:
        self.max_to_keep, self.keep_hours = max_to_keep, keep_hours
        self.managed: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.preserved: list[str] = []  # names
        self.last_preserved_timestamp = time.time() - 1.0  # a manager re-created at once still deletes

    def recover(self, on_disk: list[str], state: dict[str, Any] | None) -> None:
        """Take over the checkpoints ``on_disk`` (complete, this manager's name, by number) as recorded in ``state``."""
        now = time.time()
        recorded: dict[str, float | None] = {}
        if state is not None:
            stamp = state.get("last_preserved_timestamp")
            if isinstance(stamp, int | float) and not isinstance(stamp, bool):
                self.last_preserved_timestamp = float(stamp)
            if now < self.last_preserved_timestamp:
                warnings.warn(f"time.time() returned a value {self.last_preserved_timestamp - now:f} seconds behind "
                              "the last preserved checkpoint timestamp; CheckpointManager keeps the checkpoints "
                              "recorded before it rather than risk deleting them.", RuntimeWarning, stacklevel=3)
                self.last_preserved_timestamp = now
            names = _names(state.get("all_checkpoints"))
            stamps = state.get("all_checkpoint_timestamps")
            stamps = stamps if isinstance(stamps, list) and len(stamps) == len(names) else [None] * len(names)
            recorded = dict(zip(names, stamps, strict=True))
            present = {os.path.basename(p) for p in on_disk}
            self.preserved = [n for n in _names(state.get("preserved_checkpoints")) if n in present]
        order = {name: i for i, name in enumerate(recorded)}
        for path in sorted(on_disk, key=lambda p: order.get(os.path.basename(p), len(order))):
            name = os.path.basename(path)
            if name in self.preserved:
                continue
            stamp = recorded.get(name)
            if isinstance(stamp, int | float) and not isinstance(stamp, bool):
                if min(float(stamp), now) <= self.last_preserved_timestamp:
                    self.preserved.append(name)  # TF's clock-reset rule: kept, never deleted
                    continue
                self.managed[path] = min(float(stamp), now)
            else:  # not recorded (or recorded without a time): managed from now on
                self.managed[path] = now

    def add(self, path: str) -> list[str]:
        """Record ``path`` as just saved; return the checkpoints to delete (the new one never is)."""
        self.managed.pop(path, None)
        self.managed[path] = time.time()
        if os.path.basename(path) in self.preserved:  # removed by hand, then saved again: managed now
            self.preserved.remove(os.path.basename(path))
        doomed: list[str] = []
        if not self.max_to_keep:
            return doomed  # everything stays managed; nothing is preserved either (as TF)
        while len(self.managed) > self.max_to_keep:
            old, stamp = self.managed.popitem(last=False)
            if self.keep_hours and stamp - self.keep_hours * 3600.0 >= self.last_preserved_timestamp:
                self.last_preserved_timestamp = stamp
                self.preserved.append(os.path.basename(old))
                continue
            doomed.append(old)
        return doomed

    def state(self, latest: str | None) -> dict[str, Any]:
        """The JSON document of the state file."""
        return {"latest_checkpoint": os.path.basename(latest) if latest else None,
                "all_checkpoints": [os.path.basename(p) for p in self.managed],
                "all_checkpoint_timestamps": list(self.managed.values()),
                "last_preserved_timestamp": self.last_preserved_timestamp,
                "preserved_checkpoints": list(self.preserved)}
