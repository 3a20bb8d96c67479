"""A tied weight (``output.weight = tok_embeddings.weight``) stays one parameter through placement, on
every layout, or is refused by name when the model is created.

The model is torch's tied transformer: ``Transformer`` of
torch/testing/_internal/distributed/_tensor/common_dtensor.py (``ModelArgs(weight_tying=True)``), which
``test_transformer_training`` in test/distributed/tensor/parallel/test_tp_examples.py trains under
tensor parallelism with ``tok_embeddings`` row-wise and ``output`` column-wise over the vocabulary
(both weights split by rows: one placement) and ``output.weight = tok_embeddings.weight`` after
``parallelize_module``; ``test_weight_tying`` there asserts the tied weight and its gradient stay one
object. Here the same model keys both paths on ``model`` in a ``(batch, model)`` fully sharded map, on
4 gloo processes, and must train as one plain process does (fp32, rtol 1e-5) with the tie intact.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _two_d_model import BATCH, D_MODEL, HEADS, SEQ, VOCAB, Block, data
from torch import nn

from tests._multiproc import run_distributed

# 4 gloo processes a run, several runs a test, on a shared 2-core machine
pytestmark = [pytest.mark.timeout(1200), pytest.mark.crowded]

STEPS = 6
EXAMPLES = BATCH * (STEPS - 1) + 5  # an uneven last batch
BLOCKS = ["layers.0", "layers.1"]  # keeps the tie's two holders in the root unit (default blocks refuse it)


class TiedTransformer(nn.Module):
    """torch's test ``Transformer`` with ``weight_tying``: token and position embeddings, blocks, norm, a
    head without bias whose weight is the token embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D_MODEL)
        self.pos_embeddings = nn.Embedding(SEQ, D_MODEL)
        self.layers = nn.ModuleList(Block(D_MODEL, HEADS) for _ in range(2))
        self.norm = nn.LayerNorm(D_MODEL)
        self.output = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


class TiedPair(nn.Module):
    """torch's ``test_weight_tying`` module (test_tp_examples.py): an embedding, then a linear layer back to
    the vocabulary whose weight is the embedding's (``fc.weight = embedding.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, D_MODEL)
        self.fc = nn.Linear(D_MODEL, VOCAB)
        self.fc.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.embedding(tokens)))


class TiedRaw(nn.Module):
    """A tie tensor parallelism cannot split: the embedding's weight also held by the root and used
    through ``F.linear`` (no module style knows that use)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, D_MODEL)
        self.unembed = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.embedding(tokens), self.unembed)


def _keys(mf, layout_map, mesh, keys):
    U = mf.dtensor.UNSHARDED
    for key, specs in keys:
        layout_map[key] = mf.dtensor.Layout([U if s == "U" else s for s in specs], mesh)
    return layout_map


def _map(mf, kind, keys, world):
    """``kind``: None (one plain process), "two_d" (fully sharded over batch, keys over model),
    "fully_sharded" (1-D, batch only; "fully_sharded_one_unit": blocks=[]), "plain" (a plain LayoutMap on
    (2, 2))."""
    if kind is None:
        return None
    options = mf.CommunicationOptions(heartbeat_timeout_seconds=60)  # 4 processes on 2 shared cores
    if kind.startswith("fully_sharded"):
        mesh = mf.dtensor.create_mesh([("batch", world)], communication_options=options)
        return mf.dtensor.LayoutMap.fully_sharded(mesh, blocks=[] if kind.endswith("one_unit") else BLOCKS)
    mesh = mf.dtensor.create_mesh([("batch", 2), ("model", 2)], communication_options=options)
    if kind == "plain":
        return _keys(mf, mf.dtensor.LayoutMap(mesh), mesh, keys)
    layout_map = mf.dtensor.LayoutMap.fully_sharded(mesh, blocks=BLOCKS)
    guide = [(r"attn\.qkv\.weight", ["model", "U"]), (r"attn\.out\.weight", ["U", "model"]),
             (r"mlp\.fc1\.weight", ["model", "U"]), (r"mlp\.fc2\.weight", ["U", "model"])]
    return _keys(mf, layout_map, mesh, guide + list(keys))


def _fit(rank, world, kind, keys=(), model="transformer", meta=False, backup=None, epochs=1):
    from torch.distributed.tensor import DTensor

    import meshfit as mf

    layout_map = _map(mf, kind, keys, world)
    build = TiedTransformer if model == "transformer" else TiedPair
    with layout_map.scope() if layout_map is not None else mf.get_strategy().scope():
        torch.manual_seed(0)
        if meta:
            with torch.device("meta"):
                module = build()
        else:
            module = build()
        fitted = mf.Model(module)
        fitted.compile(optimizer=mf.optimizers.SGD(0.1),
                       loss=mf.losses.SparseCategoricalCrossentropy(from_logits=True))
    embedding, head = (module.tok_embeddings, module.output) if model == "transformer" else (module.embedding,
                                                                                            module.fc)
    tied = [head.weight is embedding.weight]
    weight = embedding.weight
    local = tuple(weight.to_local().shape) if isinstance(weight, DTensor) else tuple(weight.shape)
    x, y = data(EXAMPLES)
    ran: list[int] = []  # the steps this run trained (a resumed run skips the backup's)
    callbacks = [mf.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: ran.append(batch))]
    if backup:
        callbacks.append(mf.callbacks.BackupAndRestore(backup, delete_checkpoint=False))
    history = fitted.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    tied.append(head.weight is embedding.weight)
    names = [name for name, _ in module.named_parameters()]
    return tied, history.history["loss"], fitted.get_weights(), local, names, len(ran)


@pytest.fixture(scope="module")
def plain():
    return {model: run_distributed(_fit, world_size=1, args=(None, (), model), timeout=300)[0]
            for model in ("transformer", "pair")}


def _assert_equal_to_plain(results, want):
    for tied, losses, weights, _, names, _ in results:
        assert tied == [True, True], tied  # after placement, after fit
        assert names == want[4]  # one parameter: named once, as on one process
        np.testing.assert_allclose(losses, want[1], rtol=1e-5)
        for got, expected in zip(weights, want[2], strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


EMBEDDING, OUTPUT = r"tok_embeddings\.weight", r"output\.weight"


@pytest.mark.parametrize("keys", [
    [(EMBEDDING, ["model", "U"]), (OUTPUT, ["model", "U"])],  # torch's plan: both split by vocabulary rows
    [(r"(tok_embeddings|output)\.weight", ["model", "U"])],  # one key for both paths
    [(EMBEDDING, ["model", "U"])],  # the embedding alone keyed: the head follows
    [(OUTPUT, ["model", "U"])],  # the head alone keyed: the embedding follows
], ids=["both", "one-key", "embedding", "head"])
def test_tied_transformer_on_two_by_two_trains_as_one_process(keys, plain):
    results = run_distributed(_fit, world_size=4, args=("two_d", keys), timeout=400)
    _assert_equal_to_plain(results, plain["transformer"])
    for *_, local, _, _ in results:
        assert local == (VOCAB // 4, D_MODEL)  # vocabulary rows over model (2), then over batch (2)


def test_tied_transformer_backup_on_two_by_two_resumes_bitwise(tmp_path):
    """torch's test_train_parity_2d_transformer_checkpoint_resume (test/distributed/_composable/fsdp/
    test_fully_shard_training.py) in meshfit's terms: a backup of the tied 2-D model, taken after one
    epoch, resumes in a new group to the weights of an uninterrupted two-epoch run, the tie intact."""
    keys = [(EMBEDDING, ["model", "U"]), (OUTPUT, ["model", "U"])]
    straight = run_distributed(_fit, world_size=4, args=("two_d", keys, "transformer", False, None, 2), timeout=400)
    backup = str(tmp_path / "backup")
    run_distributed(_fit, world_size=4, args=("two_d", keys, "transformer", False, backup, 1), timeout=400)
    resumed = run_distributed(_fit, world_size=4, args=("two_d", keys, "transformer", False, backup, 2), timeout=400)
    for (tied, losses, weights, *_, ran), (_, want_losses, want, *_) in zip(resumed, straight, strict=True):
        assert tied == [True, True], tied
        assert ran == STEPS  # the second epoch only: the first came from the backup
        np.testing.assert_array_equal(losses[1], want_losses[1])
        for got, expected in zip(weights, want, strict=True):
            np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("meta", [False, True], ids=["eager", "meta"])
def test_tied_transformer_fully_sharded_keeps_the_tie(meta, plain):
    # meta: one unit, so that modules are initialised in __init__'s order; the tie gets the embedding's
    # values, as the eager build's tie does (the head's own initial values are dropped)
    kind = "fully_sharded_one_unit" if meta else "fully_sharded"
    results = run_distributed(_fit, world_size=2, args=(kind, (), "transformer", meta), timeout=400)
    _assert_equal_to_plain(results, plain["transformer"])
    for *_, local, _, _ in results:
        assert local == (VOCAB // 2, D_MODEL)


@pytest.mark.parametrize("keys", [
    [(r"embedding\.weight", ["model", "U"]), (r"fc\.weight", ["model", "U"])],
    [(r"fc\.weight", ["model", "U"])],  # the second path alone keyed: the tie takes its layout
], ids=["both", "second"])
def test_tied_pair_on_a_plain_layout_map_keeps_one_laid_out_parameter(keys, plain):
    results = run_distributed(_fit, world_size=4, args=("plain", keys, "pair"), timeout=400)
    _assert_equal_to_plain(results, plain["pair"])
    for *_, local, _, _ in results:
        assert local == (VOCAB // 2, D_MODEL)  # split over model, replicated over batch


def _refused(rank, world):
    import meshfit as mf

    out = {}
    for name, kind, model in (("two_d", "two_d", TiedTransformer), ("plain", "plain", TiedPair),
                              ("default blocks", "default blocks", TiedTransformer)):
        first, second = (EMBEDDING, OUTPUT) if model is TiedTransformer else (r"embedding\.weight", r"fc\.weight")
        keys = [(first, ["model", "U"]), (second, ["U", "model"])]
        if kind == "default blocks":
            mesh = mf.dtensor.create_mesh([("batch", 2), ("model", 2)])
            layout_map = _keys(mf, mf.dtensor.LayoutMap.fully_sharded(mesh), mesh, keys[:1])
        else:
            layout_map = _map(mf, kind, keys, world)
        try:
            with layout_map.scope():
                torch.manual_seed(0)
                built = mf.Model(model())  # held: a plain map lays out at the end of the block
        except ValueError as error:
            out[name] = str(error)
        else:
            out[name] = None
            del built
    mesh = mf.dtensor.create_mesh([("batch", 2), ("model", 2)])
    layout_map = _keys(mf, mf.dtensor.LayoutMap.fully_sharded(mesh, blocks=[]), mesh,
                       [(r"embedding\.weight", ["model", "U"])])
    try:
        with layout_map.scope():
            mf.Model(TiedRaw())
    except ValueError as error:
        out["raw"] = str(error)
    else:
        out["raw"] = None
    return out


def test_different_layouts_for_one_tied_weight_are_refused_by_name():
    for out in run_distributed(_refused, world_size=4, timeout=400):
        for name in ("two_d", "plain"):
            message = out[name]
            assert message is not None, name
            first, second = ("tok_embeddings.weight", "output.weight") if name == "two_d" \
                else ("embedding.weight", "fc.weight")
            assert f"tied parameter {first!r}" in message and f"same parameter as {second!r}" in message, message
            assert "['model', 'unsharded']" in message and "['unsharded', 'model']" in message, message
            assert "Give both paths the same layout" in message and "untie the parameter" in message, message
        # the default blocks hold the tie in two units: refused by name, as before
        message = out["default blocks"]
        assert message is not None and "'tok_embeddings.weight' is shared with 'output.weight'" in message, message
        # a tied use no tensor-parallel style splits: refused by its path and the key that laid it out
        message = out["raw"]
        assert message is not None and "for parameter 'unembed'" in message, message
        assert "Remove the key that matches 'embedding.weight' (the weight it is tied to" in message, message
