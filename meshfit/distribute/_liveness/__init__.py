"""Liveness: each worker's heartbeat, the rendezvous that forms a job, how a failure is noticed and named,
and how a survivor ends when a peer is gone (modules imported by their full paths within `meshfit.distribute`)."""
