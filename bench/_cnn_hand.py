"""The seed CNN trained by a hand-written PyTorch loop; a process of ``bench_all.py``.

The loop is the usual hand-written one: ``opt.zero_grad(); loss = F.cross_entropy(model(xb), yb); loss.backward();
opt.step()`` on ``xb, yb = x[idx], y[idx]``. meshfit is imported only to load the same digits and to
take the same batch order as ``_cnn_fit.py`` (so both do the same arithmetic: compare the checksums),
outside the timed loop. The first ``--steps`` steps are a warm-up.
"""

import argparse
import itertools
import json
import resource
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import meshfit as mf


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="steps per 'epoch'")
    parser.add_argument("--epochs", type=int, default=3, help="the first one is a warm-up")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    (x, y), _ = mf.datasets.load_digits(image_size=28)
    order = mf.data.Dataset.from_tensor_slices(np.arange(len(x))).shuffle(len(x), seed=0).repeat().batch(args.batch)
    batches = [b.clone() for b in itertools.islice(iter(order), args.epochs * args.steps)]
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(),
                          nn.LazyLinear(128), nn.ReLU(), nn.Linear(128, 10))
    with torch.no_grad():
        model(x[:2])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    marks = []
    for i, idx in enumerate(batches):
        if i == args.steps:
            marks.append((time.perf_counter(), time.process_time(), minor_faults()))
        xb, yb = x[idx], y[idx]
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
    marks.append((time.perf_counter(), time.process_time(), minor_faults()))

    (w0, c0, f0), (w1, c1, f1) = marks
    timed = (args.epochs - 1) * args.steps
    with open(args.out, "w") as f:
        json.dump({"ms_per_step": (w1 - w0) * 1e3 / timed, "cpu_ms_per_step": (c1 - c0) * 1e3 / timed,
                   "faults_per_step": (f1 - f0) / timed,
                   "checksum": sum(p.double().abs().sum().item() for p in model.parameters())}, f)


if __name__ == "__main__":
    main()
