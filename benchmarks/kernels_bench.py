# SPDX-License-Identifier: Apache-2.0
"""GPU microbenchmark of the duo Triton kernels against vLLM's FlashAttention (FA3) on a dense paged cache.

Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16), half the KV heads
retrieval ([0, 2, 5, 7]), block size 16, sink 64, recent 256.
  decode:  batch 32 x 32k context: duo decode vs FA3 over 8 KV heads and over the 4 retrieval heads;
           achieved bandwidth = KV bytes that must be read / time.
  prefill: one request of 8k / 32k / 128k tokens, whole prompt or 8k chunks: duo layer vs FA3 causal,
           duo streaming heads alone (time per token should not grow with the context).
Floors (bytes / bandwidth, FLOPs / rate): decode reads 2.15 GB of duo KV (4 of 8 heads, plus 20 MB
of streaming pages) vs 4.3 GB dense, about 0.7 ms vs 1.4 ms at a 3 TB/s copy rate; a 128k causal prefill is
2 * T^2 * 32 * 128 = 1.4e14 FLOPs dense, about 0.18 s at 800 TFLOP/s, and duo needs half of that.
Every working set here is larger than the 50 MB L2, so inputs are not rotated. Outputs are
cross-checked: duo retrieval heads against FA3 on the same K/V, decode against the PyTorch
reference for two requests, chunked prefill against the whole-prompt run.

fp8 (`--fp8`): decode at batch 4 x 64k and 32 x 32k over an e4m3 cache (scales 1), the kernels multiplying
in fp16 (their default for bf16 models) and in bf16, against the same heads in a bf16 cache and FA3's fp8
path on the dense cache (queries quantized, as vLLM's FLASH_ATTN does).

mixed (`--mixed`, issue 22): one layer over the mixed batches vLLM runs eagerly between piecewise CUDA graphs
(prefill bursts of 1k and 4k prompts, decodes beside a chunk), duo against dense's cache write + FA3: device time,
the host time to issue a call, cProfile's split of it, each launch's host time alone and through Triton's compiled
launcher alone (what a launch cached per layer would cost), and the streaming heads' prefill as served (fresh
prompts' keys from the step's K/V), with every key from the page groups, and over several tile shapes. q, k and v are
views of one fused qkv, as vLLM passes them.
Decode batches (1k-64k, 4 and 32 at once) also time decode over shorter splits, each kind of head alone, the
streaming heads in one program each as before they were split, and the layer with every split head merged in the
decode launch, then every one by a second launch (served: in the launch up to decode.MAX_PARTS_MERGED_IN_LAUNCH
parts a head).

long decode (`--long-decode`, issue 32): whole 32-layer decode steps at batch 4 x 64k and 4 x 128k over an fp8 cache
and 4 x 64k over bf16, each one CUDA graph replay as served: duo (the reference pattern's retrieval heads per layer at
sparsity 0.5) against dense's cache write + FA3 (32 splits, the step's schedule), then duo with FA3's split cap at
4-64, each part alone, every split head merged in the decode launch and every one by a second launch (served: in
the launch up to decode.MAX_PARTS_MERGED_IN_LAUNCH parts a head), the streaming
heads after FA3 on one stream (served: beside it on a second stream), FA3 given a step schedule (bf16: FA3 on the
retrieval heads instead of Triton, alone and beside the streaming heads), and the torch profiler's kernels of both
steps.

squeeze decode (`--squeeze-decode`, issue 33): the same steps at 4 x 64k and 4 x 128k over an fp8 cache, duo as served
against duo with Squeezed Attention's lookup and sparse decode on its retrieval heads at budgets 1/16, 1/8 and 1/4 of
the keys (random clusters, fp8 centroids as served: timing only), each step whole, its lookup alone and its sparse
decode alone, and with bf16 centroids; at 1/16 the layer as served (the lookup, then FlashAttention over pages of one
cache row listing the selected keys, merged with FlashAttention's window pass, which runs beside the lookup with the
streaming heads), also without its lookup, and that lookup alone (its kernels profiled beside the whole layer's).
`--squeeze-sweep`: at 4 x 128k and 1/16 only, duo's and the squeeze's layers as served (the squeeze's also without
its lookup, and its lookup alone), and one layer of the squeeze's step as the GPU ran it, kernel by kernel on its
two streams; then bounds: the squeeze with each layer's lookup made a layer ahead beside the layer before (what a
query speculated one layer early could save), without its window pass and merge, or without its streaming heads, and
its row pass in 8 to 64 FlashAttention splits (served: 32).

`--squeeze-ncu`: three squeezed steps at 4 x 128k, 1/16, eagerly, for Nsight Compute (gpu_run.sh squeeze_ncu).

Run from the repository root: python benchmarks/kernels_bench.py [--fp8 | --mixed | --long-decode | --squeeze-decode
| --squeeze-sweep | --squeeze-ncu]
(results: $OUT/kernels_bench[_fp8|_mixed|_long_decode|_squeeze_decode|_squeeze_sweep|_squeeze_ncu].json, or
benchmarks/results/ without $OUT).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import itertools
import json
import os
import sys
import time
import traceback
from pathlib import Path
from unittest.mock import patch

import torch
import triton
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[1]


def _import_kernels_from_checkout() -> None:
    """Make vllm_duo.kernels importable from this checkout when the package is not installed.

    setup.py maps the package vllm_duo.kernels to the folder kernels/; do the same by hand.
    """
    try:
        import vllm_duo.kernels  # noqa: F401
        return
    except ImportError:
        pass
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("vllm_duo.kernels", ROOT / "kernels" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_duo.kernels"] = module
    spec.loader.exec_module(module)


_import_kernels_from_checkout()
from vllm_duo.gpu_attention import duo_attention_gpu, retrieval_page_views  # noqa: E402
from vllm_duo.kernels.decode import (MIN_SPLIT_TOKENS, DecodeTiles, decode_attention,  # noqa: E402
                                     decode_num_splits)
from vllm_duo.kernels.prefill import prefill_attention  # noqa: E402
from vllm_duo.kernels import cache_write  # noqa: E402
from vllm_duo.kernels.reference import KVQuant, LayerHeads, duo_attention  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
RETRIEVAL = [0, 2, 5, 7]
BLOCK, SINK, RECENT = 16, 64, 256
DTYPE = torch.bfloat16
BYTES = 2
NOMINAL_TBPS = {"H100": 3.35, "H200": 4.8}
DEV = torch.device("cuda")
SCALE = HEAD_DIM ** -0.5


def ms(fn) -> float:
    """Median time in ms after a warm-up call (compiles, autotunes, allocates)."""
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def load_fa():
    """vLLM's flash_attn_varlen_func pinned to FA3 (FA2 if FA3 is not supported here), or (None, why)."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        from vllm.vllm_flash_attn.flash_attn_interface import fa_version_unsupported_reason, is_fa_version_supported
    except Exception as e:  # noqa: BLE001 - any import failure means: time duo alone
        return None, f"vllm.vllm_flash_attn import failed: {e!r}"
    for version in (3, 2):
        if is_fa_version_supported(version):
            def fa(*args, _v=version, **kw):
                return flash_attn_varlen_func(*args, fa_version=_v, **kw)
            fa.version = version
            return fa, None if version == 3 else f"FA3 unsupported: {fa_version_unsupported_reason(3)}"
    return None, f"no FA version supported: {fa_version_unsupported_reason(3)}"


@dataclasses.dataclass
class DuoLayout:
    """A duo cache for `seq_lens` as vllm_duo/kv_cache.py lays it out for one layer: each token block has its
    retrieval page and its streaming page group (m blocks), `stride` = 1 + m block table columns; block ids
    scattered at random, block 0 unused. Every page group is kept (the engine frees those outside sink + window;
    the kernels never read them)."""

    heads: LayerHeads
    cache: torch.Tensor
    table: torch.Tensor

    @classmethod
    def build(cls, seq_lens: list[int], retrieval: list[int] = RETRIEVAL, dtype: torch.dtype = DTYPE) -> DuoLayout:
        R, S = len(retrieval), NUM_KV_HEADS - len(retrieval)
        P = R
        stride = 1 + triton.cdiv(S, P)  # BLOCK slots x S streaming heads in blocks of BLOCK x P cells
        heads = LayerHeads.build(retrieval, NUM_KV_HEADS, NUM_HEADS, stride, SINK, RECENT, device=DEV)
        counts = [triton.cdiv(s, BLOCK) * stride for s in seq_lens]
        ids = torch.randperm(sum(counts), device=DEV).int() + 1
        table = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32, device=DEV)
        offset = 0
        for i, n in enumerate(counts):
            table[i, :n] = ids[offset:offset + n]
            offset += n
        cache = random_pages((sum(counts) + 1, 2, BLOCK, P, HEAD_DIM), dtype)
        return cls(heads, cache, table)

    def copy_retrieval_from(self, dense_k, dense_v, dense_table, seq_lens):
        """Put the dense cache's retrieval heads into the duo pages (same K/V for both kernels)."""
        stride, R = self.heads.stride, self.heads.num_retrieval
        for i, s in enumerate(seq_lens):
            n = triton.cdiv(s, BLOCK)
            src = dense_table[i, :n].long()
            dst = self.table[i, :n * stride:stride].long()
            self.cache[dst, 0, :, :R] = dense_k[src][:, :, self.heads.retrieval_kv]
            self.cache[dst, 1, :, :R] = dense_v[src][:, :, self.heads.retrieval_kv]

    def with_only(self, kind: str) -> LayerHeads:
        """The head maps with only the retrieval or only the streaming heads."""
        h = self.heads
        if kind == "streaming":
            return dataclasses.replace(h, retrieval_kv=h.retrieval_kv[:0], retrieval_q=h.retrieval_q[:0])
        return dataclasses.replace(h, streaming_kv=h.streaming_kv[:0], streaming_q=h.streaming_q[:0])


def random_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Normal values in `dtype`, drawn in bf16 chunks of 256M elements (an fp8 cache is not made at twice its size)."""
    pages = torch.empty(shape, dtype=dtype, device=DEV)
    step = max(1, 2 ** 28 // pages[0].numel())
    for i in range(0, shape[0], step):
        n = min(step, shape[0] - i)
        pages[i:i + n] = torch.randn((n, *shape[1:]), dtype=DTYPE, device=DEV).to(dtype)
    return pages


def dense_paged(seq_lens: list[int], heads: int = NUM_KV_HEADS, dtype: torch.dtype = DTYPE):
    """vLLM's FA layout: K and V `[num_blocks, block_size, heads, head_dim]`, scattered blocks."""
    counts = [triton.cdiv(s, BLOCK) for s in seq_lens]
    ids = torch.randperm(sum(counts), device=DEV).int()
    table = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32, device=DEV)
    offset = 0
    for i, n in enumerate(counts):
        table[i, :n] = ids[offset:offset + n]
        offset += n
    k = random_pages((sum(counts), BLOCK, heads, HEAD_DIM), dtype)
    v = random_pages(k.shape, dtype)
    return k, v, table


def copy_bandwidth() -> float:
    """Measured device-to-device copy rate in TB/s (read + write), the practical ceiling."""
    a = torch.empty(2 ** 30 // BYTES, dtype=DTYPE, device=DEV)
    b = torch.empty_like(a)
    return 2 * a.numel() * BYTES / (ms(lambda: b.copy_(a)) * 1e-3) / 1e12


def bench_decode(fa, rows, out_json, batch=32, context=32768):
    seq_lens = [context] * batch
    R, S = len(RETRIEVAL), NUM_KV_HEADS - len(RETRIEVAL)
    dense_k, dense_v, dense_table = dense_paged(seq_lens)
    duo = DuoLayout.build(seq_lens)
    duo.copy_retrieval_from(dense_k, dense_v, dense_table, seq_lens)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
    # the step's new K/V is the last token of the dense cache, so both sides see the same context
    last = torch.tensor([s - 1 for s in seq_lens], device=DEV)
    blk = dense_table[torch.arange(batch, device=DEV), last // BLOCK].long()
    key, value = dense_k[blk, last % BLOCK], dense_v[blk, last % BLOCK]
    out = torch.full_like(query, float("nan"))

    kv_token_bytes = 2 * HEAD_DIM * BYTES
    duo_bytes = sum(s * R + min(s, SINK + RECENT) * S for s in seq_lens) * kv_token_bytes
    dense_bytes = sum(seq_lens) * NUM_KV_HEADS * kv_token_bytes
    half_bytes = sum(seq_lens) * R * kv_token_bytes
    auto = decode_num_splits(batch, R, context, DEV)
    res = dict(batch=batch, context=context, auto_splits=auto, duo_kv_bytes=duo_bytes, dense_kv_bytes=dense_bytes,
               duo_floor_ms_at_copy_rate=duo_bytes / (out_json["copy_tbps"] * 1e9),
               dense_floor_ms_at_copy_rate=dense_bytes / (out_json["copy_tbps"] * 1e9))

    def duo_step(splits):
        return lambda: duo_attention_gpu(query, key, value, duo.cache, duo.heads, qsl, sl, duo.table, SCALE, out,
                                            1, context, splits)

    # correctness first: reference on two requests, from the cache state before the step
    before = duo.cache.clone()
    duo_step(auto)()
    ref = torch.zeros_like(query[:2])
    duo_attention(query[:2], key[:2], value[:2], before, duo.heads, [0, 1, 2], seq_lens[:2], duo.table[:2], SCALE, ref)
    res["check_vs_reference_rel_err"] = rel_err(out[:2], ref)
    del before

    cache_write.write_kv(key, value, duo.cache, duo.heads, qsl, sl, duo.table)
    for splits in sorted({auto, 4, 16}):
        t = ms(lambda: decode_attention(query, duo.cache, duo.heads, qsl, sl, duo.table, SCALE, out, splits))
        res[f"duo_decode_ms_splits{splits}"] = t
        rows.append(("decode", f"duo attention, {splits} splits", t, duo_bytes / t / 1e6))
    t = ms(duo_step(auto))
    res["duo_step_ms"] = t
    rows.append(("decode", f"duo step incl. cache writes ({auto} splits)", t, duo_bytes / t / 1e6))
    try:
        graph_ms = triton.testing.do_bench_cudagraph(duo_step(auto), rep=100, return_mode="median")
        res["duo_step_cudagraph_ms"] = graph_ms
        rows.append(("decode", "duo step, CUDA graph replay", graph_ms, duo_bytes / graph_ms / 1e6))
    except Exception as e:  # noqa: BLE001 - report and go on
        res["duo_step_cudagraph_error"] = repr(e)
        rows.append(("decode", f"duo step, CUDA graph FAILED: {e!r}"[:70], float("nan"), float("nan")))

    if fa is not None:
        cu_q = qsl
        fa_out = torch.empty_like(query)

        def fa_call(k, v, q, o):
            return lambda: fa(q, k, v, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=context, seqused_k=sl,
                              softmax_scale=SCALE, causal=True, block_table=dense_table, out=o)

        t = ms(fa_call(dense_k, dense_v, query, fa_out))
        res["fa_dense_ms"] = t
        rows.append(("decode", f"FA{fa.version} dense, {NUM_KV_HEADS} KV heads", t, dense_bytes / t / 1e6))
        rq = duo.heads.retrieval_q
        res["retrieval_heads_vs_fa_rel_err"] = rel_err(out[:, rq], fa_out[:, rq])
        k_half = dense_k[:, :, duo.heads.retrieval_kv].contiguous()
        v_half = dense_v[:, :, duo.heads.retrieval_kv].contiguous()
        q_half = query[:, rq].contiguous()
        t = ms(fa_call(k_half, v_half, q_half, torch.empty_like(q_half)))
        res["fa_retrieval_share_ms"] = t
        rows.append(("decode", f"FA{fa.version} on the {R} retrieval KV heads only", t, half_bytes / t / 1e6))
        del k_half, v_half
    out_json["decode"] = res


def bench_decode_fp8(fa, rows, out_json, shapes=((4, 65536), (32, 32768))):
    """Duo decode over fp8 pages and rings: fp16 vs bf16 multiplies, vs a bf16 cache, vs FA3 fp8 dense."""
    R = len(RETRIEVAL)
    results = []
    fp8 = torch.float8_e4m3fn
    quant = KVQuant(*(torch.ones((), device=DEV) for _ in range(3)))
    for batch, context in shapes:
        seq_lens = [context] * batch
        duo = DuoLayout.build(seq_lens)
        fp8_cache = duo.cache.to(fp8)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
        query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        key, value = (torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV) for _ in range(2))
        out = torch.empty_like(query)
        token_bytes = sum(s * R + min(s, SINK + RECENT) * (NUM_KV_HEADS - R) for s in seq_lens) * 2 * HEAD_DIM
        auto = decode_num_splits(batch, R, context, DEV)
        res = dict(batch=batch, context=context, auto_splits=auto, duo_fp8_kv_bytes=token_bytes)
        for label, cache, compute, bytes_per in (("bf16 cache", duo.cache, "fp16", 2),
                                                 ("fp8 cache, fp16 multiply", fp8_cache, "fp16", 1),
                                                 ("fp8 cache, bf16 multiply", fp8_cache, "model", 1)):
            cache_write.FP8_COMPUTE = compute
            cache_write.write_kv(key, value, cache, duo.heads, qsl, sl, duo.table, quant=quant)
            for splits in sorted({auto, 8, 16}):
                t = ms(lambda: decode_attention(query, cache, duo.heads, qsl, sl, duo.table, SCALE, out, splits,
                                                quant=quant))
                res[f"{label} splits{splits} ms"] = t
                rows.append((f"fp8 {batch}x{context // 1024}k", f"duo {label}, {splits} splits", t,
                             token_bytes * bytes_per / t / 1e6))
            if cache is fp8_cache:  # the whole step against the reference (fp32 over the same fp8 values)
                before = cache.clone()
                duo_attention_gpu(query, key, value, cache.clone(), duo.heads, qsl, sl, duo.table, SCALE, out, 1,
                                     context, auto, quant=quant)
                ref = torch.zeros_like(query[:2])
                duo_attention(query[:2], key[:2], value[:2], before, duo.heads, [0, 1, 2], seq_lens[:2],
                              duo.table[:2], SCALE, ref, quant=quant)
                res[f"{label} check_vs_reference_rel_err"] = rel_err(out[:2], ref)
                del before
        cache_write.FP8_COMPUTE = "fp16"
        del duo, fp8_cache
        if fa is not None:
            dense_k, dense_v, dense_table = dense_paged(seq_lens)
            dense_k, dense_v = dense_k.to(fp8), dense_v.to(fp8)
            shape = (batch, NUM_KV_HEADS)
            ones = torch.ones(shape, device=DEV)
            query_fp8 = query.to(fp8)
            t = ms(lambda: fa(query_fp8, dense_k, dense_v, max_seqlen_q=1, cu_seqlens_q=qsl, max_seqlen_k=context,
                              seqused_k=sl, softmax_scale=SCALE, causal=True, block_table=dense_table,
                              q_descale=ones, k_descale=ones, v_descale=ones))
            dense_bytes = sum(seq_lens) * NUM_KV_HEADS * 2 * HEAD_DIM
            res["fa_dense_fp8_ms"] = t
            rows.append((f"fp8 {batch}x{context // 1024}k", f"FA{fa.version} fp8 dense, {NUM_KV_HEADS} KV heads", t,
                         dense_bytes / t / 1e6))
            retrieval_kv = torch.tensor(RETRIEVAL, device=DEV)
            retrieval_q = torch.tensor([h * (NUM_HEADS // NUM_KV_HEADS) + g for h in RETRIEVAL
                                        for g in range(NUM_HEADS // NUM_KV_HEADS)], device=DEV)
            k_half, v_half = dense_k[:, :, retrieval_kv].contiguous(), dense_v[:, :, retrieval_kv].contiguous()
            q_half = query_fp8[:, retrieval_q].contiguous()
            half_ones = torch.ones((batch, R), device=DEV)
            t = ms(lambda: fa(q_half, k_half, v_half, max_seqlen_q=1, cu_seqlens_q=qsl, max_seqlen_k=context,
                              seqused_k=sl, softmax_scale=SCALE, causal=True, block_table=dense_table,
                              q_descale=half_ones, k_descale=half_ones, v_descale=half_ones))
            res["fa_retrieval_share_fp8_ms"] = t
            rows.append((f"fp8 {batch}x{context // 1024}k", f"FA{fa.version} fp8 on the {R} retrieval KV heads only", t,
                         dense_bytes / 2 / t / 1e6))
            del dense_k, dense_v, k_half, v_half
        torch.cuda.empty_cache()
        results.append(res)
    out_json["decode_fp8"] = results


def bench_prefill(fa, rows, out_json, lengths=(8192, 32768, 131072), chunk=8192):
    R = len(RETRIEVAL)
    results = []
    for T in lengths:
        torch.cuda.empty_cache()
        duo = DuoLayout.build([T])
        dense_k, dense_v, dense_table = dense_paged([T])
        query = torch.randn(T, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        key = torch.randn(T, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        value = torch.randn_like(key)
        pos = torch.arange(T, device=DEV)
        blk = dense_table[0, pos // BLOCK].long()
        dense_k[blk, pos % BLOCK] = key  # FA reads the same K/V as duo
        dense_v[blk, pos % BLOCK] = value
        qsl = torch.tensor([0, T], dtype=torch.int32, device=DEV)
        sl = torch.tensor([T], dtype=torch.int32, device=DEV)
        out = torch.full_like(query, float("nan"))
        res = dict(tokens=T, chunk=chunk)

        whole = lambda: duo_attention_gpu(query, key, value, duo.cache, duo.heads, qsl, sl, duo.table, SCALE,  # noqa: E731
                                             out, T, T)
        t = ms(whole)
        res["duo_layer_ms"] = t
        rows.append((f"prefill {T // 1024}k", "duo layer, whole prompt", t, float("nan")))
        for kind in ("streaming", "retrieval"):
            heads = duo.with_only(kind)
            t = ms(lambda: prefill_attention(query, duo.cache, heads, qsl, sl, duo.table, SCALE, out))
            res[f"duo_{kind}_heads_ms"] = t
            res[f"duo_{kind}_heads_us_per_token"] = t * 1e3 / T
            rows.append((f"prefill {T // 1024}k", f"duo {kind} heads only ({t * 1e6 / T:.2f} ns/token)", t,
                         float("nan")))

        chunks = []
        if T > chunk:
            for c in range(0, T, chunk):
                n = min(c + chunk, T)
                chunks.append((slice(c, n), torch.tensor([0, n - c], dtype=torch.int32, device=DEV),
                               torch.tensor([n], dtype=torch.int32, device=DEV), n))
            out_chunked = torch.full_like(query, float("nan"))

            def duo_chunked():
                for s, cq, cs, n in chunks:
                    duo_attention_gpu(query[s], key[s], value[s], duo.cache, duo.heads, cq, cs, duo.table, SCALE,
                                         out_chunked[s], s.stop - s.start, n)

            t = ms(duo_chunked)
            res["duo_layer_chunked_ms"] = t
            res["chunked_vs_whole_rel_err"] = rel_err(out_chunked, out)
            rows.append((f"prefill {T // 1024}k", f"duo layer, {chunk // 1024}k chunks", t, float("nan")))

        if fa is not None:
            fa_out = torch.empty_like(query)
            t = ms(lambda: fa(query, dense_k, dense_v, max_seqlen_q=T, cu_seqlens_q=qsl, max_seqlen_k=T, seqused_k=sl,
                              softmax_scale=SCALE, causal=True, block_table=dense_table, out=fa_out))
            res["fa_dense_ms"] = t
            res["retrieval_heads_vs_fa_rel_err"] = rel_err(out[:, duo.heads.retrieval_q], fa_out[:, duo.heads.retrieval_q])
            rows.append((f"prefill {T // 1024}k", f"FA{fa.version} dense causal, whole prompt", t, float("nan")))
            if chunks:
                def fa_chunked():
                    for s, cq, cs, n in chunks:
                        fa(query[s], dense_k, dense_v, max_seqlen_q=s.stop - s.start, cu_seqlens_q=cq, max_seqlen_k=n,
                           seqused_k=cs, softmax_scale=SCALE, causal=True, block_table=dense_table, out=fa_out[s])

                t = ms(fa_chunked)
                res["fa_dense_chunked_ms"] = t
                rows.append((f"prefill {T // 1024}k", f"FA{fa.version} dense causal, {chunk // 1024}k chunks", t,
                             float("nan")))
        res["retrieval_kv_heads"] = R
        results.append(res)
        del duo, dense_k, dense_v, query, key, value, out
    out_json["prefill"] = results


def host_us(fn, calls: int = 40, repeats: int = 5) -> float:
    """Host time to issue one call, in us: the calls queue behind a GPU sleep, so none waits for the device."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(100_000_000)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(times)[repeats // 2]


def launcher_host_us(module, name: str, call) -> tuple[float, float]:
    """Host us of kernel `name`'s launch in `call`, with the same arguments, two ways: through Triton's JIT dispatch
    (`kernel[grid](...)`: binder, key, lookup, checks; what `kernels/launch.py` skips after a specialization's first
    launch) and through Triton's compiled launcher alone (no binder, no lookup)."""
    kernel, seen = getattr(module, name), {}

    class Grab:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(grid=grid, args=args, kwargs=kwargs)

    with patch.object(module, name, Grab()):
        call()
    grid, args, kwargs = seen["grid"], seen["args"], seen["kwargs"]
    compiled = kernel[grid](*args, **kwargs)
    params = inspect.signature(kernel.fn).parameters
    bound = dict(zip(params, args))
    bound.update({key: value for key, value in kwargs.items() if key in params})
    launcher = compiled[tuple(grid) + (1,) * (3 - len(grid))]  # the compiled launcher takes 3 dims
    ordered = [bound[param] for param in params]
    return host_us(lambda: kernel[grid](*args, **kwargs)), host_us(lambda: launcher(*ordered))


def device_ms(fn) -> float:
    """Device time of one call: a CUDA graph replay where the call can be captured (no host cost in it)."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    except Exception:  # noqa: BLE001 - FlashAttention's varlen path may refuse capture: time it eagerly
        torch.cuda.synchronize()
        return ms(fn)


def python_top(fn, calls: int = 50, top: int = 10) -> list[dict]:
    """cProfile of `calls` calls: the functions with the most own time, per call."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(lambda: [fn() for _ in range(calls)])
    torch.cuda.synchronize()
    stats = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [{"function": f"{path.rsplit('/', 1)[-1]}:{line}({name})", "own_us_per_call": own * 1e6 / calls}
            for (path, line, name), (_, _, own, _, _) in stats]


# Mixed batches of one layer (issue 22): (name, per request (context after the step, new tokens)).
MIXED_CASES = (("decode 4 x 1k (a CUDA graph when served)", [(1024, 1)] * 4),
               ("decode 32 x 1k (a CUDA graph when served)", [(1024, 1)] * 32),
               ("decode 4 x 4k (a CUDA graph when served)", [(4096, 1)] * 4),
               ("decode 32 x 4k (a CUDA graph when served)", [(4096, 1)] * 32),
               ("decode 4 x 64k (a CUDA graph when served)", [(65536, 1)] * 4),
               ("decode 256 x 1k (a saturated GPU: do splits cost more than they give?)", [(1024, 1)] * 256),
               ("burst 8 x 1k prefill", [(1024, 1024)] * 8),
               ("burst 2 x 4k prefill", [(4096, 4096)] * 2),
               ("15 decode 16k + 384 after a 16k hit", [(16000, 1)] * 15 + [(16384, 384)]),
               ("31 decode 1k + 256 prefill", [(1024, 1)] * 31 + [(256, 256)]))
SERVED_MAX_MODEL_LEN = 99000  # tpot_sweep's and short_itl's server
# decode.MAX_PARTS_MERGED_IN_LAUNCH for the variants: every split head merged in the decode launch, or none
MERGE_VARIANTS = {"every_split_merged_in_the_decode_launch": 1 << 20, "every_split_merged_by_a_second_launch": 0}
DECODE_MIN_SPLITS = (64, 128, 256)  # kernels/decode.py's shortest split: MIN_SPLIT_TOKENS and shorter ones
# Tile shapes tried for the streaming heads' prefill (kernels/prefill.py's _prefill_config: the first is its H100
# choice for head_dim 128, 64/32/4/2 the one for launches that store the step's K/V too).
PREFILL_CONFIGS = (dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
                   dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2),
                   dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=2),
                   dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=1),  # 2 stages need 288 KB of shared memory
                   dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                   dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=1),
                   dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
                   dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3),
                   dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
                   dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
                   dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=3),
                   dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=3),
                   dict(BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=2),
                   dict(BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=1))


def bench_decode_splits(query, duo: DuoLayout, qsl, sl, out, name: str, T: int, rows) -> list[dict]:
    """One layer's decode attention (cache already written) at each shortest split of DECODE_MIN_SPLITS: all heads,
    each kind alone, and the streaming heads in one program each (the kernel before their splits); the error
    against the default split."""
    splits = decode_num_splits(qsl.shape[0] - 1, duo.heads.num_retrieval, SERVED_MAX_MODEL_LEN, DEV)
    decode_attention(query, duo.cache, duo.heads, qsl, sl, duo.table, SCALE, out, splits)
    reference = out.clone()
    one_program = device_ms(lambda: decode_attention(query, duo.cache, duo.heads, qsl, sl, duo.table, SCALE, out, 1,
                                                     streaming_only=True))
    rows.append((f"mixed {T}", f"{name}: streaming heads, one program each", one_program, float("nan")))
    results = [dict(splits=splits, streaming_one_program_ms=one_program)]
    for min_split in DECODE_MIN_SPLITS:
        res = dict(min_split=min_split)
        for label, heads in (("all", duo.heads), ("retrieval", duo.with_only("retrieval")),
                             ("streaming", duo.with_only("streaming"))):
            res[f"{label}_ms"] = device_ms(lambda h=heads: decode_attention(
                query, duo.cache, h, qsl, sl, duo.table, SCALE, out, splits, min_split=min_split))
            rows.append((f"mixed {T}", f"{name}: decode {label} heads, split >= {min_split}", res[f"{label}_ms"],
                         float("nan")))
        decode_attention(query, duo.cache, duo.heads, qsl, sl, duo.table, SCALE, out, splits, min_split=min_split)
        res["rel_err_vs_default"] = rel_err(out, reference)
        results.append(res)
    return results


def bench_mixed(fa, rows, out_json):
    """One layer's attention over mixed batches, duo vs dense (cache write + FA3) as vLLM runs them eagerly
    between piecewise CUDA graphs: device time, host time to issue, and where duo's host time goes. Then
    the streaming heads' prefill over the tile shapes of PREFILL_CONFIGS."""
    from vllm import _custom_ops as ops
    from vllm.vllm_flash_attn import get_scheduler_metadata
    from vllm_duo.kernels import decode as decode_module
    from vllm_duo.kernels import prefill as prefill_module
    from vllm_duo.gpu_attention import retrieval_flash_attention

    results = []
    for name, batch in MIXED_CASES:
        seq_lens = [s for s, _ in batch]
        new = [n for _, n in batch]
        T = sum(new)
        duo = DuoLayout.build(seq_lens, retrieval=list(range(len(RETRIEVAL))))  # reordered at load, as served
        heads = duo.heads
        retrieval_table = duo.table[:, ::heads.stride].contiguous()
        dense_k, dense_v, dense_table = dense_paged(seq_lens)
        qsl = torch.tensor([0] + list(itertools.accumulate(new)), dtype=torch.int32, device=DEV)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
        positions = torch.cat([torch.arange(s - n, s, device=DEV) for s, n in batch])
        request = torch.cat([torch.full((n,), i, device=DEV) for i, n in enumerate(new)])
        slots = (dense_table[request, positions // BLOCK].long() * BLOCK + positions % BLOCK).long()
        # views of one fused qkv, as vLLM's attention layers get them
        qkv = torch.randn(T, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=DTYPE, device=DEV)
        query, key, value = (part.view(T, -1, HEAD_DIM) for part in qkv.split(
            [NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=1))
        out, fa_out = torch.empty_like(query), torch.empty_like(query)
        one = torch.ones((), dtype=torch.float32, device=DEV)
        max_q, max_s = max(new), max(seq_lens)

        bound = max_s if max_q > 1 else SERVED_MAX_MODEL_LEN  # decode batches size their splits for max_model_len

        # multi-token batches: FlashAttention's schedule is made by the step's first layer of this retrieval-head
        # count and reused by the others (the common case, timed as "duo layer"); made on every call: a row below
        schedules = {}

        # as served: the inputs checked and FlashAttention's page views made at the layer's first call, the batch
        # checked at the step's build
        pages = retrieval_page_views(duo.cache, heads)

        def duo_layer(make_schedule=False, store_in_streaming=True, checked=True):
            duo_attention_gpu(query, key, value, duo.cache, heads, qsl, sl, duo.table, SCALE, out, max_q, bound,
                              retrieval_table=retrieval_table, flash_schedules={} if make_schedule else schedules,
                              store_in_streaming=store_in_streaming, checked=checked,
                              flash_pages=pages if checked else None)

        dense_schedule = None  # as vLLM's FLASH_ATTN: FA3's tile schedule made once per step, for every layer
        if fa.version == 3:
            dense_schedule = get_scheduler_metadata(
                batch_size=len(batch), max_seqlen_q=max_q, max_seqlen_k=max_s, num_heads_q=NUM_HEADS,
                num_heads_kv=NUM_KV_HEADS, headdim=HEAD_DIM, cache_seqlens=sl, qkv_dtype=DTYPE, cu_seqlens_q=qsl,
                page_size=BLOCK, causal=True)

        def dense_layer():
            ops.reshape_and_cache_flash(key, value, dense_k, dense_v, slots, "auto", one, one)
            fa(query, dense_k, dense_v, max_seqlen_q=max_q, cu_seqlens_q=qsl, max_seqlen_k=max_s, seqused_k=sl,
               softmax_scale=SCALE, causal=True, block_table=dense_table, out=fa_out, scheduler_metadata=dense_schedule)

        res = dict(case=name, tokens=T, requests=len(batch))
        duo_layer()  # eagerly, so that the schedules are made outside the CUDA graphs the timings capture
        torch.cuda.synchronize()
        for side, fn in (("duo", duo_layer), ("dense", dense_layer)):
            res[f"{side}_device_ms"] = device_ms(fn)
            res[f"{side}_host_us"] = host_us(fn)
        print(f"{name}: layer device ms / host us: duo {res['duo_device_ms']:.3f} / {res['duo_host_us']:.0f}, dense "
              f"{res['dense_device_ms']:.3f} / {res['dense_host_us']:.0f}", flush=True)  # kept if the call is cut
        res["duo_host_us_checking_every_call"] = host_us(lambda: duo_layer(checked=False))
        rows.append((f"mixed {T}", f"{name}: duo layer checking its inputs, making its page views every call, host "
                     f"us/call {res['duo_host_us_checking_every_call']:.0f}", float("nan"), float("nan")))
        if max_q > 1:  # the step's K/V stored by its own launch first (write_kv), not by the streaming heads'
            apart = functools.partial(duo_layer, store_in_streaming=False)
            res["duo_stored_apart_device_ms"], res["duo_stored_apart_host_us"] = device_ms(apart), host_us(apart)
            rows.append((f"mixed {T}", f"{name}: duo layer, K/V stored apart, device (host us/call "
                         f"{res['duo_stored_apart_host_us']:.0f})", res["duo_stored_apart_device_ms"], float("nan")))
            res["duo_host_us_making_the_schedule"] = host_us(lambda: duo_layer(make_schedule=True))
            rows.append((f"mixed {T}", f"{name}: duo layer making FA3's schedule, host us/call "
                         f"{res['duo_host_us_making_the_schedule']:.0f}", float("nan"), float("nan")))

        def streaming(into, fresh_kv=(key, value), store=False):  # fresh prompts' keys from the step's K/V
            prefill_attention(query, duo.cache, heads, qsl, sl, duo.table, SCALE, into, streaming_only=True,
                              fresh_kv=fresh_kv, store=store)

        res["duo_write_kv_ms"] = device_ms(lambda: cache_write.write_kv(key, value, duo.cache, heads, qsl, sl,
                                                                        duo.table))
        # each launch alone (checks skipped, as duo_attention_gpu's checked calls): its kernel's module and name, call
        launches = {"write_kv": (cache_write, "_write_kv_kernel", lambda: cache_write.write_kv(
            key, value, duo.cache, heads, qsl, sl, duo.table, checked=True))}
        if max_q > 1:
            for label, store in (("streaming prefill", False), ("streaming prefill storing the step", True)):
                launches[label] = (prefill_module, "_prefill_kernel", lambda store=store: prefill_attention(
                    query, duo.cache, heads, qsl, sl, duo.table, SCALE, out, streaming_only=True, checked=True,
                    fresh_kv=(key, value), store=store))
        res["launch_host_us"] = {label: host_us(call) for label, (_, _, call) in launches.items()}
        rows.append((f"mixed {T}", f"{name}: host us/launch as served (kernels/launch.py) " + ", ".join(
            f"{label} {us:.0f}" for label, us in res["launch_host_us"].items()), float("nan"), float("nan")))
        res["triton_dispatch_host_us"], res["launcher_host_us"] = {}, {}
        try:  # the same launches through Triton's JIT dispatch, and through its compiled launcher alone
            for label, (module, kernel, call) in launches.items():
                res["triton_dispatch_host_us"][label], res["launcher_host_us"][label] = launcher_host_us(
                    module, kernel, call)
        except Exception as e:  # noqa: BLE001 - another Triton's launcher API: note it, go on
            res["launcher_host_us"]["error"] = repr(e)[:200]
        for field, what in (("triton_dispatch_host_us", "Triton's JIT dispatch, kernel[grid]"),
                            ("launcher_host_us", "Triton's compiled launcher alone")):
            rows.append((f"mixed {T}", f"{name}: host us/launch, {what} " + ", ".join(
                f"{label} {us:.0f}" if isinstance(us, float) else f"{label} {us}"
                for label, us in res[field].items()), float("nan"), float("nan")))
        res["duo_streaming_prefill_ms"] = device_ms(lambda: streaming(out))
        if max_q > 1:  # as served: the same launch stores the step's K/V; then every key from the page groups
            res["duo_streaming_prefill_storing_ms"] = device_ms(lambda: streaming(out, store=True))
            rows.append((f"mixed {T}", f"{name}: duo streaming_prefill storing the step (as served)",
                         res["duo_streaming_prefill_storing_ms"], float("nan")))
            res["duo_streaming_prefill_paged_ms"] = device_ms(lambda: streaming(out, fresh_kv=None))
            rows.append((f"mixed {T}", f"{name}: duo streaming_prefill, all keys from the page groups",
                         res["duo_streaming_prefill_paged_ms"], float("nan")))
        res["duo_retrieval_fa3_ms"] = device_ms(lambda: retrieval_flash_attention(
            fa, query, duo.cache, heads, qsl, sl, retrieval_table, SCALE, out, max_q, max_s,
            schedules=schedules if max_q > 1 else None))  # as duo_attention_gpu: none in decode (graphs)
        R = heads.num_retrieval
        if seq_lens == new:  # prompts from scratch: how fast FA3 takes the streaming heads' window (no sinks)
            res["fa3_streaming_window_ms"] = device_ms(lambda: fa(
                query[:, R * heads.group_size:], key[:, R:], value[:, R:], max_seqlen_q=max_q, cu_seqlens_q=qsl,
                max_seqlen_k=max_q, cu_seqlens_k=qsl, softmax_scale=SCALE, causal=True, window_size=(RECENT - 1, 0),
                return_softmax_lse=True))
            rows.append((f"mixed {T}", f"{name}: FA3 window on the streaming heads (no sinks: a bound)",
                         res["fa3_streaming_window_ms"], float("nan")))
        if max_q > 1:  # FlashAttention's host time on the retrieval heads: as duo calls it, then one input at a time
            RG = R * heads.group_size                  # made contiguous, to find what costs (issue 22)
            k_view, v_view, q_view, o_view = duo.cache[:, 0, :, :R], duo.cache[:, 1, :, :R], query[:, :RG], out[:, :RG]
            variants = {"as duo calls it": (q_view, k_view, v_view, o_view),
                        "q contiguous": (q_view.contiguous(), k_view, v_view, o_view),
                        "k/v contiguous": (q_view, k_view.contiguous(), v_view.contiguous(), o_view),
                        "out contiguous": (q_view, k_view, v_view, o_view.contiguous())}
            res["fa3_retrieval_host_us"] = {}
            for label, (q, k, v, o) in variants.items():
                res["fa3_retrieval_host_us"][label] = host_us(lambda q=q, k=k, v=v, o=o: fa(
                    q, k, v, max_seqlen_q=max_q, cu_seqlens_q=qsl, max_seqlen_k=max_s, seqused_k=sl,
                    softmax_scale=SCALE, causal=True, block_table=retrieval_table, out=o))
                rows.append((f"mixed {T}", f"{name}: FA3 retrieval, {label}, host us/call "
                             f"{res['fa3_retrieval_host_us'][label]:.0f}", float("nan"), float("nan")))
            del variants
        else:  # decode: the launch lasts as long as its longest chain of tiles; which is it, and do shorter splits help
            res["duo_decode"] = bench_decode_splits(query, duo, qsl, sl, out, name, T, rows)
            for label, most_parts in MERGE_VARIANTS.items():
                with patch.object(decode_module, "MAX_PARTS_MERGED_IN_LAUNCH", most_parts):
                    res[f"duo_{label}_device_ms"] = device_ms(duo_layer)
                rows.append((f"mixed {T}", f"{name}: duo layer, {label.replace('_', ' ')}",
                             res[f"duo_{label}_device_ms"], float("nan")))
        res["duo_python"] = python_top(duo_layer)
        res["dense_python"] = python_top(dense_layer)
        for side in ("duo", "dense"):
            rows.append((f"mixed {T}", f"{name}: {side} layer, device", res[f"{side}_device_ms"], float("nan")))
            rows.append((f"mixed {T}", f"{name}: {side} layer, host us/call {res[f'{side}_host_us']:.0f}",
                         res[f"{side}_host_us"] / 1e3, float("nan")))
        for part in ("write_kv", "streaming_prefill", "retrieval_fa3"):
            rows.append((f"mixed {T}", f"{name}: duo {part}", res[f"duo_{part}_ms"], float("nan")))

        if max_q > 1:
            reference = out.clone()
            streaming(reference)
            default_config = prefill_module._prefill_config
            res["streaming_prefill_configs"] = []
            try:
                for config in PREFILL_CONFIGS:
                    prefill_module._prefill_config = lambda head_dim, device, store=False, c=config: dict(c)
                    trial = out.clone()
                    try:
                        streaming(trial)
                        err = rel_err(trial[:, heads.streaming_q], reference[:, heads.streaming_q])
                        t = device_ms(lambda: streaming(trial))
                        t_store = device_ms(lambda: streaming(trial, store=True))  # as served
                    except Exception as e:  # noqa: BLE001 - a shape that does not compile: note it, go on
                        err, t, t_store = repr(e)[:200], float("nan"), float("nan")
                    res["streaming_prefill_configs"].append(dict(config, ms=t, storing_ms=t_store, rel_err=err))
                    shape = "/".join(str(v) for v in config.values())
                    rows.append((f"mixed {T}", f"{name}: streaming {shape}", t, float("nan")))
                    rows.append((f"mixed {T}", f"{name}: streaming {shape} storing the step", t_store, float("nan")))
            finally:
                prefill_module._prefill_config = default_config
        results.append(res)
        del duo, dense_k, dense_v
        torch.cuda.empty_cache()
    out_json["mixed"] = results


# Long decode (issue 32): (batch, context, cache dtype) of whole 32-layer decode steps, each one CUDA graph replay.
LONG_DECODE_SHAPES = ((4, 65536, torch.float8_e4m3fn), (4, 131072, torch.float8_e4m3fn), (4, 65536, DTYPE))
LONG_DECODE_FLASH_SPLITS = (4, 8, 16, 64)  # FLASH_MAX_SPLITS tried besides the served 32
# Triton decode tiles tried over fp8 pages (decode.FP8_DECODE_TILES): the 16-bit tiles first, then the served 5
# stages, then others. Over fp8 (sm_90 compile, this Triton) the 16-bit tiles take 180 registers and 37 KB of shared
# memory: 2 programs an SM with 74 KB of pages in flight, where bf16's take 142 and 70 KB (3 programs, 210 KB); more
# stages or wider tiles at 8 warps raise what is in flight without spills (the served ones: 194 registers, 70.6 KB;
# 128 keys at 4 warps spill)
LONG_DECODE_FP8_TILES = tuple(DecodeTiles(block_n, MIN_SPLIT_TOKENS, stages, warps) for block_n, stages, warps in
                              ((64, 3, 4), (64, 5, 4), (64, 8, 4), (128, 4, 8), (128, 6, 8), (256, 2, 8)))
LONG_DECODE_REPLAYS = 20
DENSE_GRAPH_SPLITS = 32  # vLLM's FLASH_ATTN max_num_splits under full CUDA graphs


def capture(fn) -> torch.cuda.CUDAGraph:
    """`fn` in a CUDA graph, after one eager call on a side stream (compiles, autotunes, makes FA3 schedules)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = LONG_DECODE_REPLAYS) -> float:
    """Median device time of a replay: CUDA events around each of `reps` back-to-back replays."""
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) for start, end in events)[reps // 2]


def kernel_profile(graph: torch.cuda.CUDAGraph, eager, steps: int = 10, top: int = 15) -> dict:
    """The torch profiler over `steps` replays: per kernel, calls and device us per step. If the replays show no
    kernels (a profiler that sees only the graph launch), over eager steps instead: the same kernels."""
    from torch.profiler import ProfilerActivity, profile

    def device_time(event) -> float:
        return getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0))

    def run(source):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                if source == "graph replays":
                    graph.replay()
                else:
                    eager()
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.key_averages() if device_time(e) > 0), key=device_time, reverse=True)
        return dict(source=source, device_us_per_step=sum(device_time(e) for e in kernels) / steps,
                    launches_per_step=sum(e.count for e in kernels) / steps,
                    kernels=[dict(name=e.key[:90], calls_per_step=e.count / steps, us_per_step=device_time(e) / steps)
                             for e in kernels[:top]])

    result = run("graph replays")
    return result if len(result["kernels"]) > 2 else run("eager steps")


def timed_graph(res: dict, rows: list, case: str, label: str, fn, nbytes: float = float("nan"), keep: bool = False):
    """ms per step of `fn` as one CUDA graph replay into `res["variants_ms"]` and a row (a failure noted in
    `res["errors"]`, the other variants still timed); the graph if `keep`."""
    graph = None
    try:
        graph = capture(fn)
        t = replay_ms(graph)
    except Exception:  # noqa: BLE001 - note the failure, time the other variants
        res["errors"][label] = traceback.format_exc()
        print(f"{case} {label} failed:\n{res['errors'][label]}", file=sys.stderr)
        t = float("nan")
    res["variants_ms"][label] = t
    rows.append((case, label, t, nbytes / t / 1e6))
    return graph if keep else None


def print_kernels(title: str, profile: dict) -> None:
    """`kernel_profile`'s result, a kernel a line."""
    print(f"\n{title} ({profile['source']}): {profile['device_us_per_step']:.0f} us, "
          f"{profile['launches_per_step']:.0f} launches per step")
    for k in profile["kernels"]:
        print(f"  {k['us_per_step']:9.1f} us {k['calls_per_step']:5.0f} x  {k['name']}")


def layer_timeline(graph: torch.cuda.CUDAGraph, marker: str = "_centroid_logits_kernel", layer: int = 2) -> list[dict]:
    """One layer of a graph replay as the GPU ran it, from the profiler's trace: each kernel's start and end in us
    from the layer's `marker` kernel (the layer: from 3 us before its marker to 3 us before the next one) and its
    stream."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    marks = [e["ts"] for e in kernels if marker in e["name"]]
    if len(marks) < layer + 2:
        return []
    lo, hi = marks[layer] - 3, marks[layer + 1] - 3
    return [dict(start_us=round(e["ts"] - marks[layer], 2), end_us=round(e["ts"] + e["dur"] - marks[layer], 2),
                 stream=e.get("args", {}).get("stream", e.get("tid")), name=e["name"][:70])
            for e in kernels if lo <= e["ts"] < hi]


def print_timeline(title: str, timeline: list[dict]) -> None:
    """`layer_timeline`'s kernels, one a line."""
    print(f"\n{title} (start, end us; stream)")
    for k in timeline:
        print(f"  {k['start_us']:8.2f} {k['end_us']:8.2f}  {k['stream']!s:>4}  {k['name']}")


def layouts_per_count(seq_lens: list[int], counts: list[int], cache_dtype: torch.dtype, columns: int):
    """One DuoLayout per retrieval-head count (layers with the same count share its cache) and its retrieval
    pages' block table, `columns` wide as vLLM's (max_model_len)."""
    layouts, retrieval_tables = {}, {}
    for R in sorted(set(counts)):
        d = layouts[R] = DuoLayout.build(seq_lens, retrieval=list(range(R)), dtype=cache_dtype)
        pages = d.table[:, ::d.heads.stride]
        retrieval_tables[R] = torch.zeros(len(seq_lens), columns, dtype=torch.int32, device=DEV)
        retrieval_tables[R][:, :pages.shape[1]] = pages
    return layouts, retrieval_tables


def bench_long_decode(fa, rows, out_json):
    """Whole 32-layer decode steps at batch 4 x 64k / 128k as served (one full CUDA graph each): duo with the
    reference pattern's per-layer retrieval heads (sparsity 0.5, reordered) vs dense's cache write + FA3, then
    variants of duo's step that show where its time goes, and the kernels of both steps."""
    from vllm import _custom_ops as ops
    from vllm.vllm_flash_attn import get_scheduler_metadata
    from vllm_duo import gpu_attention, vllm_seam
    from vllm_duo.gpu_attention import retrieval_flash_attention
    from vllm_duo.kernels import decode as decode_module
    from vllm_duo.kernels.attention import triton_attention
    from vllm_duo.pattern import resolve_pattern

    pattern, _ = resolve_pattern("Meta-Llama-3.1-8B-Instruct")
    counts = pattern.retrieval_counts(0.5)
    fa3 = vllm_seam.flash_attn_varlen()  # as duo_attention_gpu calls it: None off Hopper
    results = []
    out_json["long_decode"] = results
    for batch, context, cache_dtype in LONG_DECODE_SHAPES:
        fp8 = cache_dtype == torch.float8_e4m3fn
        case = f"{'fp8' if fp8 else 'bf16'} {batch}x{context // 1024}k"
        max_len = context + 1024  # as served: decode sizes its splits for max_model_len
        seq_lens = [context] * batch
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
        query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        key, value = (torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV) for _ in range(2))
        outs = torch.zeros(len(counts), batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)  # one per layer
        one = torch.ones((), dtype=torch.float32, device=DEV)
        quant = KVQuant(one, one, one) if fp8 else None
        columns = triton.cdiv(max_len, BLOCK)  # vLLM's block tables are as wide as max_model_len

        layouts, retrieval_tables = layouts_per_count(seq_lens, counts, cache_dtype, columns)
        splits = {R: decode_num_splits(batch, R, max_len, DEV) for R in layouts}
        retrieval_only = {R: d.with_only("retrieval") for R, d in layouts.items()}
        bytes_per = 1 if fp8 else BYTES
        duo_bytes = sum(batch * (context * R + min(context, SINK + RECENT) * (NUM_KV_HEADS - R)) for R in counts) \
            * 2 * HEAD_DIM * bytes_per
        dense_bytes = len(counts) * batch * context * NUM_KV_HEADS * 2 * HEAD_DIM * bytes_per
        res = dict(case=case, batch=batch, context=context, max_model_len=max_len, cache_dtype=str(cache_dtype),
                   retrieval_counts=counts, duo_splits=splits, duo_kv_bytes=duo_bytes, dense_kv_bytes=dense_bytes,
                   variants_ms={}, errors={})

        def duo_step():
            for i, R in enumerate(counts):
                d = layouts[R]
                duo_attention_gpu(query, key, value, d.cache, d.heads, qsl, sl, d.table, SCALE, outs[i], 1, max_len,
                                  quant=quant, retrieval_table=retrieval_tables[R])

        def duo_parts(write=True, retrieval=None, streaming=True, overlap=False, schedules=None):
            """A duo step of chosen parts: the cache write, the retrieval heads (by "fa3" as served for fp8, or
            "triton"), the streaming heads (Triton decode); `overlap` runs the streaming heads on a second stream
            beside the retrieval heads (gpu_attention.beside, as served)."""
            def step():
                for i, R in enumerate(counts):
                    d, out = layouts[R], outs[i]
                    if write:
                        cache_write.write_kv(key, value, d.cache, d.heads, qsl, sl, d.table, quant=quant)
                    streaming_part = (functools.partial(triton_attention, query, d.cache, d.heads, qsl, sl, d.table,
                                                        SCALE, out, 1, splits[R], d.cache, quant, streaming_only=True)
                                      if streaming and d.heads.num_streaming else None)
                    retrieval_part = (
                        functools.partial(retrieval_flash_attention, fa3, query, d.cache, d.heads, qsl, sl,
                                          retrieval_tables[R], SCALE, out, 1, max_len, quant,
                                          num_splits=min(splits[R], gpu_attention.FLASH_MAX_SPLITS),
                                          schedules=schedules) if retrieval == "fa3"
                        else functools.partial(decode_attention, query, d.cache, retrieval_only[R], qsl, sl, d.table,
                                               SCALE, out, splits[R], quant=quant) if retrieval == "triton" else None)
                    if overlap and streaming_part and retrieval_part:
                        gpu_attention.beside(streaming_part, retrieval_part, DEV)
                        continue
                    for part in (retrieval_part, streaming_part):
                        if part:
                            part()
            return step

        timed = functools.partial(timed_graph, res, rows, case)

        # dense, as vLLM 0.26's FLASH_ATTN runs it in a full CUDA graph: cache write, q quantized (fp8), FA3 with
        # the step's schedule made outside the graph and 32 splits
        dense_k, dense_v, dense_table = dense_paged(seq_lens, dtype=cache_dtype)
        dense_table = torch.nn.functional.pad(dense_table, (0, columns - dense_table.shape[1]))
        last = sl.long() - 1
        slots = dense_table[torch.arange(batch, device=DEV), last // BLOCK].long() * BLOCK + last % BLOCK
        k_store, v_store = (dense_k.view(torch.uint8), dense_v.view(torch.uint8)) if fp8 else (dense_k, dense_v)
        dense_outs = torch.zeros_like(outs)
        descales = {}
        if fp8:
            shape = (batch, NUM_KV_HEADS)
            descales = dict(q_descale=one.expand(shape), k_descale=one.expand(shape), v_descale=one.expand(shape))
        q_scale = torch.ones(1, dtype=torch.float32, device=DEV)
        dense_graph = duo_graph = dense_step = None
        if fa is not None and fa.version == 3:
            schedule = get_scheduler_metadata(
                batch_size=batch, max_seqlen_q=1, max_seqlen_k=context, num_heads_q=NUM_HEADS,
                num_heads_kv=NUM_KV_HEADS, headdim=HEAD_DIM, cache_seqlens=sl, qkv_dtype=cache_dtype,
                cu_seqlens_q=qsl, page_size=BLOCK, causal=True, num_splits=DENSE_GRAPH_SPLITS)

            def dense_step():
                for i in range(len(counts)):
                    ops.reshape_and_cache_flash(key, value, k_store, v_store, slots, "fp8" if fp8 else "auto", one,
                                                one)
                    q = query
                    if fp8:
                        q = ops.scaled_fp8_quant(query.reshape(batch, -1), q_scale)[0].view(query.shape)
                    fa(q, dense_k, dense_v, max_seqlen_q=1, cu_seqlens_q=qsl, max_seqlen_k=context, seqused_k=sl,
                       softmax_scale=SCALE, causal=True, block_table=dense_table, out=dense_outs[i],
                       scheduler_metadata=schedule, num_splits=DENSE_GRAPH_SPLITS, **descales)

            dense_graph = timed("dense", dense_step, dense_bytes, keep=True)

        # duo as served; its graph against eager steps (same kernels: a capture check)
        duo_step()
        torch.cuda.synchronize()
        eager = outs.clone()
        duo_graph = timed("duo", duo_step, duo_bytes, keep=True)
        if duo_graph is not None:
            outs.fill_(float("nan"))
            duo_graph.replay()
            res["duo_graph_vs_eager_rel_err"] = rel_err(outs, eager)
        res["dense_ms"], res["duo_ms"] = res["variants_ms"].get("dense", float("nan")), res["variants_ms"]["duo"]
        res["dense_over_duo"] = res["dense_ms"] / res["duo_ms"]

        timed("write only", duo_parts(retrieval=None, streaming=False))
        timed("streaming only (Triton)", duo_parts(write=False, streaming=True))
        for label, most_parts in MERGE_VARIANTS.items():
            with patch.object(decode_module, "MAX_PARTS_MERGED_IN_LAUNCH", most_parts):
                timed(f"duo, {label.replace('_', ' ')}", duo_step, duo_bytes)
                timed(f"streaming only (Triton), {label.replace('_', ' ')}", duo_parts(write=False, streaming=True))
        if fp8 and fa3 is not None:
            for cap in LONG_DECODE_FLASH_SPLITS:
                with patch.object(gpu_attention, "FLASH_MAX_SPLITS", cap):
                    timed(f"duo, FA3 splits {cap}", duo_step, duo_bytes)
            timed("retrieval only (FA3)", duo_parts(write=False, retrieval="fa3", streaming=False))
            # could Triton's decode read the fp8 pages faster than FA3 with other tiles (it reads bf16 ones at ~83%
            # of nominal)? The retrieval heads alone per tile, then every head by Triton (as bf16 is served) with
            # the fastest, checked against the eager step
            triton_ms = {}
            for tiles in LONG_DECODE_FP8_TILES:
                with patch.object(decode_module, "FP8_DECODE_TILES", tiles):
                    label = f"retrieval only (Triton), {tiles.block_n} keys, {tiles.stages} stages, {tiles.warps} warps"
                    timed(label, duo_parts(write=False, retrieval="triton", streaming=False))
                    triton_ms[tiles] = res["variants_ms"][label]
            fastest = min(triton_ms, key=lambda t: (triton_ms[t] != triton_ms[t], triton_ms[t]))  # NaN (failed) last
            res["fp8_triton_fastest_tiles"] = fastest._asdict()
            with (patch.object(decode_module, "FP8_DECODE_TILES", fastest),
                  patch.object(gpu_attention, "FLASH_DTYPES", {(DTYPE, DTYPE)})):  # no FA3 over fp8
                label = "duo, every head by Triton (fastest tiles), no FA3"
                graph = timed(label, duo_step, duo_bytes, keep=True)
                if graph is not None:
                    outs.fill_(float("nan"))
                    graph.replay()
                    res[f"{label} vs eager rel_err"] = rel_err(outs, eager)
                del graph
            # as served before the write's launch quantized the queries: K/V stored, then the queries' own launch
            timed("duo, queries quantized by a launch of their own", duo_parts(retrieval="fa3", overlap=True),
                  duo_bytes)
            timed("duo, FA3 with a step schedule", duo_parts(retrieval="fa3", schedules={}, overlap=True), duo_bytes)
            timed("duo, streaming after FA3 on one stream", duo_parts(retrieval="fa3"), duo_bytes)
            overlapped = None  # served: the streaming heads already run beside FA3
        else:  # bf16 as served: Triton decodes every head; would FA3 on the retrieval heads help?
            timed("retrieval only (Triton)", duo_parts(write=False, retrieval="triton", streaming=False))
            overlapped = None
            if fa3 is not None:
                timed("retrieval only (FA3)", duo_parts(write=False, retrieval="fa3", streaming=False))
                timed("duo, FA3 retrieval + Triton streaming", duo_parts(retrieval="fa3"), duo_bytes)
                overlapped = duo_parts(retrieval="fa3", overlap=True)
        if overlapped is not None:
            graph = timed("duo, streaming on a 2nd stream", overlapped, duo_bytes, keep=True)
            if graph is not None:
                outs.fill_(float("nan"))
                graph.replay()
                res["overlap_vs_eager_rel_err"] = rel_err(outs, eager)
            del graph

        res["profiles"] = {}
        for name, graph, eager_step in (("dense", dense_graph, dense_step), ("duo", duo_graph, duo_step)):
            if graph is not None:
                res["profiles"][name] = profile = kernel_profile(graph, eager_step)
                print_kernels(f"{case} {name} step kernels", profile)
        results.append(res)
        del dense_graph, duo_graph, layouts, retrieval_tables, retrieval_only, dense_k, dense_v, k_store, v_store
        torch.cuda.empty_cache()


SQUEEZE_SHAPES = ((4, 65536), (4, 131072))  # fp8 caches, as issue 33's speed target
SQUEEZE_BUDGETS = (16, 8, 4)  # 1/k of the clustered keys read beyond the sinks and window
KEYS_PER_CLUSTER = 16


def bench_squeeze_decode(fa, rows, out_json, sweep: bool = False, eager_steps: int = 0):
    """Issue 33's decode step at batch 4 x 64k / 128k over an fp8 cache, 32 layers in one CUDA graph: duo as served
    against duo with Squeezed Attention on its retrieval heads (vllm_duo/squeeze.py's lookup: centroid scores, then
    the best clusters up to 1/16, 1/8, 1/4 of the keys; the sparse decode over them plus sinks and window), the
    streaming heads beside on a second stream as served. The clusters are random (16 keys per centroid on average,
    centroids in fp8 with a scale per head as served beside an fp8 cache; bf16 centroids as a variant), then at 1/16
    as dummy weights may make them (equal centroids; skewed cluster sizes): timing only;
    equality with duo at a full budget is tests/test_squeeze.py's. `sweep`: 4 x 128k at 1/16 only, also
    without its lookup and its lookup alone, and one layer's timeline (`--squeeze-sweep`).
    `eager_steps`: at 4 x 128k, only that many squeezed steps as served, eagerly, for a profiler (`--squeeze-ncu`)."""
    from vllm_duo import gpu_attention
    from vllm_duo.kernels.attention import triton_attention
    from vllm_duo.config import SqueezeSettings
    from vllm_duo.kernels.clustering import to_csr
    from vllm_duo.kernels.row_pages import WINDOW_KEYS, row_views, run_pages, window_pass_lens
    from vllm_duo.kernels.selection import band_runs, centroid_scores, select_banded, select_positions
    from vllm_duo.kernels.sparse_decode import sparse_decode_attention
    from vllm_duo.pattern import resolve_pattern
    from vllm_duo.squeeze import to_fp8_centroids, window_pages

    counts = resolve_pattern("Meta-Llama-3.1-8B-Instruct")[0].retrieval_counts(0.5)
    results = []
    out_json["squeeze_decode"] = results
    one = torch.ones((), dtype=torch.float32, device=DEV)
    quant = KVQuant(one, one, one)
    for batch, context in SQUEEZE_SHAPES[-1:] if sweep or eager_steps else SQUEEZE_SHAPES:
        case = f"fp8 {batch}x{context // 1024}k"
        max_len = context + 1024
        seq_lens = [context] * batch
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
        query = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        key, value = (torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV) for _ in range(2))
        outs = torch.zeros(len(counts), batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        columns = triton.cdiv(max_len, BLOCK)
        layouts, retrieval_tables = layouts_per_count(seq_lens, counts, torch.float8_e4m3fn, columns)
        splits = {R: decode_num_splits(batch, R, max_len, DEV) for R in layouts}
        # as served, the squeezed rows' contexts end a tail of RECENT tokens before their seq_len, on a block boundary,
        # and their clusters hold the context's keys past the sinks: [SINK, context_end)
        context_end = context - RECENT
        T = context_end - SINK
        C = triton.cdiv(T, KEYS_PER_CLUSTER)

        def clusters(R, labels, centroids, fp8=True, spread=True):
            """A store of (centroids, sizes, offsets, positions, centroid scales, radii) for `labels` [R, T] of
            `centroids` [batch, R, clusters, HEAD_DIM], the same for every request; `fp8`: the centroids in fp8 with
            a scale per (request, head), as served beside an fp8 cache (squeeze.py), else bf16 without scales; radii
            uniform in [0, 1), or 0 without `spread`."""
            n = centroids.shape[2]
            offsets, positions = to_csr(labels, n, positions_offset=SINK)
            scales = None
            if fp8:
                centroids, scales = to_fp8_centroids(centroids)
            return (centroids, (offsets[:, 1:] - offsets[:, :-1]).expand(batch, R, n).contiguous(),
                    offsets.expand(batch, R, n + 1).contiguous(), positions.expand(batch, R, T).contiguous(), scales,
                    torch.rand(batch, R, n, device=DEV) * spread)

        # random clusters: random centroids, a random label per key (and the same in bf16). Then two stores as dummy
        # weights may make them: equal centroids (every cluster in one score band, so every cluster kept) and skewed
        # labels (a key's label u^4 C for u uniform: the first cluster holds a tenth of the keys)
        random_clusters = {R: (torch.randint(0, C, (R, T), device=DEV),
                               torch.randn(batch, R, C, HEAD_DIM, dtype=DTYPE, device=DEV)) for R in layouts}
        stores = {R: clusters(R, *drawn) for R, drawn in random_clusters.items()}
        bf16_stores = {R: clusters(R, *drawn, fp8=False) for R, drawn in random_clusters.items()}
        flat = {R: clusters(R, torch.randint(0, C, (R, T), device=DEV),
                            torch.zeros(batch, R, C, HEAD_DIM, dtype=DTYPE, device=DEV), spread=False)
                for R in layouts}
        skewed = {R: clusters(R, (torch.rand(R, T, device=DEV) ** 4 * C).long(),
                              torch.randn(batch, R, C, HEAD_DIM, dtype=DTYPE, device=DEV)) for R in layouts}
        res = dict(case=case, batch=batch, context=context, clusters_per_head=C, variants_ms={}, errors={})

        # each budget's tensor made once, as serving stages it once per step (not a fill in every layer)
        budgets = {k: torch.full((batch, max(counts)), T // k, dtype=torch.int32, device=DEV)
                   for k in SQUEEZE_BUDGETS}

        def max_selected_at(k, keys_per_cluster):
            """The served selection's width at budget 1/k."""
            return SqueezeSettings(budget=1 / k, keys_per_cluster=keys_per_cluster, max_context_len=T).max_selected()

        def choose(scored, offsets, positions, k, banded=True, keys_per_cluster=KEYS_PER_CLUSTER):
            budget = budgets[k][:, :scored.scores.shape[1]]
            if banded:
                return select_banded(scored, offsets, positions, budget, max_selected_at(k, keys_per_cluster))
            return select_positions(scored.scores, offsets, positions, budget, max_selected_at(k, keys_per_cluster))

        # FlashAttention's window pass reads the tokens from the context's end (its page table shifted)
        ends = torch.full((batch,), context_end, dtype=torch.int32, device=DEV)

        def page_lists(scored, offsets, positions, R, k, keys_per_cluster=KEYS_PER_CLUSTER, window=WINDOW_KEYS):
            """FlashAttention's lists of the sinks, the keys `choose` would take and the window's newest `window`
            keys, as served (run_pages)."""
            max_selected = max_selected_at(k, keys_per_cluster)
            runs = band_runs(scored, offsets, budgets[k][:, :R], max_selected)
            d = layouts[R]
            return run_pages(runs, positions, None, ends, sl, d.table, d.heads, d.cache, max_selected, window)
        def scores_of(R, store=stores):
            """`centroid_scores` of the step's query over `store`'s clusters of layer width R, as served."""
            centroids, sizes, _offsets, _positions, scales, radii = store[R]
            return centroid_scores(query, centroids, sizes, layouts[R].heads, qsl, SCALE, centroid_scales=scales,
                                   radii=radii, radius_weight=SqueezeSettings().radius_weight)

        window_tables = {R: torch.empty_like(table) for R, table in retrieval_tables.items()}
        # the window pass's keys: as served none (the row pass reads the window), with window 0 all of the window
        window_lens = {w: window_pass_lens(sl, ends, torch.empty_like(sl), w) for w in (WINDOW_KEYS, 0)}
        for R, table in retrieval_tables.items():
            window_pages(table, ends, BLOCK, window_tables[R])

        def step(budget=None, write=True, lookup=True, attend=True, selections=None, select=True, banded=True,
                 store=stores, served=False, keys_per_cluster=KEYS_PER_CLUSTER, window=WINDOW_KEYS):
            """One decode step; `budget` 1/k squeezes the retrieval heads (None: duo as served); `lookup` and
            `attend` keep the lookup or the sparse decode alone (the latter reads `selections` made beforehand);
            `select` False stops the lookup at the centroid scores; `banded` False selects by sorting; `store` the
            clusters (of `keys_per_cluster` keys on average); `served`: the squeeze's layer as the backend runs it
            (duo_attention_gpu: the lookup, then FlashAttention over the selected rows and the merge,
            FlashAttention's window pass and the streaming heads beside them; with `attend` False its lookup alone:
            the scores, the runs and the page lists; the row pass reading the window's newest `window` keys, the
            window pass the rest)."""
            def run():
                for i, R in enumerate(counts):
                    d, out = layouts[R], outs[i]
                    if budget is None:
                        gpu_attention.duo_attention_gpu(query, key, value, d.cache, d.heads, qsl, sl, d.table, SCALE,
                                                        out, 1, max_len, quant=quant,
                                                        retrieval_table=retrieval_tables[R])
                        continue
                    if write and not served:
                        cache_write.write_kv(key, value, d.cache, d.heads, qsl, sl, d.table, quant=quant)
                    _centroids, _sizes, offsets, positions, _scales, _radii = store[R]

                    def retrieval(attend_rows=None):
                        if attend_rows is not None:  # served: FlashAttention over the page lists
                            lists = selections[R] if not lookup else page_lists(
                                scores_of(R, store), offsets, positions, R, budget, keys_per_cluster, window)
                            if attend:
                                attend_rows(*lists, ends, window_lens[window])
                            return
                        if lookup:
                            scores = scores_of(R, store)
                            if not select:
                                return
                            selected = choose(scores, offsets, positions, budget, banded, keys_per_cluster)
                        else:
                            selected = selections[R]
                        if attend:
                            sparse_decode_attention(query, d.cache, d.heads, qsl, sl, d.table, SCALE, out, *selected,
                                                    quant=quant, checked=True)
                    if served and not attend:  # the served lookup alone: its page lists, nothing attended
                        retrieval(attend_rows=lambda *lists: None)
                        continue
                    if served:
                        gpu_attention.duo_attention_gpu(query, key, value, d.cache, d.heads, qsl, sl, d.table, SCALE,
                                                        out, 1, max_len, quant=quant,
                                                        retrieval_table=window_tables[R],
                                                        retrieval_seq_lens=window_lens[window], squeezed=retrieval)
                        continue
                    streaming = functools.partial(triton_attention, query, d.cache, d.heads, qsl, sl, d.table, SCALE,
                                                  out, 1, splits[R], d.cache, quant, streaming_only=True)
                    if write and d.heads.num_streaming:
                        gpu_attention.beside(streaming, retrieval, DEV)
                    else:
                        retrieval()
            return run

        def lookahead_step(k=16):
            """The squeeze as served, but each layer's lookup (page lists) made one layer ahead on a stream of its
            own, beside the layer before (layer 0's on the main stream), the layer's row pass waiting for its lists:
            a bound for a lookup scored with a query speculated from the layer before: each lookup first multiplies
            the step's queries by a matrix of the layer's own (its retrieval query rows by the model's width, as
            the speculation would; squeeze_study.py's prev-query), then scores with the step's query (timing only).
            Without the model's GEMMs, beside which the real one would run."""
            ahead = torch.cuda.Stream(DEV)
            maps = [torch.randn(R * (NUM_HEADS // NUM_KV_HEADS) * HEAD_DIM, NUM_HEADS * HEAD_DIM, dtype=DTYPE,
                                device=DEV) * 0.01 for R in counts]

            def lists_for(layer):
                R = counts[layer]
                query.flatten(1) @ maps[layer].T  # the speculated queries, unused: the step's stand in
                _centroids, _sizes, offsets, positions, _scales, _radii = stores[R]
                return page_lists(scores_of(R), offsets, positions, R, k)

            def run():
                main = torch.cuda.current_stream(DEV)
                made, ready = {0: lists_for(0)}, [torch.cuda.Event() for _ in counts]
                ready[0].record(main)
                for i, R in enumerate(counts):
                    if i + 1 < len(counts):  # the next layer's lookup, from this layer's start
                        ahead.wait_stream(main)
                        with torch.cuda.stream(ahead):
                            made[i + 1] = lists_for(i + 1)
                            ready[i + 1].record(ahead)

                    def retrieval(attend_rows, i=i):
                        main.wait_event(ready[i])
                        attend_rows(*made[i], ends, window_lens[WINDOW_KEYS])
                    d = layouts[R]
                    gpu_attention.duo_attention_gpu(query, key, value, d.cache, d.heads, qsl, sl, d.table, SCALE,
                                                    outs[i], 1, max_len, quant=quant, retrieval_table=window_tables[R],
                                                    retrieval_seq_lens=window_lens[WINDOW_KEYS],
                                                    squeezed=retrieval)
                main.wait_stream(ahead)
            return run

        timed = functools.partial(timed_graph, res, rows, case)

        def selections_at(k, served=False):
            """Each layer width's selection at 1/k, made beforehand (for the sparse decode alone), or `served` its
            page lists."""
            chosen = {}
            for R, (_centroids, _sizes, offsets, positions, _scales, _radii) in stores.items():
                scores = scores_of(R)
                chosen[R] = (page_lists(scores, offsets, positions, R, k) if served
                             else choose(scores, offsets, positions, k))
            return chosen

        def consecutive(chosen):
            """Served page lists of the same lengths whose rows follow one another from a random start per entry:
            what the row pass would read if each head's keys lay sorted by cluster (a bound for such a layout)."""
            made = {}
            for R, (pages, lens, starts) in chosen.items():
                rows = row_views(layouts[R].cache)[0].shape[0]
                base = torch.randint(0, rows - pages.shape[1], (pages.shape[0], 1), device=DEV)
                made[R] = ((base + torch.arange(pages.shape[1], device=DEV)).int(), lens, starts)
            return made

        if eager_steps:
            served = step(16, served=True)
            for _ in range(eager_steps):
                served()
            torch.cuda.synchronize()
            return
        if sweep:
            served_rows = (("duo as served", step()),
                           ("squeeze 1/16 as served", step(16, served=True)),
                           ("squeeze 1/16: lookup as served only", step(16, served=True, attend=False)),
                           ("squeeze 1/16 as served without the lookup",
                            step(16, served=True, lookup=False, selections=selections_at(16, served=True))),
                           ("the same, each list's rows consecutive (a bound for keys sorted by cluster)",
                            step(16, served=True, lookup=False,
                                 selections=consecutive(selections_at(16, served=True)))),
                           ("squeeze 1/16 as served, the window by the window pass (before the fold)",
                            step(16, served=True, window=0)))
            for label, fn in served_rows:
                timed(label, fn)
            res["timeline"] = timeline = layer_timeline(capture(served_rows[1][1]))
            print_timeline(f"{case} squeeze 1/16 as served: one layer", timeline)
            ahead, label = lookahead_step(), "squeeze 1/16, each lookup a layer ahead (a bound)"
            timed(label, ahead)
            if label not in res["errors"]:
                res["timeline_ahead"] = timeline = layer_timeline(capture(ahead))
                print_timeline(f"{case} squeeze 1/16, lookups a layer ahead: one layer", timeline)
            # bounds, not served: the layer without what runs beside the lookup (the window pass, over no key of
            # these rows, and the merge; the streaming heads), and the row pass's FlashAttention splits (served: 32
            # at 16 entries)
            def window_skipped(*_args, queries=None, **_kwargs):
                return queries, None
            for label, patches in (
                    ("without the window pass and the merge",
                     ((gpu_attention, "retrieval_flash_attention", window_skipped),
                      (gpu_attention, "merge_rows", lambda *args: None))),
                    ("without the streaming heads", ((gpu_attention, "triton_attention", lambda *args, **kw: None),)),
                    *((f"row pass in {n} splits", ((gpu_attention, "row_splits", lambda *_, n=n: n),))
                      for n in (8, 16, 24, 48, 64))):
                with contextlib.ExitStack() as stack:
                    for module, name, replacement in patches:
                        stack.enter_context(patch.object(module, name, replacement))
                    timed(f"squeeze 1/16 as served, {label}", served_rows[1][1])
            results.append(res)
            continue

        timed("duo", step())
        timed("centroid scores only", step(16, write=False, attend=False, select=False))
        timed("centroid scores only, bf16 centroids", step(16, write=False, attend=False, select=False,
                                                           store=bf16_stores))
        timed("lookup with the sorting selection, 1/16", step(16, write=False, attend=False, banded=False))
        for k in SQUEEZE_BUDGETS:
            timed(f"squeeze 1/{k}", step(k))
            timed(f"squeeze 1/{k}: lookup only (positions gathered)", step(k, write=False, attend=False))
            selections = selections_at(k)
            res.setdefault("mean_selected", {})[f"1/{k}"] = float(
                sum(selections[R][1].float().mean() * counts.count(R) for R in selections) / len(counts))
            timed(f"squeeze 1/{k}: sparse decode only", step(k, write=False, lookup=False, selections=selections))
        timed("squeeze 1/16, equal centroids (one score band)", step(16, store=flat))
        timed("squeeze 1/16, skewed clusters", step(16, store=skewed))
        timed("squeeze 1/16, bf16 centroids", step(16, store=bf16_stores))
        timed("squeeze 1/16 as served (FlashAttention's window and row passes)", step(16, served=True))
        timed("squeeze 1/16 as served without the lookup (selections made before)",
              step(16, served=True, lookup=False, selections=selections_at(16, served=True)))
        lookup_served = step(16, served=True, attend=False)
        timed("squeeze 1/16: lookup as served only (scores, runs, page lists)", lookup_served)
        for part, fn in (("lookup", lookup_served), ("served", step(16, served=True))):
            res[f"{part}_kernels"] = profile = kernel_profile(capture(fn), fn, top=20)
            print_kernels(f"{case} {part} at 1/16, kernels", profile)
        results.append(res)
        del layouts, retrieval_tables, stores, bf16_stores, flat, skewed
        torch.cuda.empty_cache()


def print_long_decode(results: list[dict]) -> None:
    """shape, dense and duo ms per step, their ratio, then each variant's ms per step."""
    print(f"\n{'shape':<12} {'dense ms':>9} {'duo ms':>8} {'dense/duo':>9}")
    for r in results:
        print(f"{r['case']:<12} {r['dense_ms']:9.3f} {r['duo_ms']:8.3f} {r['dense_over_duo']:9.3f}")
        for label, t in r["variants_ms"].items():
            if label not in ("dense", "duo"):
                print(f"{'':<12}   {label:<40} {t:8.3f}")


def main():
    if not torch.cuda.is_available():
        sys.exit("kernels_bench.py needs a CUDA GPU")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(DEV)
    nominal = next((v for k, v in NOMINAL_TBPS.items() if k in props.name), 3.35)
    fa, fa_note = load_fa()
    started = time.time()
    out_json = dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                    triton=triton.__version__, fa_version=getattr(fa, "version", None), fa_note=fa_note,
                    nominal_tbps=nominal)
    copy_tbps = copy_bandwidth()
    out_json["copy_tbps"] = copy_tbps
    rows = []
    if "--fp8" in sys.argv:
        parts = (("decode_fp8", bench_decode_fp8),)
    elif "--mixed" in sys.argv:
        parts = (("mixed", bench_mixed),)
    elif "--long-decode" in sys.argv:
        parts = (("long_decode", bench_long_decode),)
    elif "--squeeze-decode" in sys.argv:
        parts = (("squeeze_decode", bench_squeeze_decode),)
    elif "--squeeze-sweep" in sys.argv:
        parts = (("squeeze_decode", functools.partial(bench_squeeze_decode, sweep=True)),)
    elif "--squeeze-ncu" in sys.argv:
        parts = (("squeeze_decode", functools.partial(bench_squeeze_decode, eager_steps=3)),)
    else:
        parts = (("decode", bench_decode), ("prefill", bench_prefill))
    for name, fn in parts:
        try:
            fn(fa, rows, out_json)
        except Exception:  # noqa: BLE001 - keep the other half's numbers
            out_json[f"{name}_error"] = traceback.format_exc()
            print(out_json[f"{name}_error"], file=sys.stderr)
    out_json["wall_s"] = time.time() - started

    target = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).resolve().parent / "results"
    target.mkdir(parents=True, exist_ok=True)
    suffix = next((s for flag, s in (("--fp8", "_fp8"), ("--mixed", "_mixed"), ("--long-decode", "_long_decode"),
                                     ("--squeeze-decode", "_squeeze_decode"), ("--squeeze-sweep", "_squeeze_sweep"),
                                     ("--squeeze-ncu", "_squeeze_ncu"))
                   if flag in sys.argv), "")
    result_file = target / f"kernels_bench{suffix}.json"
    result_file.write_text(json.dumps(out_json, indent=2))

    print(f"\n{props.name}, {props.multi_processor_count} SMs, triton {triton.__version__}; copy {copy_tbps:.2f} TB/s, "
          f"nominal {nominal} TB/s; FA: {fa_note or f'FA{fa.version}'}")
    checks = [("decode", k, v) for k, v in out_json.get("decode", {}).items() if "rel_err" in k]
    checks += [(f"fp8 {r['batch']}x{r['context']}", k, v) for r in out_json.get("decode_fp8", []) for k, v in r.items()
               if "rel_err" in k]
    checks += [(f"prefill {r['tokens']}", k, v) for r in out_json.get("prefill", []) for k, v in r.items()
               if "rel_err" in k]
    checks += [(r["case"], k, v) for r in out_json.get("long_decode", []) for k, v in r.items() if "rel_err" in k]
    for case, k, v in checks:
        print(f"  check {case} {k}: {v:.2e}")
    print(f"{'case':<13} {'kernel':<52} {'ms':>9} {'GB/s':>8} {'% nominal':>9}")
    for case, name, t, gbps in rows:
        pct = f"{100 * gbps / (nominal * 1e3):8.1f}%" if gbps == gbps else ""
        bw = f"{gbps:8.0f}" if gbps == gbps else ""
        print(f"{case:<13} {name:<52} {t:9.3f} {bw:>8} {pct:>9}")
    if out_json.get("long_decode"):
        print_long_decode(out_json["long_decode"])
    print(f"wrote {result_file} ({out_json['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
