# SPDX-License-Identifier: Apache-2.0
"""Triton split-head duo decoding: paged retrieval heads split flash-decoding style, streaming heads over their
sink and window in splits of the same length.

One launch covers a layer: the grid is (request, R x MAX_SPLITS + S x STREAM_SPLITS). A program serves
the G query heads of one KV head, so each K/V byte is read once. At small batches the GPU is mostly
idle and the launch takes as long as its longest program's chain of dependent tiles, so no program
reads more than one split length of keys (computed on the device from seq_len, at least MIN_SPLIT),
a streaming head's sinks or one chunk of its window (at most STREAM_WINDOW_SPLIT keys on GPU):

    seq_len 1000, split length 256, sink 64, recent 256, window chunks of 64
    retrieval head:  split 0 [0, 256)  split 1 [256, 512)  split 2 [512, 768)  split 3 [768, 1000)
    streaming head:  split 0 the sinks [0, 64)  splits 1-4 the window [744, 808) [808, 872) [872, 936) [936, 1000)

A head split more than once is merged by its split results' log-sum-exp: where its launch splits heads into few
parts (MAX_PARTS_MERGED_IN_LAUNCH) in the same launch, where the last of the head's programs to finish (a counter
per head, which that program sets back to zero) combines them, else by a second kernel. No host syncs, fixed grid
shapes and counters that end every launch at zero: CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vllm_duo.kernels.cache_write import check_attention, fp8_format, fp8_in_fp16, load_scales, scale_tensors
from vllm_duo.kernels.launch import cdiv, launch, next_power_of_2
from vllm_duo.kernels.prefill import LOG2E, retrieval_tiles, softmax_tile, streaming_kv
from vllm_duo.kernels.reference import KVQuant, LayerHeads

MIN_SPLIT_TOKENS = 256  # shortest split on GPU: below this the partial writes and merge outweigh the parallelism
MAX_DECODE_SPLITS = 64  # a power of two: the split counts decode_num_splits chooses are 1, 2, 4, ... up to it
# a streaming head's window keys per program on GPU: at 4 x 128k (H200) the squeezed layer 2.234 ms at 64, 2.243 at
# 128, 2.253 at 256 (duo 6.74 each): the streaming heads' launches end before the row pass they slowed
STREAM_WINDOW_SPLIT = 64


@triton.jit
def keys_per_split(num_keys, MAX_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Keys per split of one request's `num_keys`: num_keys / MAX_SPLITS in whole tiles, at least MIN_SPLIT."""
    return tl.maximum(tl.cdiv(tl.cdiv(num_keys, MAX_SPLITS), BLOCK_N) * BLOCK_N, MIN_SPLIT)


@triton.jit
def _stream_split(split, seq_len, sink, recent, split_len):
    """Key positions [lo, hi) of a streaming head's split (`split` a scalar or a vector): split 0 the sinks, split k
    the (k-1)-th chunk of the window, the last `recent` positions above the sinks. Empty where hi <= lo."""
    window = tl.maximum(sink, seq_len - recent)
    lo = tl.where(split == 0, 0, window + (split - 1) * split_len)
    hi = tl.where(split == 0, tl.minimum(sink, seq_len), tl.minimum(lo + split_len, seq_len))
    return lo, hi


@triton.jit
def _streaming_range(q, m_i, l_i, acc, lo, hi, stream_ptr, table_row, head, num_streaming, stream_offset, page_heads,
                     stride, qk_scale, stride_sb, stride_skv, stride_sr, stride_sh,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Attend the new token to streaming head `head`'s keys [lo, hi), all of which it sees."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        k, v = streaming_kv(pos, valid, stream_ptr, table_row, head, num_streaming, stream_offset, page_heads, stride,
                            stride_sb, stride_skv, stride_sr, stride_sh, q.dtype, HEAD_DIM, BLOCK_D, BLOCK_SIZE)
        m_i, l_i, acc = softmax_tile(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, True)
    return m_i, l_i, acc


@triton.jit
def streaming_head_decode(query_ptr, out_ptr, stream_ptr, table_row, q_start, seq_len, head, kv_head, num_streaming,
                          stream_offset, page_heads, stride, sink, recent, k_scale_ptr, v_scale_ptr, qk_scale,
                          stride_qt, stride_qh, stride_ot, stride_oh, stride_sb, stride_skv, stride_sr, stride_sh,
                          G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, FP16: tl.constexpr):
    """Streaming head `head`'s (of the layer's streaming heads, KV head `kv_head`) attention of the new token at
    `q_start` over its sinks, then its window, in one program, written to `out`."""
    q, q_head, mask, qk_scale, v_scale, m_i, l_i, acc = start_decode(
        query_ptr, q_start, kv_head, k_scale_ptr, v_scale_ptr, qk_scale, stride_qt, stride_qh, G, BLOCK_G, HEAD_DIM,
        BLOCK_D, FP8, FP16)
    m_i, l_i, acc = _streaming_range(q, m_i, l_i, acc, 0, tl.minimum(sink, seq_len), stream_ptr, table_row, head,
                                     num_streaming, stream_offset, page_heads, stride, qk_scale,
                                     stride_sb, stride_skv, stride_sr, stride_sh, HEAD_DIM, BLOCK_D, BLOCK_N,
                                     BLOCK_SIZE)
    m_i, l_i, acc = _streaming_range(q, m_i, l_i, acc, tl.maximum(sink, seq_len - recent), seq_len, stream_ptr,
                                     table_row, head, num_streaming, stream_offset, page_heads, stride, qk_scale,
                                     stride_sb, stride_skv, stride_sr, stride_sh, HEAD_DIM, BLOCK_D, BLOCK_N,
                                     BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
             (acc / l_i[:, None] * v_scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def group_queries(query_ptr, token, kv_head, stride_qt, stride_qh, G: tl.constexpr, BLOCK_G: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The G query heads of KV head `kv_head` at token `token`: (q `[BLOCK_G, BLOCK_D]`, zero past G and HEAD_DIM;
    their query heads `[BLOCK_G]`; the mask of real elements `[BLOCK_G, BLOCK_D]`), so one program reads each K/V
    byte once for the whole group."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_g < G)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_head = kv_head * G + offs_g
    q = tl.load(query_ptr + token.to(tl.int64) * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=mask, other=0.0)
    return q, q_head, mask


@triton.jit
def start_decode(query_ptr, token, kv_head, k_scale_ptr, v_scale_ptr, qk_scale, stride_qt, stride_qh,
                 G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 FP8: tl.constexpr, FP16: tl.constexpr):
    """What a decode program of KV head `kv_head` starts from: `group_queries` (in fp16 where FP16: K/V tiles follow
    q's dtype), the scores' scale with the k scale in, the v scale, and an empty online softmax (m_i, l_i, acc)."""
    q, q_head, mask = group_queries(query_ptr, token, kv_head, stride_qt, stride_qh, G, BLOCK_G, HEAD_DIM, BLOCK_D)
    if FP16:
        q = q.to(tl.float16)
    k_scale, v_scale = load_scales(k_scale_ptr, v_scale_ptr, FP8)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    return q, q_head, mask, qk_scale * k_scale, v_scale, m_i, l_i, acc


@triton.jit
def store_part(part_out_ptr, part_lse_ptr, row, split, out, m_i, l_i, G: tl.constexpr, BLOCK_G: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_PARTS: tl.constexpr):
    """Store split `split`'s result `out` `[BLOCK_G, BLOCK_D]` (normalized) and its log2-sum-exp for query-head rows
    [row, row + G) of part_out `[rows, NUM_PARTS, HEAD_DIM]` / part_lse `[rows, NUM_PARTS]`, for `merge_last` or
    `merge_parts`."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    part = (row + offs_g) * NUM_PARTS + split
    tl.store(part_out_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=(offs_g < G)[:, None] & (offs_d < HEAD_DIM)[None, :])
    tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=offs_g < G)


@triton.jit
def merge_parts(part_out_ptr, part_lse_ptr, part, s_ok, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One query head's output `[BLOCK_D]` from its split results at rows `part` `[BLOCK_S]` (those with `s_ok`),
    weighted by their log2-sum-exp."""
    offs_d = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(part_out_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    return tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)


@triton.jit(do_not_specialize=["num_retrieval", "num_streaming", "stride", "stream_offset", "page_heads", "sink",
                               "recent", "first_program", "stride_table"])
def _decode_kernel(query_ptr, cache_ptr, stream_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr, retrieval_kv_ptr,
                   streaming_kv_ptr, query_start_loc_ptr, seq_lens_ptr, block_table_ptr, k_scale_ptr, v_scale_ptr,
                   qk_scale, num_retrieval, num_streaming, stride, stream_offset, page_heads, sink, recent, first_program,
                   stride_qt: tl.int64, stride_qh: tl.int64, stride_ot: tl.int64, stride_oh: tl.int64,
                   stride_table: tl.int64, stride_cb: tl.int64, stride_ckv: tl.int64, stride_cr: tl.int64,
                   stride_ch: tl.int64, stride_sb: tl.int64, stride_skv: tl.int64, stride_sr: tl.int64,
                   stride_sh: tl.int64,
                   G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, MAX_SPLITS: tl.constexpr,
                   STREAM_SPLITS: tl.constexpr, NUM_PARTS: tl.constexpr, MIN_SPLIT: tl.constexpr,
                   WINDOW_SPLIT: tl.constexpr, FP8: tl.constexpr, FP16: tl.constexpr, MERGE_IN_LAUNCH: tl.constexpr):
    """Grid (num_reqs, R * MAX_SPLITS + S * STREAM_SPLITS - first_program); requests whose query length is not 1 exit
    at once.

    Programs before `first_program` are not launched: R * MAX_SPLITS of them leaves the streaming heads only.
    A head split more than once writes its splits' results to part_out/part_lse, and counts its programs in
    `counter[req * (R + S) + head]` (int32, zero before the launch and after it); the last one merges (`merge_last`).
    Without MERGE_IN_LAUNCH `_merge_kernel` merges them after this launch.
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
        head = (pid - num_retrieval * MAX_SPLITS) // STREAM_SPLITS + num_retrieval
        split = (pid - num_retrieval * MAX_SPLITS) % STREAM_SPLITS
        kv_head = tl.load(streaming_kv_ptr + head - num_retrieval)
    table_row = block_table_ptr + req * stride_table
    if (head >= num_retrieval) & (STREAM_SPLITS == 1):  # one program reads the sinks, then the window
        streaming_head_decode(query_ptr, out_ptr, stream_ptr, table_row, q_start, seq_len, head - num_retrieval,
                              kv_head, num_streaming, stream_offset, page_heads, stride, sink, recent, k_scale_ptr,
                              v_scale_ptr, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_sb,
                              stride_skv, stride_sr, stride_sh, G, BLOCK_G, BLOCK_N, HEAD_DIM, BLOCK_D, BLOCK_SIZE,
                              FP8, FP16)
        return
    split_len = keys_per_split(seq_len, MAX_SPLITS, BLOCK_N, MIN_SPLIT)
    if head < num_retrieval:
        lo = split * split_len
        hi = tl.minimum(seq_len, lo + split_len)
        # the head's non-empty splits [first_part, last_part)
        first_part = 0
        last_part = tl.cdiv(seq_len, split_len)
    else:
        lo, hi = _stream_split(split, seq_len, sink, recent, WINDOW_SPLIT)
        window = tl.maximum(sink, seq_len - recent)
        first_part = tl.where(tl.minimum(sink, seq_len) > 0, 0, 1)
        last_part = 1 + tl.cdiv(tl.maximum(seq_len - window, 0), WINDOW_SPLIT)
    # part_out [num_reqs, (R + S) * G, NUM_PARTS, HEAD_DIM], part_lse [num_reqs, (R + S) * G, NUM_PARTS]
    row = (req * (num_retrieval + num_streaming) + head) * G
    splits = tl.where(head < num_retrieval, MAX_SPLITS, STREAM_SPLITS)
    if lo < hi:  # else a split past the context, or an empty sink or window split: it only counts
        q, q_head, mask, qk_scale, v_scale, m_i, l_i, acc = start_decode(
            query_ptr, q_start, kv_head, k_scale_ptr, v_scale_ptr, qk_scale, stride_qt, stride_qh, G, BLOCK_G,
            HEAD_DIM, BLOCK_D, FP8, FP16)
        if head < num_retrieval:
            q_pos = tl.full([BLOCK_G], seq_len - 1, tl.int32)
            m_i, l_i, acc = retrieval_tiles(q, m_i, l_i, acc, q_pos, lo, hi, seq_len - 1, cache_ptr, table_row,
                                            stride, head, qk_scale, stride_cb, stride_ckv, stride_cr, stride_ch,
                                            HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE)
        else:
            m_i, l_i, acc = _streaming_range(q, m_i, l_i, acc, lo, hi, stream_ptr, table_row, head - num_retrieval,
                                             num_streaming, stream_offset, page_heads, stride, qk_scale,
                                             stride_sb, stride_skv, stride_sr, stride_sh,
                                             HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE)
        out = acc / l_i[:, None] * v_scale
        if splits == 1:
            offs_d = tl.arange(0, BLOCK_D)
            tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=mask)
            return
        store_part(part_out_ptr, part_lse_ptr, row, split, out, m_i, l_i, G, BLOCK_G, HEAD_DIM, BLOCK_D, NUM_PARTS)
    if MERGE_IN_LAUNCH and splits > 1:  # (an unsplit head gets here only with nothing to attend: an empty context)
        merge_last(counter_ptr + req * (num_retrieval + num_streaming) + head, splits, part_out_ptr, part_lse_ptr, row,
                   first_part, last_part, out_ptr, q_start, kv_head, stride_ot, stride_oh, G, BLOCK_G, HEAD_DIM,
                   BLOCK_D, NUM_PARTS)


@triton.jit
def merge_last(counter_ptr, num_programs, part_out_ptr, part_lse_ptr, row, first_part, last_part, out_ptr, token,
               kv_head, stride_ot, stride_oh, G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, NUM_PARTS: tl.constexpr):
    """Count this program at `counter_ptr`, one of the `num_programs` of a split head; the last to count combines
    the head's split results [first_part, last_part) (`store_part`'s rows [row, row + G)) by their log2-sum-exp into
    its G query heads' output at `token`, and sets the counter back to zero for the next launch.

    A part may carry no weight (log-sum-exp -inf: the sparse decode's split of skipped positions only).
    The barrier orders every thread's `store_part` before the count (an acquire-release atomic at GPU scope), and
    the last program reads the parts past its SM's L1 (`.cg`): it may hold lines of an earlier launch's parts."""
    tl.debug_barrier()
    if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == num_programs - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < G
        parts = (row + offs_g).to(tl.int64) * NUM_PARTS
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for part in range(first_part, last_part):
            lse = tl.load(part_lse_ptr + parts + part, mask=g_ok, other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_i, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no weight yet: keep exp2 off -inf - -inf
            alpha = tl.exp2(m_i - m_safe)
            weight = tl.exp2(lse - m_safe)
            value = tl.load(part_out_ptr + (parts + part)[:, None] * HEAD_DIM + offs_d[None, :],
                            mask=g_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0, cache_modifier=".cg")
            acc = acc * alpha[:, None] + value * weight[:, None]
            l_i = l_i * alpha + weight
            m_i = m_new
        q_head = kv_head * G + offs_g
        tl.store(out_ptr + token.to(tl.int64) * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit(do_not_specialize=["num_retrieval", "num_streaming", "sink", "recent", "first_head"])
def _merge_kernel(out_ptr, part_out_ptr, part_lse_ptr, retrieval_kv_ptr, streaming_kv_ptr, query_start_loc_ptr,
                  seq_lens_ptr, num_retrieval, num_streaming, sink, recent, first_head,
                  stride_ot: tl.int64, stride_oh: tl.int64,
                  G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  MAX_SPLITS: tl.constexpr, NUM_PARTS: tl.constexpr, MIN_SPLIT: tl.constexpr,
                  WINDOW_SPLIT: tl.constexpr, BLOCK_S: tl.constexpr):
    """Grid (num_reqs, split query heads, from KV head `first_head` on, retrieval before streaming as in part_out):
    combine one query head's split results by their log-sum-exp, after a `_decode_kernel` launch whose splits are too
    deep to merge in it (MAX_PARTS_MERGED_IN_LAUNCH)."""
    req = tl.program_id(0)
    h = tl.program_id(1) + first_head * G
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    split_len = keys_per_split(seq_len, MAX_SPLITS, BLOCK_N, MIN_SPLIT)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    head = h // G
    if head < num_retrieval:
        s_ok = offs_s * split_len < seq_len
        kv_head = tl.load(retrieval_kv_ptr + head)
    else:
        lo, hi = _stream_split(offs_s, seq_len, sink, recent, WINDOW_SPLIT)
        s_ok = lo < hi
        kv_head = tl.load(streaming_kv_ptr + head - num_retrieval)
    s_ok = s_ok & (offs_s < NUM_PARTS)
    part = (req * (num_retrieval + num_streaming) * G + h) * NUM_PARTS + offs_s
    out = merge_parts(part_out_ptr, part_lse_ptr, part, s_ok, HEAD_DIM, BLOCK_D)
    q_head = kv_head * G + h % G
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + q_head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@functools.cache
def _sm_count(device_index: int | None) -> int:
    """The GPU's SM count (a property lookup costs host time on every layer call otherwise)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class DecodeTiles(NamedTuple):
    """The decode kernels' launch shape: keys per tile, shortest split in tokens, pipeline stages, warps."""

    block_n: int
    min_split: int
    stages: int
    warps: int


def decode_tiles(head_dim: int, device: torch.device, fp8: bool = False) -> DecodeTiles:
    """The decode kernels' tiles: a multiple of the 16-token block, 64 keys, 32 for head_dim 256 (64 spills registers
    at 4 warps); over fp8 pages (`fp8`) and head_dim <= 128, FP8_DECODE_TILES. The CPU interpreter takes 16 and
    one-tile splits, so that tests cross tiles and splits. kernels_bench.py --long-decode tries others over fp8.
    """
    if device.type != "cuda":
        return DecodeTiles(16, 16, 1, 4)
    if fp8 and head_dim <= 128:
        return FP8_DECODE_TILES
    return DecodeTiles(64 if head_dim <= 128 else 32, MIN_SPLIT_TOKENS, 3, 4)


# Over fp8 pages the 16-bit tiles (64 keys, 3 stages, 4 warps) compile (sm_90) to 180 registers and 37 KB of shared
# memory: 2 programs an SM with 74 KB of pages in flight, where bf16's hold 210 KB (3 programs). 5 stages read the
# retrieval heads of a 4 x 64k step in 4.48 ms against 5.04 (4 x 128k: 7.65 against 9.24; 8 stages and wider tiles
# slower: benchmarks/results/2026-12-07-h100-decode-variants), still behind FlashAttention-3's 3.79 (7.08), which
# decodes them on Hopper (gpu_attention.py)
FP8_DECODE_TILES = DecodeTiles(64, MIN_SPLIT_TOKENS, 5, 4)
# A launch whose split heads have at most this many parts each merges them itself (the last of a head's programs,
# `merge_last`): at many requests decode_num_splits makes few splits, and the launch saved is worth more than the last
# program's merge, which overlaps other programs' work. At a few requests it makes up to 64 splits a head, and one
# program merging them in turn would be the launch's tail: a second launch merges them (`_merge_kernel`, one program
# a query head, its parts at once). One Llama-3.1-8B layer's decode in a CUDA graph on the H100, max_model_len 99,000,
# in the launch against by a second (device ms, benchmarks/results/2026-12-07-h100-merge-in-launch): 256 x 1k (5
# parts) 0.310 against 0.373, 32 x 1k (16) 0.052 against 0.058, 32 x 4k (16) 0.122 against 0.127; 4 x 1k (64) level,
# 4 x 4k (64) 0.026 against 0.023, 4 x 64k (64) 0.209 against 0.194 (a 32-layer bf16 step: 6.91 against 6.37 ms)
MAX_PARTS_MERGED_IN_LAUNCH = 16


def decode_num_splits(num_reqs: int, num_retrieval: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per retrieval head so that about 8 programs per SM stream the cache (the split length this sets
    also cuts the streaming heads' windows, in layers without retrieval heads too).

    Depends only on host ints, so a captured graph can fix it (pass max_model_len as max_seq_len).
    """
    if device.type != "cuda":
        return 1
    want = cdiv(8 * _sm_count(device.index), max(num_reqs * num_retrieval, 1))
    # a power of two: MAX_SPLITS is a compile-time constant, so at most 7 variants ever compile (all at warm-up)
    return next_power_of_2(max(1, min(want, cdiv(max_seq_len, MIN_SPLIT_TOKENS), MAX_DECODE_SPLITS)))


def decode_attention(query: torch.Tensor, cache: torch.Tensor, heads: LayerHeads, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, output: torch.Tensor,
                     max_num_splits: int, stream_cache: torch.Tensor | None = None, quant: KVQuant | None = None,
                     streaming_only: bool = False, checked: bool = False, min_split: int | None = None) -> None:
    """Duo attention of every request with exactly one new token; other requests are left untouched.

    The batch's K/V must already be in the cache (`write_kv`).

    Args:
        query: `[num_tokens, num_heads, head_dim]`.
        cache: `[num_blocks, 2, block_size, P, head_dim]`.
        heads: the layer's head maps (index tensors on the cache's device).
        query_start_loc: `[num_reqs + 1]` int32; seq_lens: `[num_reqs]` int32; block_table: `[num_reqs, max_blocks]` int32.
        output: `[num_tokens, num_heads, head_dim]`, written in place.
        max_num_splits: fixed bound on context splits per retrieval head (`decode_num_splits`); 1 also keeps each
            streaming head in one program, and skips the merge.
        stream_cache: the cache whose page groups hold the layer's streaming K/V (default `cache`).
        quant: the k/v scales of an fp8 cache (default 1).
        streaming_only: skip the retrieval heads (attention.py gives them to FlashAttention).
        checked: the caller has validated these inputs (`write_kv`'s argument).
        min_split: the shortest split in tokens, a multiple of the key tile (default MIN_SPLIT_TOKENS on GPU,
            one tile on the CPU interpreter; kernels_bench.py tries others).
    """
    stream_cache = check_attention(query, output, cache, stream_cache, heads, query_start_loc, seq_lens, block_table,
                                   checked)
    num_reqs, R, S = seq_lens.shape[0], heads.num_retrieval, heads.num_streaming
    if query.shape[0] == 0 or num_reqs == 0 or S + (0 if streaming_only else R) == 0:
        return
    head_dim, G = cache.shape[-1], heads.group_size
    block_d = next_power_of_2(head_dim)
    # a streaming head's program reads one window chunk: deeper fp8 pipelines would only hold shared memory (beside
    # FlashAttention)
    tiles = decode_tiles(head_dim, cache.device, bool(fp8_format(cache)) and not streaming_only)
    block_n, min_split = tiles.block_n, min_split or tiles.min_split
    # streaming heads: the sinks, then the window in chunks of whole tiles, at most STREAM_WINDOW_SPLIT keys on GPU
    # (min_split on the CPU interpreter)
    window_chunk = STREAM_WINDOW_SPLIT if cache.is_cuda else min_split
    stream_splits = 1 + cdiv(heads.recent, window_chunk) if S and heads.recent and max_num_splits > 1 else 1
    window_split = cdiv(cdiv(heads.recent, max(stream_splits - 1, 1)), block_n) * block_n
    num_parts = max(max_num_splits, stream_splits)
    first_program = R * max_num_splits if streaming_only else 0
    # KV heads whose splits are merged (part_out's rows run retrieval, then streaming heads)
    merged = range(0 if max_num_splits > 1 and not streaming_only else R, R + S if stream_splits > 1 else R)
    part_out = part_lse = output  # unused placeholders when nothing is split
    if merged:
        part_out = torch.empty(num_reqs, (R + S) * G, num_parts, head_dim, dtype=torch.float32, device=cache.device)
        part_lse = torch.empty(num_reqs, (R + S) * G, num_parts, dtype=torch.float32, device=cache.device)
    in_launch = (stream_splits if streaming_only else num_parts) <= MAX_PARTS_MERGED_IN_LAUNCH
    counters = merge_counters(num_reqs * (R + S), cache.device)  # read only where this launch merges
    launch(_decode_kernel, (num_reqs, R * max_num_splits + S * stream_splits - first_program))(
        query, cache, stream_cache, output, part_out, part_lse, counters, heads.retrieval_kv, heads.streaming_kv,
        query_start_loc, seq_lens, block_table, *scale_tensors(quant, cache), scale * LOG2E,
        R, S, heads.stride, heads.stream_offset, stream_cache.shape[3], heads.sink, heads.recent, first_program,
        *query.stride()[:2], *output.stride()[:2], block_table.stride(0), *cache.stride()[:4],
        *stream_cache.stride()[:4],
        G=G, BLOCK_G=max(16, next_power_of_2(G)), BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=cache.shape[2], MAX_SPLITS=max_num_splits, STREAM_SPLITS=stream_splits, NUM_PARTS=num_parts,
        MIN_SPLIT=min_split, WINDOW_SPLIT=window_split, FP8=fp8_format(cache), FP16=fp8_in_fp16(cache, query),
        MERGE_IN_LAUNCH=in_launch, num_warps=tiles.warps, num_stages=tiles.stages)
    if merged and not in_launch:
        launch(_merge_kernel, (num_reqs, len(merged) * G))(
            output, part_out, part_lse, heads.retrieval_kv, heads.streaming_kv, query_start_loc, seq_lens, R, S,
            heads.sink, heads.recent, merged.start, output.stride(0), output.stride(1),
            G=G, BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=block_d, MAX_SPLITS=max_num_splits, NUM_PARTS=num_parts,
            MIN_SPLIT=min_split, WINDOW_SPLIT=window_split, BLOCK_S=next_power_of_2(num_parts), num_warps=8)


def merge_counters(rows: int, device: torch.device) -> torch.Tensor:
    """`_decode_kernel`'s merge counters for `rows` split heads: zeros, which each launch leaves at zero, so one
    buffer per device serves every launch (launches on one device run one after another: a layer's streaming heads
    beside FlashAttention are the only decode launch of their layer). A larger one is made when needed; the smaller
    ones stay alive, since CUDA graphs keep the addresses they captured."""
    buffers = _MERGE_COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < rows:
        buffers.append(torch.zeros(max(rows, MIN_MERGE_COUNTERS), dtype=torch.int32, device=device))
    return buffers[-1]


MIN_MERGE_COUNTERS = 1 << 16  # 256 KB: every split head of 1024 requests of 64 KV heads
_MERGE_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}
