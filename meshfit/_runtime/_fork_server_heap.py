"""Imported last by `meshfit launch --preload`'s fork server: it freezes the heap it has imported.

The fork server imports torch and meshfit once, then forks every task. `gc.freeze` moves what it
imported into the collector's permanent generation, as Python's documentation advises for a process
that forks workers: a task's collections no longer walk torch's hundreds of thousands of objects
(nor write to their pages, which stay shared with the server), and the server's own exit, when the
launcher ends, skips them too. Without it the server spent 1.5 s shutting down after the launcher had
ended, with the launcher's output pipe still open, so a `| tee` or a test reading the output waited.

Only a process started with ``FORK_SERVER_ENV=1`` in its environment (the launcher sets it for its
fork server alone) freezes anything: importing this module elsewhere does nothing. Nothing else in
meshfit imports it: imported by ``import meshfit``, it would freeze before the rest of the preload.
"""

from __future__ import annotations

import gc
import os

from meshfit._runtime._preload import FORK_SERVER_ENV

if os.environ.get(FORK_SERVER_ENV) == "1":
    gc.freeze()
