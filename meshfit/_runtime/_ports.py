"""Ports for addresses a worker binds later: the rendezvous address in ``TF_CONFIG``, a replica's.

The port must still be free when the worker binds it, seconds later (it imports torch first). A port
the OS picks (a bind to port 0) comes from the kernel's ephemeral range, the range every outgoing
connection on the machine also takes its source port from: on a busy machine (gloo alone opens a
connection per pair of ranks) one of them can take it in between, and rank 0 then fails with
"Address already in use". So the ports are chosen at random from the upper half of the ports below
that range, where no connection is ever given one, and checked free by binding them.
"""

from __future__ import annotations

import random
import socket

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"  # Linux: "<low> <high>"


def ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range; None where it cannot be read (not Linux)."""
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Distinct ports free on ``host`` right now (all held open together, then released).

    Chosen at random in ``[low // 2, low)`` where ``low`` starts the ephemeral range (module
    docstring); where that range is unknown or leaves too little room, the OS picks.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = ephemeral_low()
    sockets: list[socket.socket] = []
    try:
        if low is not None and low // 2 >= 1024 and low - low // 2 >= 64 * count:
            # a generator of its own, seeded from the OS: never the user's `random` state
            for port in random.Random().sample(range(low // 2, low), 64 * count):
                if len(sockets) == count:
                    break
                s = socket.socket(family, socket.SOCK_STREAM)
                try:
                    s.bind((host, port))
                except OSError:  # in use (or in TIME_WAIT): another
                    s.close()
                    continue
                sockets.append(s)
        while len(sockets) < count:
            s = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
