"""``meshfit launch``: start local worker processes with ``TF_CONFIG`` and restart the group on failure.

Plain processes, no protocol of our own: every round picks free ports, starts ``--workers`` copies of
``python script.py args`` (plus one evaluator with ``--evaluator``), each in its own session so that
its whole process group can be signalled, and prefixes each output line with ``[worker i] ``. When a
training worker exits non-zero the rest of the group is stopped and, if restarts remain, a new group
starts with fresh ports and ``MESHFIT_RESTART_COUNT`` incremented. Exit code
`~meshfit._exit_codes.PREEMPTED_EXIT_CODE` (75) restarts without spending a restart.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO

from meshfit._exit_codes import PREEMPTED_EXIT_CODE

MAX_PREEMPTION_RESTARTS = 100
TERMINATE_TIMEOUT_S = 10.0
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Output:
    """Serialises lines from reader threads and launcher messages onto our stdout/stderr."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def write(self, to_stderr: bool, data: bytes) -> None:
        stream = sys.stderr if to_stderr else sys.stdout
        with self._lock:
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                stream.flush()
                buffer.write(data)
                buffer.flush()
            else:
                stream.write(data.decode(errors="replace"))
                stream.flush()

    def message(self, text: str) -> None:
        self.write(True, f"meshfit launch: {text}\n".encode())


@dataclass
class _Task:
    """One child process of a round."""

    task_type: str
    index: int
    proc: subprocess.Popen
    readers: list[threading.Thread] = field(default_factory=list)
    signalled: bool = False

    @property
    def name(self) -> str:
        return f"{self.task_type} {self.index}"

    def send(self, sig: int) -> None:
        """Signal the child's whole process group (it leads its own session)."""
        try:
            os.killpg(self.proc.pid, sig)
        except OSError:
            pass  # the group is already gone


def free_ports(count: int) -> list[int]:
    """Distinct ports the OS reports free right now (all held open together, then released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _pump(pipe: IO[bytes], prefix: bytes, to_stderr: bool, output: _Output) -> None:
    """Copy ``pipe`` line by line to our output with ``prefix``."""
    with pipe:
        for line in iter(pipe.readline, b""):
            output.write(to_stderr, prefix + (line if line.endswith(b"\n") else line + b"\n"))


class _Group:
    """The processes of one round: start, watch, signal and stop them."""

    def __init__(self, command: list[str], args: argparse.Namespace, round_: int, output: _Output) -> None:
        self.command, self.args, self.round, self.output = command, args, round_, output
        self.tasks: list[_Task] = []

    def start(self) -> None:
        count = self.args.workers + int(self.args.evaluator)
        ports = free_ports(count)
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports[: self.args.workers]]}
        if self.args.evaluator:
            cluster["evaluator"] = [f"127.0.0.1:{ports[-1]}"]
        roles = [("worker", i) for i in range(self.args.workers)] + [("evaluator", 0)] * self.args.evaluator
        self.output.message(f"round {self.round}: starting {self.args.workers} worker(s)"
                            f"{' and 1 evaluator' if self.args.evaluator else ''}: "
                            f"{' '.join(self.command[1:])} (cluster {json.dumps(cluster)})")
        for task_type, index in roles:
            env = dict(os.environ)
            env.setdefault("OMP_NUM_THREADS", str(self.args.threads))
            env.setdefault("MKL_NUM_THREADS", str(self.args.threads))
            env["PYTHONUNBUFFERED"] = "1"
            env["MESHFIT_RESTART_COUNT"] = str(self.round)
            env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
            proc = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            task = _Task(task_type, index, proc)
            prefix = f"[{task.name}] ".encode()
            for pipe, to_stderr in ((proc.stdout, False), (proc.stderr, True)):
                reader = threading.Thread(target=_pump, args=(pipe, prefix, to_stderr, self.output),
                                          name=f"meshfit-launch-{task.name}", daemon=True)
                reader.start()
                task.readers.append(reader)
            self.tasks.append(task)

    @property
    def training(self) -> list[_Task]:
        return [t for t in self.tasks if t.task_type != "evaluator"]

    @property
    def evaluator(self) -> _Task | None:
        return next((t for t in self.tasks if t.task_type == "evaluator"), None)

    def signal(self, sig: int, force: bool = False) -> None:
        """Send ``sig`` to every live child not signalled yet (every live child with ``force``)."""
        for task in self.tasks:
            if task.proc.poll() is None and (force or not task.signalled):
                task.signalled = True
                task.send(sig)

    def wait(self, tasks: list[_Task], timeout: float) -> bool:
        """Wait up to ``timeout`` s for ``tasks`` to exit; return whether they all did."""
        deadline = time.monotonic() + timeout
        while any(t.proc.poll() is None for t in tasks):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self, grace: float = 0.0) -> None:
        """Let children exit by themselves for ``grace`` s, then SIGTERM, then SIGKILL; reap everything."""
        self.wait(self.tasks, grace)
        for task in self.tasks:
            if task.proc.poll() is None and not task.signalled:
                task.signalled = True
                task.send(signal.SIGTERM)
        if not self.wait(self.tasks, TERMINATE_TIMEOUT_S):
            stuck = [t.name for t in self.tasks if t.proc.poll() is None]
            self.output.message(f"{', '.join(stuck)} still running {TERMINATE_TIMEOUT_S:.0f} s after SIGTERM; "
                                "sending SIGKILL")
        for task in self.tasks:
            task.send(signal.SIGKILL)  # also reaps leftovers of groups whose leader already exited
            task.proc.wait()
        for task in self.tasks:
            for reader in task.readers:
                reader.join(timeout=2.0)


class _Signals:
    """Forward SIGINT/SIGTERM to the current group; remember the first one received."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.group: _Group | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: object) -> None:
        again = self.received is not None
        self.received = self.received or signum
        if self.group is not None:
            # A second signal means "now": kill rather than wait for a clean shutdown.
            if again:
                self.group.signal(signal.SIGKILL, force=True)
            else:
                self.group.signal(signum)

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in _FORWARDED_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _exit_status(code: int) -> int:
    """A child's return code as a process exit status (killed by signal N → 128 + N)."""
    return 128 - code if code < 0 else code


def _supervise(group: _Group, signals: _Signals) -> _Task | None:
    """Watch a round until a training worker fails (returned), all succeed, or a signal arrives."""
    reported: set[int] = set()
    while signals.received is None:
        for task in group.tasks:
            code = task.proc.poll()
            if code is None or id(task) in reported:
                continue
            reported.add(id(task))
            if task.task_type == "evaluator":
                running = any(t.proc.poll() is None for t in group.training)
                group.output.message(f"{task.name} exited with code {code}"
                                     + ("; training continues" if running else ""))
            elif code != 0:
                return task
        if all(t.proc.poll() == 0 for t in group.training):
            evaluator = group.evaluator
            if evaluator is not None and evaluator.proc.poll() is None:
                timeout = group.args.evaluator_timeout
                if not group.wait([evaluator], timeout) and signals.received is None:
                    group.output.message(f"training finished; {evaluator.name} still running after "
                                         f"{timeout:g} s (--evaluator-timeout); stopping it")
            return None
        time.sleep(group.args.monitor_interval)
    return None


def _restart_message(failed: _Task, counts: dict[str, int], max_restarts: int) -> str | None:
    """Decide whether to restart after ``failed``; update ``counts``; return the message or ``None``."""
    code = failed.proc.returncode
    if code == PREEMPTED_EXIT_CODE and counts["preemptions"] < MAX_PREEMPTION_RESTARTS:
        counts["preemptions"] += 1
        return (f"{failed.name} exited with code {code} (preempted); restarting the group "
                f"(preemption restart {counts['preemptions']}, not counted against --max-restarts)")
    if counts["restarts"] < max_restarts:
        counts["restarts"] += 1
        return f"{failed.name} exited with code {code}; restarting the group (restart {counts['restarts']} of {max_restarts})"
    return None


def _run(command: list[str], args: argparse.Namespace, output: _Output) -> int:
    counts = {"restarts": 0, "preemptions": 0}
    round_ = 0
    with _Signals() as signals:
        while signals.received is None:
            group = _Group(command, args, round_, output)
            signals.group = group
            grace = 0.0
            try:
                group.start()
                failed = _supervise(group, signals)
                if signals.received is not None:
                    group.signal(signals.received)  # children started before the handler saw them
                    output.message(f"received {signal.Signals(signals.received).name}; forwarded it to all "
                                   f"processes; waiting up to {TERMINATE_TIMEOUT_S:.0f} s for them")
                    break
                if failed is None:
                    output.message("all workers finished successfully")
                    return 0
                message = _restart_message(failed, counts, args.max_restarts)
                if message is None:
                    code = failed.proc.returncode
                    output.message(f"{failed.name} exited with code {code}; no restarts left "
                                   f"(--max-restarts {args.max_restarts}); stopping the other processes")
                    return _exit_status(code)
                output.message(message)
                if failed.proc.returncode == PREEMPTED_EXIT_CODE:
                    grace = TERMINATE_TIMEOUT_S  # the others are saving at the same step: let them finish
            finally:
                group.stop(grace)
                signals.group = None
            round_ += 1
    return 128 + signals.received


def _positive(kind: type, minimum: float):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, received {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, received {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``meshfit launch`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="meshfit launch", allow_abbrev=False,
        description="Run a training script on several local processes, each with its own TF_CONFIG.")
    parser.add_argument("--workers", type=_positive(int, 1), default=2,
                        help="number of training worker processes (default 2)")
    parser.add_argument("--evaluator", action="store_true", help="also start one 'evaluator' task")
    parser.add_argument("--max-restarts", type=_positive(int, 0), default=0,
                        help="restart the whole group up to K times after a worker fails (default 0); "
                             f"exit code {PREEMPTED_EXIT_CODE} (preempted) restarts without counting")
    parser.add_argument("--threads", type=_positive(int, 1), default=1,
                        help="OMP_NUM_THREADS/MKL_NUM_THREADS for each process unless already set (default 1)")
    parser.add_argument("--monitor-interval", type=_positive(float, 0.01), default=0.1,
                        help="seconds between checks of the processes (default 0.1)")
    parser.add_argument("--evaluator-timeout", type=_positive(float, 0), default=60.0,
                        help="seconds to wait for the evaluator after training ends (default 60)")
    parser.add_argument("-m", "--module", action="store_true",
                        help="run `script` as a module (python -m script)")
    parser.add_argument("script", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def main(argv: list[str]) -> int:
    """Run ``meshfit launch`` with ``argv`` (the arguments after ``launch``); return the exit code.

    Args:
        argv: e.g. ``["--workers", "2", "--max-restarts", "3", "train.py", "--epochs", "3"]``.

    Returns:
        0 when every training worker exits 0; the failing worker's code (128 + N when it was killed
        by signal N) when no restarts are left; 128 + N when the launcher received signal N; 2 for
        bad arguments.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not args.module and not os.path.isfile(args.script):
            parser.error(f"script {args.script!r} not found. Pass the path of a Python file, "
                         "or use -m for a module.")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    command = [sys.executable] + (["-m"] if args.module else []) + [args.script, *args.script_args]
    return _run(command, args, _Output())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
