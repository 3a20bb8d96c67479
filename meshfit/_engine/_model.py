"""`Model`: a torch module with Keras's ``compile``/``fit``/``evaluate``/``predict``/``save``."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from meshfit import mixed_precision
from meshfit._engine import _summary
from meshfit._engine._call_inputs import build_sample, convert_call_inputs
from meshfit._engine._data_handler import DataHandler
from meshfit._engine._data_handler import _is_array_like as is_array_like
from meshfit._engine._evaluation import evaluate as run_evaluation
from meshfit._engine._evaluation import predict as run_prediction
from meshfit._engine._evaluation import where_to_run
from meshfit._engine._fit_arguments import (
    ClassWeightedData,
    check_class_weight,
    check_loss_reduction,
    check_shuffle,
    check_validation_freq,
    split_validation,
    validates_after,
    validation_parts,
)
from meshfit._engine._jit import check_jit_compile, resolve_jit_compile
from meshfit._engine._loop import TrainingLoop, resolve_verbose
from meshfit._engine._model_weights import WeightsMixin
from meshfit._engine._on_batch import OnBatchMixin
from meshfit._engine._outputs import (
    CompileLoss,
    compile_metrics,
    is_serialized_loss,
    loss_config,
    register_output_type,
)
from meshfit._engine._state import LoopState
from meshfit._engine._steps import StepsMixin
from meshfit._engine._tracked_metrics import TrackedMetricsMixin
from meshfit._protocols import DistributionStrategy, PlacementLike
from meshfit._runtime import flush_denormals
from meshfit._validation import check_bool, non_negative_int, positive_int
from meshfit.callbacks import CallbackList, announce_quiet_worker, checkpoint_settings
from meshfit.data import unpack_batch
from meshfit.distribute import (
    CollectiveStrategy,
    adopt,
    agree_on_settings,
    check_training_strategy,
    current_scope_strategy,
    get_strategy,
    placement_hook,
    resident_parts,
)
from meshfit.losses import get as get_loss
from meshfit.metrics import Mean, Metric
from meshfit.nn import current_remat_scope
from meshfit.optimizers import Optimizer
from meshfit.optimizers import get as get_optimizer
from meshfit.optimizers import serialize as serialize_optimizer


class Model(TrackedMetricsMixin, StepsMixin, OnBatchMixin, WeightsMixin):
    """A ``torch.nn.Module`` trained the Keras way, on whatever strategy it was created under.

    Args:
        module: the user's model, written for one device. Lazy modules are fine.
        name: a display name (default: the module's class name).

    Example:
        >>> import meshfit as mf, numpy as np
        >>> model = mf.Model(nn.Linear(4, 2))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(np.zeros((8, 4), "float32"), np.zeros((8, 2), "float32"), verbose=0)
        >>> len(history.history["loss"])
        1
    """

    def __init__(self, module: nn.Module, name: str | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"Invalid `module`: expected a torch.nn.Module, received {type(module).__name__}.")
        self.module = module
        self.name = name or type(module).__name__
        remat_scope = current_remat_scope()
        if remat_scope is not None:  # before the strategy places it: TP, then activation checkpointing, then FSDP
            remat_scope.apply(module)
        self.strategy = get_strategy()
        if current_scope_strategy() is not None:  # a module built outside, wrapped in the scope
            adopt(module, self.strategy)
        if self.strategy.num_replicas_in_sync > 1:  # DDP must see into a dict subclass of outputs
            # A placement hook: it changes no math, so model.save still describes the module's layers.
            module.register_forward_hook(placement_hook(register_output_type))
        self.optimizer: Optimizer | None = None
        self.loss: Any = None
        self.jit_compile = False
        self._run_eagerly = False
        self.stop_training = False
        self.stop_evaluating = False  # Keras 3: a test / predict batch hook ends evaluate / predict
        self.stop_predicting = False
        self.history: Any = None
        self._metric_identifiers: list[Any] | dict[str, Any] = []
        self._compiled_metrics: list[Metric] = []
        self._loss_tracker = Mean(name="loss")
        self.placement: PlacementLike | None = None  # how the strategy placed the module (set when built)
        self._compile_config: dict[str, Any] | None = None
        self.loop_state = LoopState()
        self.steps_per_execution = 1  # training steps between two batch-callback calls (compile's argument)
        self._input_example: Any = None  # one example of the batch built on, for summary()'s shapes
        self._warned_untrainable = False  # once a fit: "The model does not have any trainable weights"
        self._step_params: list[nn.Parameter] | None = None  # _has_trainable_weights's list, per build
        if self.strategy.places_on_creation(module):  # sharded as Keras lays out
            self.placement = self.strategy.setup_module(module)  # variables: at creation (custom loops too)
            self._refuse_step_overrides()  # a placement whose runner runs each step (a pipeline) takes none

    # ---- compile -------------------------------------------------------------------------
    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, metrics: Any = None,
                jit_compile: bool | str = "auto", steps_per_execution: int = 1, auto_scale_loss: bool = True,
                loss_weights: Any = None, run_eagerly: bool = False) -> None:
        """Configure training: optimizer, loss and metrics (strings, meshfit or torch objects).

        A model with several outputs (a dict, a tuple, or a Hugging Face ``ModelOutput``) takes Keras's
        keyed forms: ``loss={"logits": ...}`` or a list with one loss (or None) per position,
        ``loss_weights`` (a float, or a dict / list with one weight per loss) and ``metrics`` as a dict
        ``{output name: metrics}``; see `meshfit._engine._outputs` for the names logged.

        ``jit_compile`` (Keras's name; ``"auto"``, the default, is eager) decides per device whether
        the training step runs through ``torch.compile``: ``True`` compiles on a GPU, and on a CPU runs
        eagerly with one warning saying why (compiling measured slower there; see
        `meshfit._engine._jit`). ``model.jit_compile`` then says whether the step is compiled.
        ``run_eagerly=True`` (Keras's debugging switch) runs every step as plain PyTorch: no
        ``torch.compile``, ``jit_compile`` off. ``steps_per_execution`` runs that many training steps between
        two calls of the batch callbacks and one reduction of their logs across replicas (Keras's
        argument). Under the ``"mixed_float16"`` policy, ``auto_scale_loss`` wraps the optimizer in a
        `meshfit.mixed_precision.LossScaleOptimizer` (dynamic loss scaling), as Keras does.
        """
        check_bool("run_eagerly", run_eagerly)
        if run_eagerly and check_jit_compile(jit_compile) is True:
            warnings.warn("If `run_eagerly` is True, `jit_compile` cannot also be True: disabling `jit_compile`.",
                          UserWarning, stacklevel=2)
            jit_compile = False
        jit_compile = resolve_jit_compile(check_jit_compile(jit_compile), self.strategy.device)
        if jit_compile and self._step_runner() is not None:  # placed at creation with a runner of its own
            raise ValueError("Invalid `jit_compile=True` under a pipeline: torch.compile of pipeline stages is not "
                             "supported yet. Compile with jit_compile=False (or 'auto').")
        check_bool("auto_scale_loss", auto_scale_loss)
        # Resolve everything first: a failed compile leaves the model as it was.
        steps_per_execution = positive_int("steps_per_execution", steps_per_execution)
        check_training_strategy(self, "compile")
        resolved_optimizer = serialized_optimizer = get_optimizer(optimizer)
        if (auto_scale_loss and mixed_precision.global_policy().name == "mixed_float16"
                and not isinstance(resolved_optimizer, mixed_precision.LossScaleOptimizer)):
            resolved_optimizer = mixed_precision.LossScaleOptimizer(resolved_optimizer)
        resolved_loss = _resolve_loss(loss, loss_weights)
        compiled_metrics = compile_metrics(metrics, loss, resolved_loss if isinstance(resolved_loss, CompileLoss)
                                           else None)
        self.optimizer, self.loss, self.jit_compile = resolved_optimizer, resolved_loss, jit_compile
        self._run_eagerly = run_eagerly
        self.steps_per_execution = steps_per_execution
        # the metrics as compile took them (a dict keyed by output stays one): the saved config's shape
        self._metric_identifiers = metrics if isinstance(metrics, dict) else list(metrics or [])
        self._compiled_metrics = compiled_metrics
        self._compile_config = {
            "optimizer": serialize_optimizer(serialized_optimizer), **loss_config(self.loss),
            "metrics": [m for m in self._metric_identifiers if isinstance(m, str)]
            if isinstance(metrics, (list, tuple)) else [],
        }
        if self.optimizer.built and self.placement is None:
            self.placement = self.strategy.setup_module(self.module, jit_compile=jit_compile)

    @property
    def run_eagerly(self) -> bool:
        """Keras's debugging switch: True runs each step as plain PyTorch (``jit_compile`` off).

        Set it (or pass ``compile(run_eagerly=True)``) before the first ``fit``: a module already
        compiled by ``jit_compile=True`` stays compiled.
        """
        return self._run_eagerly

    @run_eagerly.setter
    def run_eagerly(self, value: bool) -> None:
        check_bool("run_eagerly", value)
        self._run_eagerly = value
        if value:
            self.jit_compile = False

    @property
    def compiled(self) -> bool:
        return self.optimizer is not None

    def saveable_parts(self) -> dict[str, Any]:
        """The model's own parts of a backup: the module's weights and the optimizer's state."""
        parts: dict[str, Any] = {"module": self.module}
        if self.optimizer is None or self.optimizer.built:  # built: not a module without parameters
            parts["optimizer"] = self.optimizer
        # A state held in parts (pipeline stages): completed from its holders, as one process's.
        return resident_parts(parts, self.module, self.residency, self.strategy.world)

    def _require_compiled(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"You must call model.compile(optimizer, loss, metrics) before model.{what}().")
        if self.loss is None and type(self).train_step is Model.train_step and what in ("fit", "train_on_batch"):
            raise ValueError("Invalid `loss`: compile() was called without a loss; pass loss=... to compile().")

    # ---- building --------------------------------------------------------------------------
    def build(self, sample_x: Any) -> None:
        """Materialise lazy modules with one forward pass, place the module, then build the optimizer.

        ``strategy.setup_module`` runs before the optimizer is built: a layout replaces parameters.
        ``sample_x`` is an input batch as the data yields it (placed here by the strategy).
        """
        self._step_params = None  # the module's parameters may have changed (a layout, a new submodule)
        if self._input_example is None:
            self._input_example = _summary.example_of(sample_x)
        if self.placement is None:
            self.module.to(self.strategy.device)
            if any(isinstance(p, nn.parameter.UninitializedParameter) for p in self.module.parameters()):
                was_training = self.module.training
                with torch.no_grad():
                    self.module.eval()
                    self.module(self.strategy.distribute_batch(sample_x))
                self.module.train(was_training)
            self.placement = self.strategy.setup_module(self.module, jit_compile=self.jit_compile)
            self._refuse_step_overrides()  # a placement whose runner runs each step (a pipeline) takes none
        self._metrics_follow_placement()  # compiled after the placement too: every build
        if self.optimizer is not None and not self.optimizer.built:  # also: compiled again after fit
            params = list(self.module.named_parameters())  # names: exclude_from_weight_decay
            if params:  # nothing to optimise: no optimizer (train_step skips the update)
                self.optimizer.build(params)

    def finish_training(self) -> None:
        """Keras's fit: the optimizer's moving averages (``use_ema``) replace the weights before
        ``on_train_end``."""
        if self.optimizer is not None:
            self.optimizer.finalize_variable_values()

    # ---- fit / evaluate / predict ---------------------------------------------------------
    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: str | int = "auto", callbacks: list[Any] | None = None, validation_split: float = 0.0,
            validation_data: Any = None, shuffle: bool | str = True, class_weight: dict[int, float] | None = None,
            sample_weight: Any = None, initial_epoch: int = 0, steps_per_epoch: int | None = None,
            validation_steps: int | None = None, validation_batch_size: int | None = None,
            validation_freq: int | list[int] = 1) -> Any:
        """Train for ``epochs`` epochs; returns a `History`. Arguments as in Keras's ``Model.fit``.

        ``validation_split`` holds out the last fraction of array inputs (before shuffling);
        ``class_weight`` multiplies each training example's weight by its class's; ``shuffle="batch"``
        shuffles whole batches; ``validation_freq`` is an int or a list of 1-based epochs.
        """
        self._require_compiled("fit")
        check_training_strategy(self, "fit")
        check_loss_reduction(self.loss, self.strategy.num_replicas_in_sync)
        self._warned_untrainable = False
        non_negative_int("epochs", epochs)
        non_negative_int("initial_epoch", initial_epoch)
        shuffle = check_shuffle(shuffle)
        epochs_to_validate = check_validation_freq(validation_freq)
        class_weights = check_class_weight(class_weight, sample_weight)
        requested_verbose, verbose = verbose, resolve_verbose(verbose, self.strategy.is_chief)
        announce_quiet_worker(self.strategy, requested_verbose)
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = split_validation(x, y, sample_weight, validation_split,
                                                                      is_array_like)
        validation = validation_parts(validation_data)

        def validate(epoch: int) -> dict[str, float]:
            if validation is None or not validates_after(epoch, epochs_to_validate):
                return {}
            val_x, val_y, val_w = validation
            # fit's callbacks get the test hooks, as Keras passes them to its internal evaluate.
            logs = self.evaluate(val_x, val_y, sample_weight=val_w, batch_size=validation_batch_size or batch_size,
                                 verbose=0, steps=validation_steps, callbacks=cbs, return_dict=True)
            return {f"val_{k}": v for k, v in logs.items()}

        with self.strategy.guard(), flush_denormals():
            data: DataHandler | ClassWeightedData = DataHandler(
                x, y, sample_weight, batch_size, steps_per_epoch, shuffle, self.strategy,
                unbounded_ok=bool(callbacks))  # a callback may stop an endless epoch
            if class_weights is not None:
                data = ClassWeightedData(data, class_weights)
            try:
                self.build(unpack_batch(data.peek())[0])
                cbs = CallbackList(callbacks, add_history=True, add_progbar=verbose != 0, model=self,
                                   verbose=verbose, epochs=epochs, steps=data.steps)
                # Settings that must match on every worker fail here at once, naming each worker's
                # value, instead of as a hang or a raw collective error several steps later.
                agree_on_settings(self.strategy, {
                    "steps_per_epoch": data.steps, "epochs": epochs, "initial_epoch": initial_epoch,
                    **checkpoint_settings(cbs),
                    "communication_options": _communication_options(self.strategy)}, "fit")
                loop = TrainingLoop(self, data, cbs, counters=self.loop_state)
                loop.run(epochs=epochs, initial_epoch=initial_epoch, validate=validate)
            finally:
                data.close()
        self.history = cbs.history
        return cbs.history

    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None, verbose: str | int = "auto",
                 sample_weight: Any = None, steps: int | None = None, callbacks: Iterable[Any] | None = None,
                 return_dict: bool = False) -> Any:
        """Loss and metrics over the data (a list, or a dict), on this worker alone when the model is replicated."""
        self._require_compiled("evaluate")
        verbose = resolve_verbose(verbose, self.strategy.is_chief)  # a bad value fails before any data is read
        with self.strategy.guard(), flush_denormals(), \
                where_to_run(self, "evaluate", x, inside_fit=isinstance(callbacks, CallbackList)):
            data = DataHandler(x, y, sample_weight, batch_size, steps, False, self.strategy, argument="steps")
            try:
                cbs = self._inference_callbacks(data, verbose, callbacks)
                logs = run_evaluation(self, data, cbs)
            finally:
                data.close()
        if return_dict:
            return logs
        # Keras's order: the metrics' names, then any other logged name (an override's), sorted
        names = [name for name in self.metrics_names if name in logs]
        values = [logs[name] for name in names] + [logs[key] for key in sorted(logs) if key not in names]
        return values[0] if len(values) == 1 else values

    def predict(self, x: Any, batch_size: int | None = None, verbose: str | int = "auto",
                steps: int | None = None, callbacks: list[Any] | None = None) -> Any:
        """The module's outputs for all of ``x``, in input order (numpy); see `where_to_run`."""
        verbose = resolve_verbose(verbose, self.strategy.is_chief)
        with self.strategy.guard(), flush_denormals(), where_to_run(self, "predict", x, inside_fit=False):
            data = DataHandler(x, None, None, batch_size, steps, False, self.strategy, argument="steps")
            try:
                return run_prediction(self, data, self._inference_callbacks(data, verbose, callbacks))
            finally:
                data.close()

    def _inference_callbacks(self, data: DataHandler, verbose: int, callbacks: Any) -> CallbackList:
        """Build the model from the first batch; the callbacks of one evaluate/predict pass."""
        self.build(unpack_batch(data.peek())[0])
        if isinstance(callbacks, CallbackList):  # fit's own list, for its validation
            return callbacks
        return CallbackList(callbacks, add_progbar=verbose != 0, model=self, verbose=verbose, epochs=1,
                            steps=data.steps)

    def __call__(self, *args: Any, training: bool | None = None, **kwargs: Any) -> Any:
        """Run the module; ``training=True``/``False`` runs it in train/eval mode for this call (Keras's flag).

        Numpy arrays among the arguments become tensors on the module's device, floating ones in its
        dtype, as Keras converts a layer's inputs.
        """
        args, kwargs = convert_call_inputs(self.module, self.strategy, args, kwargs)
        sample = build_sample(self.module, args) if self.placement is None else None
        if sample is not None:  # Keras builds a model at its first call: placed as fit would place it
            self.build(sample)
        if training is None:
            return self._forward(*args, **kwargs)
        modes = {module: module.training for module in self.module.modules()}
        self.module.train(bool(training))
        try:
            return self._forward(*args, **kwargs)
        finally:
            for module, mode in modes.items():
                module.training = mode

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        # Inside fit's step (grad on, train mode) go through the strategy's wrapper (DDP), so that a
        # Keras-style ``train_step`` override calling ``self(x)`` all-reduces its gradients. Outside
        # it (a custom loop) the module runs as it is and the optimizer sums the gradients across
        # replicas, TF's contract, also for gradients taken with torch.autograd.grad.
        placement = self.placement
        if placement is not None and placement.step is not None:
            raise ValueError(f"Invalid call of {self.name!r} under a pipeline: each process holds its own stages' "
                             "weights only, so calling the model here would run the other stages on copies never "
                             "trained. Call model.predict(x) or model.evaluate(x, y) (on every worker) instead.")
        if placement is not None and placement.in_step() and self.module.training and torch.is_grad_enabled():
            return placement.module(*args, **kwargs)
        return self.module(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<meshfit.Model {self.name!r} on {self.strategy!r}>"


def _resolve_loss(loss: Any, loss_weights: Any) -> Any:
    """compile's ``loss``: one `Loss`, or a `CompileLoss` for losses keyed by output or ``loss_weights``."""
    keyed = isinstance(loss, (list, tuple)) or (isinstance(loss, dict) and not is_serialized_loss(loss))
    if loss is None:
        if loss_weights is not None:
            raise ValueError(f"Invalid `loss_weights`: received loss_weights={loss_weights!r} without a loss. "
                             "Pass loss=... too, or drop loss_weights.")
        return None
    return CompileLoss(loss, loss_weights) if keyed or loss_weights is not None else get_loss(loss)


def _communication_options(strategy: DistributionStrategy) -> str:
    """The options a collective strategy's processes formed with, as every worker must agree on them."""
    return repr(strategy.communication_options if isinstance(strategy, CollectiveStrategy) else None)
