"""Distributed input: a dataset distributed over replicas (`DistributedDataset`) and a torch ``DataLoader``
split across workers (`PerReplicaLoader`)."""
