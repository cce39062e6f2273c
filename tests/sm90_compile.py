# SPDX-License-Identifier: Apache-2.0
"""Compile every duo Triton kernel for an H100 (sm_90) on a machine without a GPU; run by test_kernel_compile.py.

The CPU interpreter runs kernels as Python, so it misses what only the GPU compiler checks: the types
of values merged across branches, returns of different types, constexpr misuse. This script compiles
the kernels the way the H100 would see them (GPU tile choices, 16-byte aligned pointers and strides),
with Triton's own ptxas, and prints one line per kernel: registers, spilled bytes (stack), shared memory.
Run it without TRITON_INTERPRET. This machine's Triton may be newer than the GPU stack's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

NO_COMPILER = 77  # exit code: this Triton has no CUDA backend to compile with (the test skips)

from vllm_duo.kernels.cache_write import WRITE_BLOCK_T, _write_kv_kernel
from vllm_duo.kernels.clustering import NEAREST_TILE, _nearest_centre_kernel
from vllm_duo.kernels.decode import _decode_kernel, _merge_kernel, decode_tiles
from vllm_duo.kernels.prefill import _prefill_kernel, prefill_tiles
from vllm_duo.kernels.reference import FP8_FORMATS
from vllm_duo.kernels.selection import (BAND_CLUSTERS, BAND_COUNT_CLUSTERS, BAND_OCTAVE, GATHER_SLOTS, SCORE_BANDS,
                                         _band_ends_kernel, _band_gather_kernel, _centroid_logits_kernel,
                                         _centroid_scores_kernel, _page_scores_kernel, _score_tiles)
from vllm_duo.kernels.row_pages import PAGE_SLOTS, _merge_rows_kernel, _run_pages_kernel
from vllm_duo.kernels.sparse_decode import _sparse_decode_kernel, _sparse_merge_kernel

H100 = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
CUDA = torch.device("cuda")  # only its type is read: the tile choices for a GPU
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv"}


def pointer_types(model: torch.dtype, cache: torch.dtype) -> dict[str, str]:
    """Element types of the kernels' pointer arguments, by name (the rest are int32 batch metadata)."""
    scales = "fp32" if cache in FP8_FORMATS else TRITON_TYPES[cache]  # a bf16 cache passes itself as its scales
    types = dict.fromkeys(("query_ptr", "out_ptr", "key_ptr", "value_ptr", "rows_out_ptr"), TRITON_TYPES[model])
    types.update(dict.fromkeys(("cache_ptr", "stream_ptr"), TRITON_TYPES[cache]))
    types["centroids_ptr"] = TRITON_TYPES[cache if cache in FP8_FORMATS else model]  # fp8 beside an fp8 cache
    types.update(dict.fromkeys(("part_out_ptr", "part_lse_ptr", "scores_ptr", "summaries_ptr", "logits_ptr",
                                "part_m_ptr", "part_l_ptr", "centroid_scales_ptr", "radii_ptr", "window_lse_ptr",
                                "rows_lse_ptr"),
                               "fp32"))
    types.update(dict.fromkeys(("k_scale_ptr", "v_scale_ptr"), scales))
    types.update(dict.fromkeys(("retrieval_kv_ptr", "streaming_kv_ptr", "labels_ptr", "q_heads_ptr"), "i64"))
    # the write's query quantization (fp8 caches: FlashAttention's fp8 queries, the q scale), unread stand-ins else
    types.update(q_out_ptr=TRITON_TYPES[cache if cache in FP8_FORMATS else model], q_scale_ptr=scales)
    types.update(units_ptr="fp32", centres_ptr="bf16")  # clustering's float32 unit keys, its centres in bf16
    return {name: "*" + t for name, t in types.items()}


def compile_for_h100(kernel, model: torch.dtype, cache: torch.dtype, constants: dict, **options) -> str:
    """Compile `kernel` with `constants` for sm_90; its resource line (cuobjdump) or raise."""
    pointers = pointer_types(model, cache)
    signature, attrs = {}, {}
    for i, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif param.annotation == "i64":  # the strides: multiples of head_dim, except a block table's row
            signature[name] = "i64"
            if name != "stride_table":
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in ("qk_scale", "radius_scale") else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants, attrs=attrs), target=H100,
                              options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
    registers, stack = next(line.split("REG:")[1] for line in usage.splitlines() if "REG:" in line).split()[:2]
    return (f"registers {registers}, spilled {stack.removeprefix('STACK:')} B, "
            f"shared memory {compiled.metadata.shared} B")


def cases():
    """(label, kernel, model dtype, cache dtype, constants, options): every kernel at Llama-3.1-8B's shape (G 4,
    head_dim 128) in bf16 and over an fp8 e4m3 cache, and decode at SmolLM2's (G 3 padded to 16 rows, head_dim 64);
    the sparse decode and the selection scores (sparse_decode.py, selection.py) at Llama's.
    About 1.5 s a kernel on a cold Triton cache, so the table stays short."""
    for model, cache, G, head_dim, variants in (
            (torch.bfloat16, torch.bfloat16, 4, 128, {"write", "prefill", "decode without splits", "merge", "sparse",
                                                      "scores"}),
            (torch.bfloat16, torch.float8_e4m3fn, 4, 128, {"write", "prefill", "sparse", "logits"}),
            (torch.bfloat16, torch.bfloat16, 3, 64, set())):
        fp8 = FP8_FORMATS.get(cache, "")
        fp16 = bool(fp8) and model == torch.bfloat16
        shape = dict(HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=16, FP8=fp8)
        tag = f"{TRITON_TYPES[model]}/{TRITON_TYPES[cache]} G={G} d={head_dim}"
        if "write" in variants:
            # over fp8 as served beside FlashAttention: the launch also quantizes the retrieval heads' queries
            yield (f"write_kv {tag}", _write_kv_kernel, model, cache,
                   dict(shape, BLOCK_T=WRITE_BLOCK_T, QUERIES=bool(fp8)), {})

        if "prefill" in variants:
            def prefill_shape(store: bool) -> tuple[dict, dict]:  # (constants, launch options) as prefill_attention's
                tiles, config = prefill_tiles(head_dim, G, CUDA, store)
                return dict(shape, G=G, FP16=fp16, STORE=store, **tiles), config

            constants, config = prefill_shape(store=False)
            yield (f"prefill {tag}", _prefill_kernel, model, cache,
                   dict(constants, STREAMING_ONLY=False, FRESH_KV=False), config)
            # beside FlashAttention: fresh prompts' streaming keys from the step where the cache keeps them; as
            # served there, the launch storing the step's K/V too
            yield (f"prefill streaming heads {tag}", _prefill_kernel, model, cache,
                   dict(constants, STREAMING_ONLY=True, FRESH_KV=cache == model), config)
            if cache == model:
                constants, config = prefill_shape(store=True)
                yield (f"prefill streaming heads storing the step {tag}", _prefill_kernel, model, cache,
                       dict(constants, STREAMING_ONLY=True, FRESH_KV=True), config)

        tiles = decode_tiles(head_dim, CUDA, bool(fp8))
        block_n, min_split = tiles.block_n, tiles.min_split
        splits = ((1, 1), (64, 2)) if "decode without splits" in variants else ((64, 2),)
        for max_splits, stream_splits in splits:
            parts = max(max_splits, stream_splits)
            constants = dict(shape, G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n,
                             MAX_SPLITS=max_splits, STREAM_SPLITS=stream_splits, NUM_PARTS=parts, MIN_SPLIT=min_split,
                             WINDOW_SPLIT=min_split, FP16=fp16, MERGE_IN_LAUNCH=True)
            yield (f"decode {tag} splits {max_splits}/{stream_splits}", _decode_kernel, model, cache, constants,
                   dict(num_warps=tiles.warps, num_stages=tiles.stages))
            if parts > 1 and "merge" in variants:  # the merge launch of splits too deep for the decode launch
                constants = dict(G=G, BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=shape["BLOCK_D"],
                                 MAX_SPLITS=max_splits, NUM_PARTS=parts, MIN_SPLIT=min_split, WINDOW_SPLIT=min_split,
                                 BLOCK_S=triton.next_power_of_2(parts))
                yield f"merge {tag} parts {parts}", _merge_kernel, model, cache, constants, dict(num_warps=8)

        if "sparse" in variants:
            block_g = max(16, triton.next_power_of_2(G))
            for max_splits in (1, 64):
                constants = dict(shape, G=G, BLOCK_G=block_g, BLOCK_N=block_n, MAX_SPLITS=max_splits,
                                 MIN_SPLIT=min_split, FP16=fp16, CONTEXT_ENDS=True, MERGE_IN_LAUNCH=True)
                yield (f"sparse decode {tag} splits {max_splits}", _sparse_decode_kernel, model, cache, constants,
                       dict(num_warps=tiles.warps, num_stages=tiles.stages))
            constants = dict(G=G, BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=shape["BLOCK_D"], MAX_SPLITS=64,
                             MIN_SPLIT=min_split, BLOCK_S=64, CONTEXT_ENDS=True)
            yield f"sparse merge {tag} splits 64", _sparse_merge_kernel, model, cache, constants, {}
            yield (f"run pages {tag}", _run_pages_kernel, model, cache,
                   dict(BLOCK_SIZE=16, SLOTS=PAGE_SLOTS, SEARCH_STEPS=14, CONTEXTS=True), {})
            yield (f"merge rows {tag}", _merge_rows_kernel, model, cache,
                   dict(G=G, HEAD_DIM=head_dim, BLOCK_D=shape["BLOCK_D"]), dict(num_warps=1))
        tile = _score_tiles(CUDA)
        common = dict(G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), HEAD_DIM=head_dim, BLOCK_D=shape["BLOCK_D"])
        if variants & {"scores", "logits"}:  # fp8 centroids with their scales beside an fp8 cache
            yield (f"centroid logits {tag}", _centroid_logits_kernel, model, cache,
                   dict(common, BLOCK_C=tile, TILE_CHUNKS=4, CONTEXTS=True, SCALED=bool(fp8), RADII=True,
                        BANDS=SCORE_BANDS), {})
        if "scores" in variants:
            yield (f"centroid scores {tag}", _centroid_scores_kernel, model, cache,
                   dict(G=G, BLOCK_G=common["BLOCK_G"], BLOCK_C=BAND_COUNT_CLUSTERS, TILE_CHUNKS=16, BLOCK_T=64,
                        BANDS=SCORE_BANDS, OCTAVE=BAND_OCTAVE, CONTEXTS=True), {})
            yield f"page scores {tag}", _page_scores_kernel, model, cache, dict(common, BLOCK_P=tile, BLOCK_SIZE=16), {}
            for clusters in (4 * tile, 16 * tile):  # tiles of 4 chunks at 4 x 128k, the widest ends chunk
                ends = dict(TILE=clusters, BLOCK_E=min(BAND_CLUSTERS, clusters), BLOCK_T=64, BANDS=SCORE_BANDS,
                            OCTAVE=BAND_OCTAVE, CONTEXTS=True)
                yield f"band ends {tag} tile {clusters}", _band_ends_kernel, model, cache, ends, {}
            yield (f"band gather {tag}", _band_gather_kernel, model, cache,
                   dict(OUT_W=GATHER_SLOTS, SEARCH_STEPS=14, CONTEXTS=True), {})
            block_t, block_c, warps = NEAREST_TILE
            yield (f"nearest centres d={head_dim} bf16 dots", _nearest_centre_kernel, model, cache,
                   dict(HEAD_DIM=head_dim, BLOCK_D=shape["BLOCK_D"], BLOCK_T=block_t, BLOCK_C=block_c, BF16=True),
                   dict(num_warps=warps))


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("sm90_compile.py compiles for the GPU: run it without TRITON_INTERPRET=1")
    if not os.path.exists(CUOBJDUMP):
        print(f"Triton {triton.__version__} has no CUDA backend here")
        return NO_COMPILER
    failed = 0
    for label, kernel, model, cache, constants, options in cases():
        try:
            print(f"{label}: {compile_for_h100(kernel, model, cache, constants, **options)}", flush=True)
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            print(f"{label}: FAILED {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
