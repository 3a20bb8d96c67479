"""``meshfit launch``: start local worker processes with ``TF_CONFIG`` and restart the group on failure.

Built on the process supervisor (`meshfit._runtime._supervisor`): every round picks free ports, starts
``--workers`` copies of ``python script.py args`` (plus one evaluator with ``--evaluator``), each in its
own session, with output lines prefixed ``[worker i] ``. When a
training worker exits non-zero the rest of the group is stopped and, if restarts remain, a new group
starts with fresh ports and ``MESHFIT_RESTART_COUNT`` incremented. Exit code
`~meshfit._runtime._exit_codes.PREEMPTED_EXIT_CODE` (75) restarts without spending a restart.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from meshfit._runtime._exit_codes import PEER_FAILURE_EXIT_CODE, PREEMPTED_EXIT_CODE
from meshfit._runtime._ports import free_ports
from meshfit._runtime._preload import PreloadServer
from meshfit._runtime._standby import StandbyPool
from meshfit._runtime._supervisor import (
    TERMINATE_TIMEOUT_S,
    Child,
    ChildGroup,
    Output,
    TaskStarter,
)

__all__ = ["build_parser", "free_ports", "main"]

MAX_PREEMPTION_RESTARTS = 100
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _task_env(args: argparse.Namespace) -> dict[str, str]:
    """Every task's environment before its round's keys (``TF_CONFIG``, ``MESHFIT_RESTART_COUNT``)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    env.setdefault("MKL_NUM_THREADS", str(args.threads))
    env["PYTHONUNBUFFERED"] = "1"
    return ChildGroup.environment(env)


def _start_round(group: ChildGroup, command: list[str], args: argparse.Namespace, round_: int,
                 standbys: StandbyPool | None = None) -> None:
    """Start one round's workers (and evaluator), each with its own ``TF_CONFIG``, on fresh ports;
    from warm standbys where there are some."""
    count = args.workers + int(args.evaluator)
    ports = free_ports(count)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports[: args.workers]]}
    if args.evaluator:
        cluster["evaluator"] = [f"127.0.0.1:{ports[-1]}"]
    roles = [("worker", i) for i in range(args.workers)] + [("evaluator", 0)] * args.evaluator
    group.output.message(f"round {round_}: starting {args.workers} worker(s)"
                         f"{' and 1 evaluator' if args.evaluator else ''}"
                         f"{', forked from the preloaded process' if args.preload else ''}: "
                         f"{' '.join(command[1:])} (cluster {json.dumps(cluster)})")
    warm, base = 0, _task_env(args)
    for task_type, index in roles:
        env = dict(base)
        env["MESHFIT_RESTART_COUNT"] = str(round_)
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
        proc = standbys.take(command, env) if standbys is not None and round_ else None
        if proc is None:
            group.start(task_type, index, command, env)
        else:
            group.adopt(task_type, index, proc)
            warm += 1
    if warm:
        group.output.message(f"round {round_}: {warm} of {len(roles)} process(es) from warm standbys")
    if standbys is not None:
        standbys.fill(len(roles))  # for the next failure


def _training(group: ChildGroup) -> list[Child]:
    return [c for c in group.children if c.task_type != "evaluator"]


def _evaluator(group: ChildGroup) -> Child | None:
    return next((c for c in group.children if c.task_type == "evaluator"), None)


class _Signals:
    """Forward SIGINT/SIGTERM to the current group; remember the first one received."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.group: ChildGroup | None = None
        self._previous: dict[int, signal.Handlers | int | Callable[[int, FrameType | None], Any] | None] = {}

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


def _supervise(group: ChildGroup, args: argparse.Namespace, signals: _Signals) -> Child | None:
    """Watch a round until a training worker fails (returned), all succeed, or a signal arrives."""
    reported: set[int] = set()
    while signals.received is None:
        failed: list[Child] = []
        for task in group.children:
            code = task.proc.poll()
            if code is None or id(task) in reported:
                continue
            reported.add(id(task))
            if task.task_type == "evaluator":
                running = any(t.proc.poll() is None for t in _training(group))
                group.output.message(f"{task.name} exited with code {code}"
                                     + ("; training continues" if running else ""))
            elif code != 0:
                failed.append(task)
        if failed:
            return _root_cause(failed)
        if all(t.proc.poll() == 0 for t in _training(group)):
            evaluator = _evaluator(group)
            if evaluator is not None and evaluator.proc.poll() is None:
                timeout = args.evaluator_timeout
                if not group.wait([evaluator], timeout) and signals.received is None:
                    group.output.message(f"training finished; {evaluator.name} still running after "
                                         f"{timeout:g} s (--evaluator-timeout); stopping it")
            return None
        time.sleep(args.monitor_interval)
    return None


def _root_cause(failed: list[Child]) -> Child:
    """The worker whose failure the others followed, among those found ended in one sweep.

    A worker that saw a peer stop ends with `PEER_FAILURE_EXIT_CODE`, and only after that peer's
    process ended (its liveness connection closed) or fell silent: a killed peer has ended by then, so
    a sweep that finds the follower finds it too, and it is named whatever order the sweep met them in.
    When the sweep finds followers alone (a frozen or cut-off peer still runs), the first is named.
    """
    causes = [task for task in failed if task.proc.returncode != PEER_FAILURE_EXIT_CODE]
    return (causes or failed)[0]


def _code_text(code: int | None) -> str:
    """``code`` as the launcher prints it: a worker that ended after a peer stopped says so."""
    return f"{code} (a peer stopped first)" if code == PEER_FAILURE_EXIT_CODE else str(code)


def _restart_message(failed: Child, counts: dict[str, int], max_restarts: int) -> str | None:
    """Decide whether to restart after ``failed``; update ``counts``; return the message or ``None``."""
    code = failed.proc.returncode
    if code == PREEMPTED_EXIT_CODE and counts["preemptions"] < MAX_PREEMPTION_RESTARTS:
        counts["preemptions"] += 1
        return (f"{failed.name} exited with code {code} (preempted); restarting the group "
                f"(preemption restart {counts['preemptions']}, not counted against --max-restarts)")
    if counts["restarts"] < max_restarts:
        counts["restarts"] += 1
        return (f"{failed.name} exited with code {_code_text(code)}; restarting the group "
                f"(restart {counts['restarts']} of {max_restarts})")
    return None


def _run(command: list[str], args: argparse.Namespace, output: Output) -> int:
    standbys = StandbyPool(command[0], _task_env(args)) if args.standby else None
    starter = PreloadServer(_task_env(args)) if args.preload else None
    try:
        return _rounds(command, args, output, standbys, starter)
    finally:
        if standbys is not None:
            standbys.close()


def _rounds(command: list[str], args: argparse.Namespace, output: Output, standbys: StandbyPool | None,
            starter: TaskStarter | None = None) -> int:
    counts = {"restarts": 0, "preemptions": 0}
    round_ = 0
    with _Signals() as signals:
        while signals.received is None:
            group = ChildGroup(output, starter)
            signals.group = group
            grace, kill = 0.0, False
            try:
                _start_round(group, command, args, round_, standbys)
                failed = _supervise(group, args, signals)
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
                    code = failed.proc.wait()  # it has ended: its code
                    output.message(f"{failed.name} exited with code {_code_text(code)}; no restarts left "
                                   f"(--max-restarts {args.max_restarts}); stopping the other processes")
                    return _exit_status(code)
                output.message(message)
                if failed.proc.returncode == PREEMPTED_EXIT_CODE:
                    grace = TERMINATE_TIMEOUT_S  # the others are saving at the same step: let them finish
                # A worker saw a peer die, freeze or fall off the network, or was itself killed
                # (SIGKILL: the OOM killer, kill -9): the group is broken, no collective save can
                # complete, and a frozen process cannot act on SIGTERM, so end the rest at once
                # (backups are atomic) instead of waiting for them to wind down.
                kill = failed.proc.returncode in (PEER_FAILURE_EXIT_CODE, -signal.SIGKILL)
            finally:
                group.stop(grace, kill=kill)
                signals.group = None
            round_ += 1
    return 128 + signals.received


def _positive(kind: type, minimum: float):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, received {text!r}") from None
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a finite number >= {minimum}, received {text!r}")
        return value
    return parse


def _unknown_option(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The first option before the script that ``meshfit launch`` does not know, if any."""
    known = {s for action in parser._actions for s in action.option_strings}
    takes_value = {s for action in parser._actions if action.nargs != 0 for s in action.option_strings}
    tokens = iter(argv)
    for token in tokens:
        if token == "--" or not token.startswith("-") or token == "-":
            return None
        name = token.split("=", 1)[0]
        if name not in known:
            return token
        if name in ("-m", "--module"):
            continue
        if name in takes_value and "=" not in token:
            next(tokens, None)
    return None


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
    parser.add_argument("--standby", action="store_true",
                        help="keep one warm process per task that has imported torch and meshfit, so "
                             "that a restart skips the imports (~2.4 s here); costs ~300 MB of memory each")
    parser.add_argument("--preload", action="store_true",
                        help="start every task (and every restarted one) as a fork of one process that has "
                             "imported torch and meshfit once: no import per task; the script cannot change "
                             "what torch reads at import (use --threads)")
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
        unknown = _unknown_option(parser, argv)
        if unknown is not None:
            parser.error(f"unknown option {unknown!r} for meshfit launch (see --help). To pass it to the "
                         "training script, put it after the script's path.")
        args = parser.parse_args(argv)
        if not args.module and not os.path.isfile(args.script):
            parser.error(f"script {args.script!r} not found. Pass the path of a Python file, "
                         "or use -m for a module.")
        if args.preload and args.standby:
            parser.error("--preload and --standby both make a restart skip the imports; pass one of them "
                         "(--preload also makes the first round skip them).")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    command = [sys.executable] + (["-m"] if args.module else []) + [args.script, *args.script_args]
    return _run(command, args, Output())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
