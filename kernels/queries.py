# SPDX-License-Identifier: Apache-2.0
"""The retrieval heads' queries as FlashAttention takes them: `[num_tokens, R * G, head_dim]`.

A layer whose weights were reordered at load (retrieval heads first) hands FlashAttention a view of
its queries, with no copy. FlashAttention-3's fp8 path wants them quantized by the layer's q scale:
one launch gathers, scales, saturates and rounds them (it replaced a gather and five elementwise ops
per layer, issue 22's fixed cost), the launch that stores the step's K/V where the caller stores it first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from vllm_duo.kernels.cache_write import QueriesToQuantize, as_scale, quantize_query_rows
from vllm_duo.kernels.launch import cdiv, launch, next_power_of_2
from vllm_duo.kernels.reference import FP8_FORMATS, LayerHeads

QUANT_BLOCK_T = 16  # tokens per program


@triton.jit(do_not_specialize=["num_tokens", "num_out_heads"])
def _quantize_kernel(query_ptr, q_heads_ptr, out_ptr, q_scale_ptr, num_tokens, num_out_heads,
                     stride_qt: tl.int64, stride_qh: tl.int64, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_T: tl.constexpr, FP8: tl.constexpr):
    """Grid (cdiv(num_tokens, BLOCK_T), R * G): out[t, h] = fp8(query[t, q_heads[h]] / q_scale)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    quantize_query_rows(query_ptr, q_heads_ptr, out_ptr, q_scale_ptr, tok, tok < num_tokens, tl.program_id(1),
                        num_out_heads, stride_qt, stride_qh, HEAD_DIM, BLOCK_D, FP8)


def retrieval_queries(query: torch.Tensor, heads: LayerHeads, fp8_dtype: torch.dtype | None = None,
                      q_scale: float | torch.Tensor = 1.0, write: Callable[..., None] | None = None) -> torch.Tensor:
    """The retrieval heads' queries `[num_tokens, R * G, head_dim]`.

    Args:
        query: `[num_tokens, num_heads, head_dim]`, unit last stride.
        heads: the layer's head maps; with `retrieval_first` the result is a view of `query`.
        fp8_dtype: quantize to this fp8 dtype (contiguous result), saturating at its largest value and
            rounding to nearest even, as torch's cast does.
        q_scale: the layer's q scale (a float32 device tensor is read in the kernel: CUDA-graph safe).
        write: the step's `cache_write.write_kv` (all its arguments but `queries`), run here: where the queries
            are quantized, its launch quantizes them too (one launch fewer).
    """
    if fp8_dtype is None:
        if write is not None:
            write()
        if heads.retrieval_first:
            return query[:, :heads.retrieval_q.numel()]
        return query[:, heads.retrieval_q]
    num_tokens, head_dim = query.shape[0], query.shape[-1]
    num_out = heads.retrieval_q.numel()
    out = torch.empty(num_tokens, num_out, head_dim, dtype=fp8_dtype, device=query.device)
    scale = as_scale(q_scale, query.device)
    if write is not None and num_tokens and num_out:
        write(queries=QueriesToQuantize(query, heads.retrieval_q, out, scale))
    elif num_tokens and num_out:
        launch(_quantize_kernel, (cdiv(num_tokens, QUANT_BLOCK_T), num_out))(
            query, heads.retrieval_q, out, scale, num_tokens, num_out,
            query.stride(0), query.stride(1), HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
            BLOCK_T=QUANT_BLOCK_T, FP8=FP8_FORMATS[fp8_dtype], num_warps=4)
    elif write is not None:
        write()
    return out
