"""meshfit: Keras-style distributed training for PyTorch modules.

Write the model once for one device, create it inside a strategy's scope, call ``fit``: it trains on
many devices and machines, survives killed workers and preemption, and resumes exactly.
Importing meshfit has no side effects: no environment changes, log handlers or process groups.
"""

from meshfit import (
    callbacks,
    cluster,
    data,
    datasets,
    distribute,
    distribution,
    dtensor,
    losses,
    metrics,
    mixed_precision,
    nn,
    optimizers,
    utils,
)
from meshfit._engine import Model, SidecarEvaluator, load_model
from meshfit._export import publish as _publish
from meshfit._version import __version__ as __version__
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
    "train",
    "utils",
]

_publish(__name__)


def __getattr__(name: str) -> object:
    # meshfit.train imports torch.distributed.checkpoint (about a second): load it on first use;
    # meshfit.estimator too (a TF migration API most programs never touch).
    if name in ("train", "estimator"):
        import importlib

        return importlib.import_module(f"meshfit.{name}")
    raise AttributeError(f"module 'meshfit' has no attribute {name!r}")
