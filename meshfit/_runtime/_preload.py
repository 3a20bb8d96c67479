"""``meshfit launch --preload``: every task forked from one process that has already imported torch.

A new interpreter spends seconds of CPU importing torch, ``torch._dynamo`` (every torch optimizer
imports it) and meshfit before a script's first line (4-5 s here), and every worker of every round
pays it again. With ``--preload`` the launcher starts Python's multiprocessing fork server
(`multiprocessing.set_forkserver_preload`) once, with the tasks' environment, and that server imports
those modules once; each task of each round is then a fork of it that runs the script as
``__main__``: it starts in milliseconds, and the workers share the imported code's memory pages.

A forked task is made to look like ``python script.py``: its own session (the launcher signals its
whole process group), stdin from ``/dev/null``, its output on the launcher's pipes, the round's
environment, ``sys.argv`` and ``sys.path[0]`` as the interpreter sets them, NumPy's global random
state drawn again (Python's `random` is reseeded after a fork by itself), non-daemon threads joined
and `atexit` handlers run when the script ends, an uncaught exception printed by `sys.excepthook`
with exit code 1.

What it cannot reproduce: whatever is read while torch imports. An ``OMP_NUM_THREADS`` (or any
variable torch reads at import) set by the script itself before ``import torch`` has no effect; set it
for the launcher instead (``--threads``, or the variable in the launcher's environment). The tasks
share one ``str`` hash seed, as forked processes do.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import IO

__all__ = ["FORK_SERVER_ENV", "PRELOAD", "PreloadServer", "PreloadedProcess", "run_as_main", "run_task"]

# Set for the fork server alone: `meshfit._runtime._fork_server_heap` freezes the heap only there. That
# module must not be imported before the last entry of PRELOAD (it acts on import): the name lives here.
FORK_SERVER_ENV = "MESHFIT_PRELOAD_SERVER"

# What a training script imports before its first step, imported once by the fork server. torch's own
# modules first: ``import meshfit`` notes torch's thread count (meshfit._runtime._threads_at_import).
# The last one freezes what the server imported (see it), and only in the server.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint", "numpy", "meshfit",
           "meshfit.callbacks", "meshfit.distribute", "meshfit.optimizers", "meshfit.losses", "meshfit.metrics",
           "meshfit._runtime._fork_server_heap"]


class PreloadedProcess:
    """A task forked by the fork server: the parts of `subprocess.Popen` the supervisor uses."""

    def __init__(self, args: Sequence[str], process: BaseProcess, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        if process.pid is None:
            raise RuntimeError("the fork server returned no process id")
        self.args = list(args)
        self.pid: int = process.pid
        self.returncode: int | None = None
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self._process = process

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the task to end; `subprocess.TimeoutExpired` after ``timeout`` s."""
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the task (not to its group), unless it has ended."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the task."""
        self.send_signal(signal.SIGKILL)


class PreloadServer:
    """The launcher's side: one fork server for the whole launch, started at the first task."""

    def __init__(self, env: Mapping[str, str], preload: Sequence[str] = PRELOAD) -> None:
        self._env = dict(env)
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(list(preload))

    def start(self, command: Sequence[str], env: Mapping[str, str]) -> PreloadedProcess:
        """Fork ``command`` (``[python, script, args...]`` or ``[python, -m, module, args...]``) with ``env``."""
        module = len(command) > 2 and command[1] == "-m"
        argv = list(command[2:] if module else command[1:])
        out_r, out_w = self._context.Pipe(duplex=False)
        err_r, err_w = self._context.Pipe(duplex=False)
        process = self._context.Process(target=run_task, args=(argv, module, dict(env), out_w, err_w),
                                        name=" ".join(argv[:1]) or "task")
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(self._env)  # what the server sees at its start, when torch imports
        os.environ[FORK_SERVER_ENV] = "1"  # the tasks' own environment replaces it (`run_task`)
        try:
            process.start()
        except (OSError, EOFError) as error:
            raise RuntimeError(
                f"meshfit launch --preload: the fork server did not start {' '.join(argv)!r} ({error!r}). "
                "Run without --preload to start each task as a new interpreter.") from error
        finally:
            os.environ.clear()
            os.environ.update(saved)
            out_w.close()
            err_w.close()
        stdout, stderr = (os.fdopen(os.dup(r.fileno()), "rb") for r in (out_r, err_r))
        out_r.close()
        err_r.close()
        return PreloadedProcess(command, process, stdout, stderr)


def run_task(argv: list[str], module: bool, env: dict[str, str], out: Connection, err: Connection) -> None:
    """In the forked task: become ``python argv...`` (see the module docstring); exit with its code."""
    os.setsid()
    multiprocessing.current_process().name = "MainProcess"
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # cached from the server's environment by an import: read TMPDIR again
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # a new interpreter draws its own; a fork would share the server's
    sys.argv = list(argv)
    code = run_as_main(argv, module)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    # The interpreter's own exit order: join non-daemon threads, then run the atexit handlers.
    # multiprocessing ends a child with os._exit after its target, which skips both.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.exit(code)


def run_as_main(argv: list[str], module: bool) -> int:
    """Run ``argv[0]`` (a script, or a module with ``module``) as ``__main__`` in this process, as
    ``python argv...`` would; its exit code (1 after an uncaught exception, printed by `sys.excepthook`
    from the script's own frame)."""
    try:
        if module:
            sys.path[0] = os.getcwd()  # python -m puts the working directory first
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        return _exit_code(exit_)
    except BaseException as error:  # as the interpreter does with an uncaught exception
        trimmed = _from_the_script(error.__traceback__)
        try:
            sys.excepthook(type(error), error.with_traceback(trimmed), trimmed)
        except SystemExit as exit_:  # the interpreter, too, ends with the code a hook exits with
            return _exit_code(exit_)
        return 1
    return 0


def _exit_code(exit_: SystemExit) -> int:
    """The exit code the interpreter gives ``exit_`` (its message, if it has one, printed)."""
    code = exit_.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _from_the_script(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without its first frames in this module and runpy: the traceback ``python script.py`` prints."""
    start = tb
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return tb if tb is not None else start
