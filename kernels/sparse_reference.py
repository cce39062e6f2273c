# SPDX-License-Identifier: Apache-2.0
"""Plain PyTorch references of the sparse retrieval decode (sparse_decode.py), its selection (selection.py) and the
clustering of the keys (clustering.py): request by request, head by head and key by key, in float32, as Squeezed
Attention (Eq. 1) and Quest state them. The layout and the fp8 storage are reference.py's.
"""

from __future__ import annotations

import torch

from vllm_duo.kernels.reference import KVQuant, LayerHeads, attend, read_retrieval
from vllm_duo.kernels.selection import SCORE_BANDS


def key_positions(seq_len: int, chosen: torch.Tensor, sink: int, recent: int,
                  context_end: int | None = None) -> torch.Tensor:
    """The positions a retrieval head attends at decode: the sinks, the chosen positions between the sinks and the
    window (others are dropped: each key counts once), the window: every position from `context_end` on (a
    clustered context's end; the new token q at least), or without one (q - recent, q]."""
    window = max(sink, seq_len - recent if context_end is None else min(context_end, seq_len - 1))
    chosen = chosen.long()
    between = chosen[(chosen >= sink) & (chosen < window)]
    return torch.cat([torch.arange(min(sink, seq_len), device=chosen.device), between,
                      torch.arange(min(window, seq_len), seq_len, device=chosen.device)])


def sparse_decode_attention(query: torch.Tensor, cache: torch.Tensor, heads: LayerHeads, query_start_loc: list[int],
                            seq_lens: list[int], block_table: torch.Tensor, scale: float, output: torch.Tensor,
                            selected: torch.Tensor, num_selected: torch.Tensor, quant: KVQuant | None = None,
                            sink: int | None = None, recent: int | None = None,
                            context_ends: list[int] | None = None) -> None:
    """`sparse_decode.sparse_decode_attention`: each single-token request's retrieval query heads attend to their
    KV head's `key_positions`, written into `output` `[num_tokens, num_heads, head_dim]`; nothing else is (nor a
    request whose context end is 0)."""
    sink = heads.sink if sink is None else sink
    recent = heads.recent if recent is None else recent
    G = heads.group_size
    for i, seq_len in enumerate(seq_lens):
        t = query_start_loc[i]
        if query_start_loc[i + 1] - t != 1 or (context_ends is not None and context_ends[i] == 0):
            continue
        keys, values = read_retrieval(cache, block_table[i].long(), seq_len, heads.num_retrieval, heads.stride, quant)
        q_pos = torch.tensor([seq_len - 1], device=query.device)
        for r in range(heads.num_retrieval):
            pos = key_positions(seq_len, selected[i, r, :int(num_selected[i, r])], sink, recent,
                                None if context_ends is None else context_ends[i])
            q_heads = heads.retrieval_q[r * G:(r + 1) * G]
            out = attend(query[t:t + 1, q_heads], keys[pos, r:r + 1], values[pos, r:r + 1], q_pos, pos, scale, G)
            output[t, q_heads] = out[0].to(output.dtype)


def last_queries(query: torch.Tensor, heads: LayerHeads, query_start_loc: list[int], i: int) -> torch.Tensor:
    """Request i's last query token at the retrieval query heads, float32 `[R, G, head_dim]`."""
    token = max(query_start_loc[i + 1] - 1, 0)
    return query[token, heads.retrieval_q].float().reshape(heads.num_retrieval, heads.group_size, -1)


def centroid_scores(query: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor, heads: LayerHeads,
                    query_start_loc: list[int], scale: float, context_ids: list[int] | None = None,
                    centroid_scales: torch.Tensor | None = None, radii: torch.Tensor | None = None,
                    radius_weight: float = 0.0) -> torch.Tensor:
    """`selection.centroid_scores`: S_i = exp(l_i) / sum_j N_j exp(l_j), l_i = (q.C_i + w |q| r_i) * scale, per query
    head (0 for empty clusters; r_i the cluster's radius in `radii` `[contexts, R, C]`, w `radius_weight`, 0 without
    radii), max over each KV head's group -> `[num_reqs, R, C]` float32 (0 without a context); with
    `centroid_scales` `[contexts, R]` the centroids are stored divided by them."""
    num_reqs = len(query_start_loc) - 1
    scores = torch.zeros(num_reqs, heads.num_retrieval, centroids.shape[2], device=query.device)
    for i in range(num_reqs):
        context = i if context_ids is None else context_ids[i]
        if context < 0:
            continue
        stored = centroids[context].float()
        if centroid_scales is not None:
            stored = stored * centroid_scales[context].float()[:, None, None]
        q = last_queries(query, heads, query_start_loc, i)
        logits = torch.einsum("rgd,rcd->rgc", q, stored)
        if radii is not None:
            logits = logits + radius_weight * q.norm(dim=-1)[..., None] * radii[context].float()[:, None, :]
        logits = logits * scale
        size = sizes[context].float()[:, None, :]  # [R, 1, C]
        log_denom = torch.logsumexp(logits + size.log(), dim=-1, keepdim=True)
        estimate = torch.where(size > 0, (logits - log_denom).exp(), 0.0)
        scores[i] = estimate.amax(dim=1)
    return scores


def page_summaries(cache: torch.Tensor, heads: LayerHeads, seq_lens: list[int], block_table: torch.Tensor,
                   quant: KVQuant | None = None) -> torch.Tensor:
    """Quest's page summaries of the requests' retrieval pages: per page and head, the minimum and maximum of each
    key channel over the page's positions in the context, as attention sees the keys -> `[num_blocks, 2, R,
    head_dim]` float32 (0 for blocks of no page)."""
    R, block_size = heads.num_retrieval, cache.shape[2]
    summaries = torch.zeros(cache.shape[0], 2, R, cache.shape[-1], device=cache.device)
    for i, seq_len in enumerate(seq_lens):
        row = block_table[i].long()
        keys, _ = read_retrieval(cache, row, seq_len, R, heads.stride, quant)
        for t in range(0, seq_len, block_size):
            page = keys[t:t + block_size].float()
            summaries[row[t // block_size * heads.stride], 0] = page.amin(dim=0)
            summaries[row[t // block_size * heads.stride], 1] = page.amax(dim=0)
    return summaries


def page_scores(query: torch.Tensor, summaries: torch.Tensor, heads: LayerHeads, query_start_loc: list[int],
                seq_lens: list[int], block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """`selection.page_scores`: sum_d max(q_d min_d, q_d max_d) per page and query head, max over each KV head's
    group, -inf past the context -> `[num_reqs, R, cdiv(max_blocks, stride)]` float32."""
    R, stride = heads.num_retrieval, heads.stride
    num_pages = -(-block_table.shape[1] // stride)
    scores = torch.full((len(seq_lens), R, num_pages), float("-inf"), device=query.device)
    for i, seq_len in enumerate(seq_lens):
        q = last_queries(query, heads, query_start_loc, i)[:, :, None, :]  # [R, G, 1, D]
        pages = -(-seq_len // block_size)
        bounds = summaries[block_table[i, :pages * stride:stride].long(), :, :R].float()  # [pages, 2, R, D]
        low, high = (bounds[:, k].transpose(0, 1)[:, None] for k in (0, 1))  # [R, 1, pages, D]
        scores[i, :, :pages] = torch.maximum(q * low, q * high).sum(-1).amax(dim=1)
    return scores


def select_positions(scores: torch.Tensor, cluster_offsets: torch.Tensor, cluster_positions: torch.Tensor,
                     budget: int | torch.Tensor, max_selected: int, context_ids: list[int] | None = None,
                     threshold: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`selection.select_positions`, row by row: take clusters in descending score (ties: lower index first) while
    fewer than the budget positions are taken (and the score passes the threshold); cut at max_selected."""
    num_reqs, R, C = scores.shape
    selected = torch.zeros(num_reqs, R, max_selected, dtype=torch.int32, device=scores.device)
    counts = torch.zeros(num_reqs, R, dtype=torch.int32, device=scores.device)
    for i in range(num_reqs):
        context = i if context_ids is None else context_ids[i]
        for r in range(R):
            row_budget = int(budget[i, r]) if isinstance(budget, torch.Tensor) else budget
            offsets, taken = cluster_offsets[context, r].tolist(), []
            for c in sorted(range(C), key=lambda c: -float(scores[i, r, c])):
                if len(taken) >= row_budget or (threshold is not None and scores[i, r, c] <= threshold):
                    break
                taken += cluster_positions[context, r, offsets[c]:offsets[c + 1]].tolist()
            taken = taken[:max_selected]
            selected[i, r, :len(taken)] = torch.tensor(taken, dtype=torch.int32)
            counts[i, r] = len(taken)
    return selected, counts


def select_banded(scores: torch.Tensor, cluster_offsets: torch.Tensor, cluster_positions: torch.Tensor,
                  budget: torch.Tensor, max_selected: int,
                  context_ids: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`selection.select_banded`, row by row: each cluster's band, how far its score's float32 bits >> 20 sit
    below those of the row's highest (at most SCORE_BANDS - 1), the keys per band, the best band from which the keys
    of it and every better band reach the budget (the last if none does), every cluster of a better band in cluster
    order, then the cut band's clusters in cluster order while the keys taken are fewer than the budget; cut at
    max_selected; nothing for a request without a context."""
    num_reqs, R, C = scores.shape
    selected = torch.zeros(num_reqs, R, max_selected, dtype=torch.int32, device=scores.device)
    counts = torch.zeros(num_reqs, R, dtype=torch.int32, device=scores.device)
    bits = (scores.float().view(torch.int32) >> 20).long()
    bands = (bits.amax(-1, keepdim=True) - bits).clamp(max=SCORE_BANDS - 1)
    for i in range(num_reqs):
        context = i if context_ids is None else context_ids[i]
        for r in range(R if context >= 0 else 0):
            offsets = cluster_offsets[context, r].tolist()
            sizes = torch.tensor([offsets[c + 1] - offsets[c] for c in range(C)])
            keys_in = torch.zeros(SCORE_BANDS, dtype=torch.long).index_add_(0, bands[i, r].cpu(), sizes)
            keys_through = keys_in.cumsum(0)  # keys in a band and every better one
            cut = min([band for band in range(SCORE_BANDS) if keys_through[band] >= int(budget[i, r])],
                      default=SCORE_BANDS - 1)
            clusters = [c for c in range(C) if bands[i, r, c] < cut]
            taken = sum(int(sizes[c]) for c in clusters)
            for c in range(C):
                if bands[i, r, c] == cut and sizes[c] > 0 and taken < int(budget[i, r]):
                    clusters.append(c)
                    taken += int(sizes[c])
            kept = [p for c in clusters for p in cluster_positions[context, r, offsets[c]:offsets[c + 1]].tolist()]
            kept = kept[:max_selected]
            selected[i, r, :len(kept)] = torch.tensor(kept, dtype=torch.int32)
            counts[i, r] = len(kept)
    return selected, counts


def select_pages(scores: torch.Tensor, seq_lens: list[int], block_size: int, sink: int, recent: int,
                 num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`selection.select_pages`, row by row: the best `num_pages` pages with a position between the sinks and the
    window; their positions there, ascending."""
    num_reqs, R, pages = scores.shape
    selected = torch.zeros(num_reqs, R, num_pages * block_size, dtype=torch.int32, device=scores.device)
    counts = torch.zeros(num_reqs, R, dtype=torch.int32, device=scores.device)
    for i, seq_len in enumerate(seq_lens):
        window = max(sink, seq_len - recent)
        between = [p for p in range(pages) if p * block_size < window and (p + 1) * block_size > sink]
        for r in range(R):
            best = sorted(between, key=lambda p: -float(scores[i, r, p]))[:num_pages]
            pos = sorted(x for p in best for x in range(max(p * block_size, sink), min((p + 1) * block_size, window)))
            selected[i, r, :len(pos)] = torch.tensor(pos, dtype=torch.int32)
            counts[i, r] = len(pos)
    return selected, counts


def cluster_keys(keys: torch.Tensor, centres: torch.Tensor, iters: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor, int]:
    """`clustering.cluster_keys` from given initial centres `[H, C, D]`: spherical Lloyd iterations head by head and
    key by key (stop when no label changes), then each cluster's mean raw key. Returns centroids `[H, C, D]`,
    sizes `[H, C]`, labels `[H, T]` and the iterations run."""
    H, T, D = keys.shape
    C = centres.shape[1]
    units = keys.float() / keys.float().norm(dim=-1, keepdim=True)
    centroids, sizes, labels = torch.zeros(H, C, D), torch.zeros(H, C, dtype=torch.int32), torch.zeros(H, T).long()
    done = 0
    for h in range(H):
        centre = centres[h].float() / centres[h].float().norm(dim=-1, keepdim=True)
        label = None
        for step in range(1, iters + 1):
            new = torch.tensor([int(torch.argmax(centre @ units[h, t])) for t in range(T)])
            if label is not None and torch.equal(new, label):
                break
            label = new
            for c in range(C):
                if (label == c).any():
                    total = units[h][label == c].sum(0)
                    centre[c] = total / total.norm()
        done = max(done, step)
        labels[h] = label
        for c in range(C):
            sizes[h, c] = int((label == c).sum())
            if sizes[h, c]:
                centroids[h, c] = keys[h][label == c].float().mean(0)
    return centroids, sizes, labels, done


def to_csr(labels: torch.Tensor, num_clusters: int, positions_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`clustering.to_csr` head by head and cluster by cluster."""
    offsets, positions = [], []
    for row in labels.tolist():
        members = [[positions_offset + t for t, label in enumerate(row) if label == c] for c in range(num_clusters)]
        offsets.append([0] + [sum(len(m) for m in members[:c + 1]) for c in range(num_clusters)])
        positions.append([p for m in members for p in m])
    return torch.tensor(offsets, dtype=torch.int32), torch.tensor(positions, dtype=torch.int32)
