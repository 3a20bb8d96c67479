"""A tiny custom training loop under MultiWorkerMirroredStrategy (`strategy.run` / `reduce`), for liveness tests.

Gradients are summed with `strategy.all_reduce_sum` inside `strategy.run`, as a hand-written TF
step does with ``apply_gradients``. Test hooks freeze (SIGSTOP) or kill (SIGKILL) a rank at a step,
writing the time to ``<out>/frozen-at.txt`` / ``<out>/killed-at.txt`` first.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from torch import nn

import meshfit as mf


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--freeze-rank", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--at", type=int, default=5)
    parser.add_argument("--mark-at", type=int, default=-1, help="rank 0 writes reached.txt at this step")
    parser.add_argument("--heartbeat", type=float, default=4.0)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--manager-dir", default=None, help="save with a CheckpointManager every 5 steps there")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    strategy = mf.MultiWorkerMirroredStrategy(
        communication_options=mf.CommunicationOptions(heartbeat_timeout_seconds=args.heartbeat))
    rank, world = strategy.replica_id, strategy.num_replicas_in_sync
    with strategy.scope():
        module = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    completed = torch.tensor(0)  # the steps done: the manager's step counter
    manager = None
    if args.manager_dir:
        checkpoint = mf.train.Checkpoint(model=module, step=completed)
        manager = mf.train.CheckpointManager(checkpoint, args.manager_dir, max_to_keep=2, step_counter=completed,
                                             checkpoint_interval=5)

    def step_fn(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = ((module(xb) - yb) ** 2).mean()
        loss.backward()
        for p in module.parameters():
            strategy.all_reduce_sum(p.grad).div_(world)
        optimizer.step()
        return loss.detach()

    for step in range(1, args.steps + 1):
        if rank == 0 and step == args.mark_at:
            with open(os.path.join(args.out, "reached.txt"), "w") as f:
                f.write(repr(time.time()))
        for kind, who, sig in (("frozen", args.freeze_rank, signal.SIGSTOP), ("killed", args.kill_rank, signal.SIGKILL)):
            if who == rank and step == args.at:
                with open(os.path.join(args.out, f"{kind}-at.txt"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), sig)
        per_replica = strategy.run(step_fn, args=(x, y))
        total = strategy.reduce(mf.distribute.ReduceOp.SUM, per_replica)
        if rank == 0 and step % 50 == 0:
            print(f"step {step}: loss {float(total):.4f}", flush=True)
        completed.fill_(step)
        if manager is not None:
            manager.save(check_interval=True)
        time.sleep(args.sleep)
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
