# SPDX-License-Identifier: Apache-2.0
"""The squeeze's sparse decode as FlashAttention passes (gpu_attention.py runs them): a pass over pages of one cache
row listing each squeezed row's sinks, selected keys and its window's newest keys, and, for a window longer than
`WINDOW_KEYS`, a window pass over the rest of its retrieval pages from its context's end on, the two merged by their
log-sum-exp. This module builds the row pass's page lists, straight from the selection's runs of clusters
(`selection.band_runs`: no positions written in between), and merges; it imports no FlashAttention (the merge takes
any pass's output and log-sum-exp).

A duo cache `[num_blocks, 2, block_size, P, head_dim]` seen as rows of `head_dim` elements (`row_views`; its blocks
`B` rows apart, 2 x block_size x P when they are packed): the K row of retrieval head r at position p is

    row = block * B + (p % block_size) * P + r,   block = block_table[req, p // block_size * stride]

and its V row is `V` rows further (block_size x P when packed), so that K and V seen as `[rows, 1, 1, head_dim]`
paged caches (pages of one row, one KV head), the V view starting V rows later, take the same page ids:

    request 0 (context end 4,096, sink 64, seq_len 4,400), retrieval head 1, 3 selected positions
    entry 0 * R + 1: pages [row(0), ..., row(63), row(sel[0]), row(sel[1]), row(sel[2]),
                            row(4,096), ..., row(4,399), 0, ...], length 64 + 3 + 304
    its query: request 0's last token at head 1's G query heads
    with seq_len 5,200 the list ends with rows 4,176 ... 5,199 (WINDOW_KEYS 1,024), and the window pass reads
    [4,096, 4,176) (`window_pass_lens`)

With the window in the row pass, the window pass reads no key of a squeezed row in most steps, and its launches
beside the lookup take less of the SMs the lookup needs: 32 layers at 4 x 128k fp8 in 2.12 ms against 2.21 with the
window read by the window pass (kernels_bench.py --squeeze-sweep). FlashAttention reads each list's keys at about
1.2 TB/s where the Triton sparse decode (sparse_decode.py) reads them at 0.8 (kernels_bench.py --squeeze-decode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_duo.kernels.launch import cdiv, launch, next_power_of_2
from vllm_duo.kernels.reference import LayerHeads
from vllm_duo.kernels.selection import BandRuns, _context_of, _run_positions

PAGE_SLOTS = 256  # list entries per program
WINDOW_KEYS = 1024  # a squeezed row's newest window keys that its row pass reads (a prompt's tail and ~750 tokens)


def window_pass_lens(seq_lens: torch.Tensor, context_ends: torch.Tensor, out: torch.Tensor,
                     window: int = WINDOW_KEYS) -> torch.Tensor:
    """Into `out` `[num_reqs]` int32: the keys of each row's retrieval heads that FlashAttention's window pass reads
    from its table's first page (`squeeze.window_pages`): at a squeezed row (context end > 0) its window
    [context end, seq_len) less the newest `window` keys, which `run_pages` lists for the row pass; elsewhere all of
    them. In place, no host sync (a CUDA graph replays it from the step's buffers)."""
    torch.sub(seq_lens, context_ends, out=out)
    return out.sub_((context_ends > 0).to(out.dtype) * window).clamp_(min=0)


@triton.jit(do_not_specialize=["num_clusters", "num_retrieval", "stride", "sink", "max_selected", "window",
                               "list_len", "block_rows", "token_rows"])
def _run_pages_kernel(offsets_ptr, positions_ptr, context_ids_ptr, above_ptr, ends_ptr, counts_ptr,
                      context_ends_ptr, seq_lens_ptr, block_table_ptr, pages_ptr, lens_ptr, cu_ptr, num_clusters,
                      num_retrieval, stride, sink, max_selected, window, list_len, block_rows, token_rows,
                      stride_ox: tl.int64, stride_oh: tl.int64, stride_px: tl.int64, stride_ph: tl.int64,
                      stride_cr: tl.int64, stride_ch: tl.int64, stride_er: tl.int64, stride_eh: tl.int64,
                      stride_es: tl.int64, stride_table: tl.int64, stride_pe: tl.int64, BLOCK_SIZE: tl.constexpr,
                      SLOTS: tl.constexpr, SEARCH_STEPS: tl.constexpr, CONTEXTS: tl.constexpr):
    """Grid (num_reqs, R, cdiv(list_len, SLOTS)): SLOTS entries of entry (req, head)'s page list, its sinks, its
    selected keys (`_run_positions` finds them in the runs), then its window's newest `window` keys, as cache row
    ids; the first program of an entry writes its length (0 at a row without context) and its query start."""
    req, head, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    entry = req * num_retrieval + head
    context_end = tl.load(context_ends_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    squeezed = context_end > 0
    count = tl.minimum(tl.load(counts_ptr + req * stride_cr + head * stride_ch), max_selected)
    taken = tl.minimum(tl.maximum(seq_len - context_end, 0), window)  # the window's newest keys
    length = tl.where(squeezed, sink + count + taken, 0)
    index = chunk * SLOTS + tl.arange(0, SLOTS)
    live = index < length
    in_window = index >= sink + count
    context = tl.maximum(_context_of(context_ids_ptr, req, CONTEXTS), 0)  # without one the length is 0
    chosen = _run_positions(index - sink, live & (index >= sink) & ~in_window, req, head, context, offsets_ptr,
                            positions_ptr, above_ptr, ends_ptr, num_clusters, stride_ox, stride_oh, stride_px,
                            stride_ph, stride_cr, stride_ch, stride_er, stride_eh, stride_es, SEARCH_STEPS)
    pos = tl.where(index < sink, index, tl.where(in_window, seq_len - taken + index - sink - count, chosen))
    block = tl.load(block_table_ptr + req * stride_table + pos // BLOCK_SIZE * stride, mask=live, other=0)
    row = block.to(tl.int64) * block_rows + (pos % BLOCK_SIZE) * token_rows + head
    tl.store(pages_ptr + entry * stride_pe + index, tl.where(live, row, 0).to(tl.int32), mask=index < list_len)
    if chunk == 0:
        tl.store(lens_ptr + entry, length)
        tl.store(cu_ptr + entry, entry)
        if entry == tl.num_programs(0) * num_retrieval - 1:
            tl.store(cu_ptr + entry + 1, entry + 1)


def run_pages(runs: BandRuns, cluster_positions: torch.Tensor, context_ids: torch.Tensor | None,
              context_ends: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, heads: LayerHeads,
              cache: torch.Tensor, max_selected: int,
              window: int = WINDOW_KEYS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Page lists of one cache row for the row pass, one launch: one entry per (request, retrieval head), its
    sinks, the positions `select_banded` would gather from `runs` (the same keys in the same order), then the newest
    `window` positions after its context's end (`window_pass_lens` leaves the window pass the rest).

    Args:
        runs: `selection.band_runs`' result for `[num_reqs, R]` rows, over the clusters of `cluster_positions`
            `[num_contexts, R, T]` int32 (the CSR positions) and `context_ids` `[num_reqs]` int32 (None: row i).
        context_ends: `[num_reqs]` int32: 0 at rows that read no clustered context (their lists are empty).
        seq_lens: `[num_reqs]` int32, the step's (its K/V written before the row pass reads the lists).
        block_table: `[num_reqs, max_blocks]` int32, `heads.stride` columns per token block.
        cache: the duo cache `row_views` sees (its shape and strides set the row ids).
        max_selected: the selection's width (`band_runs`' counts are at most this).

    Returns:
        pages `[num_reqs * R, sink + max_selected + window]` int32 row ids (0 past each length), lengths
        `[num_reqs * R]` int32 and query starts `[num_reqs * R + 1]` int32 (entry i's query is row i of the
        `[num_reqs * R, G, head_dim]` queries).
    """
    sink = heads.sink
    (num_reqs, R), C = runs.counts.shape, runs.ends.shape[-1]
    list_len = sink + max_selected + window
    device = runs.counts.device
    pages = torch.empty(num_reqs * R, list_len, dtype=torch.int32, device=device)
    lens = torch.empty(num_reqs * R, dtype=torch.int32, device=device)
    starts = torch.empty(num_reqs * R + 1, dtype=torch.int32, device=device)
    if num_reqs * R == 0:
        return pages, lens, starts.zero_()
    slots = PAGE_SLOTS if device.type == "cuda" else 128  # the interpreter: few programs, several per list
    contexts = runs.counts if context_ids is None else context_ids  # without context ids the kernel reads none
    launch(_run_pages_kernel, (num_reqs, R, cdiv(list_len, slots)))(
        runs.offsets, cluster_positions, contexts, runs.above, runs.ends, runs.counts, context_ends, seq_lens,
        block_table, pages, lens, starts, C, R, heads.stride, sink, max_selected, window, list_len,
        cache.stride(0) // cache.shape[-1],
        cache.stride(2) // cache.shape[-1], *runs.offsets.stride()[:2], *cluster_positions.stride()[:2],
        *runs.counts.stride(), *runs.ends.stride()[:3], block_table.stride(0), pages.stride(0),
        BLOCK_SIZE=cache.shape[2], SLOTS=slots, SEARCH_STEPS=max(C, 1).bit_length(), CONTEXTS=context_ids is not None)
    return pages, lens, starts


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


@triton.jit(do_not_specialize=["num_retrieval"])
def _merge_rows_kernel(out_ptr, window_lse_ptr, rows_out_ptr, rows_lse_ptr, retrieval_q_ptr, query_start_loc_ptr,
                       context_ends_ptr, window_lens_ptr, num_retrieval,
                       stride_ot: tl.int64, stride_oh: tl.int64, stride_wh: tl.int64, stride_wt: tl.int64,
                       stride_re: tl.int64, stride_rg: tl.int64, stride_lg: tl.int64, stride_le: tl.int64,
                       G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (num_reqs, R * G): one squeezed row's retrieval query head h, the window pass's output (in `out`) and
    the row pass's merged by their log-sum-exp (natural log) into `out`; where the window pass read no key, the row
    pass's alone (whatever the window pass left there)."""
    req, h = tl.program_id(0), tl.program_id(1)
    if tl.load(context_ends_ptr + req) == 0:
        return
    token = tl.load(query_start_loc_ptr + req).to(tl.int64)
    entry = req * num_retrieval + h // G
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    windowed = tl.load(window_lens_ptr + req) > 0
    lse_a = tl.where(windowed, tl.load(window_lse_ptr + h * stride_wh + token * stride_wt), float("-inf"))
    lse_b = tl.load(rows_lse_ptr + (h % G) * stride_lg + entry * stride_le)
    top = tl.maximum(lse_a, lse_b)
    weight_a, weight_b = tl.exp(lse_a - top), tl.exp(lse_b - top)
    out_row = out_ptr + token * stride_ot + tl.load(retrieval_q_ptr + h) * stride_oh + offs_d
    a = tl.where(windowed, tl.load(out_row, mask=d_ok, other=0.0).to(tl.float32), 0.0)
    b = tl.load(rows_out_ptr + entry * stride_re + (h % G) * stride_rg + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    tl.store(out_row, ((a * weight_a + b * weight_b) / (weight_a + weight_b)).to(out_ptr.dtype.element_ty), mask=d_ok)


def merge_rows(output: torch.Tensor, window_lse: torch.Tensor, rows_out: torch.Tensor, rows_lse: torch.Tensor,
               heads: LayerHeads, query_start_loc: torch.Tensor, context_ends: torch.Tensor,
               window_lens: torch.Tensor) -> None:
    """Merge the two passes at each squeezed row (context end > 0, one query token) into `output`.

    Args:
        output: `[num_tokens, num_heads, head_dim]`, holding the window pass's output at the retrieval query heads.
        window_lse: `[R * G, num_tokens]` float32, the window pass's log-sum-exp per retrieval query head (in
            `heads.retrieval_q` order).
        rows_out: `[num_reqs * R, G, head_dim]` and rows_lse `[G, num_reqs * R]`: the row pass's, entry
            `req * R + r`.
        window_lens: `[num_reqs]` int32, the keys the window pass read of each row (`window_pass_lens`).
    """
    num_reqs, R, G = context_ends.shape[0], heads.num_retrieval, heads.group_size
    if num_reqs == 0 or R == 0:
        return
    head_dim = output.shape[-1]
    launch(_merge_rows_kernel, (num_reqs, R * G))(
        output, window_lse, rows_out, rows_lse, heads.retrieval_q, query_start_loc, context_ends, window_lens, R,
        *output.stride()[:2], *window_lse.stride(), *rows_out.stride()[:2], *rows_lse.stride(),
        G=G, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), num_warps=1)
