"""A killed peer is a dead peer at once: one TCP connection per worker to rank 0, closed by the kernel.

The heartbeat (``_heartbeat.py``) finds frozen peers and cut links after its timeout of silence. A
process that is killed (``kill -9``, the OOM killer, a crash) needs no timeout: the kernel closes its
sockets, and the other end reads end-of-file (or a reset) within milliseconds. Rank 0 listens on the
address with which it reaches the rendezvous store; every other rank connects once, right after the
group forms, and says who it is: its rank and an HMAC of it under the job's secret (an outsider who
reaches the port cannot pose as a worker; unauthenticated connections are dropped). Then:

- a connection that ends without a goodbye (``B``) means that worker's process is gone: rank 0
  declares it, and tells every other worker (``D`` + the rank);
- a worker whose connection to rank 0 ends without a goodbye declares rank 0 gone.

Deciding is by event (the socket closed), never by the words of an error. A clean exit (``stop``)
says goodbye first, as the heartbeat posts its "left" key. This is an accelerator for the common
case; when the channel cannot be set up, the heartbeat alone still finds every failure.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["LIVENESS_INVITATION", "Liveness", "invitation", "join_liveness", "local_address_towards",
           "open_liveness", "read_invitation"]

_HELLO = struct.Struct("!I20s")  # rank, HMAC
_HELLO_SECONDS = 2.0
_MESSAGE = 5  # one letter and a rank
LIVENESS_INVITATION = 96  # bytes: secret (16), port (2), host length (1), host


def invitation(secret: bytes, address: tuple[str, int] | None) -> bytes:
    """What rank 0 broadcasts: the job's secret and where its liveness listener is (if it has one)."""
    host, port = address if address is not None else ("", 0)
    encoded = host.encode()
    if len(encoded) > LIVENESS_INVITATION - 19:
        encoded, port = b"", 0  # cannot say where: the heartbeat alone will do
    return (secret + struct.pack("!HB", port, len(encoded)) + encoded).ljust(LIVENESS_INVITATION, b"\0")


def read_invitation(data: bytes) -> tuple[bytes, tuple[str, int] | None]:
    port, length = struct.unpack("!HB", data[16:19])
    return data[:16], ((data[19:19 + length].decode(), port) if port else None)


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``(host, port)`` (no packet is sent)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


class Liveness:
    """The connections of one worker (see the module docstring).

    Args:
        rank: this worker's rank; rank 0 listens, the others connect.
        world_size: the number of workers.
        secret: the job's shared secret.
        on_death: called (from this object's thread) with a rank whose process ended without goodbye;
            may be set later.
    """

    def __init__(self, rank: int, world_size: int, secret: bytes,
                 on_death: Callable[[int], None] | None = None) -> None:
        self._rank, self._world, self._secret = rank, world_size, secret
        self.on_death = on_death
        self._buffers: dict[socket.socket, bytes] = {}
        self._selector = selectors.DefaultSelector()
        self._peers: dict[socket.socket, int | None] = {}  # connection → its rank (None: not yet said)
        self._said_goodbye: set[int] = set()
        self._stop = threading.Event()
        self._closing = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        # `stop` writes a byte here so that the thread leaves its `select` at once, not after its timeout.
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._selector.register(self._wake_reader, selectors.EVENT_READ)

    def _mac(self, rank: int) -> bytes:
        return hmac.new(self._secret, f"liveness/{rank}".encode(), hashlib.sha256).digest()[:20]

    # ---- setting up ---------------------------------------------------------------------------
    def listen(self, host: str) -> int:
        """Rank 0: listen on ``host``; returns the port."""
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen(max(8, self._world))
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ)
        self._start()
        return listener.getsockname()[1]

    def connect(self, host: str, port: int, timeout: float) -> None:
        """Another rank: connect to rank 0 and say who this is."""
        connection = socket.create_connection((host, port), timeout=timeout)
        connection.sendall(_HELLO.pack(self._rank, self._mac(self._rank)))
        connection.setblocking(False)
        self._peers[connection] = 0
        self._selector.register(connection, selectors.EVENT_READ)
        self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="meshfit-liveness")
        self._thread.start()

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.5):
                if key.fileobj is self._wake_reader:
                    with contextlib.suppress(OSError):
                        self._wake_reader.recv(64)
                elif key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            connection, _ = self._listener.accept()  # type: ignore[union-attr]
            connection.settimeout(_HELLO_SECONDS)
            try:
                rank, mac = _HELLO.unpack(_receive_exactly(connection, _HELLO.size))
            except (OSError, struct.error):
                connection.close()
                return
            if not (0 < rank < self._world and hmac.compare_digest(mac, self._mac(rank))):
                connection.close()  # not one of ours
                return
            connection.setblocking(False)
            with self._lock:
                self._peers[connection] = rank
            self._selector.register(connection, selectors.EVENT_READ)

    def _read(self, connection: socket.socket) -> None:
        rank = self._peers.get(connection)
        try:
            data = connection.recv(64)
        except BlockingIOError:
            return
        except OSError:  # reset: the peer's kernel answered for a dead process
            data = b""
        if data:
            data = self._buffers.pop(connection, b"") + data
            while len(data) >= _MESSAGE:
                message, data = data[:_MESSAGE], data[_MESSAGE:]
                if message[:1] == b"B" and rank is not None:
                    self._said_goodbye.add(rank)
                elif message[:1] == b"D" and self._rank != 0:
                    self._died(struct.unpack("!I", message[1:])[0])
            self._buffers[connection] = data
            return
        self._selector.unregister(connection)
        connection.close()
        with self._lock:
            self._peers.pop(connection, None)
            self._buffers.pop(connection, None)
        if rank is not None and rank not in self._said_goodbye and not self._closing:
            self._died(rank)

    def _died(self, rank: int) -> None:
        if self._rank == 0:  # tell the others at once
            self._send_all(b"D" + struct.pack("!I", rank))
        if self.on_death is not None:
            self.on_death(rank)

    def _send_all(self, message: bytes) -> None:
        with self._lock:
            connections = [c for c, r in self._peers.items() if r is not None]
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.setblocking(True)
                connection.settimeout(1.0)
                connection.sendall(message.ljust(_MESSAGE, b"\0"))
                connection.setblocking(False)

    # ---- ending -------------------------------------------------------------------------------
    def stop(self, goodbye: bool) -> None:
        """Close every connection; with ``goodbye``, first say this worker ends cleanly."""
        if self._stop.is_set():
            return
        self._closing = True
        if goodbye:
            self._send_all(b"B")
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"\0")
        if self._thread is not None:
            self._thread.join(timeout=2)
        with self._lock:
            connections = list(self._peers)
            self._peers.clear()
        wake = [self._wake_reader, self._wake_writer]
        for connection in [*connections, *([self._listener] if self._listener else []), *wake]:
            with contextlib.suppress(OSError):
                connection.close()
        with contextlib.suppress(Exception):
            self._selector.close()


def open_liveness(world_size: int, secret: bytes, store: Any) -> tuple[Liveness | None, tuple[str, int] | None]:
    """Rank 0: listen on the address with which this machine reaches the rendezvous ``store``.

    Returns ``(liveness, (host, port))``, or ``(None, None)`` when the store is not a TCP one or
    nothing could listen (the heartbeat alone then finds failures)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None, None
    liveness = Liveness(0, world_size, secret)
    try:
        host = local_address_towards(store.host, store.port)
        return liveness, (host, liveness.listen(host))
    except OSError:
        liveness.stop(goodbye=False)
        return None, None


def join_liveness(rank: int, world_size: int, secret: bytes, address: tuple[str, int],
                  timeout: float) -> Liveness | None:
    """Another rank: connect to rank 0's listener; None (the heartbeat alone) if it cannot."""
    liveness = Liveness(rank, world_size, secret)
    try:
        liveness.connect(*address, timeout=max(1.0, timeout))
    except OSError:
        liveness.stop(goodbye=False)
        return None
    return liveness


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise OSError("closed before saying who it is")
        data += chunk
    return data
