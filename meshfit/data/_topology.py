"""The data topology saved with a data position: what a position ``(pass, index)`` means.

A backup's data position says "global batch ``index`` of pass ``pass``"; which examples that is
depends on the dataset's length, the global batch size, the remainder policy and the shuffles.
Restored onto other data, the same position silently reads other examples, so the topology is
saved beside it and a resume refuses a difference (`topology_mismatches`). The number of replicas
is recorded but never refused: under ``AutoShardPolicy.DATA`` a global batch holds the same
examples for any number of replicas, so meshfit resumes exactly on another world size.
"""

from __future__ import annotations

from typing import Any

from meshfit.data._dataset import Dataset
from meshfit.data._transforms import Batch, Repeat, Shuffle

# field -> what the message calls it (the user's words)
_FIELDS = {
    "examples": "examples per pass (the dataset's length)",
    "global_batch_size": "global batch size",
    "drop_remainder": "drop_remainder",
    "batches_per_pass": "batches per pass",
    "shuffle_buffers": "shuffle buffer sizes",
}


def data_topology(dataset: Dataset | None, *, global_batch_factor: int, batches_per_pass: int | None,
                  world_size: int, count_examples: bool) -> dict[str, Any]:
    """The topology of ``dataset`` as a JSON-able dict (the fields of `topology_mismatches`).

    Args:
        dataset: the pipeline this replica reads, or a torch ``DataLoader`` (its ``batch_size`` and
            ``drop_last``), or None.
        global_batch_factor: how many of its batches make a global batch (1 unless rebatched per replica).
        batches_per_pass: global batches per pass (None when infinite).
        world_size: the number of replicas (recorded, never refused).
        count_examples: whether the examples and batches per pass are the same on every replica
            (False when each replica reads its own files or builds its own pipeline).
    """
    topology: dict[str, Any] = {"world_size": world_size}
    if count_examples:
        topology["batches_per_pass"] = batches_per_pass
    if not isinstance(dataset, Dataset):  # a torch DataLoader (or another iterable of batches)
        batch_size = getattr(dataset, "batch_size", None)
        if isinstance(batch_size, int):
            topology["global_batch_size"] = batch_size
            topology["drop_remainder"] = bool(getattr(dataset, "drop_last", False))
        return topology
    nodes = dataset.node.nodes()
    batch = next((n for n in nodes if isinstance(n, Batch)), None)
    topology["shuffle_buffers"] = [n.buffer_size for n in nodes if isinstance(n, Shuffle)]
    if batch is not None:
        topology["global_batch_size"] = batch.batch_size * global_batch_factor
        topology["drop_remainder"] = bool(batch.drop_remainder)
    if count_examples:
        below = nodes[nodes.index(batch) + 1:] if batch is not None else nodes
        # the first finite length under the batch, looking through .repeat()
        lengths = (n._length() for n in below if not isinstance(n, Repeat))
        topology["examples"] = next((n for n in lengths if n is not None), None)
    return topology


def topology_mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The differences that change what a saved position reads, as ``"<what>: saved X, now Y"``.

    The number of replicas is left out (meshfit resumes exactly on another world size); a field
    missing on either side (an older backup, a DataLoader) is not compared.
    """
    out = []
    for field, words in _FIELDS.items():
        if field in saved and field in current and saved[field] != current[field]:
            out.append(f"{words}: saved {_show(saved[field])}, now {_show(current[field])}")
    return out


def _show(value: Any) -> str:
    return "infinite" if value is None else repr(value)
