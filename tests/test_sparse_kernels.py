# SPDX-License-Identifier: Apache-2.0
"""Sparse retrieval decode (Squeezed Attention) and its selection against kernels/sparse_reference.py, on the CPU
interpreter with test_kernels.py's small cases; the end-to-end equality: selecting every context position gives
duo's full retrieval decode."""

import dataclasses
from typing import NamedTuple

import pytest
import torch
from test_kernels import (CUDA, FP8, GPU_PRESETS, PRESETS, SCALES, TOL, Case, Preset, assert_caches_equal,
                          assert_close, assert_only, cuda_scales, decode_rows, lifted, lifted_table, make_case,
                          merge_splits_in_launch, written_caches)

from vllm_duo.kernels import sparse_reference as ref
from vllm_duo.kernels.clustering import KeyClusters, cluster_radii
from vllm_duo.kernels.decode import decode_attention
from vllm_duo.kernels.reference import LayerHeads, attend, read_retrieval
from vllm_duo.kernels.row_pages import WINDOW_KEYS, row_views, run_pages, window_pass_lens
from vllm_duo.kernels.selection import (BAND_OCTAVE, BandRuns, band_runs, centroid_scores, gather_positions,
                                         page_scores, select_banded, select_pages, select_positions)
from vllm_duo.kernels.sparse_decode import sparse_decode_attention

# decode batches: GQA 3 with contexts within the sinks and window, MHA with a one-token context, graph padding
# (requests without tokens), a mixed batch (its multi-token requests stay untouched), 32-token pages of head_dim 80
DECODE = ["decode_gqa3", "decode_mha", "graph_padding", "chunked_mixed", "head_dim_80_wide_pages"]


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def between(case: Case, i: int) -> torch.Tensor:
    """Request i's context positions between the sinks and the window of its new token."""
    p, seq_len = case.preset, case.seq_lens[i]
    return torch.arange(p.sink, max(p.sink, seq_len - p.recent))


def selection(case: Case, rows: list[list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`[num_reqs, R, max_selected]` positions and counts from per-request, per-head lists; each row is padded with
    positions between the sinks and the window that it did not select (a kernel reading past the count shows)."""
    width = max([1] + [len(row) + len(between(case, i)) for i, heads in enumerate(rows) for row in heads])
    selected = torch.zeros(len(rows), case.heads.num_retrieval, width, dtype=torch.int32)
    counts = torch.zeros(len(rows), case.heads.num_retrieval, dtype=torch.int32)
    for i, heads in enumerate(rows):
        for r, row in enumerate(heads):
            rest = between(case, i)[~torch.isin(between(case, i), row)]
            selected[i, r, :len(row) + len(rest)] = torch.cat([row, rest]).int()
            counts[i, r] = len(row)
    return selected, counts


def random_selection(case: Case, with_skipped: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A random share (0 to all) of each row's positions between the sinks and the window, shuffled; with
    `with_skipped`, also a sink, a window position and one past the context, which the kernel must skip."""
    rows = []
    for i, seq_len in enumerate(case.seq_lens):
        heads = []
        for _ in range(case.heads.num_retrieval):
            pool = between(case, i)[torch.randperm(len(between(case, i)))]
            row = pool[:int(torch.randint(0, len(pool) + 1, ()))]
            if with_skipped and seq_len > case.preset.sink:
                row = torch.cat([row, torch.tensor([0, seq_len - 1, seq_len + 3])])[torch.randperm(len(row) + 3)]
            heads.append(row)
        rows.append(heads)
    return selection(case, rows)


def full_selection(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position between the sinks and the window, reversed (order must not matter)."""
    return selection(case, [[between(case, i).flip(0)] * case.heads.num_retrieval for i in range(len(case.seq_lens))])


def run_sparse(case: Case, cache: torch.Tensor, selected: torch.Tensor, counts: torch.Tensor, splits: int = 3,
               table: torch.Tensor | None = None, context_ends: list[int] | None = None) -> torch.Tensor:
    out = case.poisoned_output()
    ends = None if context_ends is None else torch.tensor(context_ends, dtype=torch.int32, device=case.device)
    sparse_decode_attention(case.query, cache, case.heads, case.qsl, case.sl,
                            case.block_table if table is None else table, case.scale, out, selected, counts, splits,
                            quant=case.quant, context_ends=ends)
    return out


def duo_decode(case: Case, cache: torch.Tensor, stream: torch.Tensor | None, splits: int = 2,
               quant=None) -> torch.Tensor:
    """Duo's own decode of the step (the split decode kernel over the written caches): what a full selection equals."""
    full = case.poisoned_output()
    decode_attention(case.query, cache, case.heads, case.qsl, case.sl, case.block_table, case.scale, full, splits,
                     stream_cache=stream, quant=quant)
    return full


def sparse_reference(case: Case, cache: torch.Tensor, selected: torch.Tensor, counts: torch.Tensor,
                     context_ends: list[int] | None = None) -> torch.Tensor:
    out = case.poisoned_output()
    ref.sparse_decode_attention(case.query, cache, case.heads, case.query_start_loc, case.seq_lens, case.block_table,
                                case.scale, out, selected, counts, case.quant, context_ends=context_ends)
    return out


def assert_retrieval_rows(out: torch.Tensor, expected: torch.Tensor, case: Case, dtype=torch.float32) -> None:
    """The retrieval heads of single-token requests match; nothing else was written."""
    assert_only(out, expected, decode_rows(case), case.heads.retrieval_q, dtype,
                "wrote streaming heads or rows of multi-token requests")


@pytest.mark.parametrize("merge_in_launch", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", DECODE)
def test_sparse_decode_matches_reference(name, splits, merge_in_launch, monkeypatch):
    merge_splits_in_launch(monkeypatch, merge_in_launch)
    case = make_case(PRESETS[name])
    cache, _ = written_caches(case)
    selected, counts = random_selection(case)
    out = run_sparse(case, cache, selected, counts, splits)
    assert_retrieval_rows(out, sparse_reference(case, cache, selected, counts), case)


@pytest.mark.parametrize("name", ["decode_gqa3", "decode_mha", "head_dim_80_wide_pages", "all_retrieval"])
def test_full_selection_equals_duo_decode(name):
    """What matters end to end: selecting every position between the sinks and the window gives duo's own decode of
    the retrieval heads (the split decode kernel, and the reference)."""
    case = make_case(PRESETS[name])
    cache, stream = written_caches(case)
    full = duo_decode(case, cache, stream)
    out = run_sparse(case, cache, *full_selection(case))
    assert_retrieval_rows(out, full, case)
    assert_retrieval_rows(out, case.reference()[0], case)


@pytest.mark.parametrize("merge_in_launch", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_context_ends_set_the_window(splits, merge_in_launch, monkeypatch):
    """A request's window starts at its context's end: the tokens after a squeezed context are read however many
    there are, and selected positions from there on count once (as window)."""
    merge_splits_in_launch(monkeypatch, merge_in_launch)
    case = make_case(PRESETS["decode_gqa3"])
    cache, _ = written_caches(case)
    selected, counts = random_selection(case)
    ends = [max(1, seq_len - 40 + 7 * i) for i, seq_len in enumerate(case.seq_lens)]  # some before the window
    out = run_sparse(case, cache, selected, counts, splits, context_ends=ends)
    assert_retrieval_rows(out, sparse_reference(case, cache, selected, counts, ends), case)
    rows, q = decode_rows(case), case.heads.retrieval_q
    assert not torch.allclose(out[rows][:, q], run_sparse(case, cache, selected, counts, splits)[rows][:, q])


@pytest.mark.parametrize("merge_in_launch", [False, True])
def test_context_end_0_leaves_the_request_to_duo(merge_in_launch, monkeypatch):
    """A request without a clustered context (context end 0) is not written: duo's own decode serves it."""
    merge_splits_in_launch(monkeypatch, merge_in_launch)
    case = make_case(PRESETS["decode_gqa3"])
    cache, _ = written_caches(case)
    selected, counts = random_selection(case)
    starts, rows = case.query_start_loc, decode_rows(case)
    first = starts.index(int(rows[0]))  # the first single-token request
    ends = [0 if i == first else seq_len for i, seq_len in enumerate(case.seq_lens)]
    out = run_sparse(case, cache, selected, counts, 2, context_ends=ends)
    assert_only(out, sparse_reference(case, cache, selected, counts, ends), rows[1:], case.heads.retrieval_q,
                torch.float32, "wrote a request without a clustered context")


def test_empty_selection_attends_sinks_and_window():
    """With nothing selected a retrieval head attends as a streaming head does: the Λ mask over its own pages."""
    case = make_case(PRESETS["decode_gqa3"])
    cache, _ = written_caches(case)
    selected, counts = random_selection(case)
    out = run_sparse(case, cache, selected, torch.zeros_like(counts))
    expected = case.poisoned_output()
    p, G = case.preset, case.heads.group_size
    for i, seq_len in enumerate(case.seq_lens):
        t, k_pos = case.query_start_loc[i], torch.arange(seq_len)
        keys, values = read_retrieval(cache, case.block_table[i].long(), seq_len, case.heads.num_retrieval,
                                      case.heads.stride)
        expected[t, case.heads.retrieval_q] = attend(case.query[t:t + 1, case.heads.retrieval_q], keys, values,
                                                     torch.tensor([seq_len - 1]), k_pos, case.scale, G, p.sink,
                                                     p.recent)[0]
    assert_retrieval_rows(out, expected, case)


# bf16 queries over a bf16 cache: on CUDA only (the interpreter's bf16 tl.dot is wrong, decode.py's too)
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")  # the interpreter's log2(0) = -inf, meant
@pytest.mark.parametrize("merge_in_launch", [False, True])
@pytest.mark.parametrize("sink", [4, 0])
def test_split_of_skipped_positions_only(sink, merge_in_launch, monkeypatch):
    """A split whose listed positions all lie in the sinks, the window or past the context adds nothing to the merge
    (here 4 sinks or none, 60 skipped positions, 16 window positions in splits of 32: split 1 of 4 is skipped
    positions only, or without sinks split 0, the first part a merge reads)."""
    merge_splits_in_launch(monkeypatch, merge_in_launch)
    case = make_case(dataclasses.replace(PRESETS["decode_mha"], sink=sink))
    cache, _ = written_caches(case)
    skipped = torch.cat([torch.arange(sink), torch.arange(45, 105 - sink)])  # request 0: seq_len 61, window [45, 61)
    selected, counts = selection(case, [[skipped], [torch.tensor([], dtype=torch.long)], [skipped[:2]]])
    out = run_sparse(case, cache, selected, counts, 4)
    assert_retrieval_rows(out, sparse_reference(case, cache, selected, counts), case)


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, FP8[0]), (torch.float32, FP8[1]),
                                             (torch.bfloat16, FP8[0]), (torch.float16, torch.float16)])
def test_sparse_decode_dtypes(dtype, kv_dtype):
    """fp8 pages dequantized in registers by the layer's scales (bf16 queries meet them in fp16), fp16 caches."""
    quant = SCALES if kv_dtype in FP8 else None
    case = make_case(PRESETS["decode_gqa3"], dtype=dtype, kv_dtype=kv_dtype, quant=quant)
    cache, _ = written_caches(case, quant)
    selected, counts = random_selection(case)
    out = run_sparse(case, cache, selected, counts)
    assert_retrieval_rows(out, sparse_reference(case, cache, selected, counts), case, dtype)


def test_pages_past_2_31_elements_are_read_where_they_are():
    """64-bit cache offsets: pages moved past element 2^31 of a lazily allocated cache (see test_kernels.py)."""
    case = make_case(PRESETS["decode_gqa3"], dtype=torch.float16)
    cache, _ = written_caches(case)
    selected, counts = random_selection(case)
    expected = sparse_reference(case, cache, selected, counts)
    shift = 2 ** 31 // cache[0].numel()
    out = run_sparse(case, lifted(cache, shift), selected, counts, table=lifted_table(case.block_table, shift))
    assert_retrieval_rows(out, expected, case, torch.float16)


def test_rejects_a_malformed_selection():
    case = make_case(PRESETS["decode_mha"])
    selected, counts = random_selection(case)
    with pytest.raises(ValueError, match="int32"):
        run_sparse(case, case.cache, selected.long(), counts)
    with pytest.raises(ValueError, match="max_selected"):
        run_sparse(case, case.cache, selected[:1], counts)


def scoring_batch(num_kv_heads: int, group: int, retrieval: list[int], query_lens: list[int], dtype=torch.float32,
                  head_dim: int = 32) -> tuple[torch.Tensor, LayerHeads, torch.Tensor]:
    """Queries `[tokens, heads, head_dim]`, head maps and query_start_loc of a batch of `query_lens`."""
    heads = LayerHeads.build(retrieval, num_kv_heads, num_kv_heads * group, 2, 4, 16)
    starts = torch.tensor([0] + query_lens).cumsum(0).int()
    return torch.randn(int(starts[-1]), num_kv_heads * group, head_dim, dtype=dtype), heads, starts


@pytest.mark.parametrize("group, query_lens, clusters, shared, dtype, fp8, radius_weight", [
    (1, [1], 5, False, torch.float32, False, 0.0),
    (3, [1, 4, 0, 1], 37, True, torch.float32, False, 0.0),  # a request without tokens; requests over two contexts
    # and none
    (4, [1, 1], 16, False, torch.float16, False, 0.5),  # logits raised by the clusters' radii
    (3, [1, 4, 0, 1], 37, True, torch.float16, True, 0.0),  # fp8 centroids, each (context, head) with its scale
    (3, [1, 4, 0, 1], 37, True, torch.float16, True, 1.0),  # fp8 centroids and radii (not scaled)
])
def test_centroid_scores(group, query_lens, clusters, shared, dtype, fp8, radius_weight):
    """Eq. 1 per query head, max over the group, each logit raised by radius_weight |q| r; empty (padding) clusters
    score 0, a context of none scores 0."""
    query, heads, starts = scoring_batch(4, group, [0, 3], query_lens, dtype)
    num_contexts = 2 if shared else len(query_lens)
    centroids = torch.randn(num_contexts, 2, clusters, query.shape[-1], dtype=dtype)
    scales = None
    if fp8:
        scales = torch.rand(num_contexts, 2) + 0.5
        centroids = (centroids.float() * 100).to(torch.float8_e4m3fn)  # stored / scale: ~100 x their 1/scale
        scales = scales / 100
    sizes = torch.randint(0, 6, (num_contexts, 2, clusters), dtype=torch.int32)
    sizes[-1, -1] = 0
    contexts = torch.tensor([1, 0, 1, -1], dtype=torch.int32) if shared else None
    radii = torch.rand(num_contexts, 2, clusters) * 2 if radius_weight else None
    scored = centroid_scores(query, centroids, sizes, heads, starts, 0.3, contexts, scales, radii, radius_weight)
    scores = scored.scores
    expected = ref.centroid_scores(query, centroids, sizes, heads, starts.tolist(), 0.3,
                                   None if contexts is None else contexts.tolist(), scales, radii, radius_weight)
    if radius_weight:  # the radii count
        assert not torch.allclose(expected, ref.centroid_scores(query, centroids, sizes, heads, starts.tolist(), 0.3,
                                                                None if contexts is None else contexts.tolist(),
                                                                scales), rtol=0.01, atol=1e-4)
    tol = TOL[dtype]
    torch.testing.assert_close(scores, expected, rtol=tol.rtol, atol=tol.atol / 10)
    row_sizes = sizes if contexts is None else sizes[contexts.long()]
    assert (scores[row_sizes == 0] == 0).all()
    assert torch.equal(scored.top_bands, scores.amax(-1).view(torch.int32) >> 20)  # from the denominators alone
    if shared:
        assert (scores[3] == 0).all() and (scored.band_keys[3] == 0).all()  # no context
        row_sizes[3] = 0
    assert torch.equal(scored.band_keys.sum((2, 3)), row_sizes.sum(-1))  # every key in one band
    assert torch.equal(scored.octave_keys, scored.band_keys.unflatten(-1, (-1, BAND_OCTAVE)).sum(-1))


def test_radius_picks_a_cluster_with_a_far_key():
    """A cluster whose centroid the query barely likes but one of whose keys it wants above all: Eq. 1 passes it over
    for a tight cluster the query likes more, the radius term takes it (reference and kernel alike)."""
    heads = LayerHeads.build([0], 1, 1, 1, 4, 16)
    q = torch.zeros(1, 1, 16)
    q[0, 0, 0] = 4.0
    spread = torch.zeros(8, 16)  # cluster 0: keys along dims 1-7 around 0 and one along dim 0
    spread[0, 0] = 3.0
    spread[1:, 1:8] = torch.eye(7) * 3.0
    tight = torch.zeros(8, 16)  # cluster 1: eight keys at 0.5 along dim 0
    tight[:, 0] = 0.5
    keys = torch.cat([spread, tight])[None]  # [1, 16, 16]
    labels = torch.tensor([[0] * 8 + [1] * 8])
    centroids = torch.stack([spread.mean(0), tight.mean(0)])[None]  # [1, 2, 16]
    clusters = KeyClusters(centroids, torch.tensor([[8, 8]], dtype=torch.int32), labels, 1)
    radii = cluster_radii(keys, clusters)
    assert radii[0, 1] == 0 and radii[0, 0] > 2.5  # the tight cluster has none
    assert q[0, 0] @ centroids[0, 0] < q[0, 0] @ centroids[0, 1]  # by its centroid the tight one wins
    starts = torch.tensor([0, 1], dtype=torch.int32)
    for weight, best in ((0.0, 1), (0.5, 0)):
        expected = ref.centroid_scores(q, centroids[None], clusters.sizes[None], heads, [0, 1], 1.0, None, None,
                                       radii[None], weight)
        got = centroid_scores(q, centroids[None], clusters.sizes[None], heads, starts, 1.0, None, None, radii[None],
                              weight).scores
        torch.testing.assert_close(got, expected)
        assert int(got[0, 0].argmax()) == best


def test_centroid_scores_estimate_a_softmax():
    """The reference's estimates weigh to 1 over the keys of a single query head's clusters (its Eq. 1 denominator)."""
    query, heads, starts = scoring_batch(2, 1, [1], [1, 1])
    centroids, sizes = torch.randn(2, 1, 9, query.shape[-1]), torch.randint(1, 5, (2, 1, 9))
    scores = ref.centroid_scores(query, centroids, sizes, heads, starts.tolist(), 0.2)
    torch.testing.assert_close((scores * sizes).sum(-1), torch.ones(2, 1))


def clustered(num_contexts: int, R: int, lengths: list[int], clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random clustering of positions [0, length) of each context: (CSR offsets `[contexts, R, C + 1]`, positions
    sorted by cluster `[contexts, R, max length]`), some clusters empty."""
    offsets = torch.zeros(num_contexts, R, clusters + 1, dtype=torch.int32)
    positions = torch.zeros(num_contexts, R, max(lengths), dtype=torch.int32)
    for x in range(num_contexts):
        for r in range(R):
            label = torch.randint(0, clusters, (lengths[x],)) // 2 * 2  # odd clusters stay empty
            order = torch.argsort(label, stable=True)
            positions[x, r, :lengths[x]] = order.int()
            offsets[x, r, 1:] = torch.bincount(label, minlength=clusters).cumsum(0).int()
    return offsets, positions


@pytest.mark.parametrize("budget, max_selected, shared, threshold", [
    (10, 40, False, None),
    (0, 8, False, None),  # empty selections
    (1000, 30, True, None),  # every cluster; rows cut at max_selected
    ("per_row", 64, True, None),
    (25, 64, False, 0.02),
])
def test_select_positions(budget, max_selected, shared, threshold):
    num_reqs, R, C = 4, 3, 12
    lengths = [50, 7, 33, 64]
    offsets, positions = clustered(2 if shared else num_reqs, R, lengths, C)
    scores = torch.rand(num_reqs, R, C) / 10
    scores[0, 0, :4] = 0.05  # ties: lower index first
    if budget == "per_row":
        budget = torch.randint(0, 40, (num_reqs, R), dtype=torch.int32)
    contexts = torch.tensor([1, 0, 0, 1], dtype=torch.int32) if shared else None
    got = select_positions(scores, offsets, positions, budget, max_selected, contexts, threshold)
    expected = ref.select_positions(scores, offsets, positions, budget, max_selected,
                                    None if contexts is None else contexts.tolist(), threshold)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[0], expected[0])


@pytest.mark.parametrize("budget, max_selected, shared, C, spread, chunks", [
    (10, 40, False, 40, "wide", 1), (0, 8, False, 40, "wide", 1), (1000, 30, True, 40, "wide", 1),
    ("per_row", 64, True, 40, "wide", 1), (25, 12, False, 40, "wide", 1),
    (60, 200, False, 6, "wide", 1),  # clusters of ~50 keys, wider than the interpreter's 16 lanes
    (1000, 100, False, 2, "wide", 1),  # one cluster holds every key (odd ones stay empty), cut at max_selected
    (50, 200, True, 40, "equal", 1),  # every score equal (dummy weights): the budget taken in cluster order
    (100, 200, False, 40, "far", 1),  # half the keys e^-30 below the top: the cut in the last band
    ("per_row", 200, True, 100, "wide", 3)])  # tiles of 3 chunks, the ends kernel's chunk wider than a tile, a tile's
# keys per band of the cut octave counted over several chunks
def test_select_banded(budget, max_selected, shared, C, spread, chunks, monkeypatch):
    """The fast selection over `centroid_scores`' bands: the score bands above the cut whole, the cut band's clusters
    in cluster order until the budget is met; over several tiles of clusters (the interpreter's tiles hold 16), with
    ties, empty clusters and rows cut at max_selected, against the reference over the same scores. A row takes its
    budget (or every key there is) and less than one cluster more."""
    if chunks > 1:
        monkeypatch.setattr("vllm_duo.kernels.selection._score_split",
                            lambda rows, clusters, block_c, device: (chunks, -(-clusters // (chunks * block_c))))
    num_reqs, R = 4, 3
    lengths = [150, 7, 93, 164]
    num_contexts = 2 if shared else num_reqs
    offsets, positions = clustered(num_contexts, R, lengths, C)
    query, heads, starts = scoring_batch(4, 2, [0, 2, 3], [1] * num_reqs)
    centroids = torch.randn(num_contexts, R, C, query.shape[-1]) * (0.0 if spread == "equal" else 0.5)
    centroids[0, 0, :4] = centroids[0, 0, 0]  # ties
    if spread == "far":  # clusters 2, 6, 10, ... (odd ones are empty) e^-30 below the others
        query[..., 0], centroids[..., 0], centroids[..., 2::4, 0] = 10.0, 0.0, -10.0
    budget = (torch.randint(0, 90, (num_reqs, R), dtype=torch.int32) if budget == "per_row"
              else torch.full((num_reqs, R), budget, dtype=torch.int32))
    contexts = torch.tensor([1, -1, 0, 1], dtype=torch.int32) if shared else None  # request 1 reads none
    scored = centroid_scores(query, centroids, offsets.diff(dim=-1), heads, starts, 0.3, contexts)
    runs = band_runs(scored, offsets, budget, max_selected, contexts)
    got = gather_positions(runs, positions, max_selected, contexts)  # select_banded's two steps
    expected = ref.select_banded(scored.scores, offsets, positions, budget, max_selected,
                                 None if contexts is None else contexts.tolist())
    assert torch.equal(got[1], expected[1]) and torch.equal(got[0], expected[0])
    context = torch.arange(num_reqs) if contexts is None else contexts.clamp(min=0).long()
    there = offsets[context, :, -1]  # [num_reqs, R] keys of each row's context
    largest = (offsets[..., 1:] - offsets[..., :-1]).amax(-1)[context]
    read = torch.ones(num_reqs, dtype=torch.bool) if contexts is None else contexts >= 0
    least = torch.minimum(torch.minimum(budget, there), torch.tensor(max_selected))
    assert (got[1][read] >= least[read]).all()
    assert (got[1][read] <= torch.maximum(budget + largest - 1, torch.zeros(()))[read]).all()
    assert (got[1][~read] == 0).all()
    if spread == "far":
        assert (scored.scores[..., 2::4] < scored.scores.amax(-1, keepdim=True) / 2 ** 40).all()
    # FlashAttention's page lists made from the same runs (one launch): each row's sinks, then the same positions
    sink, block_size = 3, 16
    cache = torch.randn(40, 2, block_size, R, 8)
    table = torch.randint(0, 40, (num_reqs, 16), dtype=torch.int32)
    layer = LayerHeads.build(list(range(R)), R, R, 1, sink, 4)
    # request 1 decodes without a context: no list; shared, at a context end but with context id -1 (a plan serving
    # never makes) its sinks and window alone, none of another context's positions; then each window's newest 5
    seq_lens = [100, 30, 33, 200]
    for ends, window in (([48, 0, 32, 64], WINDOW_KEYS), ([48, 16, 32, 64], WINDOW_KEYS), ([48, 16, 32, 64], 5)):
        pages = run_pages(runs, positions, contexts, torch.tensor(ends, dtype=torch.int32),
                          torch.tensor(seq_lens, dtype=torch.int32), table, layer, cache, max_selected, window)
        assert_lists_read(pages, cache, table, [[
            list(range(sink)) + got[0][req, head, :got[1][req, head]].tolist()
            + list(range(max(ends[req], seq_lens[req] - window), seq_lens[req])) if ends[req] else []
            for head in range(R)] for req in range(num_reqs)])


def summarized(case: Case) -> torch.Tensor:
    """The case's Quest page summaries after its step."""
    cache, _ = written_caches(case)
    return ref.page_summaries(cache, case.heads, case.seq_lens, case.block_table, case.quant)


@pytest.mark.parametrize("name", ["decode_gqa3", "head_dim_80_wide_pages", "graph_padding"])
def test_page_scores(name):
    case = make_case(PRESETS[name])
    summaries = summarized(case)
    block_size = case.preset.block_size
    scores = page_scores(case.query, summaries, case.heads, case.qsl, case.sl, case.block_table, block_size)
    expected = ref.page_scores(case.query, summaries, case.heads, case.query_start_loc, case.seq_lens,
                               case.block_table, block_size)
    assert torch.equal(scores.isinf(), expected.isinf())
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("num_pages", [1, 2, 8])
def test_select_pages(num_pages):
    """Pages wholly in the sinks or the window are never chosen; a page across their edge gives its other positions."""
    seq_lens = [100, 37, 21, 5]
    scores = torch.randn(4, 2, 8)
    got = select_pages(scores, torch.tensor(seq_lens, dtype=torch.int32), 16, 4, 16, num_pages)
    expected = ref.select_pages(scores, seq_lens, 16, 4, 16, num_pages)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[0], expected[0])


def test_clusters_selecting_everything_equal_duo_decode():
    """Centroid scores, then a budget that takes every cluster of each request's whole context (its sinks and
    window included: the decode skips them): duo's retrieval decode."""
    case = make_case(PRESETS["decode_gqa3"])
    cache, stream = written_caches(case)
    R, C = case.heads.num_retrieval, 6
    offsets, positions = clustered(len(case.seq_lens), R, case.seq_lens, C)
    centroids = torch.randn(len(case.seq_lens), R, C, case.preset.head_dim)
    scores = centroid_scores(case.query, centroids, offsets.diff(dim=-1), case.heads, case.qsl, case.scale).scores
    selected, counts = select_positions(scores, offsets, positions, max(case.seq_lens), max(case.seq_lens))
    full = duo_decode(case, cache, stream, 1)
    assert_retrieval_rows(run_sparse(case, cache, selected, counts), full, case)


def test_pages_selecting_everything_equal_duo_decode():
    """Page bounds, then every page: duo's retrieval decode."""
    case = make_case(PRESETS["decode_gqa3"])
    cache, stream = written_caches(case)
    scores = page_scores(case.query, summarized(case), case.heads, case.qsl, case.sl, case.block_table,
                         case.preset.block_size)
    selected, counts = select_pages(scores, case.sl, case.preset.block_size, case.preset.sink, case.preset.recent,
                                    scores.shape[-1])
    full = duo_decode(case, cache, stream, 1)
    assert_retrieval_rows(run_sparse(case, cache, selected, counts), full, case)


@pytest.mark.gpu
@pytest.mark.parametrize("merge_in_launch", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_page_selection_and_sparse_decode_in_a_cuda_graph(kv_dtype, merge_in_launch, monkeypatch):
    """A bf16 model on CUDA: page bounds, page selection and sparse decode captured once, replayed on new queries,
    each to its reference (the selection from the replay's own scores: TF32 bounds may reorder near ties)."""
    merge_splits_in_launch(monkeypatch, merge_in_launch)
    quant = cuda_scales() if kv_dtype in FP8 else None
    case = make_case(GPU_PRESETS["llama_decode"], dtype=torch.bfloat16, device=CUDA, kv_dtype=kv_dtype, quant=quant)
    cache, _ = written_caches(case, quant)
    summaries, p, out = summarized(case), case.preset, case.poisoned_output()
    qsl, sl = case.qsl, case.sl  # device tensors made before the capture, as a model runner's are

    def step():
        scores = page_scores(case.query, summaries, case.heads, qsl, sl, case.block_table, p.block_size)
        selected, counts = select_pages(scores, sl, p.block_size, p.sink, p.recent, 8)
        sparse_decode_attention(case.query, cache, case.heads, qsl, sl, case.block_table, case.scale, out,
                                selected, counts, 8, quant=quant)
        return scores, selected, counts

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scores, selected, counts = step()
    case.query.copy_(torch.randn_like(case.query))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected = ref.page_scores(case.query, summaries, case.heads, case.query_start_loc, case.seq_lens,
                               case.block_table, p.block_size)
    torch.testing.assert_close(scores, expected, rtol=1e-2, atol=0.5)
    expected = ref.select_pages(scores, case.seq_lens, p.block_size, p.sink, p.recent, 8)
    assert torch.equal(counts, expected[1]) and torch.equal(selected, expected[0])
    assert_retrieval_rows(out, sparse_reference(case, cache, selected, counts), case, torch.bfloat16)


def stand_in_flash(q, k, v, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal, block_table,
                   num_splits=0, out=None, return_softmax_lse=False, **_descales):
    """FlashAttention-3's varlen paged call in torch, float32: entry b's queries [cu[b], cu[b+1]) over the first
    seqused_k[b] keys of its pages (k, v `[num_pages, page_size, kv_heads, head_dim]`), GQA, causal bottom-right."""
    heads, kv_heads = q.shape[1], k.shape[2]
    result = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full((heads, q.shape[0]), float("-inf"))
    for b in range(cu_seqlens_q.shape[0] - 1):
        lo, hi, n = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
        if hi == lo or n == 0:
            continue
        pages = block_table[b, :-(-n // k.shape[1])].long()
        keys, values = (x[pages].reshape(-1, kv_heads, x.shape[-1])[:n].float().repeat_interleave(heads // kv_heads, 1)
                        for x in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), keys) * softmax_scale
        if causal:
            visible = torch.arange(n)[None, :] <= torch.arange(hi - lo)[:, None] + n - (hi - lo)
            scores = scores.masked_fill(~visible[None], float("-inf"))
        lse[:, lo:hi] = torch.logsumexp(scores, -1)
        result[lo:hi] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values)
    if out is not None:
        out.copy_(result)
    result = out if out is not None else result.to(q.dtype)
    return (result, lse) if return_softmax_lse else result


@pytest.mark.parametrize("name", ["prefill_only", "chunked_mixed", "pooled_streaming"])
def test_served_prefill_with_a_flash_stand_in(name, monkeypatch):
    """A multi-token step as gpu_attention.py serves it, on the CPU with a torch stand-in for FlashAttention-3 (float32
    let through): the retrieval heads by the stand-in, the streaming heads by the Triton prefill, given the step's K/V,
    which that launch stores (the call `prefill_attention` gets is spied on); the reference's output, the cache as
    written."""
    from vllm_duo import gpu_attention, vllm_seam
    from vllm_duo.kernels import attention

    monkeypatch.setattr(vllm_seam, "flash_attn_varlen", lambda device=None: stand_in_flash)
    monkeypatch.setattr(gpu_attention, "FLASH_DTYPES", {(torch.float32, torch.float32)})
    calls, prefill = [], attention.prefill_attention
    monkeypatch.setattr(attention, "prefill_attention", lambda *a, **kw: calls.append(kw) or prefill(*a, **kw))
    case = make_case(PRESETS[name])
    ref, _ = case.reference()
    cache, stream = case.fresh_caches()
    out = case.poisoned_output()
    lens = [b - a for a, b in zip(case.query_start_loc, case.query_start_loc[1:])]
    gpu_attention.duo_attention_gpu(case.query, case.key, case.value, cache, case.heads, case.qsl, case.sl,
                                    case.block_table, case.scale, out, max(lens), max(case.seq_lens),
                                    stream_cache=stream)
    assert_close(out, ref, torch.float32)
    assert_caches_equal((cache, stream), written_caches(case))
    (call,) = calls
    assert call["streaming_only"] and call["fresh_kv"][0] is case.key and call["fresh_kv"][1] is case.value
    assert call["store"]  # 16-bit caches: the streaming heads' launch stores the step, FlashAttention reads after


# decode batches with two rows or more past a block: GQA 3, a mixed batch, 32-token pages of 3 slots, head_dim 80
FLASH_PASSES = {"decode_gqa3": PRESETS["decode_gqa3"],
                "mixed": Preset(8, 4, (1, 3), ((50, 30), (40, 1), (3, 17), (70, 1), (33, 45), (20, 1))),
                "wide_pages": Preset(6, 3, (0, 2), ((70, 1), (100, 1), (40, 1), (50, 7)), head_dim=80, block_size=32,
                                     page_heads=3, sink=8, recent=24)}


class FlashPasses(NamedTuple):
    out: torch.Tensor
    expected: torch.Tensor  # the sparse decode's reference at the squeezed rows
    squeezed: list[int]  # token rows of the requests that read a context
    plain: list[int]  # token rows of the decoding requests that read none
    cache: torch.Tensor  # the caches the step read
    stream: torch.Tensor | None


def one_cluster_runs(selected: torch.Tensor, counts: torch.Tensor) -> BandRuns:
    """Runs that select `selected`'s first `counts` positions of each row `[num_reqs, R]`, in order: each row its own
    context (no context ids) of one cluster, `selected` itself, wholly above the cut."""
    zeros = torch.zeros_like(counts)
    return BandRuns(counts, torch.stack([counts, zeros], -1)[..., None].contiguous(), counts,
                    torch.stack([zeros, counts], -1).contiguous())


def flash_passes(case: Case, flash, quant=None, served: bool = False, window: int = WINDOW_KEYS,
                 share: float = 0.5) -> FlashPasses:
    """The squeezed decode as gpu_attention.py serves it with FlashAttention (`flash`): the window pass over each
    squeezed row's pages from its block-aligned context end on but the newest `window` keys (the first decoding row
    reads no context), then the row pass over pages of one cache row listing its sinks, a random `share` of its
    clustered positions (1: all of them) and those newest keys, merged. `served` (CUDA): the whole step by
    `duo_attention_gpu` (the cache write, the streaming heads, a decode batch's passes on two streams, replayed from a
    CUDA graph)."""
    from vllm_duo.gpu_attention import duo_attention_gpu, retrieval_flash_attention, selected_rows_attention
    from vllm_duo.squeeze import window_pages

    # served, the step writes its own K/V
    cache, stream = case.fresh_caches() if served else written_caches(case, quant)
    p, heads, starts = case.preset, case.heads, case.query_start_loc
    decoding = [i for i in range(len(case.seq_lens)) if starts[i + 1] - starts[i] == 1]
    ends = [0] * len(case.seq_lens)
    for i in decoding[1:]:
        end = (case.seq_lens[i] - 1) // p.block_size * p.block_size
        ends[i] = end if end > p.sink else 0
    assert sum(e > 0 for e in ends) >= 2 and cache.is_contiguous()
    rows = [[torch.arange(p.sink, max(p.sink, e))[torch.rand(max(e - p.sink, 0)) < share]
             for _ in range(heads.num_retrieval)] for e in ends]
    selected, counts = (x.to(case.device) for x in selection(case, rows))
    context_ends = torch.tensor(ends, dtype=torch.int32, device=case.device)
    lists = run_pages(one_cluster_runs(selected, counts), selected, None, context_ends, case.sl, case.block_table,
                      heads, cache, selected.shape[-1], window)
    window_lens = window_pass_lens(case.sl, context_ends, torch.empty_like(case.sl), window)
    retrieval_table = case.block_table[:, ::heads.stride].contiguous()
    window_table = torch.zeros_like(retrieval_table)
    window_pages(retrieval_table, context_ends, p.block_size, window_table)
    out = case.poisoned_output()
    max_query_len = max(starts[i + 1] - starts[i] for i in range(len(case.seq_lens)))
    if served:
        qsl, sl = case.qsl, case.sl  # made outside the capture

        def step():
            duo_attention_gpu(case.query, case.key, case.value, cache, heads, qsl, sl, case.block_table, case.scale,
                              out, max_query_len, max(case.seq_lens), stream_cache=stream, quant=quant,
                              retrieval_table=window_table, retrieval_seq_lens=window_lens,
                              squeezed=lambda attend: attend(*lists, context_ends, window_lens))
        step()  # compiles, and runs a batch with prefills or decodes eagerly
        if max_query_len == 1:
            eager = out.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            out.fill_(float("nan"))
            graph.replay()
            torch.testing.assert_close(out, eager, equal_nan=True)
            # the decode step stores its K/V on the second stream: every byte as write_kv writes it
            assert_caches_equal((cache, stream), written_caches(case, quant))
    else:
        queries, window_lse = retrieval_flash_attention(flash, case.query, cache, heads, case.qsl, window_lens,
                                                        window_table, case.scale, out, max_query_len,
                                                        max(case.seq_lens), quant, with_lse=True)
        selected_rows_attention(flash, queries, lambda: window_lse, *lists, context_ends, window_lens, cache=cache,
                                heads=heads, query_start_loc=case.qsl, scale=case.scale, output=out, quant=quant)
    expected = sparse_reference(case, cache, selected, counts, ends)
    return FlashPasses(out, expected, [starts[i] for i, e in enumerate(ends) if e > 0],
                       [starts[i] for i in decoding if ends[i] == 0], cache, stream)


def test_select_banded_ranks_clusters_far_below_the_top():
    """Under peaked attention the budget reaches clusters whose scores are many octaves below the best one: those
    go by score too, not in cluster order."""
    heads = LayerHeads.build([0], 1, 2, 1, 4, 16)
    C, size = 64, 4
    centroids = torch.randn(1, 1, C, 16, generator=torch.Generator().manual_seed(0))
    offsets = torch.arange(0, size * C + 1, size, dtype=torch.int32).view(1, 1, -1)
    positions = torch.arange(4, 4 + size * C, dtype=torch.int32).view(1, 1, -1)
    query = centroids[0, 0, 5].repeat(2, 1)[None] * 1.5  # cluster 5 holds nearly all the weight, the next 2^-14
    scored = centroid_scores(query, centroids, offsets.diff(dim=-1), heads, torch.tensor([0, 1], dtype=torch.int32),
                             1.0)
    selected, counts = select_banded(scored, offsets, positions, torch.tensor([[4 * size]], dtype=torch.int32), 64)
    chosen = set(((selected[0, 0, :counts[0, 0]] - 4) // size).tolist())
    best = scored.scores[0, 0].argsort(descending=True)
    assert scored.scores[0, 0, best[1]] < 2 ** -8 * scored.scores[0, 0, best[0]]  # under a floor at 1/256
    assert chosen == set(best[:4].tolist())


@pytest.mark.parametrize("window", [WINDOW_KEYS, 3])
@pytest.mark.parametrize("name", list(FLASH_PASSES))
def test_flash_passes_equal_the_sparse_decode(name, window):
    """With a torch stand-in for FlashAttention: the squeezed rows get the sparse decode's result, their window read
    whole by the row pass or, past its newest 3 keys, partly by the window pass; a decoding row without a context
    keeps the window pass over all of its keys, duo's retrieval decode."""
    case = make_case(FLASH_PASSES[name])
    step = flash_passes(case, stand_in_flash, window=window)
    q = case.heads.retrieval_q
    assert_close(step.out[step.squeezed][:, q], step.expected[step.squeezed][:, q], torch.float32)
    duo = duo_decode(case, step.cache, step.stream)
    assert_close(step.out[step.plain][:, q], duo[step.plain][:, q], torch.float32)


FLASH_GPU = {"llama_decode": GPU_PRESETS["llama_decode"],
             "llama_mixed": Preset(32, 8, (1, 2, 5, 7), ((0, 1000), (3000, 1), (700, 513), (2000, 1), (2500, 300),
                                                        (900, 1)), head_dim=128, sink=64, recent=256)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FLASH_GPU))
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("window", [WINDOW_KEYS, 3])
def test_flash_passes_on_the_gpu(name, kv_dtype, window):
    """The same with vLLM's FlashAttention-3 on an H100 (bf16 model; over fp8 K/V its queries are fp8 too, as
    FlashAttention takes them: a looser tolerance there)."""
    from vllm_duo import vllm_seam

    flash = vllm_seam.flash_attn_varlen()
    if flash is None:
        pytest.skip("vLLM's FlashAttention-3 is not available here")
    quant = cuda_scales() if kv_dtype in FP8 else None
    case = make_case(FLASH_GPU[name], dtype=torch.bfloat16, device=CUDA, kv_dtype=kv_dtype, quant=quant)
    step = flash_passes(case, flash, quant, window=window)
    rows, q = step.squeezed, case.heads.retrieval_q
    tol = dict(rtol=0.1, atol=0.1) if kv_dtype in FP8 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(step.out[rows][:, q].float().cpu(), step.expected[rows][:, q].float().cpu(), **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FLASH_GPU))
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("window", [WINDOW_KEYS, 3])
def test_squeezed_step_as_served_on_the_gpu(name, kv_dtype, window, monkeypatch):
    """The whole step by duo_attention_gpu with the squeeze (a decode batch eagerly and replayed from a CUDA graph,
    its window pass and streaming heads on a second stream beside the lookup): squeezed rows get the sparse decode's
    result, decoding rows without a context duo's retrieval decode, and every decoding row duo's streaming heads.
    The second stream starts with a delay, so that a pass that did not wait for its queries or the window shows."""
    from vllm_duo import gpu_attention, vllm_seam

    flash = vllm_seam.flash_attn_varlen()
    if flash is None:
        pytest.skip("vLLM's FlashAttention-3 is not available here")
    made = gpu_attention.flash_queries

    def late_queries(*args):
        torch.cuda._sleep(5_000_000)  # a few ms of GPU clock cycles
        return made(*args)
    monkeypatch.setattr(gpu_attention, "flash_queries", late_queries)
    quant = cuda_scales() if kv_dtype in FP8 else None
    case = make_case(FLASH_GPU[name], dtype=torch.bfloat16, device=CUDA, kv_dtype=kv_dtype, quant=quant)
    step = flash_passes(case, flash, quant, served=True, window=window)
    heads = case.heads
    tol = dict(rtol=0.1, atol=0.1) if kv_dtype in FP8 else dict(rtol=2e-2, atol=2e-2)
    duo = duo_decode(case, step.cache, step.stream, quant=quant)
    for rows, expected, q in ((step.squeezed, step.expected, heads.retrieval_q), (step.plain, duo, heads.retrieval_q),
                              (step.squeezed + step.plain, duo, heads.streaming_q)):
        torch.testing.assert_close(step.out[rows][:, q].float().cpu(), expected[rows][:, q].float().cpu(), **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama_decode", "smollm2_decode"])
@pytest.mark.parametrize("window", [WINDOW_KEYS, 0])
def test_squeezed_fp8_step_of_every_key_is_as_close_as_duo(name, window):
    """Over an fp8 cache, the squeezed step as served with every clustered key selected is as close to exact
    attention (float32 over the dequantized cache) as duo's own step, whose retrieval heads FlashAttention-3 reads
    in one pass: both quantize the queries and the softmax weights to fp8, so neither matches exactly, and a greedy
    answer may part ways where the two roundings differ. With the window in the row pass (`WINDOW_KEYS`) and by
    the window pass (0)."""
    from vllm_duo import vllm_seam
    from vllm_duo.gpu_attention import duo_attention_gpu

    flash = vllm_seam.flash_attn_varlen()
    if flash is None:
        pytest.skip("vLLM's FlashAttention-3 is not available here")
    quant = cuda_scales()
    case = make_case(FLASH_FP8_EVERY_KEY[name], dtype=torch.bfloat16, device=CUDA, kv_dtype=torch.float8_e4m3fn,
                     quant=quant)
    step = flash_passes(case, flash, quant, served=True, window=window, share=1.0)
    cache, stream = case.fresh_caches()
    duo = case.poisoned_output()
    duo_attention_gpu(case.query, case.key, case.value, cache, case.heads, case.qsl, case.sl, case.block_table,
                      case.scale, duo, 1, max(case.seq_lens), stream_cache=stream, quant=quant)
    rows, q = step.squeezed, case.heads.retrieval_q
    exact = step.expected[rows][:, q].float().cpu()
    squeezed_error = (step.out[rows][:, q].float().cpu() - exact).abs()
    duo_error = (duo[rows][:, q].float().cpu() - exact).abs()
    apart = (step.out[rows][:, q].float() - duo[rows][:, q].float()).abs()  # what the two roundings differ by
    errors = dict(squeezed_max=squeezed_error.max().item(), duo_max=duo_error.max().item(),
                  squeezed_mean=squeezed_error.mean().item(), duo_mean=duo_error.mean().item(),
                  apart_max=apart.max().item(), apart_mean=apart.mean().item())
    print(name, "window", window, errors)
    assert errors["squeezed_mean"] <= 1.5 * errors["duo_mean"] and errors["squeezed_max"] <= 2 * errors["duo_max"], \
        errors


FLASH_FP8_EVERY_KEY = {"llama_decode": GPU_PRESETS["llama_decode"],  # and SmolLM2's shape, as the end-to-end tests
                       "smollm2_decode": Preset(9, 3, (0, 2), ((2000, 1), (300, 1), (900, 1), (1700, 1), (2400, 1)),
                                                sink=16, recent=64)}


def assert_lists_read(lists, cache: torch.Tensor, table: torch.Tensor, listed: list[list[list[int]]],
                      stride: int = 1) -> None:
    """`run_pages`' lists (pages, lens, starts) name, through `row_views`, the K and V of `listed[req][head]`'s
    positions of retrieval head `head`, in order (`table` has `stride` columns per token block)."""
    pages, lens, starts = lists
    k_rows, v_rows = row_views(cache)
    entries = [(req, head) for req in range(len(listed)) for head in range(len(listed[req]))]
    assert lens.tolist() == [len(listed[req][head]) for req, head in entries]
    assert starts.tolist() == list(range(len(entries) + 1))
    block_size = cache.shape[2]
    for entry, (req, head) in enumerate(entries):
        positions = torch.tensor(listed[req][head], dtype=torch.long)
        block = table[req, positions // block_size * stride].long()
        ids = pages[entry, :lens[entry]].long()
        assert torch.equal(k_rows[ids, 0, 0], cache[block, 0, positions % block_size, head])
        assert torch.equal(v_rows[ids, 0, 0], cache[block, 1, positions % block_size, head])


def test_run_pages_index_the_cache_rows_through_its_strides():
    """Row ids and views where the cache's blocks are further apart than their K/V (a layer's view into a shared
    buffer): each listed row is the K/V of its position and retrieval head, sinks first, then the selection, then
    the window's newest keys."""
    heads = LayerHeads.build([0, 2], 4, 8, 2, 3, 4)  # R 2, stride 2 (a streaming page group per block), sink 3
    buffer = torch.randn(7, 3, 16, 2, 32)
    cache = buffer[:, :2]  # blocks 3 x 16 x 2 rows apart, K/V 16 x 2
    table = torch.randperm(14, dtype=torch.int32)[None, :].reshape(2, 7) % 7
    selected = torch.tensor([[[40, 17, 5], [9, 0, 0]], [[50, 3, 3], [31, 30, 20]]], dtype=torch.int32)
    counts = torch.tensor([[3, 1], [2, 3]], dtype=torch.int32)
    runs = one_cluster_runs(selected, counts)
    ends, seq_lens = torch.tensor([48, 32], dtype=torch.int32), torch.tensor([56, 63], dtype=torch.int32)
    for window in (WINDOW_KEYS, 5):
        listed = [[[0, 1, 2] + selected[req, head, :counts[req, head]].tolist()
                   + list(range(max(int(ends[req]), int(seq_lens[req]) - window), int(seq_lens[req])))
                   for head in range(2)] for req in range(2)]
        assert_lists_read(run_pages(runs, selected, None, ends, seq_lens, table, heads, cache, 3, window), cache,
                          table, listed, stride=2)
    lists = run_pages(runs, selected, None, torch.tensor([0, 32], dtype=torch.int32), seq_lens, table, heads, cache, 3,
                      5)
    assert_lists_read(lists, cache, table, [[[], []], listed[1]], stride=2)  # a row without a context lists nothing
