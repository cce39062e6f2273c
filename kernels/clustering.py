# SPDX-License-Identifier: Apache-2.0
"""Squeezed Attention's offline step (its Section 3.1): spherical K-means of a fixed context's keys, per retrieval
KV head, and the CSR of positions per cluster that `selection.select_positions` reads.

Keys are clustered by cosine (Lloyd's iterations on unit keys, each centre the normalized sum of its unit keys),
and each cluster is summarized by the mean of its raw keys (the centroid `centroid_scores` compares queries with,
as the authors' code does). All heads of a context are clustered at once: on a GPU each assignment is one Triton
launch that keeps every key's best centre in registers (`nearest_centres`, bf16 dot products), elsewhere matmuls
chunked so that the score block stays under `max_block_bytes`; updates are `index_add_`, and nothing loops over heads
or keys in Python (only over Lloyd iterations and k-means++ draws). Deterministic for a seed on the CPU; on CUDA,
`index_add_`'s float atomics may reorder sums unless `torch.use_deterministic_algorithms(True)`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllm_duo.kernels.launch import cdiv, launch, next_power_of_2

MAX_BLOCK_BYTES = 256 << 20
FUSED_ASSIGN = True  # on CUDA, assignments by `nearest_centres` (False: the chunked matmuls, as on the CPU)
NEAREST_TILE = (128, 64, 8)  # nearest_centres on a GPU: keys and centres per tile, warps


class KeyClusters(NamedTuple):
    """K-means of `[H, T, D]` keys into C clusters per head: centroids `[H, C, D]` float32 (the mean of each
    cluster's raw keys, 0 for an empty one), sizes `[H, C]` int32, labels `[H, T]` int64 (the cluster of each key)
    and the Lloyd iterations run (fewer than asked when no label changed)."""

    centroids: torch.Tensor
    sizes: torch.Tensor
    labels: torch.Tensor
    iterations: int


@triton.jit(do_not_specialize=["num_keys", "num_centres"])
def _nearest_centre_kernel(units_ptr, centres_ptr, labels_ptr, num_keys, num_centres,
                           stride_uh: tl.int64, stride_ut: tl.int64, stride_ch: tl.int64, stride_cn: tl.int64,
                           stride_lh: tl.int64, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BF16: tl.constexpr):
    """Grid (cdiv(T, BLOCK_T), H): BLOCK_T keys of head h against every centre of h, BLOCK_C at a time, keeping
    each key's best dot product and its first index; no score block leaves the registers."""
    tile, head = tl.program_id(0), tl.program_id(1)
    offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok, d_ok = offs_t < num_keys, offs_d < HEAD_DIM
    units = tl.load(units_ptr + head * stride_uh + offs_t.to(tl.int64)[:, None] * stride_ut + offs_d[None, :],
                    mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    if BF16:
        units = units.to(tl.bfloat16)
    best = tl.full([BLOCK_T], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK_T], tl.int32)
    for start in range(0, num_centres, BLOCK_C):
        offs_c = start + tl.arange(0, BLOCK_C)
        c_ok = offs_c < num_centres
        centres = tl.load(centres_ptr + head * stride_ch + offs_c.to(tl.int64)[:, None] * stride_cn + offs_d[None, :],
                          mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        if BF16:
            scores = tl.dot(units, tl.trans(centres.to(tl.bfloat16)))
        else:
            scores = tl.dot(units, tl.trans(centres), input_precision="ieee")
        scores = tl.where(c_ok[None, :], scores, float("-inf"))
        tile_best = tl.max(scores, 1)
        tile_index = tl.argmax(scores, 1, tie_break_left=True).to(tl.int32) + start
        better = tile_best > best  # ties keep the earlier tile's, lower, index
        best_index = tl.where(better, tile_index, best_index)
        best = tl.where(better, tile_best, best)
    tl.store(labels_ptr + head * stride_lh + offs_t, best_index.to(tl.int64), mask=t_ok)


def nearest_centres(units: torch.Tensor, centres: torch.Tensor, bf16: bool = True) -> torch.Tensor:
    """The most similar centre of each key by dot product (ties: the lower index), `[H, T]` int64, from units
    `[H, T, D]` and centres `[H, C, D]` (any float dtype, unit last stride), one launch. `bf16`: dot products of
    bf16-rounded inputs (the tensor cores' fast path; unit vectors' dot products then err by ~0.004, so near-ties
    may go either way), else exact float32."""
    H, T, D = units.shape
    C = centres.shape[1]
    # every program reads all of its head's centres: bf16 once here halves that traffic
    units, centres = units.contiguous(), (centres.to(torch.bfloat16) if bf16 else centres).contiguous()
    labels = torch.empty(H, T, dtype=torch.int64, device=units.device)
    if T == 0:
        return labels
    block_t, block_c, warps = NEAREST_TILE if units.is_cuda else (16, 16, 4)
    launch(_nearest_centre_kernel, (cdiv(T, block_t), H))(
        units, centres, labels, T, C, units.stride(0), units.stride(1), centres.stride(0), centres.stride(1),
        labels.stride(0), HEAD_DIM=D, BLOCK_D=max(16, next_power_of_2(D)), BLOCK_T=block_t, BLOCK_C=block_c,
        BF16=bf16, num_warps=warps)
    return labels


def _nearest_per_head(units: torch.Tensor, centres: torch.Tensor, max_block_bytes: int) -> torch.Tensor:
    """The most cosine-similar centre of each unit key (ties: the lower index), `[H, T]`, from units `[H, T, D]` and
    unit centres `[H, C, D]`: on CUDA by `nearest_centres`, else in chunks of keys whose `[H, chunk, C]` float32
    scores fit `max_block_bytes`."""
    if units.is_cuda and FUSED_ASSIGN:
        return nearest_centres(units, centres)
    H, T, _ = units.shape
    chunk = max(1, max_block_bytes // (4 * H * max(1, centres.shape[1])))
    return torch.cat([torch.bmm(units[:, start:start + chunk], centres.transpose(1, 2)).argmax(-1)
                      for start in range(0, T, chunk)], dim=1)


def _nearest_in_group(units: torch.Tensor, group: torch.Tensor, centres: torch.Tensor,
                      max_block_bytes: int) -> torch.Tensor:
    """The most cosine-similar of its own group's K centres for each unit key (ties: the lower index), `[N]` in
    [0, K), from units `[N, D]`, group `[N]` and centres `[G, K, D]`, in chunks whose gathered `[chunk, K, D]`
    centres fit `max_block_bytes`."""
    N, D = units.shape
    chunk = max(1, max_block_bytes // (4 * centres.shape[1] * D))
    return torch.cat([torch.einsum("nd,nkd->nk", units[start:start + chunk], centres[group[start:start + chunk]])
                      .argmax(-1) for start in range(0, N, chunk)])


def _random_init(units: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, k: int,
                 generator: torch.Generator) -> torch.Tensor:
    """K distinct keys of each group drawn uniformly (a group of fewer keys repeats them: the copies end up empty),
    `[G, K, D]`, from units `[N, D]` sorted by group (group g is `units[starts[g]:starts[g] + lengths[g]]`)."""
    group = torch.repeat_interleave(torch.arange(len(lengths), device=units.device), lengths)
    shuffled = torch.argsort(group.double() + torch.rand(len(group), generator=generator, device=units.device,
                                                         dtype=torch.float64))
    slot = starts[:, None] + torch.arange(k, device=units.device) % lengths.clamp_min(1)[:, None]
    return units[shuffled[slot.clamp(max=len(units) - 1)]]


def _own_centre_similarity(units: torch.Tensor, lengths: torch.Tensor):
    """A function of one centre per group `[G, D]` giving each unit key's dot product with its group's centre, `[N]`
    (units `[N, D]` sorted by group): a batched matrix-vector product when the groups are of one length (the heads
    of `cluster_keys`), else a gather of each key's centre."""
    G, (N, D) = len(lengths), units.shape
    if N % G == 0 and bool((lengths == N // G).all()):
        return lambda centre: torch.bmm(units.view(G, N // G, D), centre[:, :, None]).flatten()
    group = torch.repeat_interleave(torch.arange(G, device=units.device), lengths)
    return lambda centre: (units * centre[group]).sum(-1)


def _kmeans_pp_init(units: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, k: int,
                    generator: torch.Generator) -> torch.Tensor:
    """k-means++ seeding on 1 - cosine, each group its own, `[G, K, D]`: the first centre uniform, each next one a
    key drawn with probability proportional to its distance to the nearest centre so far. K sequential passes over
    all N keys: the dominant cost at large K (each pass reads every key)."""
    G, device = len(lengths), units.device
    last = (starts + lengths - 1).clamp(min=0, max=len(units) - 1)
    centres = torch.empty(G, k, units.shape[1], dtype=units.dtype, device=device)
    pick = starts + (torch.rand(G, generator=generator, device=device) * lengths).long().clamp(max=lengths - 1)
    similarity = _own_centre_similarity(units, lengths)
    for j in range(k):
        if j:  # inverse CDF over each group's slice of one running sum
            cumulative = (distance.double() + 1e-12).cumsum(0)
            before = torch.where(starts > 0, cumulative[(starts - 1).clamp(min=0)], 0.0)
            target = before + torch.rand(G, generator=generator, device=device, dtype=torch.float64) * (
                cumulative[last] - before)
            pick = torch.minimum(torch.searchsorted(cumulative, target, right=True), last)
        centres[:, j] = units[pick.clamp(min=0, max=len(units) - 1)]
        gap = (1 - similarity(centres[:, j])).clamp_min(0)
        distance = gap if j == 0 else torch.minimum(distance, gap)
    return centres


def _lloyd(keys: torch.Tensor, lengths: torch.Tensor, k: int, iters: int, init: str | torch.Tensor, seed: int,
           nearest) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Spherical K-means of keys `[N, D]` sorted by group (`lengths` `[G]` keys per group), K clusters per group.
    `nearest(units, centres)` assigns each unit key to one of its group's centres. Returns centroids `[G, K, D]`
    float32 (mean raw key), sizes `[G, K]` int32, labels `[N]` in [0, K) and the iterations run."""
    G, (N, D), device = len(lengths), keys.shape, keys.device
    units = F.normalize(keys.float(), dim=-1)
    starts = lengths.cumsum(0) - lengths
    generator = torch.Generator(device=device).manual_seed(seed)
    if isinstance(init, torch.Tensor):
        centres = F.normalize(init.float().reshape(G, k, D), dim=-1)
    elif init == "k-means++":
        centres = _kmeans_pp_init(units, starts, lengths, k, generator)
    elif init == "random":
        centres = _random_init(units, starts, lengths, k, generator)
    else:
        raise ValueError(f"init {init!r}: 'k-means++', 'random' or a [G, K, D] tensor")
    row = torch.repeat_interleave(torch.arange(G, device=device), lengths) * k  # each key's first cluster row
    labels, done = None, 0
    for done in range(1, iters + 1):
        new = nearest(units, centres)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        sums = torch.zeros(G * k, D, device=device).index_add_(0, row + labels, units).view(G, k, D)
        centres = torch.where(sums.norm(dim=-1, keepdim=True) > 0, F.normalize(sums, dim=-1), centres)  # empty: kept
    if labels is None:  # iters 0: the seeds' clusters
        labels = nearest(units, centres)
    sizes = torch.zeros(G * k, dtype=torch.int32, device=device).index_add_(
        0, row + labels, torch.ones(N, dtype=torch.int32, device=device)).view(G, k)
    sums = torch.zeros(G * k, D, device=device).index_add_(0, row + labels, keys.float()).view(G, k, D)
    return sums / sizes.clamp_min(1)[..., None], sizes, labels, done


def cluster_keys(keys: torch.Tensor, num_clusters: int, iters: int = 20, seed: int = 0,
                 init: str | torch.Tensor = "k-means++", max_block_bytes: int = MAX_BLOCK_BYTES) -> KeyClusters:
    """Spherical K-means of each head's keys (Squeezed Attention's 1-level clustering), all heads at once.

    Cost per Lloyd iteration: H x T x C dot products of length D (a matmul); k-means++ adds C sequential passes over
    the keys. At 128k keys and C = n/16 = 8k centroids that is 1G dot products per head and iteration: see
    `cluster_keys_hierarchical` for the cheaper two-level build.

    Args:
        keys: `[H, T, D]` any float dtype (fp8 dequantized by the caller): the selectable keys of H heads (e.g. the
            retrieval KV heads of every layer of one context), as attention sees them.
        num_clusters: C per head (a head with fewer keys leaves clusters empty).
        iters: Lloyd iterations at most; stops early when no label changes.
        seed: seeds the initialization (the only randomness).
        init: "k-means++" (on 1 - cosine), "random" (C distinct keys), or centres `[H, C, D]` (normalized here).
        max_block_bytes: bound of the float32 `[H, chunk, C]` score block of one assignment step.

    Returns:
        KeyClusters: centroids `[H, C, D]` float32, sizes `[H, C]` int32, labels `[H, T]` int64, iterations.
    """
    H, T, D = keys.shape
    lengths = torch.full((H,), T, device=keys.device)

    def nearest(units, centres):
        return _nearest_per_head(units.view(H, T, D), centres, max_block_bytes).flatten()

    centroids, sizes, labels, done = _lloyd(keys.reshape(H * T, D), lengths, num_clusters, iters, init, seed,
                                            nearest)
    return KeyClusters(centroids, sizes, labels.view(H, T), done)


def cluster_radii(keys: torch.Tensor, clusters: KeyClusters, chunk: int = 16384) -> torch.Tensor:
    """Each cluster's radius `[H, C]` float32: the largest distance of its raw keys `[H, T, D]` from its centroid
    (0 for an empty one), `chunk` keys at a time. Every key k of a cluster C of radius r has q.k <= q.C + |q| r."""
    H, T, D = keys.shape
    radii = torch.zeros(clusters.sizes.shape, dtype=torch.float32, device=keys.device)
    for start in range(0, T, chunk):
        labels = clusters.labels[:, start:start + chunk]
        centre = clusters.centroids.gather(1, labels[..., None].expand(-1, -1, D))
        radii.scatter_reduce_(1, labels, (keys[:, start:start + chunk].float() - centre).norm(dim=-1), "amax")
    return radii


def cluster_keys_hierarchical(keys: torch.Tensor, num_coarse: int, fine_per_coarse: int, iters: int = 20,
                              seed: int = 0, init: str = "k-means++",
                              max_block_bytes: int = MAX_BLOCK_BYTES) -> tuple[KeyClusters, KeyClusters]:
    """Two-level clustering (Squeezed Attention's hierarchical lookup, Section 3.3), built top-down: each head's keys
    into `num_coarse` clusters, then the keys of each coarse cluster into `fine_per_coarse` fine clusters, all coarse
    clusters of all heads in one batched K-means. Fine cluster `c * fine_per_coarse + f` lies in coarse cluster c,
    so `to_csr` of the fine labels lists a coarse cluster's keys contiguously: positions
    `[offsets[c * F], offsets[(c + 1) * F])` with F = fine_per_coarse.

    When it pays: the paper builds the levels bottom-up (K-means of the keys into the fine centroids, then of those
    into coarse ones), which still costs the 1-level T x C per iteration and C k-means++ passes. Top-down costs
    T x (C1 + F) per iteration and C1 + F passes, least at C1 = F = sqrt(C): at 128k keys and C = 8k, about 128k x
    180 = 23M dot products per head and iteration against 1G, and 180 passes against 8k. It pays whenever C is large
    (long contexts, C = n/16): the 1-level build is quadratic in the context (T x T/16), the two-level one grows as
    T^1.5. The price: a key stays in its coarse cluster even if a fine centre of another coarse cluster is nearer,
    so the fine clusters are somewhat less tight than a 1-level K-means with the same C.

    Args:
        keys: `[H, T, D]` as in `cluster_keys`.
        num_coarse: C1 coarse clusters per head.
        fine_per_coarse: F fine clusters per coarse cluster (C = C1 x F fine clusters per head; a coarse cluster of
            fewer than F keys leaves some empty).
        iters, seed, init, max_block_bytes: as in `cluster_keys` (init "k-means++" or "random" at both levels; the
            fine level bounds its gathered `[chunk, F, D]` centres by max_block_bytes).

    Returns:
        (coarse, fine) KeyClusters: coarse `[H, C1, ...]`, fine `[H, C1 * F, ...]` with labels in [0, C1 * F); the
        iterations of the fine level.
    """
    H, T, D = keys.shape
    coarse = cluster_keys(keys, num_coarse, iters, seed, init, max_block_bytes)
    group = (torch.arange(H, device=keys.device)[:, None] * num_coarse + coarse.labels).flatten()
    order = torch.sort(group, stable=True).indices  # the keys grouped by (head, coarse cluster)
    sorted_group = group[order]

    def nearest(units, centres):
        return _nearest_in_group(units, sorted_group, centres, max_block_bytes)

    centroids, sizes, labels, done = _lloyd(keys.reshape(H * T, D)[order], coarse.sizes.flatten().long(),
                                            fine_per_coarse, iters, init, seed + 1, nearest)
    fine_labels = torch.empty_like(labels)
    fine_labels[order] = (sorted_group % num_coarse) * fine_per_coarse + labels
    C = num_coarse * fine_per_coarse
    return coarse, KeyClusters(centroids.view(H, C, D), sizes.view(H, C), fine_labels.view(H, T), done)


def to_csr(labels: torch.Tensor, num_clusters: int, positions_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of each cluster as the CSR `select_positions` reads: cluster c of head h holds
    `positions[h, offsets[h, c]:offsets[h, c + 1]]`, ascending.

        labels [[1, 0, 1, 1]], 3 clusters, offset 64: offsets [[0, 1, 4, 4]], positions [[65, 64, 66, 67]]

    Args:
        labels: `[H, T]` integer cluster of each key (key i at context position positions_offset + i).
        num_clusters: C.
        positions_offset: the context position of key 0 (e.g. the first selectable position, after the sinks).

    Returns:
        cluster_offsets `[H, C + 1]` int32, cluster_positions `[H, T]` int32 (contiguous).
    """
    H, T = labels.shape
    order = torch.sort(labels, dim=-1, stable=True).indices  # by cluster, then by position
    counts = torch.zeros(H, num_clusters, dtype=torch.int32, device=labels.device).scatter_add_(
        1, labels.long(), torch.ones(H, T, dtype=torch.int32, device=labels.device))
    offsets = F.pad(counts.cumsum(-1, dtype=torch.int32), (1, 0))
    return offsets, (order + positions_offset).to(torch.int32).contiguous()
