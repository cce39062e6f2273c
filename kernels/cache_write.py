# SPDX-License-Identifier: Apache-2.0
"""The Triton kernel that stores a batch's new K/V in the duo cache: retrieval pages and streaming page groups.

The layout helpers here (`find_request`, `retrieval_rows`, `stream_rows`) and the fp8 rounding
(`fp8_grid`) are shared with the attention kernels in prefill.py and decode.py; kernels/reference.py
defines the layout and the fp8 storage (`KVQuant`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vllm_duo.kernels.launch import launch, next_power_of_2
from vllm_duo.kernels.reference import FP8_FORMATS, KVQuant, LayerHeads

WRITE_BLOCK_T = 16  # tokens per write program
# Attention of bf16 queries over an fp8 cache multiplies in fp16: Hopper converts fp8 to fp16 in one instruction
# per pair, to bf16 only through fp32. The queries are cast to fp16 (FlashAttention-3's fp8 path clips them at
# 448, fp16 at 65504). "model" computes in the model's dtype instead (kernels_bench.py compares the two).
FP8_COMPUTE = "fp16"


def fp8_in_fp16(cache: torch.Tensor, query: torch.Tensor) -> bool:
    """The kernels' FP16 constant: whether attention casts the queries (and so the K/V tiles) to fp16."""
    return bool(fp8_format(cache)) and query.dtype == torch.bfloat16 and FP8_COMPUTE == "fp16"


def fp8_format(cache: torch.Tensor) -> str:
    """The kernels' FP8 constant for a cache: "e4m3", "e5m2", or "" for a cache of the model's dtype."""
    return FP8_FORMATS.get(cache.dtype, "")


def as_scale(scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A scale as a float32 tensor on `device` (vLLM's layer scales already are: no copy)."""
    if isinstance(scale, torch.Tensor) and scale.device == device and scale.dtype == torch.float32:
        return scale
    return torch.as_tensor(scale, dtype=torch.float32, device=device)


def scale_tensors(quant: KVQuant | None, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V scale pointers of a kernel call: float32 tensors on the cache's device for an fp8 cache (the
    kernels load them, so captured graphs see later values); else the cache itself, never read, so that no
    tensor is made (a CUDA graph capture cannot copy one to the device)."""
    if not fp8_format(cache):
        return cache, cache
    quant = quant or KVQuant()
    if quant.toward_zero:
        raise ValueError("the duo kernels round fp8 to nearest even, as vLLM's CUDA cache write does")
    return as_scale(quant.k_scale, cache.device), as_scale(quant.v_scale, cache.device)


@triton.jit
def fp8_grid(x, inv_scale, FP8: tl.constexpr):
    """`x * inv_scale` saturated and rounded to nearest even on the FP8 ("e4m3"/"e5m2") grid, in fp32.

    The result is exact in fp8, so the cast that stores it rounds no more: one rounding on every
    target (the CPU interpreter's own fp8 cast drops the carry of a mantissa that rounds up).
    """
    if FP8 == "e5m2":
        mantissa_bits = 2
        min_exponent = -14
        largest = 57344.0
    else:
        mantissa_bits = 3
        min_exponent = -6
        largest = 448.0
    y = tl.clamp(x.to(tl.float32) * inv_scale, -largest, largest)
    exponent = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 + min_exponent)  # subnormals: one step
    step = ((exponent - mantissa_bits) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - mantissa bits)
    rounded = (y / step + 12582912.0) - 12582912.0  # 1.5 * 2^23: fp32 addition rounds to an even integer
    return tl.where(rounded == 0.0, y * 0.0, rounded * step)  # keep the sign of zero


@triton.jit
def load_scales(k_scale_ptr, v_scale_ptr, FP8: tl.constexpr):
    """The layer's k and v scales for an fp8 cache, else 1."""
    if FP8 != "":
        return tl.load(k_scale_ptr), tl.load(v_scale_ptr)
    return 1.0, 1.0


@triton.jit
def find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """Request that owns flat tile `tile` of a varlen batch.

    Request i owns tiles [qsl[i] // BLOCK_Q + i, qsl[i + 1] // BLOCK_Q + i + 1), at least
    cdiv(query_len_i, BLOCK_Q) of them, so a grid of num_tokens // BLOCK_Q + num_reqs tiles
    covers any batch without knowing the query lengths on the host.
    """
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def retrieval_rows(table_row_ptr, pos, mask, stride, head, stride_block, stride_row, stride_head,
                   BLOCK_SIZE: tl.constexpr):
    """Cache offsets (of the K element 0) of retrieval head `head` at token positions `pos`: token block t's
    retrieval page is column t * stride of the request's block table row."""
    block = tl.load(table_row_ptr + pos // BLOCK_SIZE * stride, mask=mask, other=0).to(tl.int64)
    return block * stride_block + (pos % BLOCK_SIZE) * stride_row + head * stride_head


@triton.jit
def stream_rows(table_row_ptr, pos, mask, head, num_streaming, stream_offset, page_heads, stride, stride_block,
                stride_row, stride_head, BLOCK_SIZE: tl.constexpr):
    """Stream-cache offsets (of the K element 0) of streaming head `head` at token positions `pos`.

    Token block t's streaming K/V `[BLOCK_SIZE slots, S]` is flattened from cell `stream_offset` on over
    its page group (columns t * stride + 1 ...) of the stream cache, `page_heads` cells per row.
    """
    flat = stream_offset + (pos % BLOCK_SIZE) * num_streaming + head
    cells_per_block = BLOCK_SIZE * page_heads
    column = pos // BLOCK_SIZE * stride + 1 + flat // cells_per_block
    block = tl.load(table_row_ptr + column, mask=mask, other=0).to(tl.int64)
    cell = flat % cells_per_block
    return block * stride_block + (cell // page_heads) * stride_row + (cell % page_heads) * stride_head


@triton.jit
def store_step_rows(key_ptr, value_ptr, cache_ptr, stream_ptr, retrieval_kv_ptr, streaming_kv_ptr, k_scale_ptr,
                    v_scale_ptr, table_row, tok, pos, mask, j, num_retrieval, num_streaming, stride, stream_offset,
                    stream_page_heads, stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ckv, stride_cr,
                    stride_ch, stride_sb, stride_skv, stride_sr, stride_sh,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
    """Store the step's K/V rows `tok` (token positions `pos`) of the layer's head j (retrieval heads first):
    retrieval heads to their pages in the layer's cache, streaming heads to their token blocks' page groups in the
    stream cache; an FP8 cache stores `x / scale` rounded to nearest even."""
    if j < num_retrieval:
        kv_head = tl.load(retrieval_kv_ptr + j)
        dst_ptr = cache_ptr
        rows = retrieval_rows(table_row, pos, mask, stride, j, stride_cb, stride_cr, stride_ch, BLOCK_SIZE)
        stride_kv = stride_ckv
    else:
        kv_head = tl.load(streaming_kv_ptr + j - num_retrieval)
        dst_ptr = stream_ptr
        rows = stream_rows(table_row, pos, mask, j - num_retrieval, num_streaming, stream_offset, stream_page_heads,
                           stride, stride_sb, stride_sr, stride_sh, BLOCK_SIZE)
        stride_kv = stride_skv
    offs_d = tl.arange(0, BLOCK_D)
    mask2 = mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    tok64 = tok.to(tl.int64)[:, None]
    k = tl.load(key_ptr + tok64 * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=mask2)
    v = tl.load(value_ptr + tok64 * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=mask2)
    if FP8 != "":
        k = fp8_grid(k, 1.0 / tl.load(k_scale_ptr), FP8)
        v = fp8_grid(v, 1.0 / tl.load(v_scale_ptr), FP8)
    dst = dst_ptr + rows[:, None] + offs_d[None, :]
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask2)
    tl.store(dst + stride_kv, v.to(cache_ptr.dtype.element_ty), mask=mask2)


@triton.jit
def quantize_query_rows(query_ptr, q_heads_ptr, out_ptr, q_scale_ptr, tok, mask, h, num_out_heads,
                        stride_qt, stride_qh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    """out[tok, h] = fp8(query[tok, q_heads[h]] / q_scale): the retrieval heads' queries as FlashAttention-3's fp8
    path takes them, `[num_tokens, num_out_heads, HEAD_DIM]` contiguous."""
    offs_d = tl.arange(0, BLOCK_D)
    mask2 = mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    tok64 = tok.to(tl.int64)[:, None]
    q_head = tl.load(q_heads_ptr + h)
    x = tl.load(query_ptr + tok64 * stride_qt + q_head * stride_qh + offs_d[None, :], mask=mask2, other=0.0)
    y = fp8_grid(x, 1.0 / tl.load(q_scale_ptr), FP8)
    tl.store(out_ptr + (tok64 * num_out_heads + h) * HEAD_DIM + offs_d[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask2)


@triton.jit(do_not_specialize=["num_reqs", "num_retrieval", "num_streaming", "stride", "stream_offset",
                               "stream_page_heads", "stride_table", "num_q_out"])
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, stream_ptr, retrieval_kv_ptr, streaming_kv_ptr,
                     query_start_loc_ptr, seq_lens_ptr, block_table_ptr, k_scale_ptr, v_scale_ptr,
                     query_ptr, q_heads_ptr, q_out_ptr, q_scale_ptr,
                     num_reqs, num_retrieval, num_streaming, stride, stream_offset, stream_page_heads, num_q_out,
                     stride_kt: tl.int64, stride_kh: tl.int64, stride_vt: tl.int64, stride_vh: tl.int64,
                     stride_table: tl.int64, stride_cb: tl.int64, stride_ckv: tl.int64, stride_cr: tl.int64,
                     stride_ch: tl.int64, stride_sb: tl.int64, stride_skv: tl.int64, stride_sr: tl.int64,
                     stride_sh: tl.int64, stride_qt: tl.int64, stride_qh: tl.int64,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, QUERIES: tl.constexpr):
    """One program stores BLOCK_T tokens of one request for one head (grid: tiles x (R + S)); with QUERIES the
    programs of columns R + S + h (grid: tiles x (R + S + num_q_out)) quantize retrieval query head h instead."""
    tile = tl.program_id(0)
    j = tl.program_id(1)
    req = find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_T)
    q_start = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    t0 = q_start + (tile - (q_start // BLOCK_T + req)) * BLOCK_T
    if t0 >= q_end:
        return
    num_cached = tl.load(seq_lens_ptr + req) - (q_end - q_start)
    tok = t0 + tl.arange(0, BLOCK_T)
    if QUERIES:
        if j >= num_retrieval + num_streaming:
            quantize_query_rows(query_ptr, q_heads_ptr, q_out_ptr, q_scale_ptr, tok, tok < q_end,
                                j - num_retrieval - num_streaming, num_q_out, stride_qt, stride_qh, HEAD_DIM,
                                BLOCK_D, FP8)
            return
    store_step_rows(key_ptr, value_ptr, cache_ptr, stream_ptr, retrieval_kv_ptr, streaming_kv_ptr, k_scale_ptr,
                    v_scale_ptr, block_table_ptr + req * stride_table, tok, num_cached + tok - q_start, tok < q_end,
                    j, num_retrieval, num_streaming, stride, stream_offset, stream_page_heads, stride_kt, stride_kh,
                    stride_vt, stride_vh, stride_cb, stride_ckv, stride_cr, stride_ch, stride_sb, stride_skv,
                    stride_sr, stride_sh, HEAD_DIM, BLOCK_D, BLOCK_SIZE, FP8)


def check_batch(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                device: torch.device) -> None:
    """Check the batch metadata the kernels index with: int32, on `device`, consistent lengths."""
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table)):
        if t.dtype != torch.int32 or t.device != device:
            raise ValueError(f"{name} must be int32 on {device}, got {t.dtype} on {t.device}")
    if query_start_loc.dim() != 1 or seq_lens.dim() != 1 or query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} must be [num_reqs + 1] for "
                         f"seq_lens {tuple(seq_lens.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] < seq_lens.shape[0] or block_table.stride(1) != 1:
        raise ValueError(f"block_table {tuple(block_table.shape)} must be [>= num_reqs, max_blocks], unit stride rows")


def check_tokens(cache: torch.Tensor, *tensors: torch.Tensor) -> None:
    """Check `[num_tokens, heads, head_dim]` tensors against a `[num_blocks, 2, block_size, P, head_dim]` cache."""
    if cache.dim() != 5 or cache.shape[1] != 2 or not cache.is_contiguous():
        raise ValueError(f"cache must be a contiguous [num_blocks, 2, block_size, P, head_dim], got {tuple(cache.shape)}")
    for t in tensors:
        if t.dim() != 3 or t.shape[-1] != cache.shape[-1] or t.stride(-1) != 1:
            raise ValueError(f"expected [num_tokens, heads, {cache.shape[-1]}] with unit last stride, "
                             f"got {tuple(t.shape)} strides {t.stride()}")
        if t.device != cache.device or t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"tensor {t.dtype} on {t.device} does not match the cache on {cache.device}")
        if t.shape[0] != tensors[0].shape[0]:
            raise ValueError("all token tensors must have the same number of tokens")


def check_stream_cache(cache: torch.Tensor, stream_cache: torch.Tensor) -> None:
    """Check that a layer's stream cache (another layer's cache, or its own) matches its cache's blocks."""
    same = (stream_cache.dim() == 5 and stream_cache.shape[:3] == cache.shape[:3]
            and stream_cache.shape[4] == cache.shape[4] and stream_cache.dtype == cache.dtype
            and stream_cache.device == cache.device and stream_cache.is_contiguous())
    if not same:
        raise ValueError(f"stream cache {tuple(stream_cache.shape)} {stream_cache.dtype} must be a contiguous cache "
                         f"with the blocks, block size, head_dim and dtype of the layer's cache {tuple(cache.shape)} "
                         f"{cache.dtype}")


def check_attention(query: torch.Tensor, output: torch.Tensor, cache: torch.Tensor,
                    stream_cache: torch.Tensor | None, heads: LayerHeads, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, checked: bool = False) -> torch.Tensor:
    """Check an attention call's inputs (prefill.py, decode.py), unless the caller has (`checked`); returns the
    stream cache (`cache` when None)."""
    stream_cache = cache if stream_cache is None else stream_cache
    if checked:
        return stream_cache
    check_tokens(cache, query, output)
    check_stream_cache(cache, stream_cache)
    check_batch(query_start_loc, seq_lens, block_table, cache.device)
    if heads.num_streaming and heads.recent < 1:
        raise ValueError(f"recent must be >= 1, got {heads.recent}")
    return stream_cache


class QueriesToQuantize(NamedTuple):
    """`write_kv`'s query quantization: `out[t, h] = fp8(query[t, heads[h]] / scale)`, `out` `[num_tokens,
    len(heads), head_dim]` contiguous in the cache's fp8 dtype, `scale` a float32 tensor on the device."""

    query: torch.Tensor
    heads: torch.Tensor
    out: torch.Tensor
    scale: torch.Tensor


def write_kv(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, heads: LayerHeads,
             query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
             stream_cache: torch.Tensor | None = None, quant: KVQuant | None = None, checked: bool = False,
             queries: QueriesToQuantize | None = None) -> None:
    """Store every new token's K/V: retrieval heads in their pages, streaming heads in their page groups. One
    launch; run it before attention, which reads the cache alone.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`, unit last stride.
        cache: `[num_blocks, 2, block_size, P, head_dim]`, contiguous.
        heads: the layer's head maps; retrieval head r goes to page head slot r.
        query_start_loc: `[num_reqs + 1]` int32; seq_lens: `[num_reqs]` int32 (context after this step).
        block_table: `[num_reqs, max_blocks]` int32, `heads.stride` columns per token block.
        stream_cache: the cache whose page groups hold the layer's streaming K/V (default `cache`).
        quant: the k/v scales of an fp8 cache (default 1); its rounding is always to nearest even.
        checked: the caller has validated these inputs (`attention.write_step`, once per layer call: the checks
            cost host time that mixed steps, run outside CUDA graphs, pay per launch).
        queries: over an fp8 cache, the same launch also quantizes the retrieval heads' queries for FlashAttention
            (`queries.retrieval_queries`): one launch fewer before it.
    """
    stream_cache = cache if stream_cache is None else stream_cache
    if not checked:
        check_tokens(cache, key, value)
        check_stream_cache(cache, stream_cache)
        check_batch(query_start_loc, seq_lens, block_table, cache.device)
    num_heads = heads.num_retrieval + heads.num_streaming
    num_tokens, num_reqs = key.shape[0], seq_lens.shape[0]
    if num_heads == 0 or num_tokens == 0 or num_reqs == 0:
        return
    head_dim = cache.shape[-1]
    k_scale, v_scale = scale_tensors(quant, cache)
    # the queries to quantize (an fp8 cache's only), else stand-ins the launch does not read (no query heads)
    q, num_q_out = QueriesToQuantize(key, heads.retrieval_kv, key, k_scale), 0
    if queries is not None:
        if not fp8_format(cache):
            raise ValueError("write_kv quantizes queries over an fp8 cache only")
        q, num_q_out = queries, queries.out.shape[1]
    grid = (num_tokens // WRITE_BLOCK_T + num_reqs, num_heads + num_q_out)
    launch(_write_kv_kernel, grid)(
        key, value, cache, stream_cache, heads.retrieval_kv, heads.streaming_kv, query_start_loc, seq_lens,
        block_table, k_scale, v_scale, q.query, q.heads, q.out, q.scale,
        num_reqs, heads.num_retrieval, heads.num_streaming, heads.stride, heads.stream_offset, stream_cache.shape[3],
        num_q_out, *key.stride()[:2], *value.stride()[:2], block_table.stride(0), *cache.stride()[:4],
        *stream_cache.stride()[:4], *q.query.stride()[:2],
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BLOCK_T=WRITE_BLOCK_T,
        BLOCK_SIZE=cache.shape[2], FP8=fp8_format(cache), QUERIES=queries is not None, num_warps=4)
