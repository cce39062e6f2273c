# SPDX-License-Identifier: Apache-2.0
"""Duo attention of a mixed batch with the Triton kernels: same semantics as `reference.duo_attention`."""

from __future__ import annotations

import functools

import torch

from vllm_duo.kernels.cache_write import as_scale, check_attention, check_tokens, scale_tensors, write_kv
from vllm_duo.kernels.decode import decode_attention, decode_num_splits
from vllm_duo.kernels.prefill import prefill_attention
from vllm_duo.kernels.queries import retrieval_queries
from vllm_duo.kernels.reference import KVQuant, LayerHeads


def duo_attention_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                         heads: LayerHeads, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         block_table: torch.Tensor, scale: float, output: torch.Tensor, max_query_len: int,
                         max_seq_len: int, max_num_splits: int | None = None,
                         stream_cache: torch.Tensor | None = None, quant: KVQuant | None = None,
                         retrieval_table: torch.Tensor | None = None,
                         flash_schedules: dict[int, torch.Tensor] | None = None) -> None:
    """Write the batch's K/V into the duo cache, then attend: single-token requests by decode.py, the rest by
    prefill.py.

    FlashAttention-3 (Hopper) takes the retrieval heads wherever it beats our Triton kernels on
    them (benchmarks/results): every prefill, and decode over fp8 pages, which it reads at about
    twice our decode kernel's rate (kernels_bench.py --fp8). Triton keeps the Λ-masked streaming
    heads, and bf16 decode whole: FlashAttention on the retrieval heads, then the streaming heads,
    measured 35 us per layer at 4 x 1k, the one Triton launch about 32 (2026-11-25-h100-host).
    The inputs are checked once here, not per launch (mixed steps run outside CUDA graphs and pay
    every microsecond of host time).
    With max_query_len == 1 nothing syncs with the host: a decode batch is CUDA-graph capturable when
    max_num_splits is fixed (or max_seq_len is, e.g. to max_model_len).

    Args:
        query: `[num_tokens, num_heads, head_dim]`
        key, value: `[num_tokens, num_kv_heads, head_dim]` (strided views of a fused qkv are fine).
        cache: `[num_blocks, 2, block_size, P, head_dim]`
        heads: the layer's `LayerHeads`, index tensors on the cache's device.
        query_start_loc: `[num_reqs + 1]` int32 on the device.
        seq_lens: `[num_reqs]` int32 on the device, context length after this step.
        block_table: `[num_reqs, max_blocks]` int32, `heads.stride` columns per token block.
        output: `[num_tokens, num_heads, head_dim]`, written in place.
        max_query_len, max_seq_len: host ints bounding the batch (vLLM's metadata has them).
        max_num_splits: context splits per retrieval head in decode; default `decode_num_splits`.
        stream_cache: the cache whose page groups hold the layer's streaming K/V (default `cache`).
        quant: the scales of an fp8 cache (`float8_e4m3fn` or `float8_e5m2`; default 1). Queries stay in
            the model's dtype, except for FlashAttention-3's fp8 path, which quantizes them by `q_scale`.
        retrieval_table: `block_table[:, ::heads.stride]` contiguous, for FlashAttention (made here if None;
            the backend makes it once per step for all layers, in a buffer CUDA graphs can replay).
        flash_schedules: the step's FlashAttention-3 tile schedules by retrieval-head count, shared by its layers
            (`retrieval_flash_attention`); multi-token batches only, which run outside CUDA graphs.
    """
    stream_cache = cache if stream_cache is None else stream_cache
    if heads.num_retrieval == 0:
        cache = stream_cache  # a layer without retrieval heads reads no pages of its own (its cache may be a stub)
    if max_num_splits is None:
        max_num_splits = decode_num_splits(seq_lens.shape[0], heads.num_retrieval, max_seq_len, cache.device)
    check_tokens(cache, key, value)
    check_attention(query, output, cache, stream_cache, heads, query_start_loc, seq_lens, block_table)
    write_kv(key, value, cache, heads, query_start_loc, seq_lens, block_table, stream_cache, quant, checked=True)
    flash = flash_attn_varlen() if cache.is_cuda and (query.dtype, cache.dtype) in FLASH_DTYPES else None
    by_flash = flash is not None and (max_query_len > 1 or cache.dtype == torch.float8_e4m3fn)
    if by_flash and heads.num_retrieval:
        if retrieval_table is None:
            retrieval_table = block_table[:, ::heads.stride].contiguous()
        retrieval_flash_attention(flash, query, cache, heads, query_start_loc, seq_lens, retrieval_table, scale,
                                  output, max_query_len, max_seq_len, quant,
                                  num_splits=min(max_num_splits, FLASH_MAX_SPLITS) if max_query_len == 1 else 0,
                                  schedules=flash_schedules if max_query_len > 1 else None)
    if max_query_len > 1:  # with FlashAttention, every request's streaming heads; else the multi-token requests
        prefill_attention(query, cache, heads, query_start_loc, seq_lens, block_table, scale, output,
                          min_query_len=1 if by_flash else 2, streaming_only=by_flash, stream_cache=stream_cache,
                          quant=quant, checked=True)
    if max_query_len == 1 or not by_flash:
        decode_attention(query, cache, heads, query_start_loc, seq_lens, block_table, scale, output, max_num_splits,
                         stream_cache=stream_cache, quant=quant, streaming_only=by_flash, checked=True)


# (query, cache) dtypes FlashAttention-3 takes: 16-bit, or fp8 e4m3 KV with queries quantized to it;
# float32 models and e5m2 caches keep the Triton prefill.
FLASH_DTYPES = {(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                (torch.float16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn)}
# Decode passes FlashAttention a fixed number of KV splits (ours, capped as vLLM's FLASH_ATTN caps its own for CUDA
# graphs): its own choice per call would size buffers at capture time that a replay cannot change.
FLASH_MAX_SPLITS = 32


@functools.cache
def flash_attn_varlen():
    """vLLM's FlashAttention-3 varlen function on Hopper, else None (CPU builds, other GPUs)."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    except ImportError:
        return None
    if get_flash_attn_version() != 3:
        return None
    return functools.partial(flash_attn_varlen_func, fa_version=3)


@functools.cache
def flash_scheduler():
    """vLLM's `get_scheduler_metadata` (FlashAttention-3's tile schedule of a batch, computed ahead of the calls)."""
    from vllm.vllm_flash_attn import get_scheduler_metadata
    return get_scheduler_metadata


def retrieval_flash_attention(flash, query: torch.Tensor, cache: torch.Tensor, heads: LayerHeads,
                              query_start_loc: torch.Tensor, seq_lens: torch.Tensor, retrieval_table: torch.Tensor,
                              scale: float, output: torch.Tensor, max_query_len: int, max_seq_len: int,
                              quant: KVQuant | None = None, num_splits: int = 0,
                              schedules: dict[int, torch.Tensor] | None = None) -> None:
    """Causal attention of the retrieval heads over their paged rows, by FlashAttention on strided views.

    `cache[:, 0, :, :R]` is a `[num_blocks, block_size, R, head_dim]` paged K (V likewise) and
    `retrieval_table` lists each request's retrieval pages in token order. The retrieval heads' queries
    and outputs are slices where the weights put them first (reorder.py; FlashAttention writes its
    slice of `output` in place), else gathered and scattered back. On an fp8 cache the queries are
    quantized by the layer's q scale (one launch, queries.py) and FlashAttention descales q, k and v,
    as vLLM's dense FLASH_ATTN backend does. `num_splits` 0 lets FlashAttention choose its KV splits.

    Without a schedule, each call allocates one and launches a kernel to compute it before attending;
    vLLM's FLASH_ATTN computes it once per step for all layers. `schedules` does the same for the
    layers of one retrieval-head count: the first computes it with this call's own arguments, the
    others of the step reuse it (a schedule fits only the head counts, dtype and batch it was made for).
    """
    R = heads.num_retrieval
    options = {}  # the fp8 descales, the step's schedule
    if cache.dtype == torch.float8_e4m3fn:
        q_scale = as_scale((quant or KVQuant()).q_scale, cache.device)
        q = retrieval_queries(query, heads, cache.dtype, q_scale)
        shape = (seq_lens.shape[0], R)
        k_scale, v_scale = scale_tensors(quant, cache)
        options = dict(q_descale=q_scale.expand(shape), k_descale=k_scale.expand(shape),
                       v_descale=v_scale.expand(shape))
    else:
        q = retrieval_queries(query, heads)
    if schedules is not None:
        if R not in schedules:
            schedules[R] = flash_scheduler()(
                batch_size=seq_lens.shape[0], max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len,
                num_heads_q=R * heads.group_size, num_heads_kv=R, headdim=cache.shape[-1], cache_seqlens=seq_lens,
                qkv_dtype=cache.dtype, cu_seqlens_q=query_start_loc, page_size=cache.shape[2], causal=True,
                num_splits=num_splits)
        options["scheduler_metadata"] = schedules[R]
    into = output[:, :R * heads.group_size] if heads.retrieval_first and q.dtype == output.dtype else None
    out = flash(q=q, k=cache[:, 0, :, :R], v=cache[:, 1, :, :R],
                cu_seqlens_q=query_start_loc, max_seqlen_q=max_query_len, seqused_k=seq_lens,
                max_seqlen_k=max_seq_len, softmax_scale=scale, causal=True,
                block_table=retrieval_table, num_splits=num_splits, out=into, **options)
    if into is not None:
        return
    if heads.retrieval_first:
        output[:, :R * heads.group_size].copy_(out)
    else:
        output[:, heads.retrieval_q] = out.to(output.dtype)
