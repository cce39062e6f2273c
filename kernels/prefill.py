# SPDX-License-Identifier: Apache-2.0
"""Triton chunked-prefill duo attention over a varlen batch: causal retrieval heads, Λ-masked streaming heads.

One program takes BLOCK_Q query tokens x the G query heads of one KV head (BLOCK_M = BLOCK_Q * G
rows, GQA packed so each K/V tile serves the whole group). Both kinds read the cache, the chunk's
own tokens included (`write_kv` runs first): retrieval heads their pages, streaming heads only the
sink tiles and the window of `recent` positions below the tile from their page groups, so their
work is O(chunk x (sink + recent)). The tile helpers here are shared with decode.py.

A streaming program whose request has no cached tokens (a fresh prompt: every key it sees is in this
step) reads its keys from the step's own K/V instead (`fresh_kv`), which a cache of the model's dtype
holds bit for bit: contiguous rows at an address it computes, where a page-group read first loads the
block table and then the row it names, and a program's few tiles wait on that chain one by one.

Beside FlashAttention (`streaming_only`, 16-bit caches) the launch can also store the step's K/V (`store`),
one launch a layer instead of two: each program first stores its tile's rows of its head, every head in the
grid, and the streaming heads read this step's keys from the step's K/V, which no program waits on another to
store:

    request with 40 cached tokens, 24 new, BLOCK_Q 8:   tiles [40, 48) [48, 56) [56, 64)
    tile [56, 64), a streaming head:  stores positions 56-63 of its head; reads the sinks and window keys
                                      below 40 from the page groups, keys 40-63 from the step's K/V
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_duo.kernels.cache_write import (check_attention, find_request, fp8_format, fp8_in_fp16, load_scales,
                                         retrieval_rows, scale_tensors, store_step_rows, stream_rows)
from vllm_duo.kernels.launch import launch, next_power_of_2
from vllm_duo.kernels.reference import KVQuant, LayerHeads

LOG2E = 1.4426950408889634


@triton.jit
def softmax_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr):
    """One online-softmax step over a K/V tile, in base 2 (`qk_scale` includes log2(e)).

    q `[M, D]`, k/v `[N, D]`, visible `[M, N]` (read only if MASKED); m_i/l_i `[M]`, acc `[M, D]` fp32.
    """
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows with nothing visible yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def retrieval_kv(pos, valid, cache_ptr, table_row, stride, head, stride_cb, stride_ckv, stride_cr, stride_ch, dtype,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """K/V `[N, D]` of retrieval head `head` at positions `pos` (any order), from their retrieval pages; rows
    that are not `valid` read as 0."""
    offs_d = tl.arange(0, BLOCK_D)
    ok = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = retrieval_rows(table_row, pos, valid, stride, head, stride_cb, stride_cr, stride_ch, BLOCK_SIZE)
    ptr = cache_ptr + rows[:, None] + offs_d[None, :]
    return tl.load(ptr, mask=ok, other=0.0).to(dtype), tl.load(ptr + stride_ckv, mask=ok, other=0.0).to(dtype)


@triton.jit
def retrieval_tiles(q, m_i, l_i, acc, q_pos, lo, hi, first, cache_ptr, table_row, stride, head, qk_scale,
                    stride_cb, stride_ckv, stride_cr, stride_ch,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr):
    """Attend rows at positions `q_pos` (smallest `first`) to retrieval head `head`'s cached keys [lo, hi).

    Tiles wholly at or below `first` need no mask; only the tiles after them check k <= q.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = (offs_d < HEAD_DIM)[None, :]
    full_end = lo + (tl.minimum(first + 1, hi) - lo) // BLOCK_N * BLOCK_N
    for start in range(lo, full_end, BLOCK_N):
        pos = start + offs_n
        rows = retrieval_rows(table_row, pos, pos < hi, stride, head, stride_cb, stride_cr, stride_ch, BLOCK_SIZE)
        ptr = cache_ptr + rows[:, None] + offs_d[None, :]
        k = tl.load(ptr, mask=d_ok, other=0.0).to(q.dtype)
        v = tl.load(ptr + stride_ckv, mask=d_ok, other=0.0).to(q.dtype)
        m_i, l_i, acc = softmax_tile(q, k, v, None, m_i, l_i, acc, qk_scale, False)
    for start in range(full_end, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        k, v = retrieval_kv(pos, valid, cache_ptr, table_row, stride, head, stride_cb, stride_ckv, stride_cr,
                            stride_ch, q.dtype, HEAD_DIM, BLOCK_D, BLOCK_SIZE)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = softmax_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, True)
    return m_i, l_i, acc


@triton.jit
def streaming_kv(pos, valid, stream_ptr, table_row, head, num_streaming, stream_offset, page_heads, stride,
                 stride_sb, stride_skv, stride_sr, stride_sh, dtype,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """K/V `[N, D]` of streaming head `head` at positions `pos`, from their token blocks' page groups."""
    offs_d = tl.arange(0, BLOCK_D)
    ok = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = stream_rows(table_row, pos, valid, head, num_streaming, stream_offset, page_heads, stride,
                       stride_sb, stride_sr, stride_sh, BLOCK_SIZE)
    ptr = stream_ptr + rows[:, None] + offs_d[None, :]
    return tl.load(ptr, mask=ok, other=0.0).to(dtype), tl.load(ptr + stride_skv, mask=ok, other=0.0).to(dtype)


@triton.jit
def chunk_kv(pos, valid, key_row0, value_row0, stride_kt, stride_vt, dtype, HEAD_DIM: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """K/V `[N, D]` at positions `pos` of a request whose tokens all are in this step, from the step's K/V:
    `key_row0`/`value_row0` point at its position 0 in the KV head's column."""
    offs_d = tl.arange(0, BLOCK_D)
    ok = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = pos.to(tl.int64)[:, None]
    return (tl.load(key_row0 + rows * stride_kt + offs_d[None, :], mask=ok, other=0.0).to(dtype),
            tl.load(value_row0 + rows * stride_vt + offs_d[None, :], mask=ok, other=0.0).to(dtype))


@triton.jit
def streaming_tile_kv(pos, valid, stream_ptr, table_row, head, num_streaming, stream_offset, page_heads, stride,
                      stride_sb, stride_skv, stride_sr, stride_sh, key_row0, value_row0, stride_kt, stride_vt,
                      num_cached, dtype, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      KEYS: tl.constexpr):
    """A streaming key tile from the page groups (KEYS "pages", `streaming_kv`), the step's K/V ("step",
    `chunk_kv`), or both ("both": positions from `num_cached` on are this step's, which the same launch stores)."""
    if KEYS == "step":
        k, v = chunk_kv(pos, valid, key_row0, value_row0, stride_kt, stride_vt, dtype, HEAD_DIM, BLOCK_D)
    elif KEYS == "pages":
        k, v = streaming_kv(pos, valid, stream_ptr, table_row, head, num_streaming, stream_offset, page_heads, stride,
                            stride_sb, stride_skv, stride_sr, stride_sh, dtype, HEAD_DIM, BLOCK_D, BLOCK_SIZE)
    else:
        in_step = pos >= num_cached
        k, v = streaming_kv(pos, valid & ~in_step, stream_ptr, table_row, head, num_streaming, stream_offset,
                            page_heads, stride, stride_sb, stride_skv, stride_sr, stride_sh, dtype, HEAD_DIM, BLOCK_D,
                            BLOCK_SIZE)
        k_new, v_new = chunk_kv(pos - num_cached, valid & in_step, key_row0, value_row0, stride_kt, stride_vt, dtype,
                                HEAD_DIM, BLOCK_D)
        k, v = tl.where(in_step[:, None], k_new, k), tl.where(in_step[:, None], v_new, v)
    return k, v


@triton.jit
def streaming_tiles(q, m_i, l_i, acc, q_pos, first, last, stream_ptr, table_row, head, num_streaming, stream_offset,
                    page_heads, stride, sink, recent, qk_scale, stride_sb, stride_skv, stride_sr, stride_sh,
                    key_row0, value_row0, stride_kt, stride_vt, num_cached,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, KEYS: tl.constexpr):
    """Attend rows at positions `q_pos` in [first, last] to streaming head `head` under the Λ mask.

    Only two key ranges can be visible: the sinks [0, sink) and the window
    [first - recent + 1, last]; everything between is skipped (its pages may be freed).
    KEYS: where the keys come from (`streaming_tile_kv`).
    """
    offs_n = tl.arange(0, BLOCK_N)
    sink_end = tl.minimum(sink, last + 1)
    for start in range(0, sink_end, BLOCK_N):
        pos = start + offs_n
        valid = pos < sink_end
        k, v = streaming_tile_kv(pos, valid, stream_ptr, table_row, head, num_streaming, stream_offset,
                                 page_heads, stride, stride_sb, stride_skv, stride_sr, stride_sh, key_row0,
                                 value_row0, stride_kt, stride_vt, num_cached, q.dtype, HEAD_DIM, BLOCK_D,
                                 BLOCK_SIZE, KEYS)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        m_i, l_i, acc = softmax_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, True)
    for start in range(tl.maximum(sink, first - recent + 1), last + 1, BLOCK_N):
        pos = start + offs_n
        valid = pos <= last
        k, v = streaming_tile_kv(pos, valid, stream_ptr, table_row, head, num_streaming, stream_offset,
                                 page_heads, stride, stride_sb, stride_skv, stride_sr, stride_sh, key_row0,
                                 value_row0, stride_kt, stride_vt, num_cached, q.dtype, HEAD_DIM, BLOCK_D,
                                 BLOCK_SIZE, KEYS)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - recent)
        m_i, l_i, acc = softmax_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, True)
    return m_i, l_i, acc


# Batch-dependent ints (and the block table's width) are not specialized: each new value class would compile a new
# kernel mid-serving, past the warm-up (vllm_duo/warmup.py).
@triton.jit(do_not_specialize=["num_reqs", "num_tiles", "num_retrieval", "num_streaming", "stride", "stream_offset",
                               "page_heads", "sink", "recent", "min_query_len", "head_offset", "stride_table"])
def _prefill_kernel(query_ptr, cache_ptr, stream_ptr, out_ptr, key_ptr, value_ptr, retrieval_kv_ptr,
                    streaming_kv_ptr, query_start_loc_ptr, seq_lens_ptr, block_table_ptr, k_scale_ptr, v_scale_ptr,
                    qk_scale,
                    num_reqs, num_tiles, num_retrieval, num_streaming, stride, stream_offset, page_heads,
                    sink, recent, min_query_len, head_offset,
                    stride_qt: tl.int64, stride_qh: tl.int64, stride_ot: tl.int64, stride_oh: tl.int64,
                    stride_table: tl.int64, stride_cb: tl.int64, stride_ckv: tl.int64, stride_cr: tl.int64,
                    stride_ch: tl.int64, stride_sb: tl.int64, stride_skv: tl.int64, stride_sr: tl.int64,
                    stride_sh: tl.int64, stride_kt: tl.int64, stride_kh: tl.int64, stride_vt: tl.int64,
                    stride_vh: tl.int64,
                    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
                    FP16: tl.constexpr, STREAMING_ONLY: tl.constexpr, FRESH_KV: tl.constexpr,
                    STORE: tl.constexpr, BLOCK_QS: tl.constexpr):
    """Grid (query tiles, heads from head_offset on): retrieval KV heads first, then streaming ones.

    An FP8 cache holds K/V divided by the layer's scales: the scores take the k scale, the output the v scale.
    STREAMING_ONLY: no retrieval head attended (compiled without their path); FRESH_KV: `key_ptr`/`value_ptr`
    are the step's K/V as the cache holds them, read by the streaming heads of requests with nothing cached.
    STORE (with both, the grid over every head): each program first stores its tile's K/V of its head (BLOCK_QS:
    BLOCK_Q rounded up to a power of two), a retrieval head's program only that; the streaming heads read this
    step's keys from the step's K/V, not the page groups the launch is storing them in.
    """
    tile = num_tiles - 1 - tl.program_id(0)  # last tiles of a prompt have the most keys: start them first
    head = tl.program_id(1) + head_offset
    req = find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    t0 = q_start + (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if (t0 >= q_end) | (q_end - q_start < min_query_len):
        return
    num_cached = tl.load(seq_lens_ptr + req) - (q_end - q_start)
    first = num_cached + t0 - q_start
    last = num_cached + tl.minimum(t0 + BLOCK_Q, q_end) - 1 - q_start
    table_row = block_table_ptr + req * stride_table
    if STORE:
        offs_s = tl.arange(0, BLOCK_QS)
        tok_s = t0 + offs_s
        store_step_rows(key_ptr, value_ptr, cache_ptr, stream_ptr, retrieval_kv_ptr, streaming_kv_ptr, k_scale_ptr,
                        v_scale_ptr, table_row, tok_s, num_cached + tok_s - q_start,
                        (offs_s < BLOCK_Q) & (tok_s < q_end), head, num_retrieval, num_streaming, stride,
                        stream_offset, page_heads, stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ckv,
                        stride_cr, stride_ch, stride_sb, stride_skv, stride_sr, stride_sh, HEAD_DIM, BLOCK_D,
                        BLOCK_SIZE, FP8)
        if head < num_retrieval:
            return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = t0 + offs_m // G
    row_ok = (offs_m < BLOCK_Q * G) & (tok < q_end)
    q_pos = num_cached + tok - q_start
    retrieval = (not STREAMING_ONLY) and head < num_retrieval
    if retrieval:
        kv_head = tl.load(retrieval_kv_ptr + head)
    else:
        kv_head = tl.load(streaming_kv_ptr + head - num_retrieval)
    q_head = kv_head * G + offs_m % G
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    tok64 = tok.to(tl.int64)[:, None]
    q = tl.load(query_ptr + tok64 * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :], mask=mask, other=0.0)
    if FP16:  # K/V tiles follow q's dtype
        q = q.to(tl.float16)

    k_scale, v_scale = load_scales(k_scale_ptr, v_scale_ptr, FP8)
    qk_scale = qk_scale * k_scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    step_key_row0 = key_ptr + q_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    step_value_row0 = value_ptr + q_start.to(tl.int64) * stride_vt + kv_head * stride_vh
    if retrieval:
        m_i, l_i, acc = retrieval_tiles(q, m_i, l_i, acc, q_pos, 0, last + 1, first, cache_ptr, table_row, stride,
                                        head, qk_scale, stride_cb, stride_ckv, stride_cr, stride_ch,
                                        HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE)
    elif FRESH_KV and num_cached == 0:
        m_i, l_i, acc = streaming_tiles(q, m_i, l_i, acc, q_pos, first, last, stream_ptr, table_row,
                                        head - num_retrieval, num_streaming, stream_offset, page_heads, stride, sink,
                                        recent, qk_scale, stride_sb, stride_skv, stride_sr, stride_sh,
                                        step_key_row0, step_value_row0, stride_kt, stride_vt, num_cached, HEAD_DIM,
                                        BLOCK_D, BLOCK_N, BLOCK_SIZE, "step")
    elif STORE:
        m_i, l_i, acc = streaming_tiles(q, m_i, l_i, acc, q_pos, first, last, stream_ptr, table_row,
                                        head - num_retrieval, num_streaming, stream_offset, page_heads, stride, sink,
                                        recent, qk_scale, stride_sb, stride_skv, stride_sr, stride_sh,
                                        step_key_row0, step_value_row0, stride_kt, stride_vt, num_cached, HEAD_DIM,
                                        BLOCK_D, BLOCK_N, BLOCK_SIZE, "both")
    else:
        m_i, l_i, acc = streaming_tiles(q, m_i, l_i, acc, q_pos, first, last, stream_ptr, table_row,
                                        head - num_retrieval, num_streaming, stream_offset, page_heads, stride, sink,
                                        recent, qk_scale, stride_sb, stride_skv, stride_sr, stride_sh,
                                        key_ptr, value_ptr, stride_kt, stride_vt, num_cached, HEAD_DIM, BLOCK_D,
                                        BLOCK_N, BLOCK_SIZE, "pages")
    out = acc / l_i[:, None] * v_scale
    tl.store(out_ptr + tok64 * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def _prefill_config(head_dim: int, device: torch.device, store: bool = False) -> dict:
    """Tile shapes: tensor-core sized on GPU; small on the CPU interpreter so tests cross many tiles.

    The launch that also stores the step's K/V (`store`) takes smaller tiles: on the H100, Llama-3.1-8B's streaming
    heads, 0.116 against 0.150 ms a layer at 8 x 1k new tokens, 0.123 / 0.158 at 2 x 4k, 0.028 / 0.037 at 31 decodes
    and a 256-token prompt, 0.030 / 0.028 for a 384-token chunk after a 16k hit (kernels_bench.py --mixed,
    benchmarks/results/2026-12-06-h100-tiles). Without storing, the larger tiles are as fast or faster there."""
    if device.type != "cuda":
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    if head_dim > 128:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=1)
    if store:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)


def prefill_tiles(head_dim: int, G: int, device: torch.device, store: bool) -> tuple[dict, dict]:
    """`_prefill_kernel`'s tile constants (BLOCK_Q query tokens x G heads in BLOCK_M rows, BLOCK_N keys, BLOCK_QS the
    stored rows) and its launch options, for `_prefill_config`'s shape."""
    cfg = _prefill_config(head_dim, device, store)
    block_m = max(cfg.pop("BLOCK_M"), next_power_of_2(G))
    block_q = block_m // G
    return dict(BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=cfg.pop("BLOCK_N"), BLOCK_QS=next_power_of_2(block_q)), cfg


def prefill_attention(query: torch.Tensor, cache: torch.Tensor, heads: LayerHeads, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, output: torch.Tensor,
                      min_query_len: int = 1, streaming_only: bool = False, stream_cache: torch.Tensor | None = None,
                      quant: KVQuant | None = None, checked: bool = False,
                      fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None, store: bool = False) -> None:
    """Duo attention of every request with at least `min_query_len` new tokens; others are left untouched.

    The batch's K/V must already be in the cache (`write_kv`), unless `store`.

    Args:
        query: `[num_tokens, num_heads, head_dim]`.
        cache: `[num_blocks, 2, block_size, P, head_dim]`.
        heads: the layer's head maps (index tensors on the cache's device).
        query_start_loc: `[num_reqs + 1]` int32; seq_lens: `[num_reqs]` int32; block_table: `[num_reqs, max_blocks]` int32.
        output: `[num_tokens, num_heads, head_dim]`, written in place.
        min_query_len: 2 when decode.py serves the single-token requests.
        streaming_only: skip the retrieval heads (attention.py gives them to FlashAttention).
        stream_cache: the cache whose page groups hold the layer's streaming K/V (default `cache`).
        quant: the k/v scales of an fp8 cache (default 1).
        checked: the caller has validated these inputs (`write_kv`'s argument).
        fresh_kv: the step's key and value (`write_kv`'s): with `streaming_only`, the streaming heads of requests
            with nothing cached read them instead of the page groups where the cache holds them unchanged (its dtype
            is theirs). Without `streaming_only` the kernel would need more shared memory than an H100 has.
        store: the same launch stores the step's K/V of every head (`write_kv`'s work, before FlashAttention reads
            the retrieval pages), its streaming heads reading this step's keys from `fresh_kv`: with
            `streaming_only`, `fresh_kv` in the cache's dtype and every request (min_query_len 1).
    """
    stream_cache = check_attention(query, output, cache, stream_cache, heads, query_start_loc, seq_lens, block_table,
                                   checked)
    num_tokens, num_reqs = query.shape[0], seq_lens.shape[0]
    fresh = streaming_only and fresh_kv is not None and fresh_kv[0].dtype == stream_cache.dtype
    if store and not (fresh and cache.dtype == stream_cache.dtype and min_query_len == 1):
        raise ValueError("store needs streaming_only, fresh_kv in the caches' dtype and min_query_len 1")
    head_offset = heads.num_retrieval if streaming_only and not store else 0
    num_heads = heads.num_retrieval + heads.num_streaming - head_offset
    if num_tokens == 0 or num_reqs == 0 or num_heads == 0:
        return
    head_dim, G = cache.shape[-1], heads.group_size
    tiles, options = prefill_tiles(head_dim, G, cache.device, store)
    num_tiles = num_tokens // tiles["BLOCK_Q"] + num_reqs
    key, value = fresh_kv if fresh else (query, query)  # unread unless fresh
    launch(_prefill_kernel, (num_tiles, num_heads))(
        query, cache, stream_cache, output, key, value, heads.retrieval_kv, heads.streaming_kv, query_start_loc,
        seq_lens,
        block_table, *scale_tensors(quant, cache), scale * LOG2E,
        num_reqs, num_tiles, heads.num_retrieval, heads.num_streaming, heads.stride, heads.stream_offset,
        stream_cache.shape[3], heads.sink, heads.recent, min_query_len, head_offset,
        *query.stride()[:2], *output.stride()[:2], block_table.stride(0), *cache.stride()[:4],
        *stream_cache.stride()[:4], *key.stride()[:2], *value.stride()[:2],
        G=G, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BLOCK_SIZE=cache.shape[2], FP8=fp8_format(cache),
        FP16=fp8_in_fp16(cache, query), STREAMING_ONLY=streaming_only, FRESH_KV=fresh, STORE=store, **tiles,
        **options)
