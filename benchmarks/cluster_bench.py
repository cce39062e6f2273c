# SPDX-License-Identifier: Apache-2.0
"""The cost of Squeezed Attention's offline clustering (kernels/clustering.py, issue 33) for one context of
Llama-3.1-8B: its 128 retrieval KV heads (half of 32 layers x 8, head_dim 128) at 16k, 64k and 128k selectable keys,
C = n/16 clusters per head, 1 level (`cluster_keys`) and 2 levels (`cluster_keys_hierarchical`, C1 = F = sqrt(C)),
k-means++ and random seeding, at most 20 Lloyd iterations; on a GPU each with the fused assignment kernel as served
(`clustering.nearest_centres`, bf16 dot products) and with the chunked float32 matmuls, side by side.

Keys are random bf16 normals: they have no clusters, so Lloyd runs all its iterations (real keys may stop earlier:
the iterations run are reported). Each case is timed once after a small warm-up case (the runs are seconds long);
peak GPU memory is reported beside the time.

  python benchmarks/cluster_bench.py                   # GPU: writes $OUT/cluster_bench.json or benchmarks/results/
  python benchmarks/cluster_bench.py --heads 2 --head-dim 8 --lengths 64   # any device, tiny
  python benchmarks/cluster_bench.py --heads 4 --iters 10 --lengths 131072 --inits random   # one layer as served
  ... --repeats 2 --tiles 128x128x8,256x64x8   # GPU: the fused assignment in other tiles (keys x centres x warps)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from unittest.mock import patch

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from kernels_bench import _import_kernels_from_checkout  # noqa: E402

_import_kernels_from_checkout()
from vllm_duo.kernels import clustering  # noqa: E402
from vllm_duo.kernels.clustering import cluster_keys, cluster_keys_hierarchical  # noqa: E402

LENGTHS = (16384, 65536, 131072)
INITS = ("k-means++", "random")


def two_levels(clusters: int) -> tuple[int, int]:
    """Coarse clusters C1 and fine clusters per coarse one F, C1 = round(sqrt(C)) and C1 x F >= C: the split that
    makes the per-iteration cost T x (C1 + F) least."""
    coarse = max(1, round(math.sqrt(clusters)))
    return coarse, math.ceil(clusters / coarse)


def seconds(fn, device: torch.device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, result


def assignment_and_update(keys: torch.Tensor, clusters: int, device: torch.device, repeats: int = 3) -> dict:
    """One Lloyd iteration's two parts timed apart (best of `repeats`, seconds): the fused assignment of every unit
    key to its nearest of `clusters` centres, and the update's `index_add_` of the unit keys into per-cluster sums."""
    H, T, D = keys.shape
    units = torch.nn.functional.normalize(keys.float(), dim=-1)
    centres = units[:, :clusters].contiguous()
    labels = clustering.nearest_centres(units, centres)
    row = torch.arange(H, device=device).repeat_interleave(T) * clusters
    flat = units.reshape(H * T, D)

    def update():
        return torch.zeros(H * clusters, D, device=device).index_add_(0, row + labels.flatten(), flat)
    return {"assign_s": min(seconds(lambda: clustering.nearest_centres(units, centres), device)[0]
                            for _ in range(repeats)),
            "update_s": min(seconds(update, device)[0] for _ in range(repeats))}


def bench(heads: int = 128, head_dim: int = 128, lengths=LENGTHS, device: torch.device | None = None, iters: int = 20,
          inits=INITS, repeats: int = 1, tiles=()) -> list[dict]:
    """One row per keys x init x levels x assignment ("fused" on a GPU, and "matmul"): seconds (best of `repeats`),
    clusters per head, iterations run, peak GPU memory (GiB, 0 on the CPU). On a GPU, also the 1-level build with the
    fused assignment in each of `tiles` (keys, centres, warps) instead of NEAREST_TILE ("fused TxCxW"), and, for
    each length, one iteration's assignment and update timed apart."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(0)
    warm = torch.randn(heads, 256, head_dim, generator=generator, device=device).to(torch.bfloat16)
    cluster_keys(warm, 16, iters=2)
    cluster_keys_hierarchical(warm, 4, 4, iters=2)
    cuda = device.type == "cuda"
    assigns = [("fused", clustering.NEAREST_TILE), ("matmul", None)] if cuda else [("matmul", None)]
    assigns += [("fused " + "x".join(map(str, tile)), tile) for tile in tiles if cuda]
    rows = []
    for length in lengths:
        keys = torch.randn(heads, length, head_dim, generator=generator, device=device).to(torch.bfloat16)
        clusters = max(1, length // 16)
        coarse, fine = two_levels(clusters)
        for init in inits:
            cases = (
                (1, clusters, lambda: cluster_keys(keys, clusters, iters=iters, init=init).iterations),
                (2, coarse * fine, lambda: cluster_keys_hierarchical(keys, coarse, fine, iters=iters,
                                                                     init=init)[1].iterations))
            for (levels, count, run), (assign, tile) in ((case, assign) for case in cases for assign in assigns):
                if levels == 2 and assign not in ("fused", "matmul"):
                    continue  # the tile sweep is the 1-level build's
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                with patch.object(clustering, "FUSED_ASSIGN", tile is not None), \
                        patch.object(clustering, "NEAREST_TILE", tile or clustering.NEAREST_TILE):
                    best, done = min(seconds(run, device) for _ in range(repeats))
                peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else 0.0
                rows.append({"keys": length, "heads": heads, "head_dim": head_dim, "levels": levels, "init": init,
                             "assign": assign, "clusters": count, "coarse": coarse if levels == 2 else None,
                             "iterations": done, "seconds": best, "peak_gib": round(peak, 2)})
                print(f"{length:>7} keys  {levels} level  {init:<9} {assign:<6} C {count:>5}  {done:>2} it  "
                      f"{best:8.2f} s  {peak:6.1f} GiB", flush=True)
        if cuda:
            parts = assignment_and_update(keys, clusters, device)
            rows.append({"keys": length, "heads": heads, "head_dim": head_dim, "levels": 1, "clusters": clusters,
                         "assign": "one iteration's parts", **parts})
            print(f"{length:>7} keys  one iteration: assignment {parts['assign_s'] * 1e3:.2f} ms, update "
                  f"{parts['update_s'] * 1e3:.2f} ms", flush=True)
        del keys
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="selectable keys, comma separated")
    parser.add_argument("--inits", default=",".join(INITS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1, help="time each case this many times, keep the best")
    parser.add_argument("--tiles", default="", help="more fused-assignment tiles, keys x centres x warps, e.g. "
                        "128x128x8,256x64x8")
    args = parser.parse_args()
    tiles = [tuple(int(n) for n in tile.split("x")) for tile in args.tiles.split(",") if tile]
    if any(len(tile) != 3 for tile in tiles):
        parser.error(f"--tiles {args.tiles}: each tile is keys x centres x warps, e.g. 128x64x8")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = bench(args.heads, args.head_dim, [int(n) for n in args.lengths.split(",")], device, args.iters,
                 args.inits.split(","), args.repeats, tiles)
    target = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "results"
    target.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    (target / "cluster_bench.json").write_text(json.dumps({"device": name, "torch": torch.__version__,
                                                           "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
