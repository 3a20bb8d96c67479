"""Denormal floats flushed to zero while meshfit runs a model, as TensorFlow does on its CPU threads.

A float32 below ~1.2e-38 (a *denormal*) is computed in microcode on x86 CPUs, tens of times slower
than a normal one. Adam's moment estimates of a weight whose gradient stays zero (an always-blank
input pixel) decay into that range after a few hundred steps, and the optimizer step slows several
fold (keras.io's MLP: 1.5 → 4.2 ms a step). TensorFlow sets flush-to-zero (FTZ) and denormals-are-zero
(DAZ) on every thread that runs its ops (``port::ScopedFlushDenormal`` in its executor and thread
pools), for training, evaluation and prediction alike. `flush_denormals` does the same for meshfit's
``fit``/``evaluate``/``predict``, the Estimator's and ``strategy.run``: on entry, on the calling
thread and on every thread of torch's intra-op OpenMP pool (``torch.set_flush_denormal`` alone sets
the calling thread's only); on exit, every one of them back to the calling thread's state before.
Nothing changes at import. ``MESHFIT_FLUSH_DENORMALS=0`` in the environment turns it off.

Results below ~1e-38 become zero inside these regions, as in TensorFlow.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import threading
from collections.abc import Callable, Iterator

__all__ = ["FLUSH_DENORMALS_ENV", "flush_denormals", "flushing_denormals"]

FLUSH_DENORMALS_ENV = "MESHFIT_FLUSH_DENORMALS"
_OFF = {"0", "false", "no", "off"}
_depth = threading.local()  # regions nest (fit → evaluate → strategy.run): only the outermost acts


def flushing_denormals() -> bool:
    """Whether the calling thread flushes denormals now: a product below the normal range is 0.

    Python's float multiply runs on the same SSE/FP unit (flush-to-zero covers float64 too), so the
    check costs nanoseconds and no tensor."""
    return _TINY * _TINY == 0.0


_TINY = 1e-160  # squared: 1e-320, a float64 denormal (a module variable: never folded at compile time)


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """Flush denormals to zero on this thread and torch's intra-op threads while inside; restore after."""
    depth = getattr(_depth, "value", 0)
    if depth or os.environ.get(FLUSH_DENORMALS_ENV, "1").strip().lower() in _OFF:
        _depth.value = depth + 1
        try:
            yield
        finally:
            _depth.value = depth
        return
    import torch  # here, not at import: the launcher imports this package and never needs torch

    before = flushing_denormals()
    team = torch.get_num_threads()
    _set_everywhere(True, team)
    _depth.value = 1
    try:
        yield
    finally:
        _depth.value = 0
        # The team flushed at entry, even if the thread count dropped inside (a strategy sharing the
        # cores): libgomp keeps its threads for the next team, which would otherwise still flush.
        _set_everywhere(before, max(team, torch.get_num_threads()))


def _set_everywhere(flag: bool, threads: int) -> None:
    """``torch.set_flush_denormal(flag)`` on this thread, then this thread's floating-point
    environment copied to each of ``threads`` threads of its OpenMP team."""
    import torch

    if not torch.set_flush_denormal(flag):  # this CPU cannot (no SSE3 / not x86 or arm64)
        return
    copy_to_team = _environment_copier()
    if threads > 1 and copy_to_team is not None:
        copy_to_team(threads)


@functools.cache
def _environment_copier() -> Callable[[int], None] | None:
    """``copy(n)``: this thread's floating-point environment (``fegetenv``) set on ``n`` threads of the
    OpenMP team that torch's ops use, by running C's ``fesetenv`` on each through ``GOMP_parallel``
    of the OpenMP runtime torch loaded (libgomp, LLVM's libomp and Intel's libiomp5 export it).

    libgomp keeps one team per calling thread, reused by every later parallel region of that thread
    (ATen's and MKL's included); threads it creates later inherit the creating thread's environment
    (POSIX). No Python runs on the team's threads (no GIL handoff): a copy costs microseconds.
    None where torch's parallel backend is not OpenMP or a library is missing (then only the calling
    thread is set)."""
    import torch

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    openmp = _loaded_library(("libgomp", "libomp.", "libiomp5"))
    # libm is mapped into every CPython process: read its path, not ldconfig's (find_library runs it).
    libm = _loaded_library(("libm.", "libm-")) or ctypes.util.find_library("m")
    if openmp is None or libm is None:
        return None
    try:
        gomp_parallel, math = ctypes.CDLL(openmp).GOMP_parallel, ctypes.CDLL(libm)
        fegetenv, fesetenv = math.fegetenv, ctypes.cast(math.fesetenv, ctypes.c_void_p)
    except (OSError, AttributeError):
        return None
    gomp_parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    gomp_parallel.restype = None
    environment = ctypes.create_string_buffer(256)  # fenv_t: 32 bytes on x86-64, 8 on arm64

    def copy(threads: int) -> None:
        fegetenv(environment)
        gomp_parallel(fesetenv, environment, threads, 0)  # fesetenv(&environment) on each thread

    return copy


def _loaded_library(prefixes: tuple[str, ...]) -> str | None:
    """The path of a shared library with one of these name prefixes mapped into this process (Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/lib" in line}
    except OSError:
        return None
    for path in sorted(paths):
        name = os.path.basename(path)
        if name.startswith(prefixes) and ".so" in name:
            return path
    return None
