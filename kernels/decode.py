# SPDX-License-Identifier: Apache-2.0
"""Triton split-head duo decoding: paged retrieval heads split flash-decoding style, streaming heads over their
sink and window.

One launch covers a layer: the grid is (request, R x max_num_splits + S). A program serves
the G query heads of one KV head, so each K/V byte is read once. Retrieval programs take an
equal share of the context (split length computed on the device from seq_len) and a second
kernel merges the shares; streaming programs read at most sink + recent positions from their page
groups and write their output directly. No host syncs and fixed grid shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_duo.kernels.cache_write import check_attention, fp8_format, fp8_in_fp16, load_scales, scale_tensors
from vllm_duo.kernels.prefill import LOG2E, retrieval_tiles, streaming_tiles
from vllm_duo.kernels.reference import KVQuant, LayerHeads

MIN_SPLIT_TOKENS = 256  # shortest split on GPU: below this the partial writes and merge outweigh the parallelism


@triton.jit
def _split_len(seq_len, MAX_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Tokens per split of one request: seq_len / MAX_SPLITS in whole tiles, at least MIN_SPLIT."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, MAX_SPLITS), BLOCK_N) * BLOCK_N, MIN_SPLIT)


@triton.jit(do_not_specialize=["num_retrieval", "num_streaming", "stride", "stream_offset", "page_heads", "sink",
                               "recent", "first_program"])
def _decode_kernel(query_ptr, cache_ptr, stream_ptr, out_ptr, part_out_ptr, part_lse_ptr, retrieval_kv_ptr,
                   streaming_kv_ptr, query_start_loc_ptr, seq_lens_ptr, block_table_ptr, k_scale_ptr, v_scale_ptr,
                   qk_scale, num_retrieval, num_streaming, stride, stream_offset, page_heads, sink, recent, first_program,
                   stride_qt: tl.int64, stride_qh: tl.int64, stride_ot: tl.int64, stride_oh: tl.int64,
                   stride_table: tl.int64, stride_cb: tl.int64, stride_ckv: tl.int64, stride_cr: tl.int64,
                   stride_ch: tl.int64, stride_sb: tl.int64, stride_skv: tl.int64, stride_sr: tl.int64,
                   stride_sh: tl.int64,
                   G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, MAX_SPLITS: tl.constexpr,
                   MIN_SPLIT: tl.constexpr, FP8: tl.constexpr, FP16: tl.constexpr):
    """Grid (num_reqs, R * MAX_SPLITS + S - first_program); requests whose query length is not 1 exit at once.

    Programs before `first_program` are not launched: R * MAX_SPLITS of them leaves the streaming heads only.
    An FP8 cache holds K/V divided by the layer's scales: the scores take the k scale, each output
    (split results too: the merge is linear) the v scale.
    """
    req = tl.program_id(0)
    pid = tl.program_id(1) + first_program
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    if pid < num_retrieval * MAX_SPLITS:
        head = pid // MAX_SPLITS
        split = pid % MAX_SPLITS
        kv_head = tl.load(retrieval_kv_ptr + head)
    else:
        head = pid - num_retrieval * MAX_SPLITS + num_retrieval
        split = 0
        kv_head = tl.load(streaming_kv_ptr + head - num_retrieval)
    split_len = _split_len(seq_len, MAX_SPLITS, BLOCK_N, MIN_SPLIT)
    lo = split * split_len
    if lo >= seq_len:
        return

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_g < G)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_head = kv_head * G + offs_g
    q = tl.load(query_ptr + q_start.to(tl.int64) * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=mask, other=0.0)
    if FP16:  # K/V tiles follow q's dtype
        q = q.to(tl.float16)
    q_pos = tl.full([BLOCK_G], seq_len - 1, tl.int32)
    k_scale, v_scale = load_scales(k_scale_ptr, v_scale_ptr, FP8)
    qk_scale = qk_scale * k_scale
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_table_ptr + req * stride_table
    if head < num_retrieval:
        m_i, l_i, acc = retrieval_tiles(q, m_i, l_i, acc, q_pos, lo, tl.minimum(seq_len, lo + split_len), seq_len - 1,
                                        cache_ptr, table_row, stride, head, qk_scale,
                                        stride_cb, stride_ckv, stride_cr, stride_ch,
                                        HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE)
    else:
        m_i, l_i, acc = streaming_tiles(q, m_i, l_i, acc, q_pos, seq_len - 1, seq_len - 1, stream_ptr, table_row,
                                        head - num_retrieval, num_streaming, stream_offset, page_heads, stride, sink,
                                        recent, qk_scale, stride_sb, stride_skv, stride_sr, stride_sh,
                                        HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE)
    out = acc / l_i[:, None] * v_scale
    if MAX_SPLITS > 1:
        if head < num_retrieval:
            # part_out [num_reqs, R * G, MAX_SPLITS, HEAD_DIM], part_lse [num_reqs, R * G, MAX_SPLITS]
            part = (req * num_retrieval * G + head * G + offs_g) * MAX_SPLITS + split
            tl.store(part_out_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask)
            tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=offs_g < G)
            return
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_retrieval"])
def _merge_kernel(out_ptr, part_out_ptr, part_lse_ptr, retrieval_kv_ptr, query_start_loc_ptr, seq_lens_ptr,
                  num_retrieval, stride_ot: tl.int64, stride_oh: tl.int64,
                  G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  MAX_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_S: tl.constexpr):
    """Grid (num_reqs, R * G): combine one query head's split results by their log-sum-exp."""
    req = tl.program_id(0)
    h = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    num_splits = tl.cdiv(seq_len, _split_len(seq_len, MAX_SPLITS, BLOCK_N, MIN_SPLIT))
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    part = (req * num_retrieval * G + h) * MAX_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(part_out_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    q_head = tl.load(retrieval_kv_ptr + h // G) * G + h % G
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + q_head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@functools.cache
def _sm_count(device_index: int | None) -> int:
    """The GPU's SM count (a property lookup costs host time on every layer call otherwise)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_num_splits(num_reqs: int, num_retrieval: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per retrieval head so that about 8 programs per SM stream the cache.

    Depends only on host ints, so a captured graph can fix it (pass max_model_len as max_seq_len).
    """
    if device.type != "cuda" or num_retrieval == 0:
        return 1
    want = triton.cdiv(8 * _sm_count(device.index), max(num_reqs * num_retrieval, 1))
    # a power of two: MAX_SPLITS is a compile-time constant, so at most 7 variants ever compile
    return triton.next_power_of_2(max(1, min(want, triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS), 64)))


def decode_attention(query: torch.Tensor, cache: torch.Tensor, heads: LayerHeads, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, output: torch.Tensor,
                     max_num_splits: int, stream_cache: torch.Tensor | None = None, quant: KVQuant | None = None,
                     streaming_only: bool = False, checked: bool = False) -> None:
    """Duo attention of every request with exactly one new token; other requests are left untouched.

    The batch's K/V must already be in the cache (`write_kv`).

    Args:
        query: `[num_tokens, num_heads, head_dim]`.
        cache: `[num_blocks, 2, block_size, P, head_dim]`.
        heads: the layer's head maps (index tensors on the cache's device).
        query_start_loc: `[num_reqs + 1]` int32; seq_lens: `[num_reqs]` int32; block_table: `[num_reqs, max_blocks]` int32.
        output: `[num_tokens, num_heads, head_dim]`, written in place.
        max_num_splits: fixed bound on context splits per retrieval head (`decode_num_splits`); 1 skips the merge.
        stream_cache: the cache whose page groups hold the layer's streaming K/V (default `cache`).
        quant: the k/v scales of an fp8 cache (default 1).
        streaming_only: skip the retrieval heads (attention.py gives them to FlashAttention).
        checked: the caller has validated these inputs (`write_kv`'s argument).
    """
    stream_cache = check_attention(query, output, cache, stream_cache, heads, query_start_loc, seq_lens, block_table,
                                   checked)
    num_reqs, R, S = seq_lens.shape[0], heads.num_retrieval, heads.num_streaming
    if query.shape[0] == 0 or num_reqs == 0 or S + (0 if streaming_only else R) == 0:
        return
    splits = max_num_splits if R and not streaming_only else 1
    first_program = R if streaming_only else 0
    head_dim, G = cache.shape[-1], heads.group_size
    block_d = triton.next_power_of_2(head_dim)
    # keys per tile: a multiple of the 16-token block; 32 for head_dim 256 (64 spills registers at 4 warps);
    # 16 and one-tile splits on the CPU interpreter so that tests cross tiles and splits
    block_n = (64 if head_dim <= 128 else 32) if cache.is_cuda else 16
    min_split = MIN_SPLIT_TOKENS if cache.is_cuda else block_n
    part_out = part_lse = output  # unused placeholders when nothing is split
    if splits > 1:
        part_out = torch.empty(num_reqs, R * G, splits, head_dim, dtype=torch.float32, device=cache.device)
        part_lse = torch.empty(num_reqs, R * G, splits, dtype=torch.float32, device=cache.device)
    _decode_kernel[(num_reqs, R * splits + S - first_program)](
        query, cache, stream_cache, output, part_out, part_lse, heads.retrieval_kv, heads.streaming_kv,
        query_start_loc, seq_lens, block_table, *scale_tensors(quant, cache), scale * LOG2E,
        R, S, heads.stride, heads.stream_offset, stream_cache.shape[3], heads.sink, heads.recent, first_program,
        *query.stride()[:2], *output.stride()[:2], block_table.stride(0), *cache.stride()[:4],
        *stream_cache.stride()[:4],
        G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=cache.shape[2], MAX_SPLITS=splits, MIN_SPLIT=min_split, FP8=fp8_format(cache),
        FP16=fp8_in_fp16(cache, query), num_warps=4,
        num_stages=3 if cache.is_cuda else 1)
    if splits > 1:
        _merge_kernel[(num_reqs, R * G)](
            output, part_out, part_lse, heads.retrieval_kv, query_start_loc, seq_lens, R,
            output.stride(0), output.stride(1),
            G=G, BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=block_d, MAX_SPLITS=splits, MIN_SPLIT=min_split,
            BLOCK_S=triton.next_power_of_2(splits), num_warps=4)
