"""meshfit: Keras-style distributed training for PyTorch modules.

Write the model once for one device, create it inside a strategy's scope, call ``fit``: it trains on
many devices and machines, survives killed workers and preemption, and resumes exactly.
Importing meshfit has no side effects: no environment changes, log handlers or process groups.

``import meshfit`` itself imports nothing heavy: the first public name used (``meshfit.Model``,
``from meshfit import callbacks``) loads the whole package, torch included, as an eager package would.
So ``meshfit launch``, whose launcher only starts and watches processes, starts its workers without
first spending a second or more importing torch itself.
"""

from typing import TYPE_CHECKING

from meshfit._runtime import note_threads_at_import as _note_threads_at_import
from meshfit._version import __version__ as __version__

_note_threads_at_import()  # the baseline for "the user chose torch's threads" (distribute)

if TYPE_CHECKING:  # what type checkers and the reference read; `__getattr__` imports the same at run time
    from meshfit import (
        callbacks,
        cluster,
        data,
        datasets,
        distribute,
        distribution,
        dtensor,
        estimator,
        losses,
        metrics,
        mixed_precision,
        nn,
        optimizers,
        train,
        utils,
    )
    from meshfit._engine import Model, SidecarEvaluator, load_model
    from meshfit.distribute import (
        CommunicationImplementation,
        CommunicationOptions,
        InputContext,
        MirroredStrategy,
        MultiWorkerMirroredStrategy,
        OneDeviceStrategy,
        PeerFailureError,
        ReduceOp,
        ReplicaDivergenceError,
        get_strategy,
    )
    from meshfit.nn import RematScope, remat

__all__ = [
    "CommunicationImplementation",
    "CommunicationOptions",
    "InputContext",
    "MirroredStrategy",
    "Model",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "PeerFailureError",
    "ReduceOp",
    "RematScope",
    "ReplicaDivergenceError",
    "SidecarEvaluator",
    "callbacks",
    "cluster",
    "data",
    "datasets",
    "distribute",
    "distribution",
    "dtensor",
    "estimator",
    "get_strategy",
    "load_model",
    "losses",
    "metrics",
    "mixed_precision",
    "nn",
    "optimizers",
    "remat",
    "train",
    "utils",
]

# Public subpackages: each imports (and publishes its names) on its own first use. The last two are
# left out of the package's load: a TF-migration API most programs never touch, and
# torch.distributed.checkpoint (about a second).
_SUBPACKAGES = ("callbacks", "cluster", "data", "datasets", "distribute", "distribution", "dtensor",
                "losses", "metrics", "mixed_precision", "nn", "optimizers", "utils")
_ON_FIRST_USE = ("estimator", "train")


# Where each public name of the root is defined (the `TYPE_CHECKING` imports above, for run time).
_HOMES = {
    **dict.fromkeys(("Model", "SidecarEvaluator", "load_model"), "meshfit._engine"),
    **dict.fromkeys(("CommunicationImplementation", "CommunicationOptions", "InputContext", "MirroredStrategy",
                     "MultiWorkerMirroredStrategy", "OneDeviceStrategy", "PeerFailureError", "ReduceOp",
                     "ReplicaDivergenceError", "get_strategy"), "meshfit.distribute"),
    **dict.fromkeys(("RematScope", "remat"), "meshfit.nn"),
}


def _load() -> None:
    """Import every public subpackage and name, as an eager ``__init__`` would, then give the names
    defined in private modules their home here (`publish`)."""
    import importlib

    for package in _SUBPACKAGES:
        importlib.import_module(f"meshfit.{package}")
    for name, home in _HOMES.items():
        globals()[name] = getattr(importlib.import_module(home), name)
    from meshfit._export import publish

    publish(__name__)


def __getattr__(name: str) -> object:
    if name in _SUBPACKAGES or name in _ON_FIRST_USE:
        import importlib

        return importlib.import_module(f"meshfit.{name}")
    if name in __all__:
        _load()
        return globals()[name]
    raise AttributeError(f"module 'meshfit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
