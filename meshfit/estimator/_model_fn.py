"""Calling ``model_fn`` and ``input_fn`` as TF does, in eager PyTorch.

TF built ``model_fn``'s graph once per ``train``/``evaluate``/``predict``; eager PyTorch runs
``model_fn`` at every step, so a module constructed in it would be new — with fresh weights —
at every step. The idiom that keeps the seed's ``model_fn`` shape: wrap what must live across
steps in `once` (built on the first call, the same object after); or build it outside and pass it
in ``params``. A ``model_fn`` that still builds a module with parameters after its first call is
stopped with an error naming the fix, never trained silently.

The modules ``model_fn`` uses are found by watching which modules it calls (torch's global forward
hooks) on its first call; they are what the Estimator places, checkpoints and names.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from meshfit.estimator._train_op import optimizer_of

_VALID_MODEL_FN_ARGS = {"features", "labels", "mode", "params", "config", "self"}
_ACTIVE: list[ModelFnCaller] = []


def fn_args(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The argument names of ``fn`` (a function, method, ``functools.partial`` or callable object)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as error:
        raise TypeError(f"Cannot read the signature of {fn!r}: {error}") from error
    return tuple(name for name, p in signature.parameters.items()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def verify_model_fn(model_fn: Any, params: Any) -> tuple[str, ...]:
    """Check ``model_fn``'s signature as TF's Estimator does; returns its argument names."""
    if not callable(model_fn):
        raise TypeError(f"Invalid `model_fn`: expected a function model_fn(features, labels, mode[, params]"
                        f"[, config]), received {model_fn!r}.")
    args = fn_args(model_fn)
    if "features" not in args:
        raise ValueError(f"Invalid `model_fn`: {getattr(model_fn, '__name__', model_fn)}{args} must take a "
                         "`features` argument: model_fn(features, labels, mode[, params][, config]).")
    unexpected = sorted(set(args) - _VALID_MODEL_FN_ARGS)
    if unexpected:
        raise ValueError(f"Invalid `model_fn`: it has arguments {unexpected} that an Estimator cannot fill; "
                         "the arguments allowed are features, labels, mode, params and config.")
    if params is not None and "params" not in args:
        raise ValueError(f"Invalid `model_fn`: it takes no `params` argument, but params={params!r} was given "
                         "to the Estimator. Add `params` to model_fn's arguments or drop params.")
    return args


def call_input_fn(input_fn: Callable[..., Any], mode: str, params: Any, config: Any,
                  input_context: Any) -> Any:
    """``input_fn(**kwargs)`` with the arguments it names: mode, params, config, input_context."""
    args = fn_args(input_fn)
    kwargs: dict[str, Any] = {}
    if "mode" in args:
        kwargs["mode"] = mode
    if "params" in args:
        kwargs["params"] = params
    if "config" in args:
        kwargs["config"] = config
    if "input_context" in args and input_context is not None:
        kwargs["input_context"] = input_context
    return input_fn(**kwargs)


def accepts_input_context(input_fn: Callable[..., Any]) -> bool:
    return "input_context" in fn_args(input_fn)


def current_global_step() -> int | None:
    """The global step of the run whose ``model_fn`` is being called, or None outside one."""
    return _ACTIVE[-1].step_source() if _ACTIVE else None


def get_global_step() -> torch.Tensor | None:
    """The global step as an int64 scalar while an Estimator runs ``model_fn`` (else None).

    ``tf.compat.v1.train.get_global_step``; the Estimator counts steps itself, so passing it to
    ``minimize`` only documents intent.
    """
    step = current_global_step()
    return None if step is None else torch.tensor(step, dtype=torch.int64)


def get_or_create_global_step() -> torch.Tensor | None:
    """``tf.compat.v1.train.get_or_create_global_step``: the same as `get_global_step`."""
    return get_global_step()


class FreshModuleError(RuntimeError):
    """``model_fn`` built a new module (or optimizer) after its first call."""


def once(factory: Callable[[], Any], *, key: str | None = None) -> Any:
    """The object ``factory()`` built on ``model_fn``'s first call; the same object on later calls.

    Use it in ``model_fn`` for what must live across steps: modules, optimizers. Each call site
    (or ``key``) of each `Estimator` holds its own object, so a rebuilt Estimator starts fresh and
    restores from ``model_dir``.

    Args:
        factory: builds the object, e.g. ``lambda: nn.Sequential(...)``.
        key: a name for the object (default: the call site and its order within this call).

    Raises:
        RuntimeError: called outside a ``model_fn`` that an Estimator is running.

    Example:
        >>> def model_fn(features, labels, mode):
        ...     model = once(lambda: nn.Linear(4, 2))
        ...     ...
    """
    if not _ACTIVE:
        raise RuntimeError("mf.estimator.once(...) is for use inside a model_fn that an Estimator calls; "
                           "outside one, build the object directly.")
    return _ACTIVE[-1].once(factory, key, sys._getframe(1))


class ModelFnCaller:
    """Calls ``model_fn`` for one `Estimator`; finds its modules and refuses fresh ones.

    Args:
        model_fn: the user's function (signature already verified).
        args: its argument names.
        params: the Estimator's ``params``.
        config: the Estimator's `RunConfig`.
    """

    def __init__(self, model_fn: Callable[..., Any], args: tuple[str, ...], params: Any, config: Any) -> None:
        self.model_fn, self.args, self.params, self.config = model_fn, args, params, config
        self.calls = 0
        self.store: dict[Any, Any] = {}
        self.modules: dict[str, nn.Module] = {}
        self.optimizer: Any = None
        self._site_counts: dict[Any, int] = {}
        self._modes_seen: set[str] = set()
        self._building = 0
        self.synchronized = False  # replicas started from rank 0's weights
        self.gradient_sync: Any = None  # fully sharded modules: how their gradients are weighted
        self.step_source: Callable[[], int] = lambda: 0  # the running train/evaluate sets it

    def once(self, factory: Callable[[], Any], key: str | tuple[Any, ...] | None, frame: Any) -> Any:
        if key is None:
            site = (frame.f_code, frame.f_lasti)
            count = self._site_counts.get(site, 0)
            self._site_counts[site] = count + 1
            key = (*site, count)
        if key not in self.store:
            # A site first reached in a later call (code for another mode) builds once, too.
            self._building += 1
            try:
                value = factory()
            finally:
                self._building -= 1
            self.store[key] = value
            if isinstance(value, nn.Module):
                self._adopt(value, key if isinstance(key, str) else None)
        return self.store[key]

    def __call__(self, features: Any, labels: Any, mode: str) -> Any:
        """``model_fn(features, labels, mode[, params][, config])``; returns its `EstimatorSpec`."""
        from meshfit.estimator._spec import EstimatorSpec

        kwargs: dict[str, Any] = {}
        if "labels" in self.args:
            kwargs["labels"] = labels
        elif labels is not None:
            raise ValueError("model_fn takes no `labels` argument, but input_fn yields (features, labels). Add "
                             "`labels` to model_fn's arguments or yield features only.")
        if "mode" in self.args:
            kwargs["mode"] = mode
        if "params" in self.args:
            kwargs["params"] = self.params
        if "config" in self.args:
            kwargs["config"] = self.config
        self.calls += 1
        self._site_counts.clear()
        first = mode not in self._modes_seen
        self._modes_seen.add(mode)
        _ACTIVE.append(self)
        watch = _Watch(self, discover=first, refuse_new=self.calls > 1)
        try:
            with watch:
                spec = self.model_fn(features=features, **kwargs)
        finally:
            _ACTIVE.pop()
        if not isinstance(spec, EstimatorSpec):
            raise TypeError(f"model_fn must return an mf.estimator.EstimatorSpec, received {type(spec).__name__}.")
        for module in watch.top_level:
            self._adopt(module, None)
        self._check_optimizer(spec)
        return spec

    def _adopt(self, module: nn.Module, name: str | None) -> None:
        if any(module is inner for existing in self.modules.values() for inner in existing.modules()):
            return  # already known, or part of a known module
        if name is None:
            base = type(module).__name__.lower()
            name, index = base, 1
            while name in self.modules:
                name, index = f"{base}_{index}", index + 1
        self.modules[name] = module

    def _check_optimizer(self, spec: Any) -> None:
        optimizer = optimizer_of(spec.train_op)
        if optimizer is None:
            return
        if self.optimizer is None:
            self.optimizer = optimizer
        elif optimizer is not self.optimizer:
            raise FreshModuleError(
                f"model_fn created a new optimizer ({type(optimizer).__name__}) on its call {self.calls}: its state "
                "(momentum, step counts) would restart at every step. Create it once: "
                "optimizer = mf.estimator.once(lambda: ...).")


class _Watch:
    """During one ``model_fn`` call: the modules it calls directly, and any parameter it creates."""

    def __init__(self, caller: ModelFnCaller, discover: bool, refuse_new: bool) -> None:
        self.caller, self.discover, self.refuse_new = caller, discover, refuse_new
        self.top_level: list[nn.Module] = []
        self._depth = 0
        self._handles: list[Any] = []

    def __enter__(self) -> _Watch:
        if self.discover:
            self._handles.append(torch_module.register_module_forward_pre_hook(self._enter))
            self._handles.append(torch_module.register_module_forward_hook(self._exit, always_call=True))
        if self.refuse_new:
            self._handles.append(torch_module.register_module_parameter_registration_hook(self._created))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0 and any(True for _ in module.parameters()) \
                and not any(m is module for m in self.top_level):
            self.top_level.append(module)
        self._depth += 1

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1

    def _created(self, module: nn.Module, name: str, param: Any) -> None:
        if self.caller._building:
            return
        call = self.caller.calls
        shape = tuple(param.shape) if isinstance(param, torch.Tensor) and not isinstance(
            param, nn.parameter.UninitializedParameter) else "lazy"
        raise FreshModuleError(
            f"model_fn built a new {type(module).__name__} (parameter {name!r}, shape {shape}) on its call "
            f"{call}: in eager PyTorch model_fn runs at every step, so a module built inside it would "
            "train fresh weights each step. Build it once: model = mf.estimator.once(lambda: nn.Sequential(...)), "
            "or build it outside model_fn and pass it in params.")
