# SPDX-License-Identifier: Apache-2.0
"""Which context positions a retrieval head's sparse decode reads (sparse_decode.py): scores per key cluster
(Squeezed Attention's centroids) or per page (Quest's per-channel key bounds), then the positions of the best.

Scores come from each request's last query token, reduced over the GQA group by max (a KV head's keys serve all of
its query heads, so a cluster or page counts if any of them wants it). Two selections of clusters: `select_positions`
(torch, by sorting: the best clusters to the budget, the rule the CPU studies used) and `select_banded` (Triton, by
score bands below each row's best to the budget, no sort: the one decode serves, over the keys per band and per
octave of bands that `centroid_scores` counts). Both, and `select_pages`, have fixed shapes and no host syncs
(CUDA-graph capturable) and emit the `[num_reqs, R, max_selected]` positions and `[num_reqs, R]` counts that
`sparse_decode_attention` takes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vllm_duo.kernels.decode import _sm_count, group_queries
from vllm_duo.kernels.launch import cdiv, launch, next_power_of_2
from vllm_duo.kernels.prefill import LOG2E
from vllm_duo.kernels.reference import LayerHeads


@triton.jit
def _last_queries(query_ptr, query_start_loc_ptr, retrieval_kv_ptr, req, head, stride_qt, stride_qh,
                  G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The query heads of retrieval KV head `head` at request `req`'s last token, `[BLOCK_G, BLOCK_D]` (a request
    without tokens reads another's: its scores are never used)."""
    token = tl.maximum(tl.load(query_start_loc_ptr + req + 1) - 1, 0)
    q, _q_heads, _q_mask = group_queries(query_ptr, token, tl.load(retrieval_kv_ptr + head), stride_qt, stride_qh, G,
                                         BLOCK_G, HEAD_DIM, BLOCK_D)
    return q


@triton.jit
def _context_of(context_ids_ptr, req, CONTEXTS: tl.constexpr):
    """The context (slot) request `req` reads: `context_ids[req]` (negative: none), or `req` itself without context
    ids."""
    if CONTEXTS:
        return tl.load(context_ids_ptr + req).to(tl.int64)
    return req.to(tl.int64)


@triton.jit
def _centroid_logits(q, centroid_row, size_row, start, num_clusters, qk_scale, stride_cn,
                     BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Base-2 logits `[BLOCK_G, BLOCK_C]` of clusters [start, start + BLOCK_C) (-inf for empty or absent ones) and
    their sizes `[BLOCK_C]`."""
    offs_c = start + tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    c_ok = offs_c < num_clusters
    c = tl.load(centroid_row + offs_c.to(tl.int64)[:, None] * stride_cn + offs_d[None, :],
                mask=c_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0).to(q.dtype)
    size = tl.load(size_row + offs_c, mask=c_ok, other=0).to(tl.float32)
    s = tl.dot(q, tl.trans(c)) * qk_scale
    return tl.where(size[None, :] > 0, s, float("-inf")), size


@triton.jit(do_not_specialize=["num_clusters"])
def _centroid_logits_kernel(query_ptr, centroids_ptr, centroid_scales_ptr, sizes_ptr, radii_ptr, context_ids_ptr,
                            logits_ptr, part_m_ptr, part_l_ptr, band_keys_ptr, retrieval_kv_ptr, query_start_loc_ptr,
                            qk_scale, radius_scale, num_clusters,
                            stride_qt: tl.int64, stride_qh: tl.int64, stride_cx: tl.int64, stride_ch: tl.int64,
                            stride_cn: tl.int64, stride_gx: tl.int64, stride_gh: tl.int64, stride_nx: tl.int64,
                            stride_nh: tl.int64, stride_lr: tl.int64, stride_lh: tl.int64, stride_lg: tl.int64,
                            stride_pr: tl.int64, stride_ph: tl.int64, stride_pt: tl.int64, stride_br: tl.int64,
                            stride_bh: tl.int64, stride_bt: tl.int64,
                            G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, TILE_CHUNKS: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CONTEXTS: tl.constexpr,
                            SCALED: tl.constexpr, RADII: tl.constexpr, BANDS: tl.constexpr):
    """Grid (num_reqs, R, tiles): the base-2 logits of one tile of TILE_CHUNKS x BLOCK_C clusters per query head of
    the group (-inf for empty clusters), and the tile's softmax partials: the running max and the sum of
    N_j exp2(s_j - max) per query head; zeroes the tile's keys per band, which the scores kernel adds to.
    SCALED: the centroids are stored divided by their (context, head)'s scale. RADII: each logit gains
    radius_scale x |q| x the cluster's radius (radii laid out as sizes)."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    tl.store(band_keys_ptr + req * stride_br + head * stride_bh + tile * stride_bt + tl.arange(0, BANDS),
             tl.zeros([BANDS], tl.int32))
    context = _context_of(context_ids_ptr, req, CONTEXTS)
    if context < 0:
        return
    if SCALED:
        qk_scale = qk_scale * tl.load(centroid_scales_ptr + context * stride_gx + head * stride_gh)
    q = _last_queries(query_ptr, query_start_loc_ptr, retrieval_kv_ptr, req, head, stride_qt, stride_qh, G, BLOCK_G,
                      HEAD_DIM, BLOCK_D)
    centroid_row = centroids_ptr + context * stride_cx + head * stride_ch
    size_row = sizes_ptr + context * stride_nx + head * stride_nh
    q_reach = tl.sqrt(tl.sum(q.to(tl.float32) * q.to(tl.float32), 1)) * radius_scale  # [BLOCK_G]
    offs_g = tl.arange(0, BLOCK_G)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    for chunk in range(TILE_CHUNKS):
        start = (tile * TILE_CHUNKS + chunk) * BLOCK_C
        s, size = _centroid_logits(q, centroid_row, size_row, start, num_clusters, qk_scale, stride_cn,
                                   BLOCK_C, HEAD_DIM, BLOCK_D)
        offs_c = start + tl.arange(0, BLOCK_C)
        if RADII:
            radius = tl.load(radii_ptr + context * stride_nx + head * stride_nh + offs_c, mask=offs_c < num_clusters,
                             other=0.0)
            s += q_reach[:, None] * radius[None, :]
        tl.store(logits_ptr + req * stride_lr + head * stride_lh + offs_g[:, None] * stride_lg + offs_c[None, :], s,
                 mask=(offs_g < G)[:, None] & (offs_c < num_clusters)[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(size[None, :] * tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    part = req * stride_pr + head * stride_ph + tile * stride_pt + offs_g
    tl.store(part_m_ptr + part, m_i)
    tl.store(part_l_ptr + part, l_i)


SCORE_BANDS = 256  # bands of 12.5% below a row's top band, the last holding every score 2^-32 below or lower
BAND_OCTAVE = 8  # bands per octave: the ends kernel finds the cut octave (of 32), then the cut band within it
BAND_COUNT_CLUSTERS = 64  # clusters the scores kernel counts into octaves at once: a [64, 32] one-hot


@triton.jit
def _score_band(scores, top_band, BANDS: tl.constexpr):
    """How many bands of float32 bits >> 20 (the exponent and 3 mantissa bits: 12.5% at most) a score >= 0 sits
    below its row's top band (0 the best), at most BANDS - 1 (32 octaves at 256 bands: scores under 2^-32 of the top
    share the last). Under peaked attention the budget reaches far below the top, and the best of those clusters
    must still go first: with 64 bands (a floor at 1/256 of the top) duo50-fp8-sq20 lost 5.7 points on SmolLM2, and
    two-octave bands past 8 octaves recall less attention mass than 12.5% bands throughout
    (benchmarks/results/2026-11-27-cpu-squeeze-bands)."""
    return tl.minimum(tl.maximum(top_band - (scores.to(tl.int32, bitcast=True) >> 20), 0), BANDS - 1)


@triton.jit(do_not_specialize=["num_clusters", "num_tiles"])
def _centroid_scores_kernel(logits_ptr, part_m_ptr, part_l_ptr, sizes_ptr, context_ids_ptr, scores_ptr,
                            top_bands_ptr, octave_keys_ptr, band_keys_ptr, num_clusters, num_tiles,
                            stride_lr: tl.int64, stride_lh: tl.int64, stride_lg: tl.int64, stride_pr: tl.int64,
                            stride_ph: tl.int64, stride_pt: tl.int64, stride_nx: tl.int64, stride_nh: tl.int64,
                            stride_or: tl.int64, stride_oh: tl.int64, stride_tr: tl.int64, stride_th: tl.int64,
                            stride_kr: tl.int64, stride_kh: tl.int64, stride_kt: tl.int64, stride_br: tl.int64,
                            stride_bh: tl.int64, stride_bt: tl.int64,
                            G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, TILE_CHUNKS: tl.constexpr,
                            BLOCK_T: tl.constexpr, BANDS: tl.constexpr, OCTAVE: tl.constexpr,
                            CONTEXTS: tl.constexpr):
    """Grid (num_reqs, R, tiles): each query head's denominator from all tiles' partials, then the tile's scores
    exp2(s_j - max) / denominator, max over the group (0 for a request without context), and the tile's keys per
    octave of bands (one-hot sums) and per band (`_score_band`; added to the counts the logits kernel zeroed, by
    atomics: several clusters of a chunk fall in one band, and a [clusters, 256] one-hot takes ~2 registers a
    cluster per thread, against ~0.5 for [clusters, 32]). The bands count
    down from the row's top band, known without the other tiles' scores: each query head's best cluster scores
    exp2(0) / denominator, so the row's highest score is the largest of those, bit for bit. Tile 0 stores the top
    band."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    context = _context_of(context_ids_ptr, req, CONTEXTS)
    has_context = context >= 0
    tiles_read = tl.where(has_context, num_tiles, 0)  # without a context none: every score 0
    clusters_read = tl.where(has_context, num_clusters, 0)
    offs_t = tl.arange(0, BLOCK_T)
    offs_g = tl.arange(0, BLOCK_G)
    part = req * stride_pr + head * stride_ph + offs_t[:, None] * stride_pt + offs_g[None, :]
    t_ok = (offs_t < tiles_read)[:, None]
    m_t = tl.load(part_m_ptr + part, mask=t_ok, other=float("-inf"))
    l_t = tl.load(part_l_ptr + part, mask=t_ok, other=0.0)
    m = tl.max(m_t, 0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    denom = tl.sum(l_t * tl.exp2(m_t - m_safe[None, :]), 0)
    denom = tl.where(denom > 0, denom, 1.0)  # no cluster at all: every score 0
    in_group = offs_g < G
    top = tl.max(tl.where(in_group, tl.exp2(m - m_safe) / denom, 0.0), 0)
    top_band = top.to(tl.int32, bitcast=True) >> 20
    tl.store(top_bands_ptr + req * stride_tr + head * stride_th, top_band, mask=tile == 0)
    size_row = sizes_ptr + tl.maximum(context, 0) * stride_nx + head * stride_nh
    octaves = tl.arange(0, BANDS // OCTAVE)
    octave_keys = tl.zeros([BANDS // OCTAVE], tl.int32)
    band_row = band_keys_ptr + req * stride_br + head * stride_bh + tile * stride_bt
    for chunk in range(TILE_CHUNKS):
        offs_c = (tile * TILE_CHUNKS + chunk) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_read = offs_c < clusters_read
        s = tl.load(logits_ptr + req * stride_lr + head * stride_lh + offs_g[:, None] * stride_lg + offs_c[None, :],
                    mask=in_group[:, None] & c_read[None, :], other=float("-inf"))
        score = tl.max(tl.where(in_group[:, None], tl.exp2(s - m_safe[:, None]) / denom[:, None], 0.0), 0)
        tl.store(scores_ptr + req * stride_or + head * stride_oh + offs_c, score, mask=offs_c < num_clusters)
        size = tl.load(size_row + offs_c, mask=c_read, other=0).to(tl.int32)
        band = _score_band(score, top_band, BANDS)
        in_octave = (band // OCTAVE)[:, None] == octaves[None, :]
        octave_keys += tl.sum(tl.where(in_octave, size[:, None], 0), 0)
        tl.atomic_add(band_row + band, size, mask=size > 0, sem="relaxed")
    tl.store(octave_keys_ptr + req * stride_kr + head * stride_kh + tile * stride_kt + octaves, octave_keys)


@triton.jit(do_not_specialize=["num_pages", "stride"])
def _page_scores_kernel(query_ptr, summaries_ptr, scores_ptr, retrieval_kv_ptr, query_start_loc_ptr, seq_lens_ptr,
                        block_table_ptr, num_pages, stride,
                        stride_qt: tl.int64, stride_qh: tl.int64, stride_table: tl.int64, stride_sb: tl.int64,
                        stride_sm: tl.int64, stride_sh: tl.int64, stride_or: tl.int64, stride_oh: tl.int64,
                        G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Grid (num_reqs, R, cdiv(num_pages, BLOCK_P)): Quest's bound sum_d max(q_d min_d, q_d max_d) of BLOCK_P pages,
    as q+ . max + q- . min (q+ and q- the positive and negative parts of q), max over the group."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    q = _last_queries(query_ptr, query_start_loc_ptr, retrieval_kv_ptr, req, head, stride_qt, stride_qh, G, BLOCK_G,
                      HEAD_DIM, BLOCK_D).to(tl.float32)
    page = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    in_context = page * BLOCK_SIZE < tl.load(seq_lens_ptr + req)
    block = tl.load(block_table_ptr + req * stride_table + page * stride, mask=in_context, other=0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    ptr = summaries_ptr + block[:, None] * stride_sb + head * stride_sh + offs_d[None, :]
    ok = in_context[:, None] & (offs_d < HEAD_DIM)[None, :]
    low = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    high = tl.load(ptr + stride_sm, mask=ok, other=0.0).to(tl.float32)
    bound = tl.dot(tl.maximum(q, 0.0), tl.trans(high)) + tl.dot(tl.minimum(q, 0.0), tl.trans(low))
    bound = tl.max(tl.where((tl.arange(0, BLOCK_G) < G)[:, None], bound, float("-inf")), 0)
    tl.store(scores_ptr + req * stride_or + head * stride_oh + page, tl.where(in_context, bound, float("-inf")),
             mask=page < num_pages)


def _score_tiles(device: torch.device) -> int:
    """Centroids or pages per tile: tensor-core sized on GPU, the smallest tl.dot takes on the CPU interpreter."""
    return 64 if device.type == "cuda" else 16


class ClusterScores(NamedTuple):
    """`centroid_scores`' result: the scores, and what `select_banded` cuts by: each row's top band (the float32
    bits >> 20 of its highest score) and each tile's keys per band below it (`_score_band`) and per octave of bands
    (band // BAND_OCTAVE), the tiles `tile_clusters` clusters each."""

    scores: torch.Tensor  # [num_reqs, R, C] float32
    top_bands: torch.Tensor  # [num_reqs, R] int32
    octave_keys: torch.Tensor  # [num_reqs, R, tiles, SCORE_BANDS // BAND_OCTAVE] int32
    band_keys: torch.Tensor  # [num_reqs, R, tiles, SCORE_BANDS] int32
    tile_clusters: int


def centroid_scores(query: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor, heads: LayerHeads,
                    query_start_loc: torch.Tensor, scale: float, context_ids: torch.Tensor | None = None,
                    centroid_scales: torch.Tensor | None = None, radii: torch.Tensor | None = None,
                    radius_weight: float = 0.0) -> ClusterScores:
    """Squeezed Attention's estimate (its Eq. 1) of the attention weight of one key of each cluster,
    S_i = exp(l_i) / sum_j N_j exp(l_j) with l_i = q.C_i * scale, for each request's last query token, max over the
    query heads of each retrieval KV head; with each row's keys per score band, for `select_banded`. With `radii`,
    l_i = (q.C_i + radius_weight |q| r_i) * scale: a cluster whose keys spread far from its centroid may hold a key
    the query wants however far the centroid lies (w = 1 bounds every key's logit; on SmolLM2's needles w = 0.5
    brings decode's next-token distribution 3-100x closer to duo's at equal keys read: `SqueezeSettings`).

    Two launches, each over (request, head, tile of clusters): the logits with each tile's softmax partials, then
    the scores and the tile's keys per band and per octave of bands from every tile's partials. Tiles spread a
    context's centroids over the whole GPU: a batch of 4 requests has only 4 R (request, head) rows, far fewer than
    the SMs.

    Args:
        query: `[num_tokens, num_heads, head_dim]`.
        centroids: `[num_contexts, R, C, head_dim]`, unit last stride: each context's cluster centroids per
            retrieval KV head (clusters of the keys as attention sees them).
        sizes: `[num_contexts, R, C]` int32 or float: keys per cluster N_j; clusters of size 0 (padding) score 0.
        heads: the layer's head maps.
        query_start_loc: `[num_reqs + 1]` int32.
        scale: the softmax scale.
        context_ids: `[num_reqs]` int32, the context of each request (requests over one shared document read
            one copy; negative: none, its scores stay 0); None: request i's context is row i.
        centroid_scales: `[num_contexts, R]` float32: each (context, head)'s centroids are stored divided by it
            (fp8 centroids, which read half the bytes of bf16); None: stored as they are.
        radii: `[num_contexts, R, C]` float32 with the strides of `sizes`: each cluster's largest key distance
            from its centroid (clustering.cluster_radii); None: Eq. 1 as the paper states it.
        radius_weight: w above.

    Returns:
        `ClusterScores`: `.scores` `[num_reqs, R, C]` float32 (a request without query tokens gets some other
        token's).
    """
    num_reqs, R, C = query_start_loc.shape[0] - 1, heads.num_retrieval, centroids.shape[2]
    device = query.device
    block_c = _score_tiles(device)
    chunks, tiles = _score_split(num_reqs * R, C, block_c, device)
    # the kernels write every score, top band and key count
    scored = ClusterScores(torch.empty(num_reqs, R, C, dtype=torch.float32, device=device),
                           torch.empty(num_reqs, R, dtype=torch.int32, device=device),
                           torch.empty(num_reqs, R, tiles, SCORE_BANDS // BAND_OCTAVE, dtype=torch.int32,
                                       device=device),
                           torch.empty(num_reqs, R, tiles, SCORE_BANDS, dtype=torch.int32, device=device),
                           chunks * block_c)
    if query.shape[0] == 0 or num_reqs == 0 or R == 0 or C == 0:
        for tensor in scored[:4]:
            tensor.zero_()
        return scored
    if centroids.shape[1] != R or centroids.shape[-1] != query.shape[-1] or centroids.stride(-1) != 1:
        raise ValueError(f"centroids {tuple(centroids.shape)} must be [contexts, {R}, C, {query.shape[-1]}], "
                         "unit last stride")
    head_dim, G = query.shape[-1], heads.group_size
    block_g = max(16, next_power_of_2(G))
    scores = scored.scores
    logits = torch.empty(num_reqs, R, G, C, dtype=torch.float32, device=device)
    part_m, part_l = (torch.empty(num_reqs, R, tiles, block_g, dtype=torch.float32, device=device) for _ in range(2))
    if radii is not None and radii.stride() != sizes.stride():
        raise ValueError(f"radii {tuple(radii.shape)} must have the strides of sizes {tuple(sizes.shape)}")
    # without context ids, scales or radii the kernels read none: `scores` stands in for the pointer
    scales = scores if centroid_scales is None else centroid_scales
    contexts = scores if context_ids is None else context_ids
    launch(_centroid_logits_kernel, (num_reqs, R, tiles))(
        query, centroids, scales, sizes, scores if radii is None else radii, contexts, logits, part_m, part_l,
        scored.band_keys, heads.retrieval_kv, query_start_loc, scale * LOG2E, radius_weight * scale * LOG2E, C,
        *query.stride()[:2], *centroids.stride()[:3], *scales.stride()[:2], *sizes.stride()[:2], *logits.stride()[:3],
        *part_m.stride()[:3], *scored.band_keys.stride()[:3],
        G=G, BLOCK_G=block_g, BLOCK_C=block_c, TILE_CHUNKS=chunks, HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim), CONTEXTS=context_ids is not None,
        SCALED=centroid_scales is not None, RADII=radii is not None and radius_weight > 0, BANDS=SCORE_BANDS,
        **LOGITS_LAUNCH)
    count_c = min(BAND_COUNT_CLUSTERS, block_c)  # a divisor of the tile's clusters
    launch(_centroid_scores_kernel, (num_reqs, R, tiles))(
        logits, part_m, part_l, sizes, contexts, scores, scored.top_bands, scored.octave_keys, scored.band_keys, C,
        tiles, *logits.stride()[:3], *part_m.stride()[:3], *sizes.stride()[:2], *scores.stride()[:2],
        *scored.top_bands.stride(), *scored.octave_keys.stride()[:3], *scored.band_keys.stride()[:3],
        G=G, BLOCK_G=block_g, BLOCK_C=count_c, TILE_CHUNKS=chunks * block_c // count_c,
        BLOCK_T=next_power_of_2(tiles), BANDS=SCORE_BANDS, OCTAVE=BAND_OCTAVE, CONTEXTS=context_ids is not None,
        num_warps=4)
    return scored


SCORE_PROGRAMS_PER_SM = 4  # the centroid kernels' programs per SM, at most 64 tiles per row
LOGITS_LAUNCH = dict(num_warps=4, num_stages=3)  # the logits kernel's (3 stages: Triton's default on sm_90)


def _score_split(rows: int, num_clusters: int, block_c: int, device: torch.device) -> tuple[int, int]:
    """(chunks of block_c clusters per program, tiles per row): enough programs to fill the GPU
    (SCORE_PROGRAMS_PER_SM) with at most 64 tiles per row; on the CPU one chunk per tile (the interpreter tests the
    split)."""
    chunks_needed = cdiv(num_clusters, block_c)
    if device.type != "cuda":
        return 1, chunks_needed
    want = min(64, cdiv(SCORE_PROGRAMS_PER_SM * _sm_count(device.index), max(rows, 1)))
    chunks = max(1, cdiv(chunks_needed, want))  # 1 without clusters
    return chunks, cdiv(chunks_needed, chunks)


def page_scores(query: torch.Tensor, summaries: torch.Tensor, heads: LayerHeads, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Quest's upper bound of q.k over each retrieval page's keys, from per-channel key minima and maxima, for
    each request's last query token, max over the query heads of each retrieval KV head.

    Args:
        query: `[num_tokens, num_heads, head_dim]`.
        summaries: `[num_blocks, 2, >= R, head_dim]`, unit last stride: per retrieval page (by block id) and
            retrieval head slot, the minimum (0) and maximum (1) of each key channel, as attention sees the keys.
            Kept with the page, so prefix caching shares them.
        heads: the layer's head maps; `heads.stride` block table columns per token block.
        query_start_loc: `[num_reqs + 1]` int32; seq_lens: `[num_reqs]` int32; block_table: `[num_reqs, max_blocks]`
            int32.
        block_size: tokens per page.

    Returns:
        `[num_reqs, R, cdiv(max_blocks, stride)]` float32 bounds, -inf for pages past the context.
    """
    num_reqs, R = seq_lens.shape[0], heads.num_retrieval
    num_pages = cdiv(block_table.shape[1], heads.stride)
    scores = torch.full((num_reqs, R, num_pages), float("-inf"), dtype=torch.float32, device=query.device)
    if query.shape[0] == 0 or num_reqs == 0 or R == 0:
        return scores
    if summaries.dim() != 4 or summaries.shape[1] != 2 or summaries.shape[2] < R or summaries.stride(-1) != 1:
        raise ValueError(f"summaries {tuple(summaries.shape)} must be [num_blocks, 2, >= {R}, head_dim], "
                         "unit last stride")
    head_dim, G, block_p = query.shape[-1], heads.group_size, _score_tiles(query.device)
    launch(_page_scores_kernel, (num_reqs, R, cdiv(num_pages, block_p)))(
        query, summaries, scores, heads.retrieval_kv, query_start_loc, seq_lens, block_table, num_pages, heads.stride,
        *query.stride()[:2], block_table.stride(0), *summaries.stride()[:3], *scores.stride()[:2],
        G=G, BLOCK_G=max(16, next_power_of_2(G)), BLOCK_P=block_p, HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim), BLOCK_SIZE=block_size, num_warps=4)
    return scores


def select_positions(scores: torch.Tensor, cluster_offsets: torch.Tensor, cluster_positions: torch.Tensor,
                     budget: int | torch.Tensor, max_selected: int, context_ids: torch.Tensor | None = None,
                     threshold: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of each row's best clusters: clusters in descending score (ties: lower index first) while
    the positions taken before them are fewer than `budget` (the last one may pass it) and, with `threshold`,
    their score exceeds it.

    Cluster c of a context's head r holds `cluster_positions[x, r, cluster_offsets[x, r, c]:cluster_offsets[x, r,
    c + 1]]` (a CSR: positions sorted by cluster). A position that falls in the sinks or the window is skipped by
    the sparse decode, but counts here.

        sizes 3, 5, 2 (clusters 0, 1, 2), scores 0.1, 0.5, 0.3, budget 6: cluster 1 (5 taken), then cluster 2
        (5 < 6: 7 taken), not cluster 0 (7 >= 6): positions of 1 then 2, count 7

    Args:
        scores: `[num_reqs, R, C]` (`centroid_scores`).
        cluster_offsets: `[num_contexts, R, C + 1]` integer, non-decreasing from 0.
        cluster_positions: `[num_contexts, R, T]` int32, contiguous.
        budget: positions to take per row: an int, or `[num_reqs, R]` integers.
        max_selected: the width of the result; a row's positions past it are cut.
        context_ids: `[num_reqs]` int32 context of each request; None: row i.
        threshold: clusters scoring at or below it are not taken.

    Returns:
        selected `[num_reqs, R, max_selected]` int32 (0 past the count), num_selected `[num_reqs, R]` int32.
    """
    num_reqs, R, C = scores.shape
    device = scores.device
    context = torch.arange(num_reqs, device=device) if context_ids is None else context_ids.long()
    offsets = cluster_offsets[context].long()  # [num_reqs, R, C + 1]
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    sizes = (offsets[..., 1:] - offsets[..., :-1]).gather(-1, order)
    ends = sizes.cumsum(-1)
    taken = ends - sizes < (budget[..., None] if isinstance(budget, torch.Tensor) else budget)
    if threshold is not None:
        taken &= sorted_scores > threshold
    counts = (sizes * taken).sum(-1).clamp(max=max_selected)
    slot = torch.arange(max_selected, device=device).expand(num_reqs, R, max_selected).contiguous()
    rank = torch.searchsorted(ends, slot, right=True).clamp(max=C - 1)  # the rank of the cluster each slot falls in
    index = offsets.gather(-1, order.gather(-1, rank)) + slot - (ends - sizes).gather(-1, rank)
    row = (context[:, None] * R + torch.arange(R, device=device)) * cluster_positions.shape[-1]
    keep = slot < counts[..., None]
    selected = cluster_positions.reshape(-1)[torch.where(keep, row[..., None] + index, 0)]
    return torch.where(keep, selected, 0).to(torch.int32), counts.to(torch.int32)


BAND_CLUSTERS = 1024  # the ends kernel's widest chunk of clusters (a tile's, if narrower)
GATHER_SLOTS = 256  # output slots per gather program on a GPU (1024: lookup 0.34 ms slower at 4 x 128k)


@triton.jit
def _bands_and_sizes(scores_row, offsets_row, offs_c, ok, top_band, BANDS: tl.constexpr):
    """Clusters `offs_c` of a row (where `ok`): each one's score band (`_score_band`) and its keys, from the CSR
    offsets."""
    band = _score_band(tl.load(scores_row + offs_c, mask=ok, other=0.0), top_band, BANDS)
    size = tl.load(offsets_row + offs_c + 1, mask=ok, other=0) - tl.load(offsets_row + offs_c, mask=ok, other=0)
    return band, size


@triton.jit
def _cut_octave(octave_keys_ptr, budget_ptr, req, head, num_tiles, stride_kr, stride_kh, stride_kt, stride_br,
                stride_bh, BLOCK_T: tl.constexpr, OCTAVES: tl.constexpr):
    """A row's cut octave (the best whose keys and those of every better octave reach the row's budget; the last if
    none does) from every tile's keys per octave -> (cut octave, those keys `[BLOCK_T, OCTAVES]`, the budget)."""
    octaves = tl.arange(0, OCTAVES)
    offs_t = tl.arange(0, BLOCK_T)
    octave_keys = tl.load(octave_keys_ptr + req * stride_kr + head * stride_kh + offs_t[:, None] * stride_kt
                          + octaves[None, :], mask=(offs_t < num_tiles)[:, None], other=0)
    budget = tl.load(budget_ptr + req * stride_br + head * stride_bh).to(tl.int32)
    cut_octave = tl.min(tl.where(tl.cumsum(tl.sum(octave_keys, 0), 0) >= budget, octaves, OCTAVES - 1), 0)
    return cut_octave, octave_keys, budget


@triton.jit(do_not_specialize=["num_clusters", "num_tiles", "max_selected"])
def _band_ends_kernel(scores_ptr, top_bands_ptr, octave_keys_ptr, band_keys_ptr, offsets_ptr, context_ids_ptr,
                      budget_ptr, above_ptr, ends_ptr, counts_ptr, num_clusters, num_tiles, max_selected,
                      stride_sr: tl.int64, stride_sh: tl.int64, stride_tr: tl.int64, stride_th: tl.int64,
                      stride_kr: tl.int64, stride_kh: tl.int64, stride_kt: tl.int64, stride_fr: tl.int64,
                      stride_fh: tl.int64, stride_ft: tl.int64, stride_ox: tl.int64,
                      stride_oh: tl.int64, stride_br: tl.int64, stride_bh: tl.int64, stride_cr: tl.int64,
                      stride_ch: tl.int64, stride_er: tl.int64, stride_eh: tl.int64, stride_es: tl.int64,
                      TILE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BANDS: tl.constexpr,
                      OCTAVE: tl.constexpr, CONTEXTS: tl.constexpr):
    """Grid (num_reqs, R, tiles): `centroid_scores`' tiles of TILE clusters. Each program finds the row's cut band
    (the best band whose keys and those of every better band reach the budget; the last if none does) in two steps:
    the cut octave from every tile's keys per octave, then the cut band within it from every tile's keys in that
    octave's bands (both counted by `_centroid_scores_kernel`). It then writes, for each cluster of its tile, where
    its keys end in the row's two runs, inclusive running sums over all clusters in cluster order: `ends[.., 0, c]`
    of the sizes above the cut, `ends[.., 1, c]` of the sizes in the cut band. The cut band's clusters are taken
    while the keys before them are fewer than the row's need, so its run ends at the first that meets it: the
    program holding that one writes the count; where none does (all of them taken, or none needed) tile 0's program
    writes it, and always the keys above the cut."""
    req, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context = _context_of(context_ids_ptr, req, CONTEXTS)
    row = req * stride_cr + head * stride_ch
    first = tile == 0
    if context < 0:
        tl.store(above_ptr + row, 0, mask=first)
        tl.store(counts_ptr + row, 0, mask=first)
        return
    cut_octave, octave_keys, budget = _cut_octave(octave_keys_ptr, budget_ptr, req, head, num_tiles, stride_kr,
                                                  stride_kh, stride_kt, stride_br, stride_bh, BLOCK_T, BANDS // OCTAVE)
    octaves = tl.arange(0, BANDS // OCTAVE)
    offs_t = tl.arange(0, BLOCK_T)
    above_octaves = tl.sum(tl.where(octaves < cut_octave, tl.sum(octave_keys, 0), 0), 0)
    # keys in the tiles before this one, in the octaves above the cut
    octaves_before = tl.sum(tl.sum(tl.where((offs_t < tile)[:, None] & (octaves < cut_octave)[None, :], octave_keys,
                                            0), 1), 0)
    fine = tl.arange(0, OCTAVE)  # the cut octave's keys per band: the row's, the tiles' before this one
    tile_fine = tl.load(band_keys_ptr + req * stride_fr + head * stride_fh + offs_t[:, None] * stride_ft
                        + cut_octave * OCTAVE + fine[None, :], mask=(offs_t < num_tiles)[:, None], other=0)
    fine_keys = tl.sum(tile_fine, 0)
    fine_before = tl.sum(tl.where((offs_t < tile)[:, None], tile_fine, 0), 0)
    cut_fine = tl.min(tl.where(above_octaves + tl.cumsum(fine_keys, 0) >= budget, fine, OCTAVE - 1), 0)
    cut = cut_octave * OCTAVE + cut_fine
    above_all = above_octaves + tl.sum(tl.where(fine < cut_fine, fine_keys, 0), 0)
    in_cut_all = tl.sum(tl.where(fine == cut_fine, fine_keys, 0), 0)
    need = budget - above_all
    met = (need > 0) & (in_cut_all >= need)  # by one cluster of the cut band
    tl.store(above_ptr + row, above_all, mask=first)
    tl.store(counts_ptr + row, tl.minimum(above_all + tl.where(in_cut_all < need, in_cut_all, 0), max_selected),
             mask=first & ~met)
    base_above = octaves_before + tl.sum(tl.where(fine < cut_fine, fine_before, 0), 0)
    base_cut = tl.sum(tl.where(fine == cut_fine, fine_before, 0), 0)
    top_band = tl.load(top_bands_ptr + req * stride_tr + head * stride_th)
    scores_row = scores_ptr + req * stride_sr + head * stride_sh
    offsets_row = offsets_ptr + context * stride_ox + head * stride_oh
    ends_row = ends_ptr + req * stride_er + head * stride_eh
    tile_end = tl.minimum((tile + 1) * TILE, num_clusters)
    for start in range(0, TILE, BLOCK_E):
        offs_c = tile * TILE + start + tl.arange(0, BLOCK_E)
        ok = offs_c < tile_end
        band, size = _bands_and_sizes(scores_row, offsets_row, offs_c, ok, top_band, BANDS)
        above = tl.where(ok & (band < cut), size, 0)
        in_cut = tl.where(ok & (band == cut), size, 0)
        above_ends = base_above + tl.cumsum(above, 0)
        cut_ends = base_cut + tl.cumsum(in_cut, 0)
        tl.store(ends_row + offs_c, above_ends, mask=ok)
        tl.store(ends_row + stride_es + offs_c, cut_ends, mask=ok)
        meets = (in_cut > 0) & (cut_ends - in_cut < need) & (cut_ends >= need)  # at most one in the row
        tl.store(counts_ptr + row + 0 * offs_c, tl.minimum(above_all + cut_ends, max_selected), mask=meets)
        base_above += tl.sum(above, 0)
        base_cut += tl.sum(in_cut, 0)


@triton.jit
def _run_positions(slot, live, req, head, context, offsets_ptr, positions_ptr, above_ptr, ends_ptr, num_clusters,
                   stride_ox, stride_oh, stride_px, stride_ph, stride_cr, stride_ch, stride_er, stride_eh, stride_es,
                   SEARCH_STEPS: tl.constexpr):
    """The positions of a row's selected slots `slot` (where `live`; 0 elsewhere), `band_runs`' order: each slot
    finds its cluster by a binary search of its run's ends (the first cluster whose keys end after the slot) and
    reads that key's position. Every slot costs the same whatever the clusters' sizes and scores."""
    above = tl.load(above_ptr + req * stride_cr + head * stride_ch)
    in_cut = slot >= above
    target = tl.where(in_cut, slot - above, slot)  # the slot's place in its run
    ends_row = ends_ptr + req * stride_er + head * stride_eh + in_cut.to(tl.int64) * stride_es
    low = tl.zeros_like(slot)
    high = tl.where(live, num_clusters, 0)
    for _ in range(SEARCH_STEPS):
        searching = low < high
        mid = (low + high) // 2
        end = tl.load(ends_row + mid, mask=searching, other=0)
        right = end <= target
        low = tl.where(searching & right, mid + 1, low)
        high = tl.where(searching & ~right, mid, high)
    offsets_row = offsets_ptr + context * stride_ox + head * stride_oh
    first = tl.load(offsets_row + low, mask=live, other=0)
    size = tl.load(offsets_row + low + 1, mask=live, other=0) - first
    end = tl.load(ends_row + low, mask=live, other=0)
    position = tl.load(positions_ptr + context * stride_px + head * stride_ph + first + size - (end - target),
                       mask=live, other=0)
    return tl.where(live, position, 0)


@triton.jit(do_not_specialize=["num_clusters", "max_selected"])
def _band_gather_kernel(offsets_ptr, positions_ptr, context_ids_ptr, above_ptr, ends_ptr, counts_ptr, selected_ptr,
                        num_clusters, max_selected,
                        stride_ox: tl.int64, stride_oh: tl.int64, stride_px: tl.int64, stride_ph: tl.int64,
                        stride_cr: tl.int64, stride_ch: tl.int64, stride_er: tl.int64, stride_eh: tl.int64,
                        stride_es: tl.int64, stride_qr: tl.int64, stride_qh: tl.int64,
                        OUT_W: tl.constexpr, SEARCH_STEPS: tl.constexpr, CONTEXTS: tl.constexpr):
    """Grid (num_reqs, R, cdiv(max_selected, OUT_W)): OUT_W output slots' positions (`_run_positions`); slots past
    the count get 0."""
    req, head = tl.program_id(0), tl.program_id(1)
    slot = tl.program_id(2) * OUT_W + tl.arange(0, OUT_W)
    context = tl.maximum(_context_of(context_ids_ptr, req, CONTEXTS), 0)  # without one the count is 0
    live = slot < tl.load(counts_ptr + req * stride_cr + head * stride_ch)
    position = _run_positions(slot, live, req, head, context, offsets_ptr, positions_ptr, above_ptr, ends_ptr,
                              num_clusters, stride_ox, stride_oh, stride_px, stride_ph, stride_cr, stride_ch,
                              stride_er, stride_eh, stride_es, SEARCH_STEPS)
    tl.store(selected_ptr + req * stride_qr + head * stride_qh + slot, position, mask=slot < max_selected)


def select_banded(scored: ClusterScores, cluster_offsets: torch.Tensor, cluster_positions: torch.Tensor,
                  budget: torch.Tensor, max_selected: int,
                  context_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_positions` without a sort, the budget met a score band at a time: every cluster of the bands above
    the row's cut, the best band whose keys and those of every better band reach the budget, then the cut band's
    clusters in cluster order while the keys taken are fewer than the budget (every band, all of them, if the budget
    is never met). A cluster's band is how far its score sits below the row's highest (`_score_band`: bands of 12.5%
    down to 2^-32 of it). So a row takes its budget and at most one cluster more, like `select_positions`, but from
    the best bands rather than the best clusters; positions of the clusters above the cut in cluster order, then
    those of the cut band's.

        bands of clusters 0, 1, 2, 3: 2, 0, 1, 1 (band 0 holds the row's highest score), sizes 3, 5, 2, 4,
        budget 8: band 0 holds 5 keys, bands 0 and 1 11: cut 1, need 3: cluster 1, then cluster 2 (0 before it
        < 3), cluster 3 (2 < 3); positions of 1, 2, 3, count 11; with budget 7: clusters 1 and 2, count 7

    Two launches, neither zeroing nor atomics: `band_runs`', then the positions, each output slot finding
    its cluster by a binary search of the runs' ends (`row_pages.run_pages` makes FlashAttention's page lists from
    the runs instead, in one launch).

    Args and result as `select_positions`', but `scored` is `centroid_scores`' result (its `sizes` the offsets'
    differences), `budget` `[num_reqs, R]` integers, and a negative context id selects nothing; no threshold.
    """
    return gather_positions(band_runs(scored, cluster_offsets, budget, max_selected, context_ids), cluster_positions,
                            max_selected, context_ids)


def gather_positions(runs: BandRuns, cluster_positions: torch.Tensor, max_selected: int,
                     context_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_banded`'s positions from its runs, one launch: selected `[num_reqs, R, max_selected]` int32 (0 past
    the count) and the counts `[num_reqs, R]` int32."""
    (num_reqs, R), C = runs.counts.shape, runs.ends.shape[-1]
    selected = torch.empty(num_reqs, R, max_selected, dtype=torch.int32, device=runs.counts.device)
    if num_reqs == 0 or R == 0 or C == 0:
        return selected.zero_(), runs.counts
    out_w = GATHER_SLOTS if selected.is_cuda else 16
    contexts = runs.counts if context_ids is None else context_ids  # without context ids the kernel reads none
    launch(_band_gather_kernel, (num_reqs, R, cdiv(max_selected, out_w)))(
        runs.offsets, cluster_positions, contexts, runs.above, runs.ends, runs.counts, selected, C, max_selected,
        *runs.offsets.stride()[:2], *cluster_positions.stride()[:2], *runs.counts.stride(), *runs.ends.stride()[:3],
        *selected.stride()[:2], OUT_W=out_w, SEARCH_STEPS=C.bit_length(), CONTEXTS=context_ids is not None)
    return selected, runs.counts


class BandRuns(NamedTuple):
    """`band_runs`' result: each row's selected keys as two runs over its clusters in cluster order, those above
    the cut band, then the cut band's taken ones; a slot s < `above` is the s-th key of the first run, a later one
    the (s - above)-th of the second (`_run_positions` finds them)."""

    above: torch.Tensor  # [num_reqs, R] int32: keys above each row's cut band
    ends: torch.Tensor  # [num_reqs, R, 2, C] int32: inclusive running sums of each run's cluster sizes
    counts: torch.Tensor  # [num_reqs, R] int32: keys selected (at most max_selected)
    offsets: torch.Tensor  # the CSR offsets as int32, as the kernels read them


def band_runs(scored: ClusterScores, cluster_offsets: torch.Tensor, budget: torch.Tensor, max_selected: int,
              context_ids: torch.Tensor | None = None) -> BandRuns:
    """What `select_banded` takes of each row, as the runs of its clusters: one launch, per tile of clusters the
    row's cut band (from every tile's keys per octave, then per band of the cut octave, that `centroid_scores`
    counted) and the running ends of the two runs. Arguments as `select_banded`'s."""
    scores = scored.scores
    num_reqs, R, C = scores.shape
    device = scores.device
    counts = torch.empty(num_reqs, R, dtype=torch.int32, device=device)  # the ends kernel writes every row's
    above = torch.empty_like(counts)
    ends = torch.empty(num_reqs, R, 2, C, dtype=torch.int32, device=device)
    offsets = cluster_offsets.to(torch.int32)
    if num_reqs == 0 or R == 0 or C == 0:
        return BandRuns(above.zero_(), ends, counts.zero_(), offsets)
    tiles = scored.band_keys.shape[2]
    contexts = scores if context_ids is None else context_ids  # without context ids the kernel reads none
    tile = scored.tile_clusters
    launch(_band_ends_kernel, (num_reqs, R, tiles))(
        scores, scored.top_bands, scored.octave_keys, scored.band_keys, offsets, contexts, budget, above, ends, counts,
        C, tiles, max_selected, *scores.stride()[:2], *scored.top_bands.stride(), *scored.octave_keys.stride()[:3],
        *scored.band_keys.stride()[:3], *offsets.stride()[:2], *budget.stride(), *counts.stride(), *ends.stride()[:3],
        TILE=tile, BLOCK_E=min(BAND_CLUSTERS, next_power_of_2(tile)), BLOCK_T=next_power_of_2(tiles),
        BANDS=SCORE_BANDS, OCTAVE=BAND_OCTAVE, CONTEXTS=context_ids is not None)
    return BandRuns(above, ends, counts, offsets)


def select_pages(scores: torch.Tensor, seq_lens: torch.Tensor, block_size: int, sink: int, recent: int,
                 num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The context positions of each row's `num_pages` best pages (`page_scores`) among those with a position
    between the sinks [0, sink) and the window [seq_len - recent, seq_len): those positions, ascending.

    Args:
        scores: `[num_reqs, R, pages]`.
        seq_lens: `[num_reqs]` int32.
        block_size: tokens per page.
        sink, recent: the sinks and window the sparse decode attends anyway.
        num_pages: pages per row (at most `pages`).

    Returns:
        selected `[num_reqs, R, num_pages * block_size]` int32 (0 past the count), num_selected `[num_reqs, R]` int32.
    """
    pages = scores.shape[-1]
    if num_pages > pages:
        raise ValueError(f"num_pages {num_pages} exceeds the {pages} pages scored")
    window = (seq_lens.long() - recent).clamp(min=sink)[:, None, None]  # [num_reqs, 1, 1]
    first = torch.arange(pages, device=scores.device) * block_size
    between = (first < window) & (first + block_size > sink)  # pages with a position between the sinks and window
    top = scores.masked_fill(~between, float("-inf")).topk(num_pages, dim=-1).indices
    pos = (top[..., None] * block_size + torch.arange(block_size, device=scores.device)).flatten(-2)
    keep = (pos >= sink) & (pos < window)
    ascending = torch.where(keep, pos, torch.iinfo(torch.int32).max).sort(dim=-1).values
    counts = keep.sum(-1)
    return torch.where(ascending < torch.iinfo(torch.int32).max, ascending, 0).to(torch.int32), counts.to(torch.int32)
