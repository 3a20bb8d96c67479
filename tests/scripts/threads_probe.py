"""A hand-started worker (TF_CONFIG from the test): prints its torch thread count once in the group."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import meshfit as mf  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))  # the user's own choice, after importing meshfit
    strategy = mf.MultiWorkerMirroredStrategy()
    print(f"THREADS {torch.get_num_threads()} rank {strategy.replica_id}", flush=True)
