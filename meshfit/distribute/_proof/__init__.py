"""Proof: the layout-independent digest of a training state, replicas compared across ranks, one-copy tensors
checked at rest and after gathering, and the agreement of every worker's model before training."""
