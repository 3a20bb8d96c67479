"""What a worker does for its host and its terminal while it joins a group it formed itself.

- **Threads.** Several workers on one host each take every core by default and fight over them
  (torchrun and ``meshfit launch`` set ``OMP_NUM_THREADS=1``). A hand-started worker sets torch's
  intra-op threads to ``cores // workers on this host`` unless the user chose them
  (``OMP_NUM_THREADS``/``MKL_NUM_THREADS``, or ``torch.set_num_threads`` called), and the first
  worker of each host says so once.
- **Quiet waiting.** While it waits for its peers, torch's C++ store client logs every retry
  (``[c10d] ... timed out`` and a stack dump) straight to file descriptor 2, drowning meshfit's
  own "waiting for" lines. Those lines are filtered out of stderr for that window (everything else
  passes), unless ``TORCH_CPP_LOG_LEVEL`` is set: then torch's log is shown as the user asked.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
from collections.abc import Callable, Iterator

import torch

from meshfit._runtime import threads_at_import

# torch's count when `import meshfit` ran (torch imported first), else at the package's first use
THREADS_AT_IMPORT = threads_at_import() or torch.get_num_threads()

_NOISE = re.compile(rb"^(\[[EWI]\d{4} [^\]]*\] \[c10d\]|Exception raised from |frame #\d+: |<omitting python frames>)")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def user_chose_threads() -> bool:
    """Whether the user set torch's thread count (environment, or ``torch.set_num_threads``)."""
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return True
    return torch.get_num_threads() != THREADS_AT_IMPORT


def share_cores(all_gather: Callable[[object], list[object]], rank: int) -> None:
    """Give each worker of this host ``cores // local workers`` torch threads (a collective)."""
    hosts = all_gather(socket.gethostname())
    here = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    if len(here) < 2 or user_chose_threads():
        return
    threads = max(1, _cores() // len(here))
    if threads >= torch.get_num_threads():
        return
    torch.set_num_threads(threads)
    if rank == here[0]:
        print(f"meshfit: {len(here)} workers of this job share this host ({_cores()} cores): each uses "
              f"{threads} torch thread{'s' if threads > 1 else ''} (torch.set_num_threads({threads})). Set "
              "OMP_NUM_THREADS, or call torch.set_num_threads() before creating the strategy, to choose.",
              file=sys.stderr, flush=True)


@contextlib.contextmanager
def quiet_c10d_retries() -> Iterator[None]:
    """Drop torch's c10d connection-retry log lines from stderr for the duration (see the module)."""
    if os.environ.get("TORCH_CPP_LOG_LEVEL"):
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        read_end, write_end = os.pipe()
    except (OSError, ValueError):  # no usable fd 2 (an embedded interpreter): show everything
        yield
        return
    os.dup2(write_end, 2)
    os.close(write_end)
    forwarder = threading.Thread(target=_forward, args=(read_end, saved), daemon=True, name="meshfit-stderr-filter")
    forwarder.start()
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer is gone: the forwarder sees its end
        forwarder.join(timeout=5)
        os.close(saved)


def _forward(read_end: int, target: int) -> None:
    pending, in_trace = b"", False
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                in_trace = _keep(line, in_trace, target)
    if pending:
        _keep(pending, in_trace, target)


def _keep(line: bytes, in_trace: bool, target: int) -> bool:
    """Forward ``line`` unless it is c10d noise; returns whether a c10d stack dump continues."""
    if _NOISE.match(line):
        return True
    if in_trace and not line.strip():
        return False  # the blank line that ends a dump
    os.write(target, line + b"\n")
    return False
