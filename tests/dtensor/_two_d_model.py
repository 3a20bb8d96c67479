"""A small transformer language model written as a user writes one (plain torch, fused qkv, SDPA), its
data and the 2-D ``LayoutMap`` of the guide, shared by the 2-D parallelism tests."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D_MODEL, HEADS, SEQ, LAYERS = 32, 16, 4, 8, 2
BATCH, STEPS = 8, 20
EXAMPLES = BATCH * (STEPS - 1) + 5  # the last batch holds 5 sequences: 3/2 on 2 replicas, 2/1/1/1 on 4


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d_model // heads
        # head-major (heads, 3, head_dim): a column-wise split gives each process whole heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, -1, 3, self.head_dim)  # -1: this process's heads
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, 2 * d_model)
        self.fc2 = nn.Linear(2 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn, self.mlp = Attention(d_model, heads), MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TransformerLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, d_model: int = D_MODEL, heads: int = HEADS, layers: int = LAYERS,
                 seq: int = SEQ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        self.layers = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class ArangeGPT(TransformerLM):
    """The same language model with learned positions looked up by ``torch.arange(t)`` made in ``forward``
    (a GPT's habit): a plain tensor that must meet the laid-out weights as it is."""

    def __init__(self) -> None:
        super().__init__()
        del self.pos
        self.pos_embed = nn.Embedding(SEQ, D_MODEL)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos_embed(positions)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def arange_gpt(tied: bool = False) -> ArangeGPT:
    """The GPT; ``tied``: its head's weight is the token embedding's (one parameter, two blocks)."""
    torch.manual_seed(0)
    gpt = ArangeGPT()
    if tied:
        gpt.head.weight = gpt.embed.weight
    return gpt


def keras_keys(layout_map) -> None:
    """The guide's keys in Keras 3's spelling (``None``: unsharded; whole-path regular expressions)."""
    layout_map[r"layers\.\d+\.attn\.qkv\.weight"] = ("model", None)  # column-wise
    layout_map[r"layers\.\d+\.attn\.out\.weight"] = (None, "model")  # row-wise
    layout_map[r"layers\.\d+\.mlp\.fc1\.weight"] = ("model", None)
    layout_map[r"layers\.\d+\.mlp\.fc2\.weight"] = (None, "model")


def module() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM()


def data(examples: int = EXAMPLES) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, VOCAB, size=(examples, SEQ + 1)).astype("int64")
    return tokens[:, :-1], tokens[:, 1:]


def two_d_map(mf, mesh):
    """The guide's map: every weight over ``batch``, attention and MLP weights split over ``model``."""
    U = mf.dtensor.UNSHARDED
    layout_map = mf.dtensor.LayoutMap.fully_sharded(mesh)
    layout_map[r"attn\.qkv\.weight"] = mf.dtensor.Layout(["model", U], mesh)  # column-wise
    layout_map[r"attn\.out\.weight"] = mf.dtensor.Layout([U, "model"], mesh)  # row-wise
    layout_map[r"mlp\.fc1\.weight"] = mf.dtensor.Layout(["model", U], mesh)
    layout_map[r"mlp\.fc2\.weight"] = mf.dtensor.Layout([U, "model"], mesh)
    return layout_map


def scope(mf, shape):
    """The scope of a ``(batch, model)`` mesh with the guide's map; None: one plain process."""
    if shape is None:
        return mf.get_strategy().scope()
    # a lenient heartbeat: 4 processes on a shared 2-core machine may be starved for seconds
    mesh = mf.dtensor.create_mesh([("batch", shape[0]), ("model", shape[1])],
                                  communication_options=mf.CommunicationOptions(heartbeat_timeout_seconds=60))
    return two_d_map(mf, mesh).scope()


def optimizer(mf, name, **kwargs):
    return mf.optimizers.SGD(0.1, **kwargs) if name == "sgd" else mf.optimizers.AdamW(1e-3, **kwargs)


def max_rel(a, b) -> float:
    return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12)) for x, y in zip(a, b, strict=True))


def assert_weights_match(weights, want, name) -> None:
    """The issue's criteria: SGD within 1e-5 relative (max over weights), AdamW within rtol 1e-5."""
    if name == "sgd":
        assert max_rel(weights, want) <= 1e-5, max_rel(weights, want)
    else:
        for got, expected in zip(weights, want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
