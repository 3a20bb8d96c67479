"""The digest of many tensors at once (`local_parts`): bit for bit the per-tensor sums, in a few ops."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from meshfit.distribute import local_parts
from meshfit.distribute._proof._digest import COLUMNS, local_digest, range_sum, raw_words, widen
from meshfit.distribute._proof._digest_batch import WINDOWS, _layout, range_sums


def _mixed() -> list[torch.Tensor]:
    torch.manual_seed(0)
    wide = torch.randn(3, 70_000, dtype=torch.float64)
    return [
        torch.randn(0),                                      # nothing
        torch.randn(1),                                      # one word
        torch.randn(7),                                      # odd
        torch.tensor(2.5),                                   # 0-d
        torch.randn(COLUMNS),                                # exactly one key row
        torch.randn(3 * COLUMNS + 5),                        # full rows and a partial one
        torch.randn(2 * COLUMNS - 1),                        # a row and a nearly full one
        torch.randn(2 * COLUMNS + 3).to(torch.bfloat16),     # 16-bit words: rows and a partial row
        torch.randn(300).to(torch.float16),
        torch.randint(-128, 127, (70_001,), dtype=torch.int8),
        torch.randint(-128, 127, (5,), dtype=torch.int8),
        torch.rand(1000) > 0.5,                              # bool: one word per element
        wide,                                                # float64: two words per element
        wide.t(),                                            # not contiguous
        torch.randn(10, 7)[:, 2],                            # a strided view
        torch.arange(12, dtype=torch.int64).reshape(4, 3),
        torch.randn(4, COLUMNS // 2, dtype=torch.float32)[1:3],  # a view at an offset: one row exactly
        torch.randn(64 * COLUMNS + 9),                       # more rows than a CPU block
    ]


def test_the_batched_sums_equal_the_per_tensor_sums_bit_for_bit():
    tensors = _mixed()
    values, parts = local_parts(tensors, 0)
    assert values == [int(local_digest(t).value) for t in tensors]
    assert [p.meta for p in parts] == [local_digest(t).meta for t in tensors]
    assert all(p.canonical and p.shard == () for p in parts)
    assert all(not p.canonical for p in local_parts(tensors, 1)[1])
    assert local_parts(tensors, 0)[0] == values  # again, with the layout cached
    assert local_parts(list(reversed(tensors)), 0)[0] == values[::-1]
    assert local_parts([], 0) == ([], [])


def test_shard_ranges_at_any_offset_equal_the_per_range_sums():
    # A flat-range shard of a DTensor starts anywhere: heads end at the row's end, short shards sit
    # inside a row; every window (left, right, whole row) is used.
    generator = torch.Generator().manual_seed(1)
    ranges = []
    for count in (1, 5, 255, 300, 4000, COLUMNS - 1, COLUMNS, COLUMNS + 1, 3 * COLUMNS + 17):
        for start in (0, 1, 2, 700, COLUMNS - 300, COLUMNS - 4000, COLUMNS - 16_000, COLUMNS - 1, 3 * COLUMNS + 12_345,
                      5 * COLUMNS - 1):
            for dtype in (torch.int32, torch.int16, torch.int8) if count in (5, COLUMNS + 1) else (torch.int32,):
                info = torch.iinfo(dtype)
                ranges.append((torch.randint(info.min, info.max, (count,), dtype=dtype, generator=generator), start))
    expected = [int(range_sum(widen(words), start)) for words, start in ranges]
    assert range_sums(ranges).tolist() == expected
    windows = {w for _, p in _layout(torch.device("cpu"), tuple((w.numel(), s, w.element_size()) for w, s in ranges))
               .partials for w in p.windows}
    assert {(0, w) for w in WINDOWS} | {(COLUMNS - w, w) for w in WINDOWS[:-1]} <= {w[:2] for w in windows}


def test_the_digest_of_fixed_tensors_is_the_one_backups_recorded():
    # Computed by the per-tensor digest before the batched one existed (commit a712614): a backup
    # records these values, so they never change.
    tensors = [
        torch.arange(3 * COLUMNS + 5, dtype=torch.float32) * 0.5,
        (torch.arange(70_001) % 251 - 125).to(torch.int8),
        torch.linspace(-3, 3, 4000, dtype=torch.float64).reshape(40, 100).t(),
        torch.arange(COLUMNS, dtype=torch.int32),
        torch.linspace(-1, 1, 9).to(torch.bfloat16),
    ]
    recorded = [2911063686844791936, -6198203081728082712, 2780591933361883304, 6666514591594242592,
                -415025297044413696]
    assert local_parts(tensors, 0)[0] == recorded
    assert [int(local_digest(t).value) for t in tensors] == recorded


# Ops that launch no kernel: views, allocations, and the host read's bookkeeping.
_NO_KERNEL = {"aten::view", "aten::slice", "aten::narrow", "aten::reshape", "aten::_reshape_alias",
              "aten::as_strided", "aten::detach", "aten::alias", "aten::select", "aten::split_with_sizes",
              "aten::split", "aten::empty", "aten::empty_strided", "aten::resolve_conj", "aten::resolve_neg"}


def _kernel_ops(tensors: list[torch.Tensor]) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        local_parts(tensors, 0)
    return [e.name for e in prof.events()
            if e.cpu_parent is None and e.name.startswith("aten::") and e.name not in _NO_KERNEL]


def test_many_tensors_cost_one_op_per_block_of_rows_and_a_fixed_few_more():
    # A model-like state: 12 tensors with 2 full key rows each (one block each, together 24 rows: one
    # CPU scratch matrix of 64) and 48 small ones of float32 and bfloat16. Per block of full rows: a
    # multiply into the scratch matrix; per scratch matrix filled: a row sum. Per integer width of
    # words (2 here): one cat of the partial rows, and a multiply and a sum per window of padded rows
    # used (tensors at offset 0 use the left windows only: at most 5). Then one zeros, one multiply by
    # the row keys and one index_add_. Bound: blocks + 1 + 2 x (1 + 2 x 5) + 3 = blocks + 26. Summing
    # one tensor at a time cost 8 to 12 ops per tensor (489 here).
    torch.manual_seed(0)
    tensors = [torch.randn(2 * COLUMNS + 77 * i) for i in range(12)]
    tensors += [torch.randn(int(10 ** (1 + 3 * i / 48))) for i in range(48)]
    tensors[20::3] = [t.to(torch.bfloat16) for t in tensors[20::3]]
    blocks = 12
    local_parts(tensors, 0)  # the layout is built once per list of sizes
    built = _layout.cache_info().misses
    ops = _kernel_ops(tensors)
    assert _layout.cache_info().misses == built
    assert len(ops) <= blocks + 26, sorted(ops)
    assert ops.count("aten::sum") <= 1 + 10
    assert ops.count("aten::mul") + ops.count("aten::mul_") <= blocks + 11
    assert ops.count("aten::cat") == 2  # float32 and bfloat16 words


def test_the_raw_words_of_a_narrow_dtype_widen_to_the_per_tensor_words():
    for tensor in (torch.randn(9).to(torch.bfloat16), torch.tensor([True, False]), torch.tensor([-3, 7], dtype=torch.int8)):
        words, per_element = raw_words(tensor)
        assert per_element == 1 and words.element_size() == tensor.element_size()
        assert widen(words).dtype == torch.int32 and widen(words).tolist() == words.tolist()
