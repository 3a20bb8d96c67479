"""DTensor sharding of torch's CPU attention kernel, so a stage split over a tensor axis runs SDPA on a CPU.

``F.scaled_dot_product_attention`` on a CPU dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``
(and its backward), for which torch's DTensor registers no sharding strategy (the CUDA kernels have
one). A pipeline stage whose weights are split over a tensor axis runs its traced graph on DTensors
(`meshfit.dtensor._stage_layouts`), so its attention would stop there. `register_attention_sharding`
declares the strategies DTensor uses for the CUDA kernels, through torch's own extension point
(``torch.distributed.tensor.experimental.register_sharding``): every tensor replicated, or query, key,
value and their outputs split by heads (dim 1 of ``(batch, heads, sequence, head_dim)``), each
process computing its heads' attention, which is one process's attention for those heads. A mask
keeps the replicated strategy only. Registered once, the first time a stage is laid out.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def register_attention_sharding() -> None:
    """Register the CPU attention kernel's strategies with DTensor (once per process)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is None or backward is None:
        return

    @register_sharding(forward.default)
    def _forward(query: Any, key: Any, value: Any, dropout_p: float = 0.0, is_causal: bool = False,
                 attn_mask: Any = None, scale: Any = None) -> list[Any]:
        # (output, logsumexp) from (query, key, value, dropout_p, is_causal, attn_mask, scale)
        mask = None if attn_mask is None else Replicate()
        found: list[Any] = [([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), None, None, mask, None])]
        if attn_mask is None:
            found.append(([Shard(1), Shard(1)], [Shard(1), Shard(1), Shard(1), None, None, None, None]))
        return found

    @register_sharding(backward.default)
    def _backward(grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, dropout_p: float,
                  is_causal: bool, attn_mask: Any = None, scale: Any = None) -> list[Any]:
        # (grad_query, grad_key, grad_value) from (grad_out, query, key, value, out, logsumexp, ...)
        mask = None if attn_mask is None else Replicate()
        found: list[Any] = [([Replicate()] * 3, [Replicate()] * 6 + [None, None, mask, None])]
        if attn_mask is None:
            found.append(([Shard(1)] * 3, [Shard(1)] * 6 + [None, None, None, None]))
        return found
