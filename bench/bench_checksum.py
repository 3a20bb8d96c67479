"""What checksums cost at save time: ``model.save`` and ``Checkpoint.save`` of the seed CNN, with and without CRC-32C.

The seed tutorial's CNN (Conv2D(32, 3) + Dense(128) + Dense(10) on 28x28 images, 2.77 M parameters,
SGD with momentum, so the optimizer holds one buffer per parameter) is saved ``--repeats`` times
each way (interleaved) into a fresh folder under ``--dir``; "without" replaces the CRC-32C functions
by a constant. Reported: median save time with / without, the median of the paired differences
(ms and percent), and the CRC-32C rate over the parameters' bytes.
One process, CPU; run it on a quiet machine for stable figures.

Run:  .venv/bin/python bench/bench_checksum.py [--repeats 15] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn

import meshfit as mf
import meshfit._saving._weights as weights
import meshfit.train._storage as storage
from meshfit._storage._checksum import file_crc32, tensor_crc32


def seed_cnn() -> mf.Model:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(),
                           nn.Linear(32 * 26 * 26, 128), nn.ReLU(), nn.Linear(128, 10))
    model = mf.Model(module)
    model.compile(mf.optimizers.SGD(learning_rate=0.001, momentum=0.9),
                  mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(torch.randn(64, 28, 28), torch.randint(0, 10, (64,)), batch_size=64, epochs=1, verbose=0)
    return model


def timed(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    model = seed_cnn()
    checkpoint = mf.train.Checkpoint(module=model.module, optimizer=model.optimizer)
    root = tempfile.mkdtemp(dir=args.dir)
    counter = iter(range(10**6))

    def save_model() -> None:
        model.save(f"{root}/model-{next(counter)}")

    def save_checkpoint() -> None:
        checkpoint.save(f"{root}/ckpt-{next(counter)}")

    params = sum(p.numel() for p in model.module.parameters())
    print(f"seed CNN: {params / 1e6:.2f} M parameters; {args.repeats} saves each way into {root}")
    real = (tensor_crc32, file_crc32)
    fake = (lambda t: "0"), (lambda p: "0")
    for name, action in (("model.save", save_model), ("Checkpoint.save", save_checkpoint)):
        timed(action, 2)  # warm-up
        pairs = []
        for _ in range(args.repeats):  # interleaved, so that load changes hit both sides alike
            with_crc = timed(action, 1)
            weights.tensor_crc32, storage.file_crc32 = fake
            without = timed(action, 1)
            weights.tensor_crc32, storage.file_crc32 = real
            pairs.append((with_crc, without))
        with_crc, without = (statistics.median(p[i] for p in pairs) for i in (0, 1))
        extra = statistics.median(a - b for a, b in pairs)
        print(f"{name:16s} with CRC-32C {with_crc * 1e3:7.1f} ms, without {without * 1e3:7.1f} ms: "
              f"median difference {extra * 1e3:+.1f} ms ({extra / without * 100:+.1f} %)")
    shutil.rmtree(root)
    data = torch.randn(params)
    rate = data.numel() * 4 / timed(lambda: tensor_crc32(data), 5) / 1e9
    print(f"CRC-32C rate: {rate:.2f} GB/s")


if __name__ == "__main__":
    main()
