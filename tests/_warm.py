"""Worker scripts in processes forked from a warm interpreter: torch and meshfit imported once.

A fresh ``python script.py`` here spends 4-5 s of CPU importing torch, ``torch._dynamo`` (every torch
optimizer imports it) and meshfit before the script's first line; the multi-process tests start
hundreds of them. `start` (tests/_procs.py) forks each worker script instead from one server process
per pytest worker that imported those modules once, single-threaded. The worker is still a process of
its own that the test signals, kills and waits for: it runs the script as ``__main__`` with the
requested argv, environment and working directory, in a session of its own, with its output on a pipe
to the test, and it ends as ``python script.py`` does (``atexit`` handlers, non-daemon threads joined,
the interpreter finalised; an uncaught exception through ``sys.excepthook`` and exit code 1).

What it does not reproduce, so tests of those use a fresh interpreter (``start(..., fresh=True)``):
what happens while torch and meshfit import (their import time, threads, environment read then), and a
hash seed of its own (the workers share the server's ``str`` hash seed, as forked processes do). The
objects the server imported are frozen (``gc.freeze``), as in ``meshfit launch --preload``'s tasks.

Protocol (one connection per worker, over a Unix socket): the test sends the request (JSON) and its
pipe's write end (``SCM_RIGHTS``); the server answers the worker's pid, then its wait status when the
server reaps it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import locale
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

# What a worker script imports before its first step, imported once in the server. A pipeline's stages are
# split by torch's tracer (torch.export): 400 modules, 1.2-1.8 s a rank under the suite's load, paid by each of
# the 4-8 ranks of every pipeline test when they imported it themselves.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "torch.distributed.elastic.multiprocessing.errors", "torch.export",
           "torch.export._trace", "torch.distributed.pipelining", "numpy", "meshfit",
           "meshfit._engine", "meshfit.callbacks", "meshfit.data", "meshfit.distribute", "meshfit.dtensor",
           "meshfit.losses", "meshfit.metrics", "meshfit.optimizers", "meshfit.estimator", "meshfit.train",
           "meshfit.datasets"]
# Environment variables read while those modules import: a request must match the server's.
_IMPORT_TIME_PREFIXES = ("PYTHON", "TORCH", "OMP_", "MKL_", "KMP_", "CUDA", "LD_")
_HEADER = struct.Struct("!I")


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES)}


# ---- the test's side -------------------------------------------------------------------------------
class WarmProcess:
    """A worker forked by the server: the parts of `subprocess.Popen` the tests use (text output)."""

    def __init__(self, args: Sequence[str], pid: int, control: socket.socket, out_fd: int) -> None:
        self.args, self.pid, self.returncode = list(args), pid, None
        self._control = control
        self._out_fd = out_fd
        self.stdout = io.TextIOWrapper(io.FileIO(out_fd, "r", closefd=False),
                                       encoding=locale.getpreferredencoding(False))
        self._chunks: list[bytes] = []
        self._eof = False

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        self._control.settimeout(timeout)
        try:
            data = _recv_exact(self._control, 4)
        except (TimeoutError, BlockingIOError):
            return None
        finally:
            self._control.settimeout(None)
        self.returncode = os.waitstatus_to_exitcode(_HEADER.unpack(data)[0])
        self._control.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def communicate(self, input: None = None, timeout: float | None = None) -> tuple[str, None]:  # noqa: A002
        """Read the output to its end, then wait; `subprocess.TimeoutExpired` after ``timeout`` (call again)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._eof:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            ready, _, _ = select.select([self._out_fd], [], [], left)
            if ready:
                chunk = os.read(self._out_fd, 65536)
                if chunk:
                    self._chunks.append(chunk)
                else:
                    self._eof = True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        text = b"".join(self._chunks).decode(locale.getpreferredencoding(False))
        self._chunks = []
        return text.replace("\r\n", "\n").replace("\r", "\n"), None

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._out_fd)
        with contextlib.suppress(OSError):
            self._control.close()


class _Server:
    """The warm interpreter of this pytest worker (started on first use, ended when this process ends)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.import_env = _import_time_env(env)
        self._dir = tempfile.TemporaryDirectory(prefix="warm-")
        self.path = os.path.join(self._dir.name, "socket")
        self.proc = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), self.path], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=None)
        # The server is ready once its socket exists (it binds after the imports).
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the warm interpreter did not start (exit code {self.proc.poll()})")
            time.sleep(0.05)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]  # EOF: the server ends
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._dir.cleanup()

    def start(self, args: Sequence[str], env: dict[str, str], cwd: str | None, netns: str | None) -> WarmProcess:
        read_fd, write_fd = os.pipe()
        control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            control.connect(self.path)
            request = json.dumps({"argv": list(args), "env": env, "cwd": cwd or os.getcwd(),
                                  "netns": netns}).encode()
            socket.send_fds(control, [_HEADER.pack(len(request)) + request], [write_fd])
            os.close(write_fd)
            write_fd = -1
            control.settimeout(60)
            pid = _HEADER.unpack(_recv_exact(control, 4))[0]
            control.settimeout(None)
        except BaseException:
            control.close()
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
            raise
        return WarmProcess(args, pid, control, read_fd)


_server: _Server | None = None
_lock = threading.Lock()


def server_pid() -> int | None:
    """The pid of this process's warm interpreter, if started (a session-long helper, no test's leak)."""
    return _server.proc.pid if _server is not None and _server.proc.poll() is None else None


def can_start(args: Sequence[str], env: dict[str, str]) -> bool:
    """Whether ``args`` is a script the server can run under ``env`` (else: a fresh interpreter)."""
    if not args or not str(args[0]).endswith(".py") or not os.path.isfile(args[0]):
        return False
    return _server is None or _server.import_env == _import_time_env(env)


def start(args: Sequence[str], env: dict[str, str], cwd: str | None = None, netns: str | None = None,
          ) -> WarmProcess:
    """Run ``python args...`` as a worker forked from this process's warm interpreter (started here once).

    ``netns``: a network namespace's file (``/var/run/netns/<name>``) the worker enters before its
    script's first line, as ``ip netns exec <name>`` puts a process in it (tests/_hosts.py); the
    ``/sys`` and ``/etc/netns`` mounts that command also makes are not made (no test reads them).
    """
    global _server
    with _lock:
        if _server is None:
            # The server imports under this process's environment with the request's import-time
            # variables; nothing else of the first request's (its TF_CONFIG, TMPDIR...) is kept there.
            _server = _Server({**os.environ, **_import_time_env(env)})
            import atexit

            atexit.register(_server.close)
        server = _server
    return server.start(args, env, cwd, netns)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the warm interpreter closed the connection")
        data += chunk
    return data


# ---- the server's side -------------------------------------------------------------------------------
class _Become(BaseException):
    """Raised in a forked child: leave the server loop and run this request as ``__main__``."""

    def __init__(self, request: dict, out_fd: int) -> None:
        super().__init__()
        self.request, self.out_fd = request, out_fd


def _serve(path: str) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    # As meshfit's --preload fork server does (meshfit/_runtime/_fork_server_heap.py): the workers'
    # collections, and their interpreters' shutdown, skip what the server imported.
    gc.freeze()
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # forking a process with threads is unsafe: refuse rather than hang a test
        raise RuntimeError(f"the warm interpreter has {threads} threads after its imports; it must have 1")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # the client waits for this name: ready
    children: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener, sys.stdin, wake_r], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return  # the pytest worker ended
        if wake_r in ready:
            os.read(wake_r, 4096)
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                connection = children.pop(pid, None)
                if connection is not None:
                    with contextlib.suppress(OSError):
                        connection.sendall(_HEADER.pack(status))
                    connection.close()
        if listener in ready:
            connection, _ = listener.accept()
            connection.settimeout(30)  # a client that died mid-request must not stall the server
            try:
                message, fds, _, _ = socket.recv_fds(connection, 65536, 1)
                size = _HEADER.unpack(message[:4])[0]
                body = message[4:]
                while len(body) < size:
                    body += _recv_exact(connection, size - len(body))
                request = json.loads(body)
                if len(fds) != 1:
                    raise ValueError(f"{len(fds)} file descriptors sent with the request; expected 1")
            except (OSError, ValueError, struct.error) as error:
                print(f"warm interpreter: a bad request ({error!r}) was dropped", file=sys.stderr, flush=True)
                connection.close()
                continue
            connection.settimeout(None)
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                for other in children.values():
                    other.close()
                signal.set_wakeup_fd(-1)
                os.close(wake_r)
                os.close(wake_w)
                raise _Become(request, fds[0])
            os.close(fds[0])
            children[pid] = connection
            connection.sendall(_HEADER.pack(pid))


def _enter_network_namespace(path: str) -> None:
    """Move this process (single-threaded: just forked) into the network namespace of ``path``.

    The namespace is a property of each thread: threads the script starts later inherit it.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python 3.12+
            os.setns(fd, os.CLONE_NEWNET)
        else:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                error = ctypes.get_errno()
                raise OSError(error, f"setns({path!r}): {os.strerror(error)}")
    finally:
        os.close(fd)


def _become(request: dict, out_fd: int) -> int:
    """In the forked child: become ``python argv...`` (see the module docstring); its exit code."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    if request.get("netns"):  # after the output is the worker's: a failure shows in it
        _enter_network_namespace(request["netns"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # cached from the server's environment by an import: read TMPDIR again
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    from meshfit._runtime._preload import run_as_main  # meshfit's launcher runs its forked tasks so

    return run_as_main(sys.argv, module=False)


if __name__ == "__main__":
    job: _Become | None = None
    try:
        _serve(sys.argv[1])
    except _Become as become:
        job = become
    if job is not None:  # outside the handler: the script's own exceptions carry no server context
        request, out_fd = job.request, job.out_fd
        del job
        sys.exit(_become(request, out_fd))
