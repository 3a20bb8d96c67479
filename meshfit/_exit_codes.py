"""Process exit codes shared by workers and ``meshfit launch``.

``PREEMPTED_EXIT_CODE`` (75, ``EX_TEMPFAIL`` in BSD ``sysexits.h``) means "this worker was preempted
after saving its state; restart me". ``meshfit launch`` restarts the group when a worker exits with
it, without spending one of the ``--max-restarts`` restarts.
"""

PREEMPTED_EXIT_CODE = 75
