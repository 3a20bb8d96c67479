"""Issue 11 goal 1: after warm-up, ``fit`` takes ~0 minor page faults per step in a DEFAULT process.

A scaled-down seed CNN (20x20 images, 16 channels: a 2.5 MB gradient, still far above glibc's
initial mmap threshold) trains in a subprocess started as a user starts it -- no malloc variables,
nothing tuned -- and reports its minor faults per step over the epochs after the first.
For reference, measured here on 2026-11-23: 800-1300 faults/step by default, 0.1 with
MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ set (which the test does not do).
"""

from __future__ import annotations

import json
import os

import pytest
from _procs import ROOT, child_env, finish, start

BOUND = 10  # faults per step after warm-up; the tuned allocator measures ~0.1


def _default_env() -> dict[str, str]:
    env = child_env()
    for key in list(env):
        if key.startswith("MALLOC_") or key.startswith("GLIBC_TUNABLES"):
            env.pop(key)
    return env


@pytest.mark.xfail(strict=False, reason="issue 11 goal 1: fit frees and re-faults its gradients every step "
                                        "(800-1300 minor faults/step on this model by default); the loop owner fixes it")
def test_fit_takes_almost_no_page_faults_per_step_after_warmup():
    proc = start([os.path.join(ROOT, "tests", "scripts", "fit_page_faults.py"), "--steps", "20", "--epochs", "3"],
                 _default_env())
    code, out = finish(proc, timeout=240)
    assert code == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["warmup_faults_per_step"] > 0, result  # the counter counts
    assert result["faults_per_step"] < BOUND, (
        f"fit took {result['faults_per_step']:.1f} minor page faults per step after warm-up "
        f"(bound {BOUND}; gradient {result['gradient_mb']:.1f} MB)")
