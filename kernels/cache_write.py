# SPDX-License-Identifier: Apache-2.0
"""Triton kernels that store a batch's new K/V in the duo cache: retrieval pages and streaming ring cells.

The layout helpers here (`find_request`, `retrieval_rows`, `ring_rows`) and the fp8 rounding
(`fp8_grid`) are shared with the attention kernels in prefill.py and decode.py; kernels/reference.py
defines the layout and the fp8 storage (`KVQuant`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_duo.kernels.reference import KVQuant

WRITE_BLOCK_T = 16  # tokens per write program
FP8_FORMATS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
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
def retrieval_rows(table_row_ptr, pos, mask, streaming_blocks, head, stride_block, stride_row, stride_head,
                   BLOCK_SIZE: tl.constexpr):
    """Cache offsets (of the K element 0) of retrieval head `head` at token positions `pos`."""
    block = tl.load(table_row_ptr + streaming_blocks + pos // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    return block * stride_block + (pos % BLOCK_SIZE) * stride_row + head * stride_head


@triton.jit
def ring_rows(table_row_ptr, pos, mask, head, num_streaming, ring_offset, page_heads, sink, recent, stride_block,
              stride_row, stride_head, BLOCK_SIZE: tl.constexpr):
    """Ring-cache offsets (of the K element 0) of streaming head `head`'s ring cells for positions `pos`.

    Slot p for p < sink, else sink + (p - sink) % recent; the ring `[W, S]` is flattened from
    cell `ring_offset` on over the E streaming blocks of the ring cache, `page_heads` cells per row.
    """
    slot = tl.where(pos < sink, pos, sink + (pos - sink) % recent)
    flat = ring_offset + slot * num_streaming + head
    cells_per_block = BLOCK_SIZE * page_heads
    block = tl.load(table_row_ptr + flat // cells_per_block, mask=mask, other=0).to(tl.int64)
    cell = flat % cells_per_block
    return block * stride_block + (cell // page_heads) * stride_row + (cell % page_heads) * stride_head


@triton.jit(do_not_specialize=["num_reqs", "num_heads", "streaming_blocks", "ring_offset", "page_heads", "sink",
                               "recent"])
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, kv_heads_ptr, query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
                     k_scale_ptr, v_scale_ptr, num_reqs, num_heads, streaming_blocks, ring_offset, page_heads, sink,
                     recent,
                     stride_kt: tl.int64, stride_kh: tl.int64, stride_vt: tl.int64, stride_vh: tl.int64,
                     stride_table: tl.int64, stride_cb: tl.int64, stride_ckv: tl.int64, stride_cr: tl.int64,
                     stride_ch: tl.int64,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, STREAMING: tl.constexpr, FP8: tl.constexpr):
    """One program stores BLOCK_T tokens of one request for one head (grid: tiles x heads).

    `cache_ptr` is the layer's cache for retrieval writes, its ring cache for STREAMING ones; an
    FP8 cache stores `x / scale` rounded to nearest even.
    """
    tile = tl.program_id(0)
    j = tl.program_id(1)
    req = find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_T)
    q_start = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    t0 = q_start + (tile - (q_start // BLOCK_T + req)) * BLOCK_T
    if t0 >= q_end:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    num_cached = seq_len - (q_end - q_start)
    first = num_cached + t0 - q_start
    last = num_cached + tl.minimum(t0 + BLOCK_T, q_end) - 1 - q_start
    if STREAMING:
        if (first >= sink) & (last < seq_len - recent):  # no position of this tile stays visible
            return

    tok = t0 + tl.arange(0, BLOCK_T)
    pos = num_cached + tok - q_start
    mask = tok < q_end
    if STREAMING:
        mask &= (pos < sink) | (pos >= seq_len - recent)
    table_row = block_table_ptr + req * stride_table
    if STREAMING:
        rows = ring_rows(table_row, pos, mask, j, num_heads, ring_offset, page_heads, sink, recent,
                         stride_cb, stride_cr, stride_ch, BLOCK_SIZE)
    else:
        rows = retrieval_rows(table_row, pos, mask, streaming_blocks, j, stride_cb, stride_cr, stride_ch, BLOCK_SIZE)
    kv_head = tl.load(kv_heads_ptr + j)
    offs_d = tl.arange(0, BLOCK_D)
    mask2 = mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    tok64 = tok.to(tl.int64)[:, None]
    k = tl.load(key_ptr + tok64 * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=mask2)
    v = tl.load(value_ptr + tok64 * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=mask2)
    if FP8 != "":
        k = fp8_grid(k, 1.0 / tl.load(k_scale_ptr), FP8)
        v = fp8_grid(v, 1.0 / tl.load(v_scale_ptr), FP8)
    dst = cache_ptr + rows[:, None] + offs_d[None, :]
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask2)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask2)


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


def check_ring(cache: torch.Tensor, ring_cache: torch.Tensor) -> None:
    """Check that a layer's ring cache (another layer's cache, or its own) matches its cache's blocks."""
    same = (ring_cache.dim() == 5 and ring_cache.shape[:3] == cache.shape[:3] and ring_cache.shape[4] == cache.shape[4]
            and ring_cache.dtype == cache.dtype and ring_cache.device == cache.device and ring_cache.is_contiguous())
    if not same:
        raise ValueError(f"ring cache {tuple(ring_cache.shape)} {ring_cache.dtype} must be a contiguous cache with the "
                         f"blocks, block size, head_dim and dtype of the layer's cache {tuple(cache.shape)} {cache.dtype}")


def check_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                    cache: torch.Tensor, ring_cache: torch.Tensor | None, recent: int, has_streaming: bool,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Check an attention call's inputs (prefill.py, decode.py); returns the ring cache (`cache` when None)."""
    ring_cache = cache if ring_cache is None else ring_cache
    check_tokens(cache, query, key, value, output)
    check_ring(cache, ring_cache)
    check_batch(query_start_loc, seq_lens, block_table, cache.device)
    if has_streaming and recent < 1:
        raise ValueError(f"recent must be >= 1, got {recent}")
    return ring_cache


def _write(key, value, cache, kv_heads, query_start_loc, seq_lens, block_table, streaming_blocks, ring_offset, sink,
           recent, streaming, quant):
    check_tokens(cache, key, value)
    check_batch(query_start_loc, seq_lens, block_table, cache.device)
    num_heads = kv_heads.numel()
    num_tokens, num_reqs = key.shape[0], seq_lens.shape[0]
    if num_heads == 0 or num_tokens == 0 or num_reqs == 0:
        return
    head_dim = cache.shape[-1]
    grid = (num_tokens // WRITE_BLOCK_T + num_reqs, num_heads)
    _write_kv_kernel[grid](
        key, value, cache, kv_heads, query_start_loc, seq_lens, block_table, *scale_tensors(quant, cache),
        num_reqs, num_heads, streaming_blocks, ring_offset, cache.shape[3], sink, recent,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        block_table.stride(0), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_T=WRITE_BLOCK_T,
        BLOCK_SIZE=cache.shape[2], STREAMING=streaming, FP8=fp8_format(cache), num_warps=4)


def write_retrieval_kv(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, retrieval_kv: torch.Tensor,
                       query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                       streaming_blocks: int, quant: KVQuant | None = None) -> None:
    """Store every new token's retrieval K/V in its paged row; run before attention reads the pages.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`, unit last stride.
        cache: `[num_blocks, 2, block_size, P, head_dim]`, contiguous.
        retrieval_kv: `[R]` model KV head ids (int32 or int64); head r is stored in page head slot r.
        query_start_loc: `[num_reqs + 1]` int32; seq_lens: `[num_reqs]` int32 (context after this step).
        block_table: `[num_reqs, max_blocks]` int32, E streaming blocks then retrieval blocks.
        streaming_blocks: E.
        quant: the k/v scales of an fp8 cache (default 1); its rounding is always to nearest even.
    """
    _write(key, value, cache, retrieval_kv, query_start_loc, seq_lens, block_table, streaming_blocks, 0, 0, 1, False,
           quant)


def write_streaming_kv(key: torch.Tensor, value: torch.Tensor, ring_cache: torch.Tensor, streaming_kv: torch.Tensor,
                       query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                       sink: int, recent: int, ring_offset: int = 0, quant: KVQuant | None = None) -> None:
    """Store the new streaming K/V that later queries can still see (positions < sink or >= seq_len - recent).

    Run after streaming attention: within one chunk a later position can take the ring slot
    that an earlier query of the same chunk still reads.

    Args:
        key, value, query_start_loc, seq_lens, block_table: as in `write_retrieval_kv`.
        ring_cache: the cache whose streaming blocks hold the layer's ring.
        streaming_kv: `[S]` model KV head ids; head s takes ring column s.
        sink, recent: ring sizes, recent >= 1.
        ring_offset: the layer's first cell in the ring cache's streaming blocks.
        quant: the k/v scales of an fp8 ring cache (default 1).
    """
    if recent < 1:
        raise ValueError(f"recent must be >= 1, got {recent}")
    _write(key, value, ring_cache, streaming_kv, query_start_loc, seq_lens, block_table, 0, ring_offset, sink, recent,
           True, quant)
