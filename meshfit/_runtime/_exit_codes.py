"""Process exit codes shared by workers, `meshfit launch` and the local process supervisor.

``PREEMPTED_EXIT_CODE`` (75, ``EX_TEMPFAIL`` in BSD ``sysexits.h``) means "this worker was preempted
after saving its state; restart me". ``meshfit launch`` restarts the group when a worker exits with
it, without spending one of the ``--max-restarts`` restarts.

``PEER_FAILURE_EXIT_CODE`` (76) means "a peer of this worker stopped (killed, frozen or unreachable)
and this worker ended itself rather than wait on it"; the message naming the peer is on stderr.
"""

PREEMPTED_EXIT_CODE = 75
PEER_FAILURE_EXIT_CODE = 76
