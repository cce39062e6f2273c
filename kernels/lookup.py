# SPDX-License-Identifier: Apache-2.0
"""The squeeze's served lookup in one launch on a GPU: centroid logits, scores, band ends and FlashAttention's page
lists (selection.py's `centroid_scores` and `band_runs`, row_pages.py's `run_pages`) as four phases of one program
per (request, retrieval head, tile of clusters), the tiles of a row waiting for each other between phases.

Each phase reads what every tile of its row wrote in the one before (the row's softmax denominators, its keys per
score band, its runs' ends), so as four launches each waited for the whole grid, and each launch paid its ramp and
tail: 38 us of a 68 us squeezed layer at 4 x 128k, every kernel well under a wave (benchmarks/results/
2026-11-29-h200-squeeze-timeline). Here a row's tiles meet at a counter instead:

    tile t of row (req, head):  logits | arrive, wait for 1 x tiles | scores | 2 x tiles | ends | 3 x tiles | pages
    the last program out of the row (4 x tiles arrivals) sets the counter back to 0 for the next launch

A program that waits spins, so every program of the grid must be resident at once: the grid is at most
LOOKUP_PROGRAMS_PER_SM programs per SM, and the launch is cooperative (the driver refuses a grid that does not fit
rather than let it hang). The CPU interpreter runs programs one after another, so there the phases stay the four
launches they are in `centroid_scores`, `band_runs` and `run_pages`: the same kernels, which this one calls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_duo.kernels.prefill import LOG2E
from vllm_duo.kernels.reference import LayerHeads
from vllm_duo.kernels.row_pages import _run_pages_kernel, cache_rows, page_lists, page_slots, run_pages
from vllm_duo.kernels.selection import (BAND_CLUSTERS, BAND_OCTAVE, SCORE_BANDS, BandRuns, _band_ends_kernel,
                                         _centroid_logits_kernel, _centroid_scores_kernel, band_runs,
                                         centroid_scores, run_buffers, score_plan)

LOOKUP_PROGRAMS_PER_SM = 4  # resident at the 96 registers and 32 KiB of shared memory it takes on sm_90 (5 fit)
LOOKUP_COOPERATIVE = True  # launch cooperatively: the driver checks that the grid fits
LOOKUP_LAUNCH = dict(num_warps=4, num_stages=4)  # 96 registers on sm_90, no spill (3 stages spill 8 bytes)


@triton.jit
def _arrive_and_wait(waits_ptr, arrivals):
    """This program's arrival at its row's counter, then a spin until `arrivals` programs have arrived; every
    thread's stores before are seen by the row's programs after (release, acquire, and a CTA barrier each side)."""
    tl.debug_barrier()
    tl.atomic_add(waits_ptr, 1, sem="release", scope="gpu")
    while tl.atomic_add(waits_ptr, 0, sem="acquire", scope="gpu") < arrivals:
        pass
    tl.debug_barrier()


@triton.jit(do_not_specialize=["num_clusters", "num_tiles", "num_retrieval", "max_selected", "table_stride", "sink",
                               "list_len", "block_rows", "token_rows"])
def _lookup_kernel(query_ptr, centroids_ptr, centroid_scales_ptr, sizes_ptr, radii_ptr, context_ids_ptr,
                   retrieval_kv_ptr, query_start_loc_ptr, logits_ptr, part_m_ptr, part_l_ptr, scores_ptr,
                   top_bands_ptr, octave_keys_ptr, band_keys_ptr, offsets_ptr, budget_ptr, above_ptr, ends_ptr,
                   counts_ptr, positions_ptr, context_ends_ptr, block_table_ptr, pages_ptr, lens_ptr, cu_ptr, waits_ptr,
                   qk_scale, radius_scale, num_clusters, num_tiles, num_retrieval, max_selected, table_stride, sink,
                   list_len, block_rows, token_rows,
                   stride_qt: tl.int64, stride_qh: tl.int64, stride_cx: tl.int64, stride_ch: tl.int64,
                   stride_cn: tl.int64, stride_gx: tl.int64, stride_gh: tl.int64, stride_nx: tl.int64,
                   stride_nh: tl.int64, stride_lr: tl.int64, stride_lh: tl.int64, stride_lg: tl.int64,
                   stride_pr: tl.int64, stride_ph: tl.int64, stride_pt: tl.int64, stride_sr: tl.int64,
                   stride_sh: tl.int64, stride_tr: tl.int64, stride_th: tl.int64, stride_kr: tl.int64,
                   stride_kh: tl.int64, stride_kt: tl.int64, stride_br: tl.int64, stride_bh: tl.int64,
                   stride_bt: tl.int64, stride_ox: tl.int64, stride_oh: tl.int64, stride_ur: tl.int64,
                   stride_uh: tl.int64, stride_mr: tl.int64, stride_mh: tl.int64, stride_er: tl.int64,
                   stride_eh: tl.int64, stride_es: tl.int64, stride_xx: tl.int64, stride_xh: tl.int64,
                   stride_table: tl.int64, stride_pe: tl.int64,
                   G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, TILE_CHUNKS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SCALED: tl.constexpr, RADII: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, SLOTS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BANDS: tl.constexpr, OCTAVE: tl.constexpr):
    """Grid (num_reqs, R, num_tiles): the four kernels' phases in turn, each program the tile its ids name (and
    every num_tiles-th chunk of its row's page list), its row's tiles meeting at `waits[req * R + head]` between
    them. Strides as the kernels' (x: a context, r: a request, h: a head, t: a tile): q query, c centroids,
    g centroid scales, n sizes and radii, l logits, p partials, s scores, t top bands, k keys per octave, b keys per
    band, o offsets, u budget, m counts and keys above, e ends, x positions."""
    waits = waits_ptr + tl.program_id(0) * num_retrieval + tl.program_id(1)
    _centroid_logits_kernel(query_ptr, centroids_ptr, centroid_scales_ptr, sizes_ptr, radii_ptr, context_ids_ptr,
                            logits_ptr, part_m_ptr, part_l_ptr, band_keys_ptr, retrieval_kv_ptr, query_start_loc_ptr,
                            qk_scale, radius_scale, num_clusters, stride_qt, stride_qh, stride_cx, stride_ch,
                            stride_cn, stride_gx, stride_gh, stride_nx, stride_nh, stride_lr, stride_lh, stride_lg,
                            stride_pr, stride_ph, stride_pt, stride_br, stride_bh, stride_bt,
                            G, BLOCK_G, BLOCK_C, TILE_CHUNKS, HEAD_DIM, BLOCK_D, True, SCALED, RADII, BANDS)
    _arrive_and_wait(waits, num_tiles)
    _centroid_scores_kernel(logits_ptr, part_m_ptr, part_l_ptr, sizes_ptr, context_ids_ptr, scores_ptr, top_bands_ptr,
                            octave_keys_ptr, band_keys_ptr, num_clusters, num_tiles, stride_lr, stride_lh, stride_lg,
                            stride_pr, stride_ph, stride_pt, stride_nx, stride_nh, stride_sr, stride_sh, stride_tr,
                            stride_th, stride_kr, stride_kh, stride_kt, stride_br, stride_bh, stride_bt,
                            G, BLOCK_G, BLOCK_C, TILE_CHUNKS, BLOCK_T, BANDS, OCTAVE, True)
    _arrive_and_wait(waits, 2 * num_tiles)
    _band_ends_kernel(scores_ptr, top_bands_ptr, octave_keys_ptr, band_keys_ptr, offsets_ptr, context_ids_ptr,
                      budget_ptr, above_ptr, ends_ptr, counts_ptr, num_clusters, num_tiles, max_selected,
                      stride_sr, stride_sh, stride_tr, stride_th, stride_kr, stride_kh, stride_kt, stride_br,
                      stride_bh, stride_bt, stride_ox, stride_oh, stride_ur, stride_uh, stride_mr, stride_mh,
                      stride_er, stride_eh, stride_es, TILE_CHUNKS * BLOCK_C, BLOCK_E, BLOCK_T, BANDS, OCTAVE, True)
    _arrive_and_wait(waits, 3 * num_tiles)
    _run_pages_kernel(offsets_ptr, positions_ptr, context_ids_ptr, above_ptr, ends_ptr, counts_ptr, context_ends_ptr,
                      block_table_ptr, pages_ptr, lens_ptr, cu_ptr, num_clusters, num_retrieval, table_stride, sink,
                      max_selected, list_len, block_rows, token_rows, stride_ox, stride_oh, stride_xx, stride_xh,
                      stride_mr, stride_mh, stride_er, stride_eh, stride_es, stride_table, stride_pe,
                      BLOCK_SIZE, SLOTS, SEARCH_STEPS, True)
    tl.debug_barrier()
    if tl.atomic_add(waits, 1, sem="acq_rel", scope="gpu") == 4 * num_tiles - 1:  # the row's last program out
        tl.atomic_xchg(waits, 0, sem="relaxed", scope="gpu")


def lookup_pages(query: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor, heads: LayerHeads,
                 query_start_loc: torch.Tensor, scale: float, context_ids: torch.Tensor,
                 centroid_scales: torch.Tensor | None, radii: torch.Tensor | None, radius_weight: float,
                 cluster_offsets: torch.Tensor, budget: torch.Tensor, max_selected: int,
                 cluster_positions: torch.Tensor, context_ends: torch.Tensor, block_table: torch.Tensor,
                 cache: torch.Tensor, waits: torch.Tensor) -> tuple[BandRuns, tuple[torch.Tensor, ...]]:
    """`run_pages(band_runs(centroid_scores(...)))` in one launch on a GPU: each request's selection (its runs) and
    FlashAttention's page lists (pages, lens, starts) for the second pass.

    Args as those three functions' (`budget` `[num_reqs, R]`), and `waits`: at least num_reqs x R int32 zeros, the
    rows' counters, which the kernel leaves at zero (one buffer for every layer and step: the launches of a stream
    run one at a time). On the CPU the three functions, one after the other.
    """
    R = heads.num_retrieval
    plan = score_plan(query, centroids, sizes, heads, query_start_loc, radii, LOOKUP_PROGRAMS_PER_SM)
    if not query.is_cuda or plan.empty:
        runs = band_runs(centroid_scores(query, centroids, sizes, heads, query_start_loc, scale, context_ids,
                                         centroid_scales, radii, radius_weight),
                         cluster_offsets, budget, max_selected, context_ids)
        return runs, run_pages(runs, cluster_positions, context_ids, context_ends, block_table, heads, cache,
                               max_selected)
    scored = plan.scored
    num_reqs, _, C = scored.scores.shape
    if waits.numel() < num_reqs * R:
        raise ValueError(f"{waits.numel()} counters for {num_reqs} x {R} rows")
    tiles = scored.band_keys.shape[2]
    runs = run_buffers(scored, cluster_offsets)
    pages, lens, starts = lists = page_lists(num_reqs * R, heads.sink + max_selected, query.device)
    scales = scored.scores if centroid_scales is None else centroid_scales  # read only where SCALED
    head_dim = query.shape[-1]
    _lookup_kernel[(num_reqs, R, tiles)](
        query, centroids, scales, sizes, scored.scores if radii is None else radii, context_ids, heads.retrieval_kv,
        query_start_loc, plan.logits, plan.part_m, plan.part_l, scored.scores, scored.top_bands, scored.octave_keys,
        scored.band_keys, runs.offsets, budget, runs.above, runs.ends, runs.counts, cluster_positions, context_ends,
        block_table, pages, lens, starts, waits,
        scale * LOG2E, radius_weight * scale * LOG2E, C, tiles, R, max_selected, heads.stride, heads.sink,
        pages.shape[1], *cache_rows(cache),
        *query.stride()[:2], *centroids.stride()[:3], *scales.stride()[:2], *sizes.stride()[:2],
        *plan.logits.stride()[:3], *plan.part_m.stride()[:3], *scored.scores.stride()[:2], *scored.top_bands.stride(),
        *scored.octave_keys.stride()[:3], *scored.band_keys.stride()[:3], *runs.offsets.stride()[:2],
        *budget.stride(), *runs.counts.stride(), *runs.ends.stride()[:3], *cluster_positions.stride()[:2],
        block_table.stride(0), pages.stride(0),
        G=heads.group_size, BLOCK_G=plan.block_g, BLOCK_C=plan.block_c, TILE_CHUNKS=plan.chunks, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), SCALED=centroid_scales is not None,
        RADII=radii is not None and radius_weight > 0, BLOCK_T=triton.next_power_of_2(tiles),
        BLOCK_E=min(BAND_CLUSTERS, triton.next_power_of_2(scored.tile_clusters)), SLOTS=page_slots(query.device),
        SEARCH_STEPS=max(C, 1).bit_length(), BLOCK_SIZE=cache.shape[2], BANDS=SCORE_BANDS, OCTAVE=BAND_OCTAVE,
        launch_cooperative_grid=LOOKUP_COOPERATIVE, **LOOKUP_LAUNCH)
    return runs, lists
