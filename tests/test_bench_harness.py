"""bench/bench_all.py's arithmetic: the backup step figures, the per-round ratios and the table."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
_spec = importlib.util.spec_from_file_location("bench_all", os.path.join(ROOT, "bench", "bench_all.py"))
bench_all = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_all)


def test_backup_figures_take_saving_steps_after_warmup():
    # step_ms[i] is the duration of step i + 1 (start to next start, so it holds the save made at its
    # end); 10 steps an epoch, saves every 5 steps (steps 5, 10, 15...)
    step_ms = [10.0] * 29
    for step in (5, 10, 15, 20, 25):
        step_ms[step - 1] = 10.0 + (100.0 if step <= 10 else 4.0)  # warm-up saves are slow and ignored
    step_ms[15] = 13.0  # a step slowed by the background write, early in a save cycle: not quiet
    extra, mean, in_run = bench_all.backup_figures(step_ms, steps_per_epoch=10, save_freq=5)
    assert extra == pytest.approx(4.0)
    assert mean == pytest.approx(10.0 + (4.0 * 3 + 3.0) / 19)
    assert in_run == pytest.approx(mean / 10.0)  # quiet: steps 12, 13, 14, 17, 18, 19, ... all 10 ms


def test_user_env_drops_cluster_and_malloc_variables(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{}")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    env = bench_all.user_env()
    assert not {"TF_CONFIG", "MALLOC_TRIM_THRESHOLD_", "OMP_NUM_THREADS"} & set(env)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == ROOT
    assert bench_all.user_env(**bench_all.TUNED_MALLOC)["MALLOC_MMAP_THRESHOLD_"] == str(32 * 2**20)


def _round(scale: float) -> dict:
    cnn = {"ms_per_step": 10.0 * scale, "cpu_ms_per_step": 9.0 * scale, "faults_per_step": 3.0}
    hand = {"ms_per_step": 8.0, "cpu_ms_per_step": 9.0, "faults_per_step": 500.0}
    r = {f"{v}_{t}t": dict(cnn if v == "fit" else hand) for v in ("fit", "hand", "hand_tuned") for t in (1, 2)}
    r.update(fit_bf16_1t={"ms_per_step": 5.0}, mlp_meshfit={"ms_per_step": 2.0, "cpu_ms_per_step": 2.0},
             mlp_keras={"ms_per_step": 4.0, "cpu_ms_per_step": 2.0},
             scale_1p2t={"ms_per_step": 9.0}, scale_2w1t={"ms_per_step": 10.0}, scale_2x1t_alone={"ms_per_step": 9.5},
             scale_2w1t_bf16={"ms_per_step": 9.0},
             imports={"torch_s": [2.0, 1.0, 3.0], "meshfit_s": [2.2, 1.2, 3.3]},
             first_1p={"spawned": 100.0, "first_step_end": 103.5}, first_2w={"spawned": 0.0, "first_step_end": 5.0},
             mlp50k_meshfit={"ms_per_step": 1.5}, mlp50k_meshfit_off={"ms_per_step": 3.0},
             fit_1t_flush_off={"ms_per_step": 10.0 * scale}, recovery={"total": 4.0, "detection": 0.2})
    steps = [10.0] * 89
    steps[60 - 1] = 13.0  # the save at step 60 (step 90 ends the run: no next start)
    r.update(backup_none={"step_ms": [10.0] * 89}, backup_sync={"step_ms": steps}, backup_default={"step_ms": steps})
    return r


def test_rows_are_per_round_ratios_and_the_table_shows_their_median():
    import argparse

    rows = bench_all.collect([_round(1.0), _round(2.0), _round(1.5)],
                             argparse.Namespace(backup_steps=30, save_freq=30))
    assert rows["fit/hand 1t"] == [1.25, 2.5, 1.875]
    assert rows["2w/1p2t"] == [0.9] * 3
    assert rows["backup sync saving step +ms"] == [3.0] * 3
    assert rows["backup default saving step +ms"] == [3.0] * 3
    assert rows["mlp50k flush/off"] == [0.5] * 3 and rows["recovery total"] == [4.0] * 3
    assert rows["import meshfit/torch"] == pytest.approx([1.1] * 3)  # median of per-pair 1.1, 1.2, 1.1
    assert rows["import torch s"] == [2.0] * 3
    text = bench_all.table(rows, cores=2, load=(0.5, 3.0), save_freq=30, mlp50k_steps=1563)
    assert "machine: 2 cores" in text and "MEASURED UNDER LOAD" in text
    assert "| 1.875 [1.250–2.500] |" in text                      # median of the per-round ratios
    assert "| 0.500 [0.500–0.500] | – | ≤ 1.0 |" in text            # meshfit ÷ TF
    assert "3.50 s" in text and "5.00 s" in text
    assert "3 / 500 / 500" in text


def test_tiny_mlp_counts_ops_and_python_calls_in_separate_epochs():
    # The op counter is a TorchDispatchMode: its own Python code runs at every op. Counted in the same
    # epoch as the calls, it made a fused-Adam hand loop's 241 calls a step read as 1,160.
    import torch

    _tiny = importlib.util.spec_from_file_location("_tiny_mlp", os.path.join(ROOT, "bench", "_tiny_mlp.py"))
    tiny = importlib.util.module_from_spec(_tiny)
    _tiny.loader.exec_module(tiny)

    def step() -> None:
        torch.ones(3).add_(1)

    meter = tiny.Meter(counts=True)
    meter.epoch(0)
    step()  # the warm-up epoch: nothing counted
    meter.epoch(1)
    step()  # ops: ones, add_
    meter.epoch(2)
    step()  # calls: step, ones, add_ (and the profile's own exit)
    meter.stop()
    assert sum(meter.ops.values()) == 2
    assert meter.counted_epochs == {"ops": 1, "calls": 1}
    assert 3 <= meter.calls <= 6  # with the dispatch mode on, each op added its Python frames (dozens)


def test_tiny_mlp_host_reads_are_the_scalar_reads_a_step():
    _bench = importlib.util.spec_from_file_location("bench_tiny_mlp", os.path.join(ROOT, "bench", "bench_tiny_mlp.py"))
    bench = importlib.util.module_from_spec(_bench)
    _bench.loader.exec_module(bench)
    # 10 steps of 4 ops, 3 of the 40 a scalar read (an epoch-end log, say): 0.3 a step
    counted = {"ops": 4.0, "ops_by_name": {"aten.addmm.default": 37, "aten._local_scalar_dense.default": 3}}
    assert bench.host_reads(counted) == pytest.approx(0.3)
    assert bench.host_reads({"ops": 0.0, "ops_by_name": {}}) == 0.0
