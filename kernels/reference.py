# SPDX-License-Identifier: Apache-2.0
"""Plain PyTorch duo attention over the duo cache layout: the CPU path and the kernels' reference.

Layout (see vllm_duo/kv_cache.py): a layer's cache is `[num_blocks, 2, block_size, P, head_dim]`. A
request's block table row gives each token block t `stride` = 1 + m columns: its retrieval page at
column t * stride, then the m blocks of its streaming page group. The streaming K/V of all layers for
those block_size positions is pooled in the group's blocks of a host layer's cache (the layer's own
or another's: the stream cache), the layer's cells from `stream_offset` on. Streaming pages that no
later query can see are freed (their columns go stale or null) and never read.

Masks, with q and k token positions of one request:
* retrieval heads: k <= q (causal over the whole context);
* streaming heads: k <= q and (k < sink or k > q - recent)  (the Λ mask), per token, so the
  result does not depend on how a prompt is split into chunks.

A step first stores its tokens' K/V (pages and streaming pages), then attends to the cache alone. An
fp8 cache (`torch.float8_e4m3fn` or `float8_e5m2`) stores `fp8(x / scale)` with vLLM's per-layer k/v
scales (`KVQuant`), so attention sees every key and value as stored, as vLLM's dense backends do.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vllm_duo.kernels import fp8

FP8_FORMATS = {getattr(torch, name): grid for name, grid in fp8.FORMATS.items()}  # torch dtype -> the kernels' FP8
FP8_DTYPES = tuple(FP8_FORMATS)
FP8_CACHE_DTYPES = {option: getattr(torch, name) for option, name in fp8.KV_CACHE_DTYPES.items()}  # --kv-cache-dtype


@dataclass(frozen=True)
class KVQuant:
    """How K/V sit in an fp8 cache: `fp8(x / scale)`, saturated, read back as `stored * scale`.

    The scales are vLLM's per-layer `_k_scale` / `_v_scale` (floats, or 0-dim float32 tensors on the
    cache's device: the kernels read those, so graphs see scales set after capture). `toward_zero`
    rounds as vLLM's CPU cache write does, else to nearest even as its CUDA one does. `q_scale` is
    for FlashAttention's fp8 path only, which wants fp8 queries.
    """

    k_scale: float | torch.Tensor = 1.0
    v_scale: float | torch.Tensor = 1.0
    q_scale: float | torch.Tensor = 1.0
    toward_zero: bool = False


def quantize(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype, toward_zero: bool = False):
    """`x / scale` in fp8 `dtype`, saturated at its largest finite value."""
    finfo = torch.finfo(dtype)
    scaled = (x.float() * (1.0 / scale)).clamp(finfo.min, finfo.max)
    stored = scaled.to(dtype)
    if toward_zero:  # one code toward zero where rounding went up in magnitude (codes are monotonic per sign)
        code = stored.view(torch.uint8)
        stored = torch.where(stored.float().abs() > scaled.abs(), code - 1, code).view(dtype)
    return stored


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale, toward_zero: bool = False) -> torch.Tensor:
    """K or V as a cache of `cache_dtype` stores it."""
    if cache_dtype in FP8_DTYPES:
        return quantize(x, scale, cache_dtype, toward_zero)
    return x.to(cache_dtype)


def from_cache(stored: torch.Tensor, scale) -> torch.Tensor:
    """Stored K or V as attention sees it (fp8: dequantized to float32)."""
    return stored.float() * scale if stored.dtype in FP8_DTYPES else stored


@dataclass(frozen=True)
class LayerHeads:
    """Which KV heads of one layer are retrieval / streaming, the query heads that go with them, and where the
    layer's streaming K/V sits in a token block's page group.

    `retrieval_kv` and `streaming_kv` index the model's KV heads; `retrieval_q` and `streaming_q`
    list each group's query heads in the same order (query head i of a group belongs to its
    KV head i // group_size). Index maps instead of reordered weights: see backend.py.
    """

    retrieval_kv: torch.Tensor
    streaming_kv: torch.Tensor
    retrieval_q: torch.Tensor
    streaming_q: torch.Tensor
    group_size: int
    stride: int  # block table columns per token block: the retrieval page and m streaming blocks
    stream_offset: int  # the layer's first cell in a page group of its stream cache
    sink: int
    recent: int
    retrieval_first: bool = False  # retrieval KV heads are 0..R-1 (weights reordered): their queries are a slice

    @classmethod
    def build(cls, retrieval: list[int], num_kv_heads: int, num_heads: int, stride: int, sink: int, recent: int,
              stream_offset: int = 0, device="cpu") -> LayerHeads:
        group = num_heads // num_kv_heads
        streaming = [h for h in range(num_kv_heads) if h not in set(retrieval)]

        def q_heads(kv):
            return torch.tensor([h * group + g for h in kv for g in range(group)], dtype=torch.long, device=device)

        def kv_heads(kv):
            return torch.tensor(kv, dtype=torch.long, device=device)

        return cls(kv_heads(retrieval), kv_heads(streaming), q_heads(retrieval), q_heads(streaming),
                   group, stride, stream_offset, sink, recent, list(retrieval) == list(range(len(retrieval))))

    # counted once: the index maps never change, and every layer call of an eager step reads them several times
    @functools.cached_property
    def num_retrieval(self) -> int:
        return self.retrieval_kv.numel()

    @functools.cached_property
    def num_streaming(self) -> int:
        return self.streaming_kv.numel()


def visible_streaming_positions(num_cached: int, seq_len: int, sink: int, recent: int, device="cpu") -> torch.Tensor:
    """Positions some query in [num_cached, seq_len) sees through the Λ mask: the sinks and the last window."""
    window_start = min(max(sink, num_cached - recent + 1), seq_len)
    return torch.cat([torch.arange(min(sink, seq_len), device=device),
                      torch.arange(window_start, seq_len, device=device)])


def retrieval_pages(table_row: torch.Tensor, positions: torch.Tensor, stride: int, block_size: int):
    """(block, row) of each position's retrieval page row."""
    return table_row[positions // block_size * stride], positions % block_size


def stream_cells(table_row: torch.Tensor, positions: torch.Tensor, heads: int, stride: int, block_size: int,
                 page_heads: int, offset: int):
    """(block, row, head) stream-cache coordinates of `positions` x streaming heads [0, heads).

    A token block's streaming K/V is `[block_size slots, heads]`, flattened from cell `offset` on over
    its m page-group blocks (columns t * stride + 1 ...), `page_heads` cells per row.
    """
    flat = offset + (positions % block_size)[:, None] * heads + torch.arange(heads, device=positions.device)[None, :]
    per_block = block_size * page_heads
    column = (positions // block_size * stride + 1)[:, None] + flat // per_block
    return table_row[column], (flat % per_block) // page_heads, flat % page_heads


def write_retrieval(cache: torch.Tensor, table_row: torch.Tensor, positions: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, stride: int, quant: KVQuant | None = None) -> None:
    """Store retrieval K/V `[n, R, D]` of `positions` in their retrieval pages."""
    quant = quant or KVQuant()
    block, row = retrieval_pages(table_row, positions, stride, cache.shape[2])
    head = torch.arange(key.shape[1], device=key.device)[None, :]
    cache[block[:, None], 0, row[:, None], head] = to_cache(key, cache.dtype, quant.k_scale, quant.toward_zero)
    cache[block[:, None], 1, row[:, None], head] = to_cache(value, cache.dtype, quant.v_scale, quant.toward_zero)


def read_retrieval(cache: torch.Tensor, table_row: torch.Tensor, num_tokens: int, heads: int, stride: int,
                   quant: KVQuant | None = None):
    """Retrieval K/V `[num_tokens, heads, D]` of positions [0, num_tokens), as attention sees them."""
    quant = quant or KVQuant()
    block_size = cache.shape[2]
    pages = cache[table_row[: (num_tokens + block_size - 1) // block_size * stride: stride], :, :, :heads]
    kv = pages.transpose(0, 1).reshape(2, -1, heads, cache.shape[-1])[:, :num_tokens]
    return from_cache(kv[0], quant.k_scale), from_cache(kv[1], quant.v_scale)


def write_streaming(cache: torch.Tensor, table_row: torch.Tensor, positions: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, stride: int, offset: int = 0, quant: KVQuant | None = None) -> None:
    """Store streaming K/V `[n, S, D]` of `positions` in their token blocks' page groups of the stream cache."""
    quant = quant or KVQuant()
    block, row, head = stream_cells(table_row, positions, key.shape[1], stride, cache.shape[2], cache.shape[3], offset)
    cache[block, 0, row, head] = to_cache(key, cache.dtype, quant.k_scale, quant.toward_zero)
    cache[block, 1, row, head] = to_cache(value, cache.dtype, quant.v_scale, quant.toward_zero)


def read_streaming(cache: torch.Tensor, table_row: torch.Tensor, positions: torch.Tensor, heads: int, stride: int,
                   offset: int = 0, quant: KVQuant | None = None):
    """Streaming K/V `[n, heads, D]` of `positions`, as attention sees them."""
    quant = quant or KVQuant()
    block, row, head = stream_cells(table_row, positions, heads, stride, cache.shape[2], cache.shape[3], offset)
    return from_cache(cache[block, 0, row, head], quant.k_scale), from_cache(cache[block, 1, row, head], quant.v_scale)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_pos: torch.Tensor,
           k_pos: torch.Tensor, scale: float, group_size: int, sink: int | None = None,
           recent: int | None = None) -> torch.Tensor:
    """Softmax attention in float32 with the causal mask, or the Λ mask when sink/recent are given.

    query `[Tq, Hkv * group, D]`, key/value `[Tk, Hkv, D]` -> `[Tq, Hkv * group, D]`.
    """
    q = query.float()
    k = key.float().repeat_interleave(group_size, dim=1)
    v = value.float().repeat_interleave(group_size, dim=1)
    visible = k_pos[None, :] <= q_pos[:, None]
    if sink is not None:
        visible &= (k_pos[None, :] < sink) | (k_pos[None, :] > q_pos[:, None] - recent)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def duo_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                  heads: LayerHeads, query_start_loc: list[int], seq_lens: list[int],
                  block_table: torch.Tensor, scale: float, output: torch.Tensor,
                  stream_cache: torch.Tensor | None = None, quant: KVQuant | None = None) -> None:
    """Write the batch's K/V into the duo cache, then attend to the cache, request by request.

    Every request's K/V is stored before any request attends: with prefix caching a request can hit
    blocks that another request of the same batch fills in this very step (vLLM hashes blocks when it
    schedules them), as vLLM's dense backends write the whole batch before they attend.

    Args:
        query: `[num_tokens, num_heads, head_dim]`
        key, value: `[num_tokens, num_kv_heads, head_dim]`
        cache: `[num_blocks, 2, block_size, P, head_dim]`
        query_start_loc: `[num_reqs + 1]` token offsets of each request's queries.
        seq_lens: `[num_reqs]` context length of each request after this step.
        block_table: `[num_reqs, max_blocks]`, `heads.stride` columns per token block.
        output: `[num_tokens, num_heads, head_dim]`, written in place.
        stream_cache: the cache whose page groups hold this layer's streaming K/V (default `cache`).
        quant: scales and rounding of an fp8 cache (ignored for others).
    """
    quant = quant or KVQuant()
    stream_cache = cache if stream_cache is None else stream_cache
    requests = []
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end > start:
            requests.append((start, end, seq_len, block_table[i].long(),
                             torch.arange(seq_len - (end - start), seq_len, device=query.device)))
    for start, end, _, row, positions in requests:
        k, v = key[start:end], value[start:end]
        if heads.num_retrieval:
            write_retrieval(cache, row, positions, k[:, heads.retrieval_kv], v[:, heads.retrieval_kv], heads.stride,
                            quant)
        if heads.num_streaming:
            write_streaming(stream_cache, row, positions, k[:, heads.streaming_kv], v[:, heads.streaming_kv],
                            heads.stride, heads.stream_offset, quant)
    for start, end, seq_len, row, positions in requests:
        q = query[start:end]
        if heads.num_retrieval:
            k_all, v_all = read_retrieval(cache, row, seq_len, heads.num_retrieval, heads.stride, quant)
            k_pos = torch.arange(seq_len, device=query.device)
            out = attend(q[:, heads.retrieval_q], k_all, v_all, positions, k_pos, scale, heads.group_size)
            output[start:end, heads.retrieval_q] = out.to(output.dtype)
        if heads.num_streaming:
            k_pos = visible_streaming_positions(seq_len - (end - start), seq_len, heads.sink, heads.recent,
                                                query.device)
            k_seen, v_seen = read_streaming(stream_cache, row, k_pos, heads.num_streaming, heads.stride,
                                            heads.stream_offset, quant)
            out = attend(q[:, heads.streaming_q], k_seen, v_seen, positions, k_pos, scale, heads.group_size,
                         heads.sink, heads.recent)
            output[start:end, heads.streaming_q] = out.to(output.dtype)
