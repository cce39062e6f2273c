# SPDX-License-Identifier: Apache-2.0
"""Triton sparse decode of duo's retrieval heads (Squeezed Attention): each retrieval KV head attends exactly over
its sinks, its recent window and a selected list of the context's positions, not the whole context.

Each (request, retrieval KV head) reads one key list, the sinks, then its selected positions in the order given,
then the window, split flash-decoding style into MAX_SPLITS chunks of one split length (computed on the device
from the list's length, at least MIN_SPLIT), so that a few requests with long lists still fill the GPU:

    seq_len 1000, sink 64, recent 256, 5 selected positions, split length 128
    list index  0 .. 63  | 64 .. 68             | 69 .. 324
    position    0 .. 63  | selected[0 .. 4]     | 744 .. 999
    split 0 [0, 128)  split 1 [128, 256)  split 2 [256, 325)

Each head's split results are merged by their log-sum-exp as decode.py's are: by the last of its programs
(`merge_last`) where the splits are few (decode.MAX_PARTS_MERGED_IN_LAUNCH), else by a second kernel (`merge_parts`).
No host syncs and fixed grid shapes: CUDA-graph capturable. The selection itself is selection.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_duo.kernels.cache_write import check_attention, fp8_format, fp8_in_fp16, scale_tensors
from vllm_duo.kernels import decode
from vllm_duo.kernels.decode import (decode_num_splits, decode_tiles, keys_per_split, merge_counters, merge_last,
                                     merge_parts, start_decode, store_part)
from vllm_duo.kernels.launch import launch, next_power_of_2
from vllm_duo.kernels.prefill import LOG2E, retrieval_kv, softmax_tile
from vllm_duo.kernels.reference import KVQuant, LayerHeads


@triton.jit
def _key_list(seq_len, num_selected, sink, recent, context_ends_ptr, req, CONTEXT_ENDS: tl.constexpr):
    """(sinks, first window position, list length) of request `req`'s key list: the sinks [0, min(sink, seq_len)),
    the selected positions, the window [max(sink, context_ends[req]), seq_len) (the new token at least), or
    without context ends [max(sink, seq_len - recent), seq_len)."""
    if CONTEXT_ENDS:
        window = tl.maximum(sink, tl.minimum(tl.load(context_ends_ptr + req), seq_len - 1))
    else:
        window = tl.maximum(sink, seq_len - recent)
    num_sink = tl.minimum(sink, seq_len)
    return num_sink, window, num_sink + num_selected + tl.maximum(seq_len - window, 0)


@triton.jit
def _unclustered(context_ends_ptr, req, CONTEXT_ENDS: tl.constexpr):
    """Whether request `req` has a context end of 0: no clustered context, left to duo's decode."""
    if CONTEXT_ENDS:
        return tl.load(context_ends_ptr + req) == 0
    return False


@triton.jit(do_not_specialize=["num_retrieval", "stride", "sink", "recent", "max_selected"])
def _sparse_decode_kernel(query_ptr, cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr, retrieval_kv_ptr,
                          query_start_loc_ptr, seq_lens_ptr, block_table_ptr, selected_ptr, num_selected_ptr,
                          context_ends_ptr, k_scale_ptr, v_scale_ptr, qk_scale, num_retrieval, stride, sink, recent,
                          max_selected,
                          stride_qt: tl.int64, stride_qh: tl.int64, stride_ot: tl.int64, stride_oh: tl.int64,
                          stride_table: tl.int64, stride_cb: tl.int64, stride_ckv: tl.int64, stride_cr: tl.int64,
                          stride_ch: tl.int64, stride_selr: tl.int64, stride_selh: tl.int64, stride_nr: tl.int64,
                          stride_nh: tl.int64,
                          G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, MAX_SPLITS: tl.constexpr,
                          MIN_SPLIT: tl.constexpr, FP8: tl.constexpr, FP16: tl.constexpr,
                          CONTEXT_ENDS: tl.constexpr, MERGE_IN_LAUNCH: tl.constexpr):
    """Grid (num_reqs, R * MAX_SPLITS): split `pid % MAX_SPLITS` of retrieval head `pid // MAX_SPLITS`'s key list.

    Requests whose query length is not 1 or whose context end is 0 exit at once; splits past the list attend
    nothing (with MERGE_IN_LAUNCH they count toward their head's merge). A
    selected position in the sinks or the window, or past the context, is skipped (those keys are read once, as
    sinks or window).
    With MAX_SPLITS > 1 the results go to part_out/part_lse for the merge: with MERGE_IN_LAUNCH the last of a head's
    programs merges them (`counter[req * R + head]`, decode.py's `merge_last`), else `_sparse_merge_kernel` after
    this launch. An FP8 cache holds K/V divided by the layer's scales: the scores take the k scale, each output the v
    scale.
    """
    req = tl.program_id(0)
    head = tl.program_id(1) // MAX_SPLITS
    split = tl.program_id(1) % MAX_SPLITS
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - q_start != 1 or _unclustered(context_ends_ptr, req, CONTEXT_ENDS):
        return
    seq_len = tl.load(seq_lens_ptr + req)
    num_selected = tl.minimum(tl.load(num_selected_ptr + req * stride_nr + head * stride_nh), max_selected)
    num_sink, window, length = _key_list(seq_len, num_selected, sink, recent, context_ends_ptr, req, CONTEXT_ENDS)
    split_len = keys_per_split(length, MAX_SPLITS, BLOCK_N, MIN_SPLIT)
    lo = split * split_len
    hi = tl.minimum(length, lo + split_len)
    kv_head = tl.load(retrieval_kv_ptr + head)
    # part_out [num_reqs, R * G, MAX_SPLITS, HEAD_DIM], part_lse [num_reqs, R * G, MAX_SPLITS]
    row = (req * num_retrieval + head) * G
    if lo < hi:  # else a split past the list: with MERGE_IN_LAUNCH it only counts
        q, q_head, mask, qk_scale, v_scale, m_i, l_i, acc = start_decode(
            query_ptr, q_start, kv_head, k_scale_ptr, v_scale_ptr, qk_scale, stride_qt, stride_qh, G, BLOCK_G,
            HEAD_DIM, BLOCK_D, FP8, FP16)
        table_row = block_table_ptr + req * stride_table
        selected_row = selected_ptr + req * stride_selr + head * stride_selh
        for start in range(lo, hi, BLOCK_N):
            index = start + tl.arange(0, BLOCK_N)
            valid = index < hi
            listed = (index >= num_sink) & (index < num_sink + num_selected)
            chosen = tl.load(selected_row + (index - num_sink), mask=valid & listed, other=0)
            pos = tl.where(index < num_sink, index, tl.where(listed, chosen, window + index - num_sink - num_selected))
            valid = valid & (~listed | ((chosen >= sink) & (chosen < window)))
            k, v = retrieval_kv(pos, valid, cache_ptr, table_row, stride, head, stride_cb, stride_ckv, stride_cr,
                                stride_ch, q.dtype, HEAD_DIM, BLOCK_D, BLOCK_SIZE)
            m_i, l_i, acc = softmax_tile(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale, True)
        # a split of skipped positions only: 0 with log-sum-exp -inf, no weight in the merge (the window is never
        # empty)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
        if MAX_SPLITS == 1:
            offs_d = tl.arange(0, BLOCK_D)
            tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=mask)
            return
        store_part(part_out_ptr, part_lse_ptr, row, split, out, m_i, l_i, G, BLOCK_G, HEAD_DIM, BLOCK_D, MAX_SPLITS)
    if MERGE_IN_LAUNCH and MAX_SPLITS > 1:
        merge_last(counter_ptr + req * num_retrieval + head, MAX_SPLITS, part_out_ptr, part_lse_ptr, row, 0,
                   tl.cdiv(length, split_len), out_ptr, q_start, kv_head, stride_ot, stride_oh, G, BLOCK_G, HEAD_DIM,
                   BLOCK_D, MAX_SPLITS)


@triton.jit(do_not_specialize=["num_retrieval", "sink", "recent", "max_selected"])
def _sparse_merge_kernel(out_ptr, part_out_ptr, part_lse_ptr, retrieval_kv_ptr, query_start_loc_ptr, seq_lens_ptr,
                         num_selected_ptr, context_ends_ptr, num_retrieval, sink, recent, max_selected,
                         stride_ot: tl.int64, stride_oh: tl.int64, stride_nr: tl.int64, stride_nh: tl.int64,
                         G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         MAX_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_S: tl.constexpr,
                         CONTEXT_ENDS: tl.constexpr):
    """Grid (num_reqs, R * G): combine one retrieval query head's split results (those within its key list)."""
    req = tl.program_id(0)
    h = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - q_start != 1 or _unclustered(context_ends_ptr, req, CONTEXT_ENDS):
        return
    head = h // G
    num_selected = tl.minimum(tl.load(num_selected_ptr + req * stride_nr + head * stride_nh), max_selected)
    _, _, length = _key_list(tl.load(seq_lens_ptr + req), num_selected, sink, recent, context_ends_ptr, req,
                             CONTEXT_ENDS)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = (offs_s * keys_per_split(length, MAX_SPLITS, BLOCK_N, MIN_SPLIT) < length) & (offs_s < MAX_SPLITS)
    out = merge_parts(part_out_ptr, part_lse_ptr, (req * num_retrieval * G + h) * MAX_SPLITS + offs_s, s_ok,
                      HEAD_DIM, BLOCK_D)
    offs_d = tl.arange(0, BLOCK_D)
    q_head = tl.load(retrieval_kv_ptr + head) * G + h % G
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + q_head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def sparse_decode_attention(query: torch.Tensor, cache: torch.Tensor, heads: LayerHeads,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                            scale: float, output: torch.Tensor, selected: torch.Tensor, num_selected: torch.Tensor,
                            max_num_splits: int | None = None, quant: KVQuant | None = None,
                            sink: int | None = None, recent: int | None = None, checked: bool = False,
                            min_split: int | None = None, context_ends: torch.Tensor | None = None) -> None:
    """Attention of the retrieval heads of every request with exactly one new token over their sinks, window and
    selected positions; other requests, and the streaming heads, are left untouched.

    With every context position between the sinks and the window selected, this is `decode_attention`'s result
    for the retrieval heads. The batch's K/V must already be in the cache (`write_kv`).

    Args:
        query: `[num_tokens, num_heads, head_dim]`.
        cache: `[num_blocks, 2, block_size, P, head_dim]` (bf16, fp16, fp32 or fp8 with `quant`'s scales).
        heads: the layer's head maps (index tensors on the cache's device); retrieval head r is page slot r.
        query_start_loc: `[num_reqs + 1]` int32; seq_lens: `[num_reqs]` int32; block_table: `[num_reqs, max_blocks]`
            int32, `heads.stride` columns per token block.
        output: `[num_tokens, num_heads, head_dim]`, written in place at the retrieval query heads.
        selected: `[num_reqs, R, max_selected]` int32, unit last stride: each (request, retrieval KV head)'s
            distinct context positions, any order; the query heads of its GQA group share them. Positions in
            the sinks or the window, or past the context, are skipped.
        num_selected: `[num_reqs, R]` int32: how many of a row's positions count (at most max_selected).
        max_num_splits: fixed bound on splits per key list; default `decode_num_splits` for lists of
            sink + max_selected + recent keys (1 skips the merge).
        quant: the k/v scales of an fp8 cache (default 1).
        sink, recent: the sinks and window every head attends (default `heads.sink`, `heads.recent`).
        checked: the caller has validated these inputs.
        min_split: the shortest split in keys, a multiple of the key tile (default as `decode_attention`).
        context_ends: `[num_reqs]` int32, where each request's clustered context ends: its selectable positions are
            [sink, end) and its window [end, seq_len), every token after the context (the prompt's tail, those
            generated), however many; 0: the request has none and is left untouched (duo's decode serves it).
            None: the window is the last `recent` positions.
    """
    sink = heads.sink if sink is None else sink
    recent = heads.recent if recent is None else recent
    num_reqs, R = seq_lens.shape[0], heads.num_retrieval
    if not checked:
        check_attention(query, output, cache, None, heads, query_start_loc, seq_lens, block_table)
        check_selection(selected, num_selected, num_reqs, R, cache.device)
        if recent < 1 or sink < 0:
            raise ValueError(f"sparse decode needs recent >= 1 (the new token) and sink >= 0, got {recent}, {sink}")
    if query.shape[0] == 0 or num_reqs == 0 or R == 0:
        return
    head_dim, G, max_selected = cache.shape[-1], heads.group_size, selected.shape[-1]
    block_d = next_power_of_2(head_dim)
    tiles = decode_tiles(head_dim, cache.device, bool(fp8_format(cache)))
    block_n, min_split = tiles.block_n, min_split or tiles.min_split
    if max_num_splits is None:
        max_num_splits = decode_num_splits(num_reqs, R, sink + max_selected + recent, cache.device)
    part_out = part_lse = output  # unused placeholders when nothing is split
    if max_num_splits > 1:
        part_out = torch.empty(num_reqs, R * G, max_num_splits, head_dim, dtype=torch.float32, device=cache.device)
        part_lse = torch.empty(num_reqs, R * G, max_num_splits, dtype=torch.float32, device=cache.device)
    in_launch = max_num_splits <= decode.MAX_PARTS_MERGED_IN_LAUNCH
    launch(_sparse_decode_kernel, (num_reqs, R * max_num_splits))(
        query, cache, output, part_out, part_lse, merge_counters(num_reqs * R, cache.device), heads.retrieval_kv,
        query_start_loc, seq_lens, block_table, selected, num_selected,
        seq_lens if context_ends is None else context_ends, *scale_tensors(quant, cache),
        scale * LOG2E, R, heads.stride, sink, recent,
        max_selected, *query.stride()[:2], *output.stride()[:2], block_table.stride(0), *cache.stride()[:4],
        *selected.stride()[:2], *num_selected.stride(),
        G=G, BLOCK_G=max(16, next_power_of_2(G)), BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=cache.shape[2], MAX_SPLITS=max_num_splits, MIN_SPLIT=min_split, FP8=fp8_format(cache),
        FP16=fp8_in_fp16(cache, query), CONTEXT_ENDS=context_ends is not None, MERGE_IN_LAUNCH=in_launch,
        num_warps=tiles.warps, num_stages=tiles.stages)
    if max_num_splits > 1 and not in_launch:
        launch(_sparse_merge_kernel, (num_reqs, R * G))(
            output, part_out, part_lse, heads.retrieval_kv, query_start_loc, seq_lens, num_selected,
            seq_lens if context_ends is None else context_ends, R, sink, recent, max_selected, *output.stride()[:2],
            *num_selected.stride(),
            G=G, BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=block_d, MAX_SPLITS=max_num_splits, MIN_SPLIT=min_split,
            BLOCK_S=next_power_of_2(max_num_splits), CONTEXT_ENDS=context_ends is not None, num_warps=4)


def check_selection(selected: torch.Tensor, num_selected: torch.Tensor, num_reqs: int, num_retrieval: int,
                    device: torch.device) -> None:
    """Check a selection's shapes and dtypes: `[num_reqs, R, max_selected]` positions, `[num_reqs, R]` counts."""
    ok = (selected.dim() == 3 and tuple(selected.shape[:2]) == (num_reqs, num_retrieval) and selected.stride(-1) == 1
          and tuple(num_selected.shape) == (num_reqs, num_retrieval))
    if not ok:
        raise ValueError(f"selected {tuple(selected.shape)} must be [{num_reqs}, {num_retrieval}, max_selected] with "
                         f"unit last stride, num_selected {tuple(num_selected.shape)} [{num_reqs}, {num_retrieval}]")
    for name, t in (("selected", selected), ("num_selected", num_selected)):
        if t.dtype != torch.int32 or t.device != device:
            raise ValueError(f"{name} must be int32 on {device}, got {t.dtype} on {t.device}")
