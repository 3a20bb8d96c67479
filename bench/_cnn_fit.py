"""The seed CNN trained by meshfit's ``fit``, written as a user writes it; a process of ``bench_all.py``.

Run as a user runs it (``python bench/_cnn_fit.py``; under ``meshfit launch`` for 2 workers). The
first epoch is a warm-up; the others are timed by epoch-boundary callbacks only (no per-batch
callback, unless --step-times or --first-step ask for one). Writes one JSON object to --out (chief only).
"""

import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import meshfit as mf  # noqa: E402

T_IMPORTED = time.time()


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class EpochClock(mf.callbacks.Callback):
    """Wall, CPU and minor faults at the start of the 2nd epoch and the end of the last."""

    def __init__(self) -> None:
        super().__init__()
        self.marks = []

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            self.marks.append((time.perf_counter(), time.process_time(), minor_faults()))

    def on_train_end(self, logs=None):
        self.marks.append((time.perf_counter(), time.process_time(), minor_faults()))


class StepClock(mf.callbacks.Callback):
    """The start and batch-end time of every step (and the wall-clock end of the first one).

    Step ``k`` lasts from its start to the start of step ``k + 1``: that holds its batch-end
    callbacks too, among them a save that `BackupAndRestore` makes after every other callback, so
    the time from this clock's batch end to the next step's start holds the save.
    """

    def __init__(self) -> None:
        super().__init__()
        self.begins, self.ends, self.first_end = [], [], None

    def on_train_batch_begin(self, batch, logs=None):
        self.begins.append(time.perf_counter())

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())
        if self.first_end is None:
            self.first_end = time.time()


def writer_cpu_ms() -> float:
    """CPU time of meshfit's checkpoint writer thread so far, 0 without one.

    Linux: ``/proc/self/task/<tid>/schedstat`` (nanoseconds; its ``stat`` counts clock ticks of 10 ms,
    coarser than one save's write).
    """
    import threading

    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith("meshfit-checkpoint") and thread.native_id is not None:
            try:
                with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
                    total += int(f.read().split()[0]) / 1e6
            except OSError:
                continue
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="the first one is a warm-up")
    parser.add_argument("--policy", default=None, help="mf.mixed_precision global policy")
    parser.add_argument("--backup-freq", type=int, default=0, help="BackupAndRestore(save_freq=N)")
    # BackupAndRestore's default arguments (asynchronous saves) unless one of these is given
    parser.add_argument("--async-save", dest="async_save", action="store_const", const=True, default=None)
    parser.add_argument("--sync-save", dest="async_save", action="store_const", const=False)
    parser.add_argument("--backup-dir", default=None)
    parser.add_argument("--compression", default=None, help="CommunicationOptions(gradient_compression=...)")
    parser.add_argument("--step-times", action="store_true")
    parser.add_argument("--jit-compile", choices=["auto", "true", "false"], default="auto",
                        help="compile(jit_compile=...): Keras's values")
    parser.add_argument("--first-step", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    if args.policy:
        mf.mixed_precision.set_global_policy(args.policy)
    options = mf.CommunicationOptions(gradient_compression=args.compression)
    strategy = (mf.MultiWorkerMirroredStrategy(communication_options=options) if os.environ.get("TF_CONFIG")
                else mf.get_strategy())
    (x, y), _ = mf.datasets.load_digits(image_size=28)
    dataset = mf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0).repeat().batch(args.batch)
    torch.manual_seed(0)
    with strategy.scope():
        module = nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(),
                               nn.LazyLinear(128), nn.ReLU(), nn.Linear(128, 10))
        with torch.no_grad():
            module(torch.from_numpy(x[:2]))  # build the lazy layer: the same init as the hand loop
        model = mf.Model(module)
        model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.01),
                      loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                      jit_compile={"true": True, "false": False}.get(args.jit_compile, "auto"))
    epoch_clock, step_clock = EpochClock(), StepClock()
    callbacks = [epoch_clock]
    if args.backup_freq:
        callbacks.insert(0, mf.callbacks.BackupAndRestore(args.backup_dir, save_freq=args.backup_freq,
                                                          **({} if args.async_save is None
                                                             else {"async_save": args.async_save})))
    if args.step_times or args.first_step:
        callbacks.append(step_clock)
    model.fit(dataset, epochs=args.epochs, steps_per_epoch=args.steps, verbose=0, callbacks=callbacks)

    result = {"start": T_START, "imported": T_IMPORTED, "first_step_end": step_clock.first_end,
              "checksum": sum(p.double().abs().sum().item() for p in model.module.parameters())}
    if len(epoch_clock.marks) == 2:
        (w0, c0, f0), (w1, c1, f1) = epoch_clock.marks
        timed = (args.epochs - 1) * args.steps
        result.update(ms_per_step=(w1 - w0) * 1e3 / timed, cpu_ms_per_step=(c1 - c0) * 1e3 / timed,
                      faults_per_step=(f1 - f0) / timed)
    if args.step_times:
        begins = step_clock.begins
        result["step_ms"] = [(b - a) * 1e3 for a, b in zip(begins, begins[1:], strict=False)]
        # from each step's batch end (this clock's callback) to the next step's start: the save, if any
        result["after_end_ms"] = [(b - e) * 1e3 for e, b in zip(step_clock.ends, begins[1:], strict=False)]
        result["writer_cpu_ms"] = writer_cpu_ms()
    if strategy.cluster_resolver.is_chief:
        with open(args.out, "w") as f:
            json.dump(result, f)
    elif args.step_times:  # every rank's writer shares the cores: the other ranks' writer CPU beside the chief's
        with open(f"{args.out}.task{strategy.cluster_resolver.task_id}", "w") as f:
            json.dump({"writer_cpu_ms": result["writer_cpu_ms"]}, f)


if __name__ == "__main__":
    main()
