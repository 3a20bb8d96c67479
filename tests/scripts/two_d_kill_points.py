"""A (2, 2) mesh from a plain ``python two_d_kill_points.py``: replica 0 starts the other three itself
(``create_mesh(..., devices=[4 CPUs])``), ``BackupAndRestore`` saves asynchronously after every step, and
one process SIGKILLs itself at a chosen point: ``--kill writer:N`` before its N-th collective on the
checkpoint writer thread (a save in flight: DCP's plan gather and scatter, its result gather and
broadcast, the commit's all-gather), or ``--kill step:N`` at the start of optimizer step N.

At the start of steps 2 and 3 every rank's main thread polls ``check_alive`` for a moment, so that a
survivor learns of the failure at a step boundary and ends through its uncaught `PeerFailureError`
(the interpreter's own exit, which joins the writer thread) rather than by the watchdog.

``--fork-replicas``: the replicas are forked from replica 0 (torch already imported) instead of started
as new interpreters, as the tests start their worker scripts (tests/_warm.py); they then run this
script from its first line as replicas, as `spawn_local_replicas`' children do, and replica 0 waits
for them at exit through the same `LocalReplicas`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dtensor"))
from _two_d_model import BATCH, data, module, two_d_map  # noqa: E402

import meshfit as mf  # noqa: E402
import meshfit.distribute._mirrored as mirrored  # noqa: E402
from meshfit._runtime import LocalReplicas  # noqa: E402
from meshfit._runtime._supervisor import (  # noqa: E402
    REPLICA_ADDR_ENV,
    REPLICA_PARENT_ENV,
    REPLICA_RANK_ENV,
    ChildGroup,
    Output,
)

_WRITER_COLLECTIVES = ("all_gather", "gather_object", "scatter_object_list", "broadcast_object_list",
                       "all_gather_object", "broadcast", "all_reduce", "gather", "scatter", "barrier")


def say(line: str) -> None:
    """One line in one write: four processes share the output pipe."""
    os.write(1, (line + "\n").encode())


class _RunAsReplica(BaseException):
    """Raised in a forked replica: unwinds to the script's top, which runs it again as that replica."""


class _Forked:
    """A forked replica, as `LocalReplicas` sees a child (``subprocess.Popen``'s parts it uses)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode, self.stdout, self.stderr = pid, None, None, None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(self.pid)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


def forked_replicas(world: int, address: str, env: dict | None = None) -> LocalReplicas:
    group = ChildGroup(Output("meshfit"))
    parent = os.getpid()
    for rank in range(1, world):
        pid = os.fork()
        if pid == 0:
            os.environ.update({REPLICA_RANK_ENV: str(rank), REPLICA_ADDR_ENV: address, REPLICA_PARENT_ENV: str(parent)})
            raise _RunAsReplica
        group.adopt("replica", rank, _Forked(pid), capture=False, own_session=False)
    return LocalReplicas(group)


RANK = [-1]  # this process's rank, once the mesh formed
_installed: list[bool] = []


def install_kill(kill_rank: int, point: str) -> None:
    """SIGKILL this process (when it is ``kill_rank``) before its N-th writer-thread collective."""
    where, _, count = point.partition(":")
    if where != "writer" or _installed:  # a forked replica inherits replica 0's wrappers
        return
    _installed.append(True)
    seen = [0]

    def wrap(name: str) -> None:
        real = getattr(dist, name)

        def call(*args, **kwargs):
            if threading.current_thread().name.startswith("meshfit-checkpoint") and RANK[0] == kill_rank:
                seen[0] += 1
                if seen[0] == int(count):
                    say(f"rank {kill_rank}: SIGKILL before writer collective #{count} ({name}) at {time.time():.3f}")
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        setattr(dist, name, call)

    for name in _WRITER_COLLECTIVES:
        wrap(name)


class KillAndPoll(mf.callbacks.Callback):
    def __init__(self, rank: int, kill_rank: int, point: str) -> None:
        super().__init__()
        self.rank, self.kill_rank = rank, kill_rank
        where, _, count = point.partition(":")
        self.kill_step = int(count) if where == "step" else -1

    def on_train_batch_begin(self, batch, logs=None):
        step = self.model.loop_state.iterations + 1
        if self.rank == self.kill_rank and step == self.kill_step:
            say(f"rank {self.rank}: SIGKILL at the start of step {step} at {time.time():.3f}")
            os.kill(os.getpid(), signal.SIGKILL)
        if step in (2, 3):  # learn of a failure here, at a step boundary (see the module docstring)
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                self.model.strategy.check_alive()
                time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backup-dir", required=True)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill", default="", help="writer:N or step:N")
    parser.add_argument("--fork-replicas", action="store_true")
    args = parser.parse_args()
    if args.fork_replicas:
        mirrored.spawn_local_replicas = forked_replicas  # type: ignore[assignment]
    install_kill(args.kill_rank, args.kill)
    mesh = mf.dtensor.create_mesh([("batch", 2), ("model", 2)], devices=[f"cpu:{i}" for i in range(4)])
    RANK[0] = rank = mesh.device_mesh.get_rank()
    say(f"rank {rank} pid {os.getpid()}")
    with two_d_map(mf, mesh).scope():
        model = mf.Model(module())
        model.compile(optimizer=mf.optimizers.SGD(0.1), loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data()
    callbacks = [mf.callbacks.BackupAndRestore(args.backup_dir, save_freq=1), KillAndPoll(rank, args.kill_rank, args.kill)]
    model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=4, shuffle=False, callbacks=callbacks, verbose=0)
    say(f"rank {rank} finished")


if __name__ == "__main__":
    while True:
        try:
            main()
            break
        except _RunAsReplica:  # this process is a forked replica now: run the script again as it
            continue
