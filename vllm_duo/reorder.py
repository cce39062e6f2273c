# SPDX-License-Identifier: Apache-2.0
"""Reorder each duo layer's KV heads at weight load so that its retrieval heads come first.

Attention is unchanged when KV heads are permuted together with their query-head groups, the K and V
rows of the fused qkv projection and the o_proj input columns. After the permutation a layer's
retrieval heads are KV heads 0..R-1 (query heads 0..R*G-1) and its streaming heads follow, so each
kind is one contiguous slice. Under tensor parallelism each rank permutes its own shard, within its
own heads.

The load step (backend.bind_duo_layers) runs this before vLLM's post-load processing, which may repack or
quantize weights (oneDNN on CPU, fp8 on GPU). Checkpoints vLLM loads into quantized layers keep the model's order;
their layers run on the same index maps (`LayerHeads`), which work for any order.
"""

from __future__ import annotations

import torch
from torch import nn


def head_order(retrieval: list[int], num_kv_heads: int) -> list[int]:
    """New position -> old KV head: the retrieval heads first, then the streaming ones, each in model order."""
    return retrieval + [h for h in range(num_kv_heads) if h not in set(retrieval)]


def permute_heads(qkv_proj: nn.Module, o_proj: nn.Module, order: list[int], num_heads: int, num_kv_heads: int,
                  head_dim: int) -> None:
    """Permute a fused `[q | k | v]` projection's output rows and o_proj's input columns by KV head `order`."""
    group = num_heads // num_kv_heads
    dims = torch.arange(head_dim)
    q_heads = torch.tensor([h * group + g for h in order for g in range(group)])
    kv_heads = torch.tensor(order)
    q_rows = (q_heads[:, None] * head_dim + dims).flatten()
    kv_rows = (kv_heads[:, None] * head_dim + dims).flatten()
    rows = torch.cat([q_rows, num_heads * head_dim + kv_rows, (num_heads + num_kv_heads) * head_dim + kv_rows])
    with torch.no_grad():
        for param in (qkv_proj.weight, getattr(qkv_proj, "bias", None)):
            if param is not None:
                param.copy_(param[rows.to(param.device)])
        o_proj.weight.copy_(o_proj.weight[:, q_rows.to(o_proj.weight.device)])


def _reorderable(module: nn.Module, attn) -> bool:
    """An unquantized fused qkv / o projection pair with the shapes of this rank's heads."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    qkv, out = getattr(module, "qkv_proj", None), getattr(module, "o_proj", None)
    if qkv is None or out is None:
        return False
    if not all(isinstance(getattr(p, "quant_method", None), UnquantizedLinearMethod) for p in (qkv, out)):
        return False
    rows = (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_size
    return qkv.weight.shape[0] == rows and out.weight.shape[1] == attn.num_heads * attn.head_size


def reorder_heads(module: nn.Module, attn, retrieval: list[int]) -> bool:
    """Reorder the KV heads of `attn`, a duo `Attention` layer in `module` (its qkv / o projections), retrieval
    heads first; False where its weights do not allow it (quantized, or not a fused qkv projection), which then
    run on index maps. A reordered layer is marked with `duo_head_order` (new position -> old head)."""
    if not _reorderable(module, attn):
        return False
    order = head_order(retrieval, attn.num_kv_heads)
    permute_heads(module.qkv_proj, module.o_proj, order, attn.num_heads, attn.num_kv_heads, attn.head_size)
    attn.duo_head_order = order
    return True
