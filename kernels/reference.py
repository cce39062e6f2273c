# SPDX-License-Identifier: Apache-2.0
"""Plain PyTorch duo attention over the duo cache layout: the CPU path and the kernels' reference.

Layout (see vllm_duo/kv_cache.py): a layer's cache is `[num_blocks, 2, block_size, P, head_dim]`;
a request's block table row is `[E streaming blocks | retrieval blocks ...]`. A layer's streaming
ring lives in the E streaming blocks of a ring cache (its own cache or another layer's, which
the layers share), starting `ring_offset` cells in.

Masks, with q and k token positions of one request:
* retrieval heads: k <= q (causal over the whole context);
* streaming heads: k <= q and (k < sink or k > q - recent)  (the Λ mask), per token, so the
  result does not depend on how a prompt is split into chunks.

An fp8 cache (`torch.float8_e4m3fn` or `float8_e5m2`) stores `fp8(x / scale)` with vLLM's per-layer
k/v scales (`KVQuant`). Attention sees every key and value as stored, the chunk's own included,
as vLLM's dense backends do (they write the cache before they read it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


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


def as_stored(x: torch.Tensor, cache_dtype: torch.dtype, scale, toward_zero: bool = False) -> torch.Tensor:
    """K or V as attention sees it once it is in a cache of `cache_dtype`."""
    return from_cache(to_cache(x, cache_dtype, scale, toward_zero), scale).to(x.dtype)


@dataclass(frozen=True)
class LayerHeads:
    """Which KV heads of one layer are retrieval / streaming, and the query heads that go with them.

    `retrieval_kv` and `streaming_kv` index the model's KV heads; `retrieval_q` and `streaming_q`
    list each group's query heads in the same order (query head i of a group belongs to its
    KV head i // group_size). Index maps instead of reordered weights: see backend.py.
    """

    retrieval_kv: torch.Tensor
    streaming_kv: torch.Tensor
    retrieval_q: torch.Tensor
    streaming_q: torch.Tensor
    group_size: int
    ring_offset: int
    streaming_blocks: int
    sink: int
    recent: int

    @classmethod
    def build(cls, retrieval: list[int], num_kv_heads: int, num_heads: int, streaming_blocks: int, sink: int,
              recent: int, ring_offset: int = 0, device="cpu") -> LayerHeads:
        group = num_heads // num_kv_heads
        streaming = [h for h in range(num_kv_heads) if h not in set(retrieval)]

        def q_heads(kv):
            return torch.tensor([h * group + g for h in kv for g in range(group)], dtype=torch.long, device=device)

        def kv_heads(kv):
            return torch.tensor(kv, dtype=torch.long, device=device)

        return cls(kv_heads(retrieval), kv_heads(streaming), q_heads(retrieval), q_heads(streaming),
                   group, ring_offset, streaming_blocks, sink, recent)

    @property
    def num_retrieval(self) -> int:
        return self.retrieval_kv.numel()

    @property
    def num_streaming(self) -> int:
        return self.streaming_kv.numel()


def ring_positions(num_cached: int, sink: int, recent: int, device="cpu") -> torch.Tensor:
    """Token position held by each ring slot after `num_cached` tokens were written; -1 if empty.

    Slots [0, sink) hold positions [0, sink); slot sink + r holds the latest position
    p >= sink with (p - sink) % recent == r.
    """
    sinks = torch.arange(sink, device=device)
    sinks = torch.where(sinks < num_cached, sinks, -1)
    r = torch.arange(recent, device=device)
    last = num_cached - 1 - sink - r
    recents = torch.where(last >= 0, sink + r + recent * torch.div(last.clamp(min=0), recent, rounding_mode="floor"), -1)
    return torch.cat([sinks, recents])


def ring_slots(positions: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Ring slot of each position (positions past the sink need recent > 0)."""
    wrapped = sink + (positions - sink) % max(recent, 1)
    return torch.where(positions < sink, positions, wrapped)


def ring_cells(stream_blocks: torch.Tensor, slots: torch.Tensor, heads: int, block_size: int, page_heads: int,
               offset: int):
    """(block, row, head) ring-cache coordinates of ring `slots` x streaming heads [0, heads).

    The ring is `[W, heads]` flattened from cell `offset` on over the E streaming blocks of the
    ring cache, `page_heads` cells per row.
    """
    flat = offset + slots[:, None] * heads + torch.arange(heads, device=slots.device)[None, :]
    per_block = block_size * page_heads
    block = stream_blocks[flat // per_block]
    row = (flat % per_block) // page_heads
    head = flat % page_heads
    return block, row, head


def write_retrieval(cache: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor,
                    key: torch.Tensor, value: torch.Tensor, quant: KVQuant | None = None) -> None:
    """Store retrieval K/V `[n, R, D]` of `positions` in the request's retrieval `blocks`."""
    quant = quant or KVQuant()
    block_size = cache.shape[2]
    block = blocks[positions // block_size][:, None]
    row = (positions % block_size)[:, None]
    head = torch.arange(key.shape[1], device=key.device)[None, :]
    cache[block, 0, row, head] = to_cache(key, cache.dtype, quant.k_scale, quant.toward_zero)
    cache[block, 1, row, head] = to_cache(value, cache.dtype, quant.v_scale, quant.toward_zero)


def read_retrieval(cache: torch.Tensor, blocks: torch.Tensor, num_tokens: int, heads: int,
                   quant: KVQuant | None = None):
    """Retrieval K/V `[num_tokens, heads, D]` of positions [0, num_tokens), as attention sees them."""
    quant = quant or KVQuant()
    block_size = cache.shape[2]
    pages = cache[blocks[: (num_tokens + block_size - 1) // block_size], :, :, :heads]
    kv = pages.transpose(0, 1).reshape(2, -1, heads, cache.shape[-1])[:, :num_tokens]
    return from_cache(kv[0], quant.k_scale), from_cache(kv[1], quant.v_scale)


def write_streaming(cache: torch.Tensor, stream_blocks: torch.Tensor, positions: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, seq_len: int, sink: int, recent: int, offset: int = 0,
                    quant: KVQuant | None = None) -> None:
    """Store the streaming K/V `[n, S, D]` that future queries can still see: sinks and the last `recent`."""
    quant = quant or KVQuant()
    keep = (positions < sink) | (positions >= seq_len - recent)
    positions, key, value = positions[keep], key[keep], value[keep]
    if positions.numel() == 0:
        return
    block, row, head = ring_cells(stream_blocks, ring_slots(positions, sink, recent), key.shape[1],
                                  cache.shape[2], cache.shape[3], offset)
    cache[block, 0, row, head] = to_cache(key, cache.dtype, quant.k_scale, quant.toward_zero)
    cache[block, 1, row, head] = to_cache(value, cache.dtype, quant.v_scale, quant.toward_zero)


def read_streaming(cache: torch.Tensor, stream_blocks: torch.Tensor, num_cached: int, heads: int,
                   sink: int, recent: int, offset: int = 0, quant: KVQuant | None = None):
    """Ring K/V `[W', heads, D]` as attention sees them and their positions `[W']`, empty slots dropped."""
    quant = quant or KVQuant()
    positions = ring_positions(num_cached, sink, recent, device=cache.device)
    slots = torch.nonzero(positions >= 0).flatten()
    block, row, head = ring_cells(stream_blocks, slots, heads, cache.shape[2], cache.shape[3], offset)
    return (from_cache(cache[block, 0, row, head], quant.k_scale), from_cache(cache[block, 1, row, head], quant.v_scale),
            positions[slots])


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
                  ring_cache: torch.Tensor | None = None, quant: KVQuant | None = None) -> None:
    """Write the chunk's K/V into the duo cache and attend, request by request.

    Args:
        query: `[num_tokens, num_heads, head_dim]`
        key, value: `[num_tokens, num_kv_heads, head_dim]`
        cache: `[num_blocks, 2, block_size, P, head_dim]`
        query_start_loc: `[num_reqs + 1]` token offsets of each request's queries.
        seq_lens: `[num_reqs]` context length of each request after this step.
        block_table: `[num_reqs, max_blocks]`, E streaming blocks then retrieval blocks.
        output: `[num_tokens, num_heads, head_dim]`, written in place.
        ring_cache: the cache whose streaming blocks hold this layer's ring (default `cache`).
        quant: scales and rounding of an fp8 cache (ignored for others).
    """
    quant = quant or KVQuant()
    E = heads.streaming_blocks
    ring_cache = cache if ring_cache is None else ring_cache
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end == start:
            continue
        num_cached = seq_len - (end - start)
        positions = torch.arange(num_cached, seq_len, device=query.device)
        q, k, v = query[start:end], key[start:end], value[start:end]
        row = block_table[i].long()
        if heads.num_retrieval:
            blocks = row[E:]
            write_retrieval(cache, blocks, positions, k[:, heads.retrieval_kv], v[:, heads.retrieval_kv], quant)
            k_all, v_all = read_retrieval(cache, blocks, seq_len, heads.num_retrieval, quant)
            k_pos = torch.arange(seq_len, device=query.device)
            out = attend(q[:, heads.retrieval_q], k_all, v_all, positions, k_pos, scale, heads.group_size)
            output[start:end, heads.retrieval_q] = out.to(output.dtype)
        if heads.num_streaming:
            ring = row[:E]
            k_new, v_new = k[:, heads.streaming_kv], v[:, heads.streaming_kv]
            k_old, v_old, old_pos = read_streaming(ring_cache, ring, num_cached, heads.num_streaming,
                                                   heads.sink, heads.recent, heads.ring_offset, quant)
            k_seen = as_stored(k_new, ring_cache.dtype, quant.k_scale, quant.toward_zero)
            v_seen = as_stored(v_new, ring_cache.dtype, quant.v_scale, quant.toward_zero)
            out = attend(q[:, heads.streaming_q], torch.cat([k_old.to(k_new.dtype), k_seen]),
                         torch.cat([v_old.to(v_new.dtype), v_seen]), positions, torch.cat([old_pos, positions]),
                         scale, heads.group_size, heads.sink, heads.recent)
            output[start:end, heads.streaming_q] = out.to(output.dtype)
            write_streaming(ring_cache, ring, positions, k_new, v_new, seq_len, heads.sink, heads.recent,
                            heads.ring_offset, quant)
