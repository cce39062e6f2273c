# SPDX-License-Identifier: Apache-2.0
"""Duo attention on a GPU as served: FlashAttention-3 on the retrieval heads where it beats our Triton kernels,
the Triton kernels (kernels/) for the rest.

FlashAttention-3 (Hopper, vLLM's build) takes the retrieval heads of every prefill, and of decode over fp8 pages,
which it reads at about twice our decode kernel's rate (kernels_bench.py --fp8). Triton keeps the Λ-masked
streaming heads, and bf16 decode whole: FlashAttention on the retrieval heads, then the streaming heads, measured
35 us per layer at 4 x 1k, the one Triton launch about 32 (benchmarks/results/2026-11-25-h100-host). Where
FlashAttention decodes the retrieval heads, the streaming heads' Triton decode runs beside it on a second stream.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from vllm_duo import vllm_seam
from vllm_duo.kernels.attention import triton_attention, write_step
from vllm_duo.kernels.cache_write import as_scale, scale_tensors
from vllm_duo.kernels.queries import retrieval_queries
from vllm_duo.kernels.reference import KVQuant, LayerHeads


def duo_attention_gpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                      heads: LayerHeads, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      block_table: torch.Tensor, scale: float, output: torch.Tensor, max_query_len: int,
                      max_seq_len: int, max_num_splits: int | None = None, stream_cache: torch.Tensor | None = None,
                      quant: KVQuant | None = None, retrieval_table: torch.Tensor | None = None,
                      flash_schedules: dict[int, torch.Tensor] | None = None,
                      retrieval_seq_lens: torch.Tensor | None = None,
                      squeezed: Callable[[], None] | None = None) -> None:
    """`kernels.attention.duo_attention_triton`'s arguments and result, with the retrieval heads by FlashAttention-3
    where it is faster (where it is not available, the Triton kernels do all).

    Args (beyond duo_attention_triton's):
        quant: on an e4m3 cache FlashAttention-3 quantizes the retrieval heads' queries by `q_scale`, as vLLM's
            dense FLASH_ATTN backend does; the Triton kernels keep queries in the model's dtype.
        retrieval_table: `block_table[:, ::heads.stride]` contiguous, for FlashAttention (made here if None;
            the backend makes it once per step for all layers, in a buffer CUDA graphs can replay).
        flash_schedules: the step's FlashAttention-3 tile schedules by retrieval-head count, shared by its layers
            (`retrieval_flash_attention`); multi-token batches only, which run outside CUDA graphs.
        retrieval_seq_lens: where the squeeze is on, the keys FlashAttention reads of each row's retrieval heads
            (1 at rows whose squeezed decode follows, `SqueezeRows.flash_seq_lens`); FlashAttention then takes
            the retrieval heads of decode too.
        squeezed: the squeeze's lookup and sparse decode of the retrieval heads (`ClusteredContexts.decode`), run
            right after them on the same stream, so that the streaming heads' decode runs beside both.
    """
    cache, stream_cache, max_num_splits = write_step(query, key, value, cache, heads, query_start_loc, seq_lens,
                                                     block_table, output, max_seq_len, max_num_splits, stream_cache,
                                                     quant)
    flash = vllm_seam.flash_attn_varlen() if cache.is_cuda and (query.dtype, cache.dtype) in FLASH_DTYPES else None
    by_flash = flash is not None and (max_query_len > 1 or cache.dtype == torch.float8_e4m3fn
                                      or retrieval_seq_lens is not None)
    streaming = functools.partial(triton_attention, query, cache, heads, query_start_loc, seq_lens, block_table,
                                  scale, output, max_query_len, max_num_splits, stream_cache, quant,
                                  streaming_only=by_flash)
    then = squeezed or (lambda: None)
    if not (by_flash and heads.num_retrieval):
        streaming()
        then()
        return
    if retrieval_table is None:
        retrieval_table = block_table[:, ::heads.stride].contiguous()
    flash_part = functools.partial(
        retrieval_flash_attention, flash, query, cache, heads, query_start_loc,
        seq_lens if retrieval_seq_lens is None else retrieval_seq_lens, retrieval_table, scale,
        output, max_query_len, max_seq_len, quant,
        num_splits=min(max_num_splits, FLASH_MAX_SPLITS) if max_query_len == 1 else 0,
        schedules=flash_schedules if max_query_len > 1 else None)

    def retrieval() -> None:
        flash_part()
        then()

    if max_query_len == 1 and heads.num_streaming:
        beside(streaming, retrieval, query.device)
    else:
        retrieval()
        streaming()


def beside(side_work, main_work, device: torch.device) -> None:
    """`side_work` on a second stream while `main_work` runs on the current one; both start after everything queued
    so far and finish before anything queued after.

    Decode over a long context is FlashAttention streaming the retrieval heads' pages; the streaming heads' few
    hundred keys per head are a chain of short dependent tiles that leave most SMs idle, so beside it they cost
    almost nothing (the 32-layer step at 4 x 64k fp8: 4.76 -> 4.34 ms, kernels_bench.py --long-decode). Inside a
    CUDA graph capture the second stream joins the capture as a parallel branch (its allocations come from the
    graph's pool, as the capture stream's do)."""
    main = torch.cuda.current_stream(device)
    side = _SIDE_STREAMS.get(device.index)
    if side is None:
        side = _SIDE_STREAMS[device.index] = torch.cuda.Stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        side_work()
    main_work()
    main.wait_stream(side)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # by device index: one second stream each, made on first use


# (query, cache) dtypes FlashAttention-3 takes: 16-bit, or fp8 e4m3 KV with queries quantized to it;
# float32 models and e5m2 caches keep the Triton prefill.
FLASH_DTYPES = {(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                (torch.float16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn)}
# Decode passes FlashAttention a fixed number of KV splits (ours, capped as vLLM's FLASH_ATTN caps its own for CUDA
# graphs): its own choice per call would size buffers at capture time that a replay cannot change.
FLASH_MAX_SPLITS = 32


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
            schedules[R] = vllm_seam.flash_scheduler()(
                batch_size=seq_lens.shape[0], max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len,
                num_heads_q=R * heads.group_size, num_heads_kv=R, headdim=cache.shape[-1], cache_seqlens=seq_lens,
                qkv_dtype=cache.dtype, cu_seqlens_q=query_start_loc, page_size=cache.shape[2], causal=True,
                num_splits=num_splits)
        options["scheduler_metadata"] = schedules[R]
    # FlashAttention-3 returns its fp8 path's output in bf16: a bf16 model's output slice takes it in place
    out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    into = output[:, :R * heads.group_size] if heads.retrieval_first and out_dtype == output.dtype else None
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
