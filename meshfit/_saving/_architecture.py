"""A plain-JSON description of modules built from standard ``torch.nn`` layers.

`module_to_config` records, for each layer, its class name and the exact constructor arguments read
back from the layer's attributes (plus its parameter dtype); containers (``Sequential``,
``ModuleList``, ``ModuleDict``) record their children by name. `module_from_config` rebuilds an
equivalent module with freshly initialised weights: load the saved ``state_dict`` into it.
Anything else (a custom ``nn.Module``, a subclass of a known layer, a layer with hooks) has no
config: `module_to_config` returns ``None`` and the caller must supply the module itself.

Layout (``json.dumps`` works on it)::

    {"format": "meshfit.architecture/1",
     "module": {"class_name": "Sequential",
                "layers": [{"name": "0", "class_name": "Conv2d", "config": {"in_channels": 1, ...}},
                           ...]}}
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshfit.distribute import PlacementHook

__all__ = ["ARCHITECTURE_FORMAT", "module_from_config", "module_to_config", "supported_layers"]

ARCHITECTURE_FORMAT = "meshfit.architecture/1"

_CONV = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups")
_CONV_TAIL = ("padding_mode",)
_LAZY_CONV = ("out_channels", "kernel_size", "stride", "padding", "dilation", "groups")
_CONV_T = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "output_padding", "groups")
_MAX_POOL = ("kernel_size", "stride", "padding", "dilation", "return_indices", "ceil_mode")
_AVG_POOL_1D = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")
_BATCH_NORM = ("num_features", "eps", "momentum", "affine", "track_running_stats")
_EMBEDDING = (
    "num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse",
)  # fmt: skip


def _has_bias(module: nn.Module) -> bool:
    return getattr(module, "bias", None) is not None


def _reader(*names: str, has_bias: bool = False, **extra: Callable[[nn.Module], Any]) -> Callable:
    """A function reading ctor kwargs ``names`` (and ``bias=<bias is not None>``) from a layer."""

    def read(module: nn.Module) -> dict[str, Any]:
        config = {name: getattr(module, name) for name in names}
        if has_bias:
            config["bias"] = _has_bias(module)
        config.update({name: fn(module) for name, fn in extra.items()})
        return config

    return read


def _layer_norm_bias(module: nn.Module) -> bool:
    return _has_bias(module) if module.elementwise_affine else True


def _norm_reader(*names: str) -> Callable:
    """Like `_reader`; ``bias=False`` is recorded only for an affine norm without bias (newer torch)."""
    read_names = _reader(*names)

    def read(module: nn.Module) -> dict[str, Any]:
        config = read_names(module)
        if module.affine and not _has_bias(module):
            config["bias"] = False
        return config

    return read


# class name -> (class, reader of its constructor kwargs). Exact types only: a subclass may change forward.
_LAYERS: dict[str, tuple[type[nn.Module], Callable[[nn.Module], dict[str, Any]]]] = {
    "Linear": (nn.Linear, _reader("in_features", "out_features", has_bias=True)),
    "LazyLinear": (nn.LazyLinear, _reader("out_features", has_bias=True)),
    "Conv1d": (nn.Conv1d, _reader(*_CONV, *_CONV_TAIL, has_bias=True)),
    "Conv2d": (nn.Conv2d, _reader(*_CONV, *_CONV_TAIL, has_bias=True)),
    "Conv3d": (nn.Conv3d, _reader(*_CONV, *_CONV_TAIL, has_bias=True)),
    "LazyConv1d": (nn.LazyConv1d, _reader(*_LAZY_CONV, *_CONV_TAIL, has_bias=True)),
    "LazyConv2d": (nn.LazyConv2d, _reader(*_LAZY_CONV, *_CONV_TAIL, has_bias=True)),
    "LazyConv3d": (nn.LazyConv3d, _reader(*_LAZY_CONV, *_CONV_TAIL, has_bias=True)),
    "ConvTranspose1d": (nn.ConvTranspose1d, _reader(*_CONV_T, "dilation", *_CONV_TAIL, has_bias=True)),
    "ConvTranspose2d": (nn.ConvTranspose2d, _reader(*_CONV_T, "dilation", *_CONV_TAIL, has_bias=True)),
    "MaxPool1d": (nn.MaxPool1d, _reader(*_MAX_POOL)),
    "MaxPool2d": (nn.MaxPool2d, _reader(*_MAX_POOL)),
    "AvgPool1d": (nn.AvgPool1d, _reader(*_AVG_POOL_1D)),
    "AvgPool2d": (nn.AvgPool2d, _reader(*_AVG_POOL_1D, "divisor_override")),
    "AdaptiveAvgPool1d": (nn.AdaptiveAvgPool1d, _reader("output_size")),
    "AdaptiveAvgPool2d": (nn.AdaptiveAvgPool2d, _reader("output_size")),
    "AdaptiveMaxPool2d": (nn.AdaptiveMaxPool2d, _reader("output_size", "return_indices")),
    "Flatten": (nn.Flatten, _reader("start_dim", "end_dim")),
    "Unflatten": (nn.Unflatten, _reader("dim", "unflattened_size")),
    "Identity": (nn.Identity, _reader()),
    "ReLU": (nn.ReLU, _reader("inplace")),
    "ReLU6": (nn.ReLU6, _reader("inplace")),
    "LeakyReLU": (nn.LeakyReLU, _reader("negative_slope", "inplace")),
    "ELU": (nn.ELU, _reader("alpha", "inplace")),
    "SiLU": (nn.SiLU, _reader("inplace")),
    "GELU": (nn.GELU, _reader("approximate")),
    "Tanh": (nn.Tanh, _reader()),
    "Sigmoid": (nn.Sigmoid, _reader()),
    "Softmax": (nn.Softmax, _reader("dim")),
    "LogSoftmax": (nn.LogSoftmax, _reader("dim")),
    "Dropout": (nn.Dropout, _reader("p", "inplace")),
    "Dropout1d": (nn.Dropout1d, _reader("p", "inplace")),
    "Dropout2d": (nn.Dropout2d, _reader("p", "inplace")),
    "BatchNorm1d": (nn.BatchNorm1d, _norm_reader(*_BATCH_NORM)),
    "BatchNorm2d": (nn.BatchNorm2d, _norm_reader(*_BATCH_NORM)),
    "BatchNorm3d": (nn.BatchNorm3d, _norm_reader(*_BATCH_NORM)),
    "LayerNorm": (
        nn.LayerNorm,
        _reader("normalized_shape", "eps", "elementwise_affine", bias=_layer_norm_bias),
    ),
    "GroupNorm": (nn.GroupNorm, _norm_reader("num_groups", "num_channels", "eps", "affine")),
    "Embedding": (nn.Embedding, _reader(*_EMBEDDING)),
}
_CONTAINERS: dict[str, type[nn.Module]] = {
    "Sequential": nn.Sequential,
    "ModuleList": nn.ModuleList,
    "ModuleDict": nn.ModuleDict,
}


def supported_layers() -> list[str]:
    """Names of the ``torch.nn`` classes that `module_to_config` can describe."""
    return sorted([*_LAYERS, *_CONTAINERS])


class _Unsupported(Exception):
    """Raised internally when a module has no config."""


def _json_value(value: Any) -> Any:
    """Tuples become lists; anything that is not plain JSON makes the layer unsupported."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    raise _Unsupported


def _dtype_of(module: nn.Module) -> str | None:
    """The single floating dtype of a layer's own parameters and buffers (None if it has none)."""
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point()}
    if len(dtypes) > 1:
        raise _Unsupported
    return dtypes.pop() if dtypes else None


def _has_custom_behaviour(module: nn.Module) -> bool:
    """Hooks or an instance-level ``forward`` would not survive a rebuild."""
    pre_hooks = dict(module._forward_pre_hooks)
    lazy_hook = getattr(module, "_initialize_hook", None)  # an uninitialized lazy layer's own hook
    if lazy_hook is not None:
        pre_hooks.pop(lazy_hook.id, None)
    forward_hooks = dict(module._forward_hooks)
    for table in (pre_hooks, forward_hooks):  # a strategy's placement hooks (mf.dtensor) change no math
        for key in [k for k, hook in table.items() if _is_placement_hook(hook)]:
            del table[key]
    hooks = (forward_hooks, pre_hooks, module._backward_hooks, module._state_dict_hooks)
    return any(hooks) or "forward" in vars(module)


def _is_placement_hook(hook: Any) -> bool:
    """A hook of a strategy's placement: meshfit's (marked) or torch ``fully_shard``'s (its state's methods)."""
    if isinstance(hook, PlacementHook):
        return True
    owner = getattr(hook, "__self__", None)
    return owner is not None and type(owner).__module__.startswith("torch.distributed.fsdp.")


def plain_type(module: nn.Module) -> type:
    """The module's own class: the one ``fully_shard`` subclassed (``FSDPLinear`` -> ``Linear``), else its type."""
    cls = type(module)
    if "torch.distributed.fsdp" not in sys.modules:  # nothing was fully sharded in this process
        return cls
    from torch.distributed.fsdp import FSDPModule

    if issubclass(cls, FSDPModule) and FSDPModule in cls.__bases__:
        return next(base for base in cls.__bases__ if base is not FSDPModule)
    return cls


def _describe(module: nn.Module) -> dict[str, Any]:
    """The config node of one module (raises `_Unsupported`)."""
    cls = plain_type(module)
    class_name = cls.__name__
    if _has_custom_behaviour(module):
        raise _Unsupported
    if class_name in _CONTAINERS and cls is _CONTAINERS[class_name]:
        layers = [{"name": name, **_describe(child)} for name, child in module.named_children()]
        return {"class_name": class_name, "layers": layers}
    if class_name not in _LAYERS or cls is not _LAYERS[class_name][0]:
        raise _Unsupported
    kwargs = _LAYERS[class_name][1](module)
    config = {name: _json_value(value) for name, value in kwargs.items()}
    dtype = _dtype_of(module)
    if dtype is not None:
        config["dtype"] = dtype
    return {"class_name": class_name, "config": config}


def _signature(module: nn.Module) -> dict[str, tuple[Any, ...]]:
    """State-dict keys with (shape, dtype), or a marker for uninitialized lazy tensors."""
    out: dict[str, tuple[Any, ...]] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if nn.parameter.is_lazy(tensor):
            out[key] = ("uninitialized",)
        else:
            out[key] = (tuple(tensor.shape), tensor.dtype)
    return out


def module_to_config(module: nn.Module) -> dict[str, Any] | None:
    """Describes a module made of standard ``torch.nn`` layers as plain JSON.

    Args:
        module: The module. Lazy layers that have run are described as their materialised class
            (``LazyLinear`` -> ``Linear``); uninitialized ones stay lazy.

    Returns:
        A JSON-serializable dict for `module_from_config`, or ``None`` if any part of the module is
        not a supported standard layer (see `supported_layers`), or if rebuilding it would not give
        the same state-dict keys, shapes and dtypes.

    Raises:
        TypeError: If ``module`` is not an ``nn.Module``.

    Example:
        >>> from torch import nn
        >>> config = module_to_config(nn.Sequential(nn.Linear(4, 2), nn.ReLU()))
        >>> module_from_config(config)
        Sequential(
          (0): Linear(in_features=4, out_features=2, bias=True)
          (1): ReLU()
        )
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"Invalid `module`: expected a torch.nn.Module, received {type(module).__name__}.")
    try:
        config = {"format": ARCHITECTURE_FORMAT, "module": _describe(module)}
        json.dumps(config, allow_nan=False)
    except (_Unsupported, ValueError):
        return None
    with torch.device("meta"):
        rebuilt = module_from_config(config)
    if _signature(rebuilt) != _signature(module):
        return None
    return config


def _to_python(value: Any) -> Any:
    """JSON lists back to the tuples the layers store."""
    if isinstance(value, list):
        return tuple(_to_python(v) for v in value)
    return value


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Invalid architecture config: unknown dtype {name!r}; expected e.g. 'float32'.")
    return dtype


def _build(node: Any) -> nn.Module:
    """Builds one config node."""
    if not isinstance(node, dict) or "class_name" not in node:
        raise ValueError(
            f"Invalid architecture config node: expected a dict with 'class_name', received {node!r}."
        )
    class_name = node["class_name"]
    if class_name in _CONTAINERS:
        children = [(child["name"], _build(child)) for child in node.get("layers", [])]
        if class_name == "Sequential":
            return nn.Sequential(OrderedDict(children))
        if class_name == "ModuleList":
            return nn.ModuleList([child for _, child in children])
        return nn.ModuleDict(OrderedDict(children))
    if class_name not in _LAYERS:
        raise ValueError(
            f"Invalid architecture config: unknown layer class_name={class_name!r}. "
            f"Supported: {', '.join(supported_layers())}. Pass the module to load_model(path, module=...)."
        )
    kwargs = {name: _to_python(value) for name, value in node.get("config", {}).items()}
    if "dtype" in kwargs:
        kwargs["dtype"] = _dtype(kwargs["dtype"])
    try:
        return _LAYERS[class_name][0](**kwargs)
    except TypeError as err:
        raise ValueError(
            f"Invalid architecture config for {class_name}: {err} (config={node['config']!r})."
        ) from err


def module_from_config(config: dict[str, Any]) -> nn.Module:
    """Builds the module described by `module_to_config`, with fresh weights.

    Args:
        config: The dict returned by `module_to_config` (possibly after a JSON round trip).

    Returns:
        A new module with the same structure; load the saved ``state_dict`` into it.

    Raises:
        TypeError: If ``config`` is not a dict.
        ValueError: If it is not a meshfit architecture config, or names an unknown layer.
    """
    if not isinstance(config, dict):
        raise TypeError(
            f"Invalid `config`: expected a dict from module_to_config, received {type(config).__name__}."
        )
    if config.get("format") != ARCHITECTURE_FORMAT or "module" not in config:
        raise ValueError(
            f"Invalid architecture config: expected format {ARCHITECTURE_FORMAT!r}, "
            f"received format={config.get('format')!r}. Pass the dict returned by module_to_config."
        )
    return _build(config["module"])
