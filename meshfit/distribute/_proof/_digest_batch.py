"""Every tensor's digest part at once: a fixed handful of device ops for a whole state.

The sum is the one `meshfit.distribute._proof._digest` defines, computed for all the tensors of a device
together, bit for bit equal to `range_sum` one tensor at a time. Per tensor, only its full key rows
cost an op of their own: a multiply by the key row into rows of a scratch matrix, per block of rows;
the blocks of several tensors fill the scratch matrix, and one row sum of it writes their rows' sums
into one vector of row sums. The rows no tensor fills (a head and a tail per tensor) are gathered by
one ``cat`` into zero-padded rows of a few widths (a small tensor's row is a few hundred words, not
65,536) and multiplied and summed per width. The row keys and one ``index_add_`` then turn all the
row sums into every tensor's sum at once. The layout of all this (which row belongs to which tensor,
with which row key) depends only on the tensors' sizes and offsets: it is computed once per layout
and kept on the device.

On a GPU a digest is bound by kernel launches, not by bandwidth: one tensor at a time cost 12 or more
kernels per tensor (34 times one ``sum`` per tensor); here a tensor of fewer than a block of full
rows costs one multiply and a share of a row sum, and the host reads every sum of a device in one
copy at the end, with no sync before.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from meshfit.distribute._proof._digest import (
    BLOCK_ROWS,
    COLUMNS,
    LocalPart,
    LocalWords,
    _indexed_sum,
    _keys,
    _row_key_table,
    local_words,
    widen,
)

# Widths of the padded rows that hold partial rows: a row spanning columns [c, e) goes into the
# narrowest window [0, w) or [C - w, C) that holds it (a tensor's tail starts at column 0; a shard's
# head ends at column C), so a small tensor costs a few hundred words, and there are at most 9 windows.
WINDOWS = (256, 1024, 4096, 16384, COLUMNS)
GPU_BLOCK_ROWS = 256  # scratch rows on an accelerator: 64 MiB, 4 tensors of 4 M float32 per row sum
_LAYOUTS = 32  # layouts kept per process (a training state has one or two: the model's, a checkpoint's)


@dataclasses.dataclass(frozen=True)
class _Partials:
    """The partial rows of the words of one integer width, in the order of the ``cat``.

    Attributes:
        pieces: ``(slot, offset, length, zeros before, zeros after)`` for each partial row (the
            zeros: views of one zero row on the device, or ``None``).
        windows: ``(first key column, width, rows)`` for each run of rows padded to one width.
    """

    pieces: tuple[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None], ...]
    windows: tuple[tuple[int, int, int], ...]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each tensor's words go, for one list of ``(word count, start, word width)``.

    Attributes:
        blocks: ``(slot, offset, rows, at, flush)``: a matrix of full key rows of one tensor's
            words, multiplied into rows ``[at, at + rows)`` of the scratch matrix; after it, when
            ``flush``, the first ``flush`` rows of the scratch matrix are summed (the blocks of
            several tensors fill it before one sum: a tensor's full rows cost one op, not two).
        partials: by integer width (bytes), the partial rows of the words of that width.
        scratch_rows: the scratch matrix's height.
        runs: how many row sums each flush, then each window of ``partials``, writes.
        row_keys: each row sum's row key (int64, on the device).
        segments: each row sum's tensor (its slot; int64, on the device).
    """

    blocks: tuple[tuple[int, int, int, int, int], ...]
    partials: tuple[tuple[int, _Partials], ...]
    scratch_rows: int
    runs: tuple[int, ...]
    row_keys: torch.Tensor
    segments: torch.Tensor


def _window(column: int, end: int) -> tuple[int, int]:
    """The narrowest window ``(first column, width)`` holding columns ``[column, end)`` of a key row."""
    for width in WINDOWS:
        if end <= width:
            return 0, width
        if column >= COLUMNS - width:
            return COLUMNS - width, width
    return 0, COLUMNS


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor on ``device`` without a host sync (a CUDA copy from pinned memory is asynchronous)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@functools.cache  # a row of zero words per device and integer width, to pad partial rows with
def _zeros(device: torch.device, width: int) -> torch.Tensor:
    return torch.zeros(COLUMNS, dtype={4: torch.int32, 2: torch.int16, 1: torch.int8}[width], device=device)


@functools.lru_cache(maxsize=_LAYOUTS)
def _layout(device: torch.device, sizes: tuple[tuple[int, int, int], ...]) -> _Layout:
    """The layout for tensors of ``(word count, start, word width)``, in slot order, on ``device``."""
    block = BLOCK_ROWS if device.type == "cpu" else GPU_BLOCK_ROWS
    blocks: list[tuple[int, int, int, int, int]] = []
    runs: list[int] = []
    fill = 0  # scratch rows filled since the last flush
    row_index: list[int] = []
    segments: list[int] = []
    loose: dict[int, list[tuple[tuple[int, int], int, int, int, int, int]]] = {}
    for slot, (count, start, width) in enumerate(sizes):
        head = min((-start) % COLUMNS, count)
        rows = (count - head) // COLUMNS
        tail = head + rows * COLUMNS
        for offset, length in ((0, head), (tail, count - tail)):
            if length:
                column = (start + offset) % COLUMNS
                window = _window(column, column + length)
                loose.setdefault(width, []).append((window, slot, offset, length, column, (start + offset) // COLUMNS))
        for begin in range(0, rows, block):
            height = min(block, rows - begin)
            if fill + height > block:
                blocks[-1] = (*blocks[-1][:4], fill)
                runs.append(fill)
                fill = 0
            blocks.append((slot, head + begin * COLUMNS, height, fill, 0))
            fill += height
            first = (start + head) // COLUMNS + begin
            row_index.extend(range(first, first + height))
            segments.extend([slot] * height)
    if blocks:
        blocks[-1] = (*blocks[-1][:4], fill)
        runs.append(fill)
    scratch_rows = max(runs, default=0)
    partials = []
    for width in sorted(loose):
        zeros = _zeros(device, width)
        pieces: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]] = []
        windows: list[tuple[int, int, int]] = []
        for (key_start, size), slot, offset, length, column, row in sorted(loose[width], key=lambda p: p[0]):
            before, after = column - key_start, key_start + size - column - length
            pieces.append((slot, offset, length, zeros[:before] if before else None, zeros[:after] if after else None))
            if windows and windows[-1][:2] == (key_start, size):
                windows[-1] = (key_start, size, windows[-1][2] + 1)
            else:
                windows.append((key_start, size, 1))
            row_index.append(row)
            segments.append(slot)
        partials.append((width, _Partials(tuple(pieces), tuple(windows))))
        runs.extend(rows for _, _, rows in windows)
    table = _row_key_table(device, 1 << max(10, max(row_index, default=0).bit_length()))
    return _Layout(tuple(blocks), tuple(partials), scratch_rows, tuple(runs),
                   table.index_select(0, _to_device(row_index, device)), _to_device(segments, device))


def range_sums(ranges: Sequence[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """`range_sum` of every ``(words, start)`` (flat words of one device, see `raw_words`), as one
    int64 vector on that device, in a fixed number of ops plus one per block of full rows and one per
    scratch matrix they fill."""
    device = ranges[0][0].device
    layout = _layout(device, tuple((w.numel(), start, w.element_size()) for w, start in ranges))
    keys, _ = _keys(device)
    row_sums = torch.empty(sum(layout.runs), dtype=torch.int64, device=device)
    outs = iter(row_sums.split(layout.runs))  # one op for every slice written below
    if layout.blocks:
        scratch = torch.empty(layout.scratch_rows, COLUMNS, dtype=torch.int32, device=device)
        lanes = scratch.view(torch.int64)
        views: dict[tuple[int, int], torch.Tensor] = {}  # tensors of equal sizes: their views made once
        for slot, offset, rows, at, flush in layout.blocks:
            if (at, rows) not in views:
                views[at, rows] = scratch[at:at + rows]
            words = ranges[slot][0]
            torch.mul(words.as_strided((rows, COLUMNS), (COLUMNS, 1), words.storage_offset() + offset), keys,
                      out=views[at, rows])  # int32: wraps modulo 2**32 (a narrow word sign-extended first)
            if flush:
                torch.sum(lanes[:flush], dim=1, out=next(outs))
    for width, partial in layout.partials:
        pieces = []
        for slot, offset, length, before, after in partial.pieces:
            if before is not None:
                pieces.append(before)
            pieces.append(ranges[slot][0][offset:offset + length])
            if after is not None:
                pieces.append(after)
        padded = torch.cat(pieces)  # a new tensor: multiplied in place below
        done = 0
        for key_start, size, rows in partial.windows:
            matrix = padded[done:done + rows * size].view(rows, size)
            row_keys = keys[key_start:key_start + size]
            products = matrix.mul_(row_keys) if width == 4 else torch.mul(matrix, row_keys)
            torch.sum(products.view(torch.int64), dim=1, out=next(outs))
            done += rows * size
    totals = torch.zeros(len(ranges), dtype=torch.int64, device=device)
    return totals.index_add_(0, layout.segments, row_sums.mul_(layout.row_keys))


def local_parts(tensors: Sequence[torch.Tensor], rank: int) -> tuple[list[int], list[LocalPart]]:
    """Each tensor's local part on ``rank``: its sum (a signed 64-bit int) and where it counts.

    The tensors of each device are summed together (`queue_sums`); the host then reads each
    device's sums in one copy (one sync per device, none before).
    """
    held, queued = queue_sums(tensors, rank)
    values = [0] * len(held)
    for slots, sums in queued:
        for slot, value in zip(slots, sums.tolist(), strict=True):
            values[slot] = value
    parts: list[LocalPart] = list(held)
    return values, parts


def queue_sums(tensors: Sequence[torch.Tensor], rank: int) -> tuple[list[LocalWords], list[tuple[list[int], torch.Tensor]]]:
    """The words each tensor has on ``rank``, and per device the slots summed there with their sums
    (an int64 vector on the device, not read yet). A tensor holding no words is in none: its sum is 0."""
    held = [local_words(t, rank) for t in tensors]
    ranged: dict[torch.device, list[tuple[int, torch.Tensor, int]]] = {}
    indexed: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for slot, part in enumerate(held):
        if part.words is None or not part.words.numel():
            continue
        if part.word_index is None:
            ranged.setdefault(part.words.device, []).append((slot, part.words, part.start))
        else:  # a block of a sharded tensor that is not one flat range: its own path
            indexed.setdefault(part.words.device, []).append((slot, _indexed_sum(widen(part.words), part.word_index)))
    queued: list[tuple[list[int], torch.Tensor]] = []
    for device in {**ranged, **indexed}:
        sums = []
        if device in ranged:
            sums.append(range_sums([(words, start) for _, words, start in ranged[device]]))
        if device in indexed:
            sums.append(torch.stack([value for _, value in indexed[device]]))
        slots = [s for s, _, _ in ranged.get(device, [])] + [s for s, _ in indexed.get(device, [])]
        queued.append((slots, sums[0] if len(sums) == 1 else torch.cat(sums)))
    return held, queued
