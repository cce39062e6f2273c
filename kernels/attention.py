# SPDX-License-Identifier: Apache-2.0
"""Duo attention of a mixed batch with the Triton kernels: same semantics as `reference.duo_attention`.

Served on a GPU, FlashAttention-3 takes the retrieval heads where it is faster (vllm_duo/gpu_attention.py): it
calls `write_step` and then `triton_attention(streaming_only=True)` around its own call."""

from __future__ import annotations

import torch

from vllm_duo.kernels.cache_write import check_attention, check_tokens, write_kv
from vllm_duo.kernels.decode import decode_attention, decode_num_splits
from vllm_duo.kernels.prefill import prefill_attention
from vllm_duo.kernels.reference import KVQuant, LayerHeads


def duo_attention_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                         heads: LayerHeads, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         block_table: torch.Tensor, scale: float, output: torch.Tensor, max_query_len: int,
                         max_seq_len: int, max_num_splits: int | None = None,
                         stream_cache: torch.Tensor | None = None, quant: KVQuant | None = None) -> None:
    """Write the batch's K/V into the duo cache, then attend: single-token requests by decode.py, the rest by
    prefill.py.

    The inputs are checked once here, not per launch (mixed steps run outside CUDA graphs and pay
    every microsecond of host time).
    With max_query_len == 1 nothing syncs with the host: a decode batch is CUDA-graph capturable when
    max_num_splits is fixed (or max_seq_len is, e.g. to max_model_len).

    Args:
        query: `[num_tokens, num_heads, head_dim]`
        key, value: `[num_tokens, num_kv_heads, head_dim]` (strided views of a fused qkv are fine).
        cache: `[num_blocks, 2, block_size, P, head_dim]`
        heads: the layer's `LayerHeads`, index tensors on the cache's device.
        query_start_loc: `[num_reqs + 1]` int32 on the device.
        seq_lens: `[num_reqs]` int32 on the device, context length after this step.
        block_table: `[num_reqs, max_blocks]` int32, `heads.stride` columns per token block.
        output: `[num_tokens, num_heads, head_dim]`, written in place.
        max_query_len, max_seq_len: host ints bounding the batch (vLLM's metadata has them).
        max_num_splits: context splits per retrieval head in decode; default `decode_num_splits`.
        stream_cache: the cache whose page groups hold the layer's streaming K/V (default `cache`).
        quant: the scales of an fp8 cache (`float8_e4m3fn` or `float8_e5m2`; default 1). Queries stay in
            the model's dtype.
    """
    cache, stream_cache, max_num_splits = write_step(query, key, value, cache, heads, query_start_loc, seq_lens,
                                                     block_table, output, max_seq_len, max_num_splits, stream_cache,
                                                     quant)
    triton_attention(query, cache, heads, query_start_loc, seq_lens, block_table, scale, output, max_query_len,
                     max_num_splits, stream_cache, quant, streaming_only=False)


def write_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, heads: LayerHeads,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
               output: torch.Tensor, max_seq_len: int, max_num_splits: int | None,
               stream_cache: torch.Tensor | None, quant: KVQuant | None,
               write: bool = True, checked: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Check a layer call's inputs once (unless the caller has: `checked`) and store its new K/V (unless not `write`:
    the caller stores them later, by `write_kv` with these caches); returns the caches to attend over (a layer without
    retrieval heads reads no pages of its own: its cache may be a stub) and the decode splits."""
    stream_cache = cache if stream_cache is None else stream_cache
    if heads.num_retrieval == 0:
        cache = stream_cache
    if max_num_splits is None:
        max_num_splits = decode_num_splits(seq_lens.shape[0], heads.num_retrieval, max_seq_len, cache.device)
    if not checked:
        check_tokens(cache, key, value)
        check_attention(query, output, cache, stream_cache, heads, query_start_loc, seq_lens, block_table)
    if write:
        write_kv(key, value, cache, heads, query_start_loc, seq_lens, block_table, stream_cache, quant, checked=True)
    return cache, stream_cache, max_num_splits


def triton_attention(query: torch.Tensor, cache: torch.Tensor, heads: LayerHeads, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, output: torch.Tensor,
                     max_query_len: int, max_num_splits: int, stream_cache: torch.Tensor, quant: KVQuant | None,
                     streaming_only: bool, fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                     store: bool = False) -> None:
    """Attend over checked, written caches: multi-token requests by prefill.py, single-token ones by decode.py;
    `streaming_only` (the retrieval heads attended elsewhere): every request's streaming heads, by prefill.py in a
    multi-token batch, fresh prompts' from the step's K/V (`fresh_kv`, prefill_attention), which with `store` that
    launch also stores (the caches are written by it, not before)."""
    if max_query_len > 1:
        prefill_attention(query, cache, heads, query_start_loc, seq_lens, block_table, scale, output,
                          min_query_len=1 if streaming_only else 2, streaming_only=streaming_only,
                          stream_cache=stream_cache, quant=quant, checked=True, fresh_kv=fresh_kv, store=store)
    if max_query_len == 1 or not streaming_only:
        decode_attention(query, cache, heads, query_start_loc, seq_lens, block_table, scale, output, max_num_splits,
                         stream_cache=stream_cache, quant=quant, streaming_only=streaming_only, checked=True)
