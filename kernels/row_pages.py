# SPDX-License-Identifier: Apache-2.0
"""The squeeze's sparse decode as two FlashAttention passes (gpu_attention.py runs them): the window pass over each
squeezed row's retrieval pages from its context's end on, then a pass over pages of one cache row listing its sinks
and selected keys, the two merged by their log-sum-exp. This module builds the second pass's page lists and merges;
it imports no FlashAttention (the merge takes any pass's output and log-sum-exp).

A duo cache `[num_blocks, 2, block_size, P, head_dim]` seen as rows of `head_dim` elements (`row_views`; its blocks
`B` rows apart, 2 x block_size x P when they are packed): the K row of retrieval head r at position p is

    row = block * B + (p % block_size) * P + r,   block = block_table[req, p // block_size * stride]

and its V row is `V` rows further (block_size x P when packed), so that K and V seen as `[rows, 1, 1, head_dim]`
paged caches (pages of one row, one KV head), the V view starting V rows later, take the same page ids:

    request 0 (context end 4,096, sink 64), retrieval head 1, 3 selected positions, its list in 2 parts
    list: row(0), ..., row(63), row(sel[0]), row(sel[1]), row(sel[2]): 67 ids, parts of 34 and 33
    entry (0 * R + 1) * 2 + 0: pages [row(0), ..., row(33), 0, ...], length 34
    entry (0 * R + 1) * 2 + 1: pages [row(34), ..., row(63), row(sel[0]), row(sel[1]), row(sel[2]), 0, ...], length 33
    each entry's query: a copy of request 0's last token at head 1's G query heads

The parts stand in for FlashAttention's own KV splits: each entry read in one split, the parts and the window pass
merged by one launch here (`merge_rows`) instead of FlashAttention's split combine and then a merge.

The window [context end, seq_len) is the first pass's (FlashAttention over the retrieval pages shifted by the
context end's page: context ends are block aligned). FlashAttention reads each list's selected keys at about 1.2
TB/s where the Triton sparse decode (sparse_decode.py) reads them at 0.8 (kernels_bench.py --squeeze-decode).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vllm_duo.kernels.reference import LayerHeads

PAGE_SLOTS = 256  # list entries per program


@triton.jit(do_not_specialize=["num_retrieval", "parts", "stride", "sink", "max_selected", "part_width",
                               "block_rows", "token_rows"])
def _row_pages_kernel(selected_ptr, num_selected_ptr, context_ends_ptr, block_table_ptr, queries_ptr,
                      query_start_loc_ptr, pages_ptr, lens_ptr, cu_ptr, part_queries_ptr, num_retrieval, parts,
                      stride, sink, max_selected, part_width, block_rows, token_rows,
                      stride_sr: tl.int64, stride_sh: tl.int64, stride_nr: tl.int64, stride_nh: tl.int64,
                      stride_table: tl.int64, stride_pe: tl.int64, stride_qt: tl.int64, stride_qh: tl.int64,
                      stride_ue: tl.int64, stride_ug: tl.int64,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, SLOTS: tl.constexpr):
    """Grid (num_reqs, R, parts x cdiv(part_width, SLOTS)): SLOTS page ids of one part of entry (req, head)'s list;
    the first program of a part writes its length and query start, and copies its query."""
    req, head, program = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    chunks = tl.cdiv(part_width, SLOTS)
    part, chunk = program // chunks, program % chunks
    entry = req * num_retrieval + head
    squeezed = tl.load(context_ends_ptr + req) > 0
    count = tl.minimum(tl.load(num_selected_ptr + req * stride_nr + head * stride_nh), max_selected)
    length = tl.where(squeezed, sink + count, 0)
    width = tl.cdiv(length, parts)  # every part's but the last's (which may be shorter, or empty)
    part_len = tl.minimum(tl.maximum(length - part * width, 0), width)
    col = chunk * SLOTS + tl.arange(0, SLOTS)
    live = col < part_len
    index = part * width + col  # in the entry's list: sinks, then the selection
    chosen = tl.load(selected_ptr + req * stride_sr + head * stride_sh + (index - sink), mask=live & (index >= sink),
                     other=0)
    pos = tl.where(index < sink, index, chosen)
    block = tl.load(block_table_ptr + req * stride_table + pos // BLOCK_SIZE * stride, mask=live, other=0)
    row = block.to(tl.int64) * block_rows + (pos % BLOCK_SIZE) * token_rows + head
    sub = entry * parts + part
    tl.store(pages_ptr + sub * stride_pe + col, tl.where(live, row, 0).to(tl.int32), mask=col < part_width)
    if chunk == 0:
        tl.store(lens_ptr + sub, part_len)
        tl.store(cu_ptr + sub, sub)
        if sub == tl.num_programs(0) * num_retrieval * parts - 1:
            tl.store(cu_ptr + sub + 1, sub + 1)
        token = tl.maximum(tl.load(query_start_loc_ptr + req + 1) - 1, 0).to(tl.int64)  # the request's last
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        ok = (offs_g < G)[:, None] & (offs_d < HEAD_DIM)[None, :]
        q = tl.load(queries_ptr + token * stride_qt + (head * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                    mask=ok)
        tl.store(part_queries_ptr + sub * stride_ue + offs_g[:, None] * stride_ug + offs_d[None, :], q, mask=ok)


class RowBatch(NamedTuple):
    """The row pass's batch for FlashAttention: entry `(req * R + r) * parts + p` is part p of request req's list
    for retrieval head r (its sinks, then its selected positions, in `parts` runs of equal length, the last
    shorter or empty), its query that request's last token at head r's G query heads."""

    pages: torch.Tensor  # [num_reqs * R * parts, part_width] int32 row ids (0 past each length)
    lens: torch.Tensor  # [num_reqs * R * parts] int32
    starts: torch.Tensor  # [num_reqs * R * parts + 1] int32: entry i's query is row i of `queries`
    queries: torch.Tensor  # [num_reqs * R * parts, G, head_dim]


def row_batch(selected: torch.Tensor, num_selected: torch.Tensor, context_ends: torch.Tensor,
              block_table: torch.Tensor, heads: LayerHeads, cache: torch.Tensor, queries: torch.Tensor,
              query_start_loc: torch.Tensor, parts: int, sink: int | None = None) -> RowBatch:
    """Page lists of one cache row for the row pass, one launch: per (request, retrieval head) its sinks then its
    selected positions, cut into `parts` batch entries each with its own copy of the query. FlashAttention then
    reads every entry in one split, and `merge_rows` merges the parts with the window pass: no split-combine
    launch of FlashAttention's own.

    Args:
        selected: `[num_reqs, R, max_selected]` int32 positions, `num_selected` `[num_reqs, R]` int32 (selection.py).
        context_ends: `[num_reqs]` int32: 0 at rows that read no clustered context (their lists are empty).
        block_table: `[num_reqs, max_blocks]` int32, `heads.stride` columns per token block.
        cache: the duo cache `row_views` sees (its shape and strides set the row ids).
        queries: `[num_tokens, R * G, head_dim]`, unit last stride: the retrieval query heads as FlashAttention
            takes them (gpu_attention.flash_queries); query_start_loc `[num_reqs + 1]` int32.
        parts: batch entries per list (>= 1).
        sink: default `heads.sink`.
    """
    sink = heads.sink if sink is None else sink
    num_reqs, R, max_selected = selected.shape
    G, head_dim = heads.group_size, queries.shape[-1]
    entries = num_reqs * R * parts
    part_width = triton.cdiv(sink + max_selected, parts)
    device = selected.device
    batch = RowBatch(torch.empty(entries, part_width, dtype=torch.int32, device=device),
                     torch.empty(entries, dtype=torch.int32, device=device),
                     torch.empty(entries + 1, dtype=torch.int32, device=device),
                     torch.empty(entries, G, head_dim, dtype=queries.dtype, device=device))
    if entries == 0:
        batch.starts.zero_()
        return batch
    slots = PAGE_SLOTS if device.type == "cuda" else 16
    _row_pages_kernel[(num_reqs, R, parts * triton.cdiv(part_width, slots))](
        selected, num_selected, context_ends, block_table, queries, query_start_loc, batch.pages, batch.lens,
        batch.starts, batch.queries, R, parts, heads.stride, sink, max_selected, part_width,
        cache.stride(0) // cache.shape[-1], cache.stride(2) // cache.shape[-1], *selected.stride()[:2],
        *num_selected.stride(), block_table.stride(0), batch.pages.stride(0), *queries.stride()[:2],
        *batch.queries.stride()[:2], G=G, BLOCK_G=triton.next_power_of_2(G), HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=cache.shape[2], SLOTS=slots)
    return batch


def row_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a duo cache `[num_blocks, 2, block_size, P, head_dim]` as `[rows, 1, 1, head_dim]` pages of one
    row that `row_pages`' ids index (as many pages each). Its rows must be whole: each token's P heads one after
    another, its blocks and K/V halves a whole number of rows apart."""
    head_dim = cache.shape[-1]
    strides = cache.stride()
    if strides[3:] != (head_dim, 1) or strides[2] != cache.shape[3] * head_dim or strides[0] % head_dim \
            or strides[1] % head_dim:
        raise ValueError(f"a duo cache of shape {tuple(cache.shape)} and strides {strides} has no rows of one head")
    v_rows = strides[1] // head_dim
    rows = (cache.shape[0] - 1) * (strides[0] // head_dim) + v_rows  # through the last block's K rows
    k = torch.as_strided(cache, (rows, 1, 1, head_dim), (head_dim, head_dim, head_dim, 1))
    v = torch.as_strided(cache, (rows, 1, 1, head_dim), (head_dim, head_dim, head_dim, 1),
                         cache.storage_offset() + strides[1])
    return k, v


@triton.jit(do_not_specialize=["num_retrieval", "parts"])
def _merge_rows_kernel(out_ptr, window_lse_ptr, rows_out_ptr, rows_lse_ptr, rows_lens_ptr, retrieval_q_ptr,
                       query_start_loc_ptr, context_ends_ptr, num_retrieval, parts,
                       stride_ot: tl.int64, stride_oh: tl.int64, stride_wh: tl.int64, stride_wt: tl.int64,
                       stride_re: tl.int64, stride_rg: tl.int64, stride_lg: tl.int64, stride_le: tl.int64,
                       G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr):
    """Grid (num_reqs, R * G): one squeezed row's retrieval query head h, the window pass's output (in `out`) and
    the row pass's parts merged by their log-sum-exp (natural log) into `out`; empty parts are left out whatever
    FlashAttention wrote for them."""
    req, h = tl.program_id(0), tl.program_id(1)
    if tl.load(context_ends_ptr + req) == 0:
        return
    token = tl.load(query_start_loc_ptr + req).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)
    sub = (req * num_retrieval + h // G) * parts + offs_p
    has = (offs_p < parts) & (tl.load(rows_lens_ptr + sub, mask=offs_p < parts, other=0) > 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lse_a = tl.load(window_lse_ptr + h * stride_wh + token * stride_wt)
    lse_b = tl.load(rows_lse_ptr + (h % G) * stride_lg + sub * stride_le, mask=has, other=0.0)
    top = tl.maximum(lse_a, tl.max(tl.where(has, lse_b, float("-inf")), 0))
    weight_a = tl.exp(lse_a - top)
    weight_b = tl.where(has, tl.exp(lse_b - top), 0.0)
    out_row = out_ptr + token * stride_ot + tl.load(retrieval_q_ptr + h) * stride_oh + offs_d
    a = tl.load(out_row, mask=d_ok, other=0.0).to(tl.float32)
    b = tl.load(rows_out_ptr + sub[:, None] * stride_re + (h % G) * stride_rg + offs_d[None, :],
                mask=has[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    merged = a * weight_a + tl.sum(weight_b[:, None] * b, 0)
    tl.store(out_row, (merged / (weight_a + tl.sum(weight_b, 0))).to(out_ptr.dtype.element_ty), mask=d_ok)


def merge_rows(output: torch.Tensor, window_lse: torch.Tensor, rows_out: torch.Tensor, rows_lse: torch.Tensor,
               batch: RowBatch, heads: LayerHeads, query_start_loc: torch.Tensor, context_ends: torch.Tensor) -> None:
    """Merge the two passes at each squeezed row (context end > 0, one query token) into `output`.

    Args:
        output: `[num_tokens, num_heads, head_dim]`, holding the window pass's output at the retrieval query heads.
        window_lse: `[R * G, num_tokens]` float32, the window pass's log-sum-exp per retrieval query head (in
            `heads.retrieval_q` order).
        rows_out: `[entries, G, head_dim]` and rows_lse `[G, entries]`: the row pass's over `batch` (`row_batch`).
    """
    num_reqs, R, G = context_ends.shape[0], heads.num_retrieval, heads.group_size
    if num_reqs == 0 or R == 0:
        return
    parts = batch.lens.shape[0] // (num_reqs * R)
    head_dim = output.shape[-1]
    _merge_rows_kernel[(num_reqs, R * G)](
        output, window_lse, rows_out, rows_lse, batch.lens, heads.retrieval_q, query_start_loc, context_ends, R,
        parts, *output.stride()[:2], *window_lse.stride(), *rows_out.stride()[:2], *rows_lse.stride(),
        G=G, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_P=triton.next_power_of_2(parts),
        num_warps=4)
