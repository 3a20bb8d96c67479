"""The local process supervisor shared by ``meshfit launch`` and the self-spawning strategies.

Plain processes, no protocol of our own. A `ChildGroup` starts commands, each in its own session (so
its whole process group can be signalled), copies their output line by line with a ``[name] `` prefix,
and stops them: a grace period, then SIGTERM, then SIGKILL, reaping everything. ``meshfit launch``
(`meshfit._runtime._launch`) adds argument parsing, ``TF_CONFIG`` and the restart policy on top.

`spawn_local_replicas` is the function API for strategies that start their own replicas from a plain
``python train.py`` (`MirroredStrategy`, and a device mesh over local processes): replica 0 calls it
and runs the same command line again for replicas ``1 .. world-1`` with `REPLICA_RANK_ENV`,
`REPLICA_ADDR_ENV` and `REPLICA_PARENT_ENV` set; in a replica, `replica_identity` returns its rank and
the rendezvous address, and `watch_parent` ends the replica if replica 0 goes away.

Example:
    >>> from meshfit._runtime._ports import free_ports
    >>> identity = replica_identity()   # None in a process that was not spawned as a replica
    >>> if identity is None:            # replica 0: start the others, then join at `address`
    ...     address = f"127.0.0.1:{free_ports(1)[0]}"
    ...     # replicas = spawn_local_replicas(world, address)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Protocol

TERMINATE_TIMEOUT_S = 10.0
REPLICA_RANK_ENV = "MESHFIT_MIRRORED_RANK"
REPLICA_ADDR_ENV = "MESHFIT_MIRRORED_ADDR"
REPLICA_PARENT_ENV = "MESHFIT_MIRRORED_PARENT"
# Set for captured children when our stdout is a terminal: their output is forwarded as it comes,
# carriage returns included, so a live progress bar (`meshfit.callbacks.Progbar`) redraws in place.
FORWARDED_TERMINAL_ENV = "MESHFIT_FORWARDED_TERMINAL"


class Output:
    """Serialises lines from reader threads and supervisor messages onto our stdout/stderr."""

    def __init__(self, who: str = "meshfit launch") -> None:
        self._lock = threading.Lock()
        self._who = who
        self._open_line: tuple[object, bool] | None = None  # (writer, to_stderr) of an unfinished line
        self._cut: set[object] = set()  # writers whose unfinished line another's output ended

    def write(self, to_stderr: bool, data: bytes, writer: object = None, prefix: bytes = b"") -> None:
        """Write ``data``; ``writer`` (a live child's pipe) may leave its line unfinished.

        Another writer's output first ends that line. The rest of the cut line then starts a line of
        its own with ``prefix`` (the child's ``[name] ``): without it, the rest would read as the
        output of whoever wrote just before.
        """
        with self._lock:
            if self._open_line is not None and self._open_line[0] is not writer:
                self._write(self._open_line[1], b"\n")  # end another child's live bar before our line
                self._cut.add(self._open_line[0])
            if writer in self._cut:
                self._cut.discard(writer)
                if not data.startswith((b"\r", prefix)):  # a redraw is prefixed after its carriage return
                    data = prefix + data
            self._write(to_stderr, data)
            self._open_line = None if data.endswith(b"\n") else (writer, to_stderr)

    def _write(self, to_stderr: bool, data: bytes) -> None:
        stream = sys.stderr if to_stderr else sys.stdout
        buffer = getattr(stream, "buffer", None)
        if buffer is not None:
            stream.flush()
            buffer.write(data)
            buffer.flush()
        else:
            stream.write(data.decode(errors="replace"))
            stream.flush()

    def message(self, text: str) -> None:
        self.write(True, f"{self._who}: {text}\n".encode())


class ProcessHandle(Protocol):
    """A started child process: what `subprocess.Popen` offers and the supervisor uses."""

    pid: int
    returncode: int | None
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


class TaskStarter(Protocol):
    """Starts a captured child another way than ``subprocess.Popen`` (`meshfit launch --preload`)."""

    def start(self, command: Sequence[str], env: Mapping[str, str]) -> ProcessHandle: ...


@dataclass
class Child:
    """One supervised child process."""

    task_type: str
    index: int
    proc: ProcessHandle
    readers: list[threading.Thread] = field(default_factory=list)
    signalled: bool = False
    own_session: bool = True

    @property
    def name(self) -> str:
        return f"{self.task_type} {self.index}"

    def send(self, sig: int) -> None:
        """Signal the child's whole process group when it leads its own session, else the child.

        A forked task (``--preload``) makes its own session a moment after the fork server reports it:
        a signal sent before then goes to the process itself.
        """
        try:
            if self.own_session:
                try:
                    os.killpg(self.proc.pid, sig)
                    return
                except ProcessLookupError:  # no such group: gone, or not its own session yet
                    pass
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
        except OSError:
            pass  # already gone


def _pump(pipe: IO[bytes], prefix: bytes, to_stderr: bool, output: Output) -> None:
    """Copy ``pipe`` line by line to our output with ``prefix``."""
    with pipe:
        for line in iter(pipe.readline, b""):
            line = line if line.endswith(b"\n") else line + b"\n"
            output.write(to_stderr, (prefix.rstrip() if line.isspace() else prefix) + line)  # no trailing blank


def _pump_live(pipe: IO[bytes], prefix: bytes, to_stderr: bool, output: Output) -> None:
    """Copy ``pipe`` as it arrives, with ``prefix`` after each newline or carriage return."""
    at_line_start = True
    with pipe:
        while chunk := os.read(pipe.fileno(), 65536):
            out = bytearray()
            for piece in re.split(rb"(?<=[\r\n])", chunk):
                if piece and not (at_line_start and piece == b"\r"):  # a redraw: prefix its text, not the \r
                    out += prefix if at_line_start else b""
                out += piece
                at_line_start = piece.endswith((b"\r", b"\n")) or (at_line_start and not piece)
            output.write(to_stderr, bytes(out), writer=pipe, prefix=prefix)


def _stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


class ChildGroup:
    """Processes started together: start, watch, signal and stop them."""

    def __init__(self, output: Output, starter: TaskStarter | None = None) -> None:
        self.output = output
        self.children: list[Child] = []
        self._starter = starter

    def start(self, task_type: str, index: int, command: Sequence[str], env: Mapping[str, str],
              capture: bool = True, own_session: bool | None = None) -> Child:
        """Start ``command``.

        With ``capture``, the child reads no stdin and its output lines are prefixed with its name;
        without, it shares our terminal. ``own_session`` (default: ``capture``): the child leads its
        own session (the launcher's workers); self-spawned replicas share our session and signals,
        as the script they are copies of, while their output is prefixed as the launcher's is. A group
        made with a ``starter`` starts its captured own-session children with it.
        """
        own_session = capture if own_session is None else own_session
        if self._starter is not None and capture and own_session:
            return self.adopt(task_type, index, self._starter.start(command, self.environment(env)))
        pipe = subprocess.PIPE if capture else None
        proc: ProcessHandle = subprocess.Popen(list(command), env=self.environment(env, capture),
                                               stdin=subprocess.DEVNULL if capture else None,
                                               stdout=pipe, stderr=pipe, start_new_session=own_session)
        return self.adopt(task_type, index, proc, capture=capture, own_session=own_session)

    @staticmethod
    def environment(env: Mapping[str, str], capture: bool = True) -> dict[str, str]:
        """The environment `start` gives a child: ``env``, plus the forwarded-terminal mark when its
        captured output goes on to a terminal."""
        return {**env, FORWARDED_TERMINAL_ENV: "1"} if capture and _stdout_is_terminal() else dict(env)

    def adopt(self, task_type: str, index: int, proc: ProcessHandle, capture: bool = True,
              own_session: bool = True) -> Child:
        """Supervise ``proc`` (started by `start`, a starter or a warm standby) as task ``task_type index``."""
        child = Child(task_type, index, proc, own_session=own_session)
        if capture:
            live = _stdout_is_terminal()
            prefix = f"[{child.name}] ".encode()
            for stream, to_stderr in ((proc.stdout, False), (proc.stderr, True)):
                reader = threading.Thread(target=_pump_live if live else _pump,
                                          args=(stream, prefix, to_stderr, self.output),
                                          name=f"meshfit-supervisor-{child.name}", daemon=True)
                reader.start()
                child.readers.append(reader)
        self.children.append(child)
        return child

    def signal(self, sig: int, force: bool = False) -> None:
        """Send ``sig`` to every live child not signalled yet (every live child with ``force``)."""
        for child in self.children:
            if child.proc.poll() is None and (force or not child.signalled):
                child.signalled = True
                child.send(sig)

    def wait(self, children: Sequence[Child], timeout: float) -> bool:
        """Wait up to ``timeout`` s for ``children`` to exit; return whether they all did."""
        deadline = time.monotonic() + timeout
        while any(c.proc.poll() is None for c in children):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self, grace: float = 0.0, kill: bool = False) -> None:
        """Let children exit by themselves for ``grace`` s, then SIGTERM, then SIGKILL; reap everything.

        With ``kill``, SIGKILL at once (a frozen process cannot act on SIGTERM).
        """
        self.wait(self.children, grace)
        if not kill:
            for child in self.children:
                if child.proc.poll() is None and not child.signalled:
                    child.signalled = True
                    child.send(signal.SIGTERM)
            if not self.wait(self.children, TERMINATE_TIMEOUT_S):
                stuck = [c.name for c in self.children if c.proc.poll() is None]
                self.output.message(f"{', '.join(stuck)} still running {TERMINATE_TIMEOUT_S:.0f} s after "
                                    "SIGTERM; sending SIGKILL")
        for child in self.children:
            child.send(signal.SIGKILL)  # also reaps leftovers of groups whose leader already exited
            child.proc.wait()
        for child in self.children:
            for reader in child.readers:
                reader.join(timeout=2.0)


class LocalReplicas:
    """Replicas ``1 .. world-1`` started by `spawn_local_replicas`; replica 0 is this process."""

    def __init__(self, group: ChildGroup) -> None:
        self._group = group

    @property
    def pids(self) -> list[int]:
        """The replicas' process ids, by rank (replica 1 first)."""
        return [c.proc.pid for c in self._group.children]

    def wait(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` s for every replica to exit (then kill the rest); describe each failure."""
        self._group.wait(self._group.children, timeout)
        failed = []
        for rank, child in enumerate(self._group.children, start=1):
            if child.proc.poll() is None:
                failed.append(f"replica {rank} (pid {child.proc.pid}) still running after {timeout:g} s; killed")
            elif child.proc.returncode != 0:
                failed.append(f"replica {rank} (pid {child.proc.pid}) exited with code {child.proc.returncode}")
        self._group.stop()
        return failed


def spawn_local_replicas(world: int, address: str, env: Mapping[str, str] | None = None) -> LocalReplicas:
    """Run this process's command line again as replicas ``1 .. world-1`` of a local group.

    Each replica gets `REPLICA_RANK_ENV` (its rank), `REPLICA_ADDR_ENV` (``address``, where replica 0
    hosts the rendezvous) and `REPLICA_PARENT_ENV` (this process's pid); its output lines are
    prefixed ``[replica N]``, as `meshfit launch` prefixes its workers'.

    Args:
        world: the number of replicas including this one (replica 0).
        address: ``"host:port"`` of the rendezvous that replica 0 will host.
        env: extra environment variables for the replicas.

    Returns:
        The started replicas; call `LocalReplicas.wait` at exit.

    Raises:
        RuntimeError: this process has no script to run again (``python -c``, an interactive shell).
    """
    script = sys.argv[0] if sys.argv else ""
    if not script or script == "-c" or not os.path.exists(script):
        raise RuntimeError(
            "Starting one process per device runs your script again, but this process has no script to "
            f"run (sys.argv[0]={script!r}). Run it as `python train.py`, or start the replicas with "
            "`meshfit launch` / torchrun and use MultiWorkerMirroredStrategy.")
    group = ChildGroup(Output("meshfit"))
    for rank in range(1, world):
        child_env = dict(os.environ, **(env or {}), **{REPLICA_RANK_ENV: str(rank), REPLICA_ADDR_ENV: address,
                                                       REPLICA_PARENT_ENV: str(os.getpid())})
        child_env.setdefault("OMP_NUM_THREADS", "1")
        group.start("replica", rank, [sys.executable, *sys.argv], child_env, own_session=False)
    return LocalReplicas(group)


def replica_identity() -> tuple[int, str] | None:
    """``(rank, address)`` in a replica started by `spawn_local_replicas`; ``None`` elsewhere."""
    if REPLICA_RANK_ENV not in os.environ:
        return None
    return int(os.environ[REPLICA_RANK_ENV]), os.environ[REPLICA_ADDR_ENV]


def watch_parent() -> None:
    """In a spawned replica: end this process (SIGTERM, then exit) if replica 0 goes away."""
    parent = int(os.environ[REPLICA_PARENT_ENV])

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="meshfit-parent-watch").start()
