# SPDX-License-Identifier: Apache-2.0
"""kernels/clustering.py on the CPU: the batched spherical K-means against the key-by-key reference, its CSR
against `select_positions`, the two-level build, and a quality check on keys drawn from separated clusters."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vllm_duo.kernels import sparse_reference as ref
from vllm_duo.kernels.clustering import cluster_keys, cluster_keys_hierarchical, cluster_radii, to_csr
from vllm_duo.kernels.selection import select_positions

ROOT = Path(__file__).resolve().parents[1]


def random_keys(heads=3, tokens=40, dim=8, seed=0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(heads, tokens, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def separated_keys(heads: int, clusters: int, per_cluster: int, dim: int, seed: int):
    """Keys around `clusters` random directions per head (spread 0.05 around unit centres, scaled by random
    norms: cosine, not length, tells the clusters apart), shuffled; returns keys `[H, T, D]` and true labels."""
    generator = torch.Generator().manual_seed(seed)
    centres = F.normalize(torch.randn(heads, clusters, dim, generator=generator), dim=-1)
    truth = torch.arange(clusters).repeat_interleave(per_cluster)
    truth = torch.stack([truth[torch.randperm(len(truth), generator=generator)] for _ in range(heads)])
    keys = centres.gather(1, truth[..., None].expand(-1, -1, dim))
    keys = keys + 0.05 * torch.randn(keys.shape, generator=generator)
    return keys * (0.5 + 2 * torch.rand(heads, truth.shape[1], 1, generator=generator)), truth


def purity(labels: torch.Tensor, truth: torch.Tensor, clusters: int) -> float:
    """The share of keys in their cluster's majority true class, over all heads."""
    hits = 0
    for found, true in zip(labels, truth):
        for c in found.unique():
            hits += int(torch.bincount(true[found == c], minlength=clusters).max())
    return hits / labels.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_for_fixed_init(dtype):
    keys = random_keys(dtype=dtype)
    init = keys[:, :5].float()
    got = cluster_keys(keys, 5, iters=8, init=init)
    centroids, sizes, labels, done = ref.cluster_keys(keys, init, iters=8)
    assert torch.equal(got.labels, labels) and torch.equal(got.sizes, sizes) and got.iterations == done
    torch.testing.assert_close(got.centroids, centroids)
    assert got.centroids.dtype == torch.float32 and got.sizes.dtype == torch.int32


@pytest.mark.parametrize("init", ["k-means++", "random"])
def test_labels_are_nearest_by_cosine_and_centroids_the_mean(init):
    keys = random_keys(heads=4, tokens=64)
    result = cluster_keys(keys, 6, iters=30, init=init, seed=3)
    units = F.normalize(keys, dim=-1)
    directions = torch.zeros(4, 6, 8)
    for h in range(4):
        for c in range(6):
            members = result.labels[h] == c
            assert int(members.sum()) == int(result.sizes[h, c])
            if members.any():
                directions[h, c] = F.normalize(units[h][members].sum(0), dim=0)
                torch.testing.assert_close(result.centroids[h, c], keys[h][members].mean(0))
    assert result.iterations < 30  # converged: each key is at its own cluster's nearest direction
    cosines = torch.einsum("htd,hcd->htc", units, directions)
    own = cosines.gather(-1, result.labels[..., None])[..., 0]
    assert torch.all(own >= cosines.max(-1).values - 1e-6)


def test_deterministic_and_seeded():
    keys = random_keys(heads=2, tokens=50)
    first, again = cluster_keys(keys, 7, seed=11), cluster_keys(keys, 7, seed=11)
    assert torch.equal(first.labels, again.labels) and torch.equal(first.centroids, again.centroids)
    other = cluster_keys(keys, 7, seed=12, iters=0)
    assert not torch.equal(cluster_keys(keys, 7, seed=11, iters=0).labels, other.labels)


@pytest.mark.parametrize("init", ["k-means++", "random"])
def test_chunking_changes_nothing(init):
    keys = random_keys(heads=3, tokens=45)
    whole = cluster_keys(keys, 6, seed=5, init=init)
    chunked = cluster_keys(keys, 6, seed=5, init=init, max_block_bytes=3 * 6 * 4 * 7)  # 7 keys per chunk
    assert torch.equal(whole.labels, chunked.labels) and torch.equal(whole.centroids, chunked.centroids)
    coarse, fine = cluster_keys_hierarchical(keys, 3, 2, seed=5, init=init)
    coarse_chunked, fine_chunked = cluster_keys_hierarchical(keys, 3, 2, seed=5, init=init,
                                                             max_block_bytes=160)  # 4 and 2 keys per chunk
    assert torch.equal(fine.labels, fine_chunked.labels) and torch.equal(coarse.labels, coarse_chunked.labels)


def test_empty_clusters():
    keys = random_keys(heads=2, tokens=10).repeat_interleave(2, dim=1)[:, :6]  # 3 distinct keys, each twice
    result = cluster_keys(keys, 5, init="random")
    assert result.sizes.sum(-1).tolist() == [6, 6]
    assert (result.sizes == 0).sum(-1).tolist() == [2, 2]
    assert torch.all(result.centroids[result.sizes == 0] == 0)
    one_key = cluster_keys(keys[:, :1], 4)
    assert one_key.sizes.sum(-1).tolist() == [1, 1] and one_key.labels.tolist() == [[0], [0]]


@pytest.mark.parametrize("chunk", [16384, 7])
def test_radii_are_the_farthest_key(chunk):
    """A cluster's radius is its farthest raw key's distance from its centroid (0 when empty), in chunks too."""
    keys = random_keys(heads=2, tokens=30) * torch.rand(2, 30, 1) * 4  # raw keys of several norms
    result = cluster_keys(keys, 9, init="random")
    radii = cluster_radii(keys, result, chunk=chunk)
    for h in range(2):
        for c in range(9):
            members = keys[h, result.labels[h] == c]
            far = (members - result.centroids[h, c]).norm(dim=-1).max() if len(members) else torch.tensor(0.0)
            torch.testing.assert_close(radii[h, c], far)


def test_csr_round_trips_labels():
    labels = cluster_keys(random_keys(heads=3, tokens=30), 5, seed=1).labels
    offsets, positions = to_csr(labels, 5, positions_offset=64)
    expected_offsets, expected_positions = ref.to_csr(labels, 5, 64)
    assert torch.equal(offsets, expected_offsets) and torch.equal(positions, expected_positions)
    back = torch.empty_like(labels)
    for h in range(3):
        for c in range(5):
            back[h, positions[h, offsets[h, c]:offsets[h, c + 1]].long() - 64] = c
    assert torch.equal(back, labels)
    assert to_csr(torch.tensor([[1, 0, 1, 1]]), 3, 64)[0].tolist() == [[0, 1, 4, 4]]


def test_full_budget_selects_every_position_once():
    keys = random_keys(heads=4, tokens=37)
    result = cluster_keys(keys, 6, seed=2)
    offsets, positions = to_csr(result.labels, 6, positions_offset=16)
    scores = torch.rand(2, 4, 6, generator=torch.Generator().manual_seed(0))
    selected, counts = select_positions(scores, offsets[None], positions[None], budget=37, max_selected=37,
                                        context_ids=torch.zeros(2, dtype=torch.int32))
    assert counts.tolist() == [[37] * 4] * 2
    assert torch.equal(selected.sort(-1).values, torch.arange(16, 53, dtype=torch.int32).expand(2, 4, 37))


@pytest.mark.parametrize("init", ["k-means++", "random"])
def test_recovers_separated_clusters(init):
    """Twice as many clusters as true ones (as n/16 clusters over-split a context's topics): each found cluster
    should lie within one true cluster (random labels give a purity near 0.3)."""
    keys, truth = separated_keys(heads=4, clusters=8, per_cluster=16, dim=16, seed=0)
    assert purity(cluster_keys(keys, 16, seed=0, init=init).labels, truth, 8) > 0.95
    _, fine = cluster_keys_hierarchical(keys, 4, 4, seed=0, init=init)
    assert purity(fine.labels, truth, 8) > 0.95


def test_hierarchical_nests_fine_in_coarse():
    keys = random_keys(heads=3, tokens=60)
    coarse, fine = cluster_keys_hierarchical(keys, 4, 3, seed=4)
    assert fine.centroids.shape == (3, 12, 8) and fine.sizes.shape == (3, 12)
    assert torch.equal(fine.labels // 3, coarse.labels)
    assert torch.equal(fine.sizes.view(3, 4, 3).sum(-1), coarse.sizes)
    offsets, positions = to_csr(fine.labels, 12)
    coarse_offsets, coarse_positions = to_csr(coarse.labels, 4)
    assert torch.equal(offsets[:, ::3], coarse_offsets)
    assert fine.iterations < 20
    units = F.normalize(keys, dim=-1)
    directions = F.normalize(torch.zeros(3, 12, 8).scatter_add_(1, fine.labels[..., None].expand(-1, -1, 8), units),
                             dim=-1)
    cosines = torch.einsum("htd,hcd->htc", units, directions).view(3, 60, 4, 3)
    own_coarse = cosines.gather(2, coarse.labels[:, :, None, None].expand(-1, -1, 1, 3))[:, :, 0]  # [3, 60, 3]
    assert torch.equal(own_coarse.argmax(-1), fine.labels % 3)  # the nearest of its coarse cluster's fine centres


def test_cluster_bench_runs_tiny():
    spec = importlib.util.spec_from_file_location("cluster_bench", ROOT / "benchmarks" / "cluster_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.bench(heads=2, head_dim=8, lengths=(64,), device=torch.device("cpu"), iters=3, repeats=1)
    assert {(r["keys"], r["levels"]) for r in rows} >= {(64, 1), (64, 2)}
    assert all(r["seconds"] > 0 and r["clusters"] == 4 and r["assign"] == "matmul" for r in rows)


@pytest.mark.parametrize("tokens, clusters", [(40, 37), (16, 5), (1, 1)])
def test_nearest_centres_is_the_argmax_of_the_dot_products(tokens, clusters):
    """The fused assignment kernel (exact float32) picks what the matmul's argmax picks, over several tiles of keys
    and centres with ragged ends; ties go to the lower index, within a tile and across tiles. (Its bf16 path is the
    GPU test's: Triton's interpreter gets bf16 dot products wrong.)"""
    from vllm_duo.kernels.clustering import nearest_centres

    units = F.normalize(random_keys(heads=3, tokens=tokens, dim=8), dim=-1)
    centres = F.normalize(random_keys(heads=3, tokens=clusters, dim=8, seed=1), dim=-1)
    if clusters > 20:
        centres[:, 5] = centres[:, 3]  # the same tile as 3
        centres[:, 20] = centres[:, 3]  # a later tile
        units[:, 0] = centres[:, 3]
    got = nearest_centres(units, centres, bf16=False)
    assert torch.equal(got, torch.einsum("htd,hcd->htc", units, centres).argmax(-1))
    if clusters > 20:
        assert (got[:, 0] == 3).all()


@pytest.mark.gpu
def test_cluster_keys_on_the_gpu_assigns_by_the_fused_kernel():
    """On CUDA, Lloyd's assignments go through the bf16 kernel: seeded with one key of each true class, the
    clusters of separated keys are found exactly, and over-clustered from k-means++ seeds as on the CPU (with as
    many clusters as classes k-means++ often seeds two in one class, whatever the assignment); a key's centre is
    within bf16's error of its best."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from vllm_duo.kernels.clustering import nearest_centres

    keys, truth = separated_keys(heads=4, clusters=8, per_cluster=64, dim=128, seed=5)
    one_per_class = torch.stack([k[t.argsort(stable=True)[::64]] for k, t in zip(keys, truth)])
    assert purity(cluster_keys(keys.cuda(), 8, iters=30, init=one_per_class.cuda()).labels.cpu(), truth, 8) == 1.0
    assert purity(cluster_keys(keys.cuda(), 16, iters=30, seed=1).labels.cpu(), truth, 8) > 0.99
    units = F.normalize(torch.randn(4, 4096, 128, device="cuda"), dim=-1)
    centres = F.normalize(torch.randn(4, 1000, 128, device="cuda"), dim=-1)
    scores = torch.einsum("htd,hcd->htc", units, centres)
    got = nearest_centres(units, centres)
    assert torch.all(scores.gather(-1, got[..., None])[..., 0] >= scores.max(-1).values - 0.02)
    exact = nearest_centres(units, centres, bf16=False)  # float32 sums in another order than the matmul's
    assert torch.all(scores.gather(-1, exact[..., None])[..., 0] >= scores.max(-1).values - 1e-5)
    assert (exact == scores.argmax(-1)).float().mean() > 0.999
