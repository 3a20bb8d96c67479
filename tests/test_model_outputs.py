"""Hugging Face model outputs with Keras's losses keyed by output name: ``mf.Model(hf_model)`` +
``compile(loss={"logits": ...})``, no ``train_step`` override, for fit, evaluate and predict.

``transformers`` is not a test dependency: with its own dependencies it installs about 190 MB (129 MB
itself) and importing ``GPT2LMHeadModel`` took 13 s on the project's 2-core machine. The outputs are
built here as transformers builds them: ``ModelOutput`` is an ``OrderedDict`` subclass whose ``None``
fields are absent, read by key or attribute, with ``past_key_values`` a cache object that holds no
tensor structure of its own. One test runs the real ``GPT2LMHeadModel`` where transformers is installed.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshfit as mf
from tests._multiproc import run_distributed

VOCAB, SEQ = 11, 6


class ModelOutput(OrderedDict):
    """transformers.utils.ModelOutput's contract: a dict of the fields that are not None, with
    attribute access and ``to_tuple()``."""

    def __init__(self, **fields) -> None:
        super().__init__((k, v) for k, v in fields.items() if v is not None)

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_tuple(self):
        return tuple(self.values())


class CausalLMOutputWithPast(ModelOutput):
    pass


class FrozenOutput(Mapping):
    """A read-only mapping of outputs that is not a dict (a user's own output type)."""

    def __init__(self, **fields) -> None:
        self._fields = {k: v for k, v in fields.items() if v is not None}

    def __getitem__(self, name):
        return self._fields[name]

    def __iter__(self):
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


class DynamicCache:
    """transformers' cache: an object with tensors inside, not a tensor, dict or tuple."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.layers = [hidden.detach()]


class TinyCausalLM(nn.Module):
    """A causal LM head over an embedding, returning what ``GPT2LMHeadModel`` returns (``return_dict``)."""

    def __init__(self, return_dict: bool = True, output_type: type = CausalLMOutputWithPast) -> None:
        super().__init__()
        self.return_dict, self.output_type = return_dict, output_type
        self.embed = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, VOCAB)

    def forward(self, input_ids):
        hidden = torch.tanh(self.mix(self.embed(input_ids)))
        logits = self.lm_head(hidden)
        if not self.return_dict:
            return logits, DynamicCache(hidden)
        return self.output_type(loss=None, logits=logits, past_key_values=DynamicCache(hidden),
                                hidden_states=None, attentions=None)


def causal_lm_loss(labels, logits):
    """The loss transformers computes from ``labels``: each position predicts the next token."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def _ids(n: int = 32) -> np.ndarray:
    return np.random.RandomState(0).randint(0, VOCAB, (n, SEQ)).astype("int64")


def _plain_torch_loop(module: nn.Module, ids: np.ndarray, batch_size: int, epochs: int, lr: float) -> list[float]:
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for start in range(0, len(ids), batch_size):
            batch = torch.from_numpy(ids[start:start + batch_size])
            optimizer.zero_grad()
            loss = causal_lm_loss(batch, module(batch).logits)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        losses.append(total / len(ids))
    return losses


def test_model_output_trains_with_a_loss_keyed_logits_equal_to_a_plain_torch_loop():
    """fit on a ``CausalLMOutputWithPast`` with ``loss={"logits": ...}``: the same weights and per-epoch
    losses as a hand-written torch loop over the same batches; evaluate and predict read the outputs."""
    torch.manual_seed(0)
    module = TinyCausalLM()
    reference = copy.deepcopy(module)
    ids = _ids()
    model = mf.Model(module)
    model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.5), loss={"logits": causal_lm_loss})
    history = model.fit(ids, ids, batch_size=8, epochs=3, shuffle=False, verbose=0)
    expected = _plain_torch_loop(reference, ids, batch_size=8, epochs=3, lr=0.5)
    np.testing.assert_allclose(history.history["loss"], expected, rtol=1e-5)
    assert history.history["loss"][-1] < history.history["loss"][0]
    for name, tensor in module.state_dict().items():
        torch.testing.assert_close(tensor, reference.state_dict()[name], rtol=1e-5, atol=1e-6)
    # one loss: no per-output loss in the logs (Keras 3 adds <output>_loss with several losses)
    assert set(history.history) == {"loss"}

    logs = model.evaluate(ids, ids, return_dict=True, verbose=0)
    with torch.no_grad():
        want = causal_lm_loss(torch.from_numpy(ids), reference(torch.from_numpy(ids)).logits)
    assert logs["loss"] == pytest.approx(float(want), rel=1e-5)
    outputs = model.predict(ids, batch_size=8, verbose=0)
    assert isinstance(outputs, dict) and list(outputs) == ["logits"]  # the cache holds no tensor structure
    assert outputs["logits"].shape == (32, SEQ, VOCAB)
    np.testing.assert_allclose(outputs["logits"], reference(torch.from_numpy(ids)).logits.detach().numpy(),
                               rtol=1e-5, atol=1e-6)
    step = model.train_on_batch(ids[:8], ids[:8], return_dict=True)
    assert step["loss"] > 0
    assert model.predict_on_batch(ids[:4])["logits"].shape == (4, SEQ, VOCAB)


def test_model_output_with_two_keyed_losses_and_metrics():
    """Two outputs of a ModelOutput, each with a loss, weights and a metric: Keras's names in the logs."""
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            hidden = self.body(x)
            return ModelOutput(logits=self.head(hidden), hidden_states=hidden, attentions=None)

    torch.manual_seed(0)
    x = np.random.RandomState(1).randn(16, 4).astype("float32")
    y = {"logits": np.random.RandomState(2).randint(0, 3, 16), "hidden_states": np.zeros((16, 4), "float32")}
    model = mf.Model(TwoHeads())
    model.compile(optimizer="sgd", loss={"logits": mf.losses.SparseCategoricalCrossentropy(from_logits=True),
                                         "hidden_states": "mse"},
                  loss_weights={"logits": 1.0, "hidden_states": 0.5}, metrics={"logits": ["accuracy"]})
    logs = model.evaluate(x, y, return_dict=True, verbose=0)
    assert set(logs) == {"loss", "logits_loss", "hidden_states_loss", "logits_accuracy"}
    assert logs["loss"] == pytest.approx(logs["logits_loss"] + 0.5 * logs["hidden_states_loss"], rel=1e-5)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    assert set(history) == {"loss", "logits_loss", "hidden_states_loss", "logits_accuracy"}


def test_tuple_outputs_take_a_list_of_losses():
    """``return_dict=False``: a tuple ``(logits, cache)`` takes ``loss=[lm_loss, None]``, as Keras's
    partial list of losses; the result equals the ModelOutput model's."""
    ids = _ids(16)
    results = []
    for return_dict, loss in ((True, {"logits": causal_lm_loss}), (False, [causal_lm_loss, None])):
        torch.manual_seed(0)
        model = mf.Model(TinyCausalLM(return_dict=return_dict))
        model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.5), loss=loss)
        results.append(model.fit(ids, ids, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"])
    np.testing.assert_allclose(results[1], results[0], rtol=1e-6)
    outputs = model.predict(ids, verbose=0)
    assert isinstance(outputs, tuple) and outputs[0].shape == (16, SEQ, VOCAB) and outputs[1] is None


def test_a_single_loss_on_a_model_output_says_which_names_to_key():
    """What used to be a raw ``AttributeError: ... has no attribute 'device'`` from the loss: a clear
    error naming the outputs and the keyed form; a dict naming a missing output lists the available ones."""
    ids = _ids(8)
    model = mf.Model(TinyCausalLM())
    model.compile(optimizer="sgd", loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=r"one loss for a model that returns a CausalLMOutputWithPast with "
                                         r"outputs \['logits', 'past_key_values'\].*loss=\{'logits': \.\.\.\}"):
        model.fit(ids, ids, verbose=0)
    model.compile(optimizer="sgd", loss={"logit": causal_lm_loss})
    with pytest.raises(ValueError, match=r"names output 'logit', which the model does not produce.*"
                                         r"\['logits', 'past_key_values'\]"):
        model.evaluate(ids, ids, verbose=0)


def _fit_causal_lm(kind: str) -> dict:
    """fit, evaluate and train_on_batch of the ModelOutput model with ``loss={"logits": ...}``."""
    ids = _ids(32)
    output_type = FrozenOutput if kind.endswith("mapping") else CausalLMOutputWithPast
    if kind.startswith("mirrored"):
        scope = mf.MultiWorkerMirroredStrategy().scope()
    elif kind == "fully_sharded":
        scope = mf.dtensor.LayoutMap.fully_sharded(mf.dtensor.create_mesh([("batch", 2)])).scope()
    else:
        scope = contextlib.nullcontext()
    with scope:
        torch.manual_seed(0)  # after the strategy is made: the same initial weights as one process
        model = mf.Model(TinyCausalLM(output_type=output_type))
        model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.5), loss={"logits": causal_lm_loss})
    history = model.fit(ids, ids, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    step = model.train_on_batch(ids[:8], ids[:8], return_dict=True)
    logs = model.evaluate(ids, ids, return_dict=True, verbose=0)
    return {"history": history, "step": step, "logs": logs,
            "weights": [np.asarray(w).tolist() for w in model.get_weights()]}


def _worker(rank: int, world: int, kind: str) -> dict:
    return _fit_causal_lm(kind)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["mirrored", "fully_sharded", "mirrored-mapping"])
def test_model_output_on_two_workers_equals_one_process(kind):
    """The keyed loss on a ModelOutput under MultiWorkerMirroredStrategy and fully sharded over 2
    processes: each global batch split in two, the same losses and weights as one process. The local
    ModelOutput does not register itself with torch's pytree (transformers' does): meshfit does, or
    DDP's first, static-graph step would leave its gradients unreduced (losses off by ~1e-3); so does a
    read-only Mapping output that is not a dict (weights were 0.056 off)."""
    single = _fit_causal_lm("single-mapping" if kind.endswith("mapping") else "single")
    for result in run_distributed(_worker, world_size=2, args=(kind,), timeout=300):
        np.testing.assert_allclose(result["history"]["loss"], single["history"]["loss"], rtol=1e-5)
        assert result["step"]["loss"] == pytest.approx(single["step"]["loss"], rel=1e-5)
        assert result["logs"]["loss"] == pytest.approx(single["logs"]["loss"], rel=1e-5)
        for got, want in zip(result["weights"], single["weights"], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(600)
def test_real_gpt2_lm_head_model_when_transformers_is_installed():
    """transformers' own ``GPT2LMHeadModel`` from a tiny ``GPT2Config`` (no downloads): ``mf.Model(hf_model)``
    + ``compile(loss={"logits": ...})`` equals a plain torch loop (skipped where transformers is absent)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf_model = transformers.GPT2LMHeadModel(config)
    reference = copy.deepcopy(hf_model)
    ids = _ids(16)
    model = mf.Model(hf_model)
    model.compile(optimizer=mf.optimizers.SGD(learning_rate=0.5), loss={"logits": causal_lm_loss})
    history = model.fit(ids, ids, batch_size=8, epochs=2, shuffle=False, verbose=0)
    expected = _plain_torch_loop(reference, ids, batch_size=8, epochs=2, lr=0.5)
    np.testing.assert_allclose(history.history["loss"], expected, rtol=1e-4)
    assert model.predict(ids, verbose=0)["logits"].shape == (16, SEQ, VOCAB)


# ---- the (batch 2, model 2) mesh: GPT-, Llama- and ResNet-shaped outputs ------------------------------
class ImageClassifierOutputWithNoAttention(ModelOutput):
    pass


def _gpt_like():
    """tests/dtensor/_two_d_model.py's transformer LM returning what ``GPT2LMHeadModel`` returns: logits and
    a cache object (no tensor structure), its hidden states and attentions None."""
    from tests.dtensor import _two_d_model as lm

    class GPTLike(lm.TransformerLM):
        def forward(self, tokens):
            logits = super().forward(tokens)
            return CausalLMOutputWithPast(loss=None, logits=logits, past_key_values=DynamicCache(logits),
                                          hidden_states=None, attentions=None)

    torch.manual_seed(0)
    return GPTLike()


def _llama_like():
    """The same LM returning what ``LlamaForCausalLM(use_cache=False, output_hidden_states=True)`` returns:
    logits, ``past_key_values`` None (absent) and a tuple of hidden states that no loss reads."""
    from tests.dtensor import _two_d_model as lm

    class LlamaLike(lm.TransformerLM):
        def forward(self, tokens):
            x = self.embed(tokens) + self.pos[: tokens.shape[1]]
            hidden = [x]
            for layer in self.layers:
                x = layer(x)
                hidden.append(x)
            return CausalLMOutputWithPast(loss=None, logits=self.head(self.norm(x)), past_key_values=None,
                                          hidden_states=tuple(hidden), attentions=None)

    torch.manual_seed(0)
    return LlamaLike()


class _ResNetLike(nn.Module):
    """An image classifier returning ``ImageClassifierOutputWithNoAttention(logits=...)`` alone: a stem, one
    residual block (GroupNorm: a BatchNorm's per-replica statistics would differ from one process's) and
    a pooled linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                                   nn.Conv2d(8, 8, 3, padding=1))
        self.classifier = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))

    def forward(self, pixel_values):
        x = torch.relu(self.stem(pixel_values))
        x = torch.relu(x + self.block(x))
        return ImageClassifierOutputWithNoAttention(loss=None, logits=self.classifier(x), hidden_states=None)


def _resnet_like():
    torch.manual_seed(0)
    return _ResNetLike()


def _fit_shapes(rank, world, shape):
    """Each model with ``loss={"logits": ...}`` (no override) on ``shape`` (None: one plain process):
    4 full batches of 8 and one of 5 (3 and 2 on the mesh's two replicas)."""
    from tests.dtensor import _two_d_model as lm

    mesh = None if shape is None else mf.dtensor.create_mesh(
        [("batch", shape[0]), ("model", shape[1])],
        communication_options=mf.CommunicationOptions(heartbeat_timeout_seconds=60))
    tokens, labels = lm.data(lm.BATCH * 4 + 5)
    images = np.random.RandomState(3).randn(lm.BATCH * 4 + 5, 1, 6, 6).astype("float32")
    classes = np.random.RandomState(4).randint(0, 5, lm.BATCH * 4 + 5)
    out = {}
    for name, build, x, y in (("gpt", _gpt_like, tokens, labels), ("llama", _llama_like, tokens, labels),
                              ("resnet", _resnet_like, images, classes)):
        if mesh is None:
            scope = mf.get_strategy().scope()
        else:  # the image classifier has no attention or MLP weight to key on `model`
            scope = (mf.dtensor.LayoutMap.fully_sharded(mesh) if name == "resnet" else lm.two_d_map(mf, mesh)).scope()
        with scope:
            model = mf.Model(build())
            model.compile(optimizer=mf.optimizers.SGD(0.1),
                          loss={"logits": mf.losses.SparseCategoricalCrossentropy(from_logits=True)},
                          metrics={"logits": ["accuracy"]})
        history = model.fit(x, y, batch_size=lm.BATCH, epochs=1, shuffle=False, verbose=0).history
        logs = model.evaluate(x, y, batch_size=lm.BATCH, return_dict=True, verbose=0)
        predicted = model.predict(x[:13], batch_size=lm.BATCH, verbose=0)
        first = next(iter(model.module.parameters())) if name == "resnet" else model.module.layers[0].attn.qkv.weight
        local = tuple(first.to_local().shape) if hasattr(first, "to_local") else tuple(first.shape)
        out[name] = {"history": history, "logs": logs, "weights": model.get_weights(), "local": local,
                     "predicted": {k: v for k, v in predicted.items() if k == "logits"},
                     "predicted_keys": sorted(predicted)}
    return out


@pytest.mark.crowded
@pytest.mark.timeout(900)
def test_gpt_llama_and_resnet_shaped_outputs_on_a_two_by_two_mesh_equal_one_process():
    """The (batch 2, model 2) mesh of tests/dtensor/_two_d_model.py (attention and MLP weights split over
    ``model``, every weight fully sharded over ``batch``; the image classifier, with no such weight, fully
    sharded over ``batch`` alone): the three output shapes, trained with the keyed loss and metric alone,
    give one process's losses, metrics, predictions and weights (SGD, rtol 1e-5)."""
    from tests.dtensor import _two_d_model as lm

    single = _fit_shapes(0, 1, None)
    assert single["gpt"]["predicted_keys"] == ["logits"]  # the cache holds no tensor structure
    assert single["llama"]["predicted_keys"] == ["hidden_states", "logits"]
    assert single["resnet"]["predicted_keys"] == ["logits"]
    for result in run_distributed(_fit_shapes, world_size=4, args=((2, 2),), timeout=600):
        for name, want in single.items():
            got = result[name]
            # qkv (48, 16): a quarter of its rows here (model, then batch); the stem (8, 1, 3, 3): half
            assert got["local"] == ((12, 16) if name != "resnet" else (4, 1, 3, 3)), (name, got["local"])
            assert set(got["history"]) == {"loss", "logits_accuracy"}, name
            np.testing.assert_allclose(got["history"]["loss"], want["history"]["loss"], rtol=1e-5, err_msg=name)
            assert got["history"]["logits_accuracy"] == pytest.approx(want["history"]["logits_accuracy"]), name
            assert got["logs"] == pytest.approx(want["logs"], rel=1e-5), name
            assert got["predicted_keys"] == want["predicted_keys"], name
            np.testing.assert_allclose(got["predicted"]["logits"], want["predicted"]["logits"], rtol=1e-4,
                                       atol=1e-5, err_msg=name)
            if name == "resnet":  # no weight keyed on `model`: every one fully sharded over `batch`
                for a, b in zip(got["weights"], want["weights"], strict=True):
                    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
            else:
                lm.assert_weights_match(got["weights"], want["weights"], "sgd")
