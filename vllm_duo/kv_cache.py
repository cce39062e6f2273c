# SPDX-License-Identifier: Apache-2.0
"""Duo KV cache layout: retrieval heads on paged blocks, streaming heads in a fixed sink+recent ring.

vLLM 0.26 gives each attention layer one cache tensor and one block table, and a KV cache
group shares block ids across its layers. Two caches per layer would need a second group
whose layers have equal page sizes, which per-layer retrieval counts R_l (3, 5, 6, 7 of 8 ...)
break. So duo keeps ONE group and puts both kinds of storage in the same blocks:

    block table row of a request:  [ s_0 ... s_{E-1} | r_0 r_1 r_2 ... ]
                                     streaming ring     retrieval pages, one per block_size tokens

* A layer's page holds `P_l = R_l` head slots per token row (`num_kv_heads` of its spec):
  `cache[block, kv, token, head, dim]`, shape `[num_blocks, 2, block_size, P_l, head_dim]`.
* Retrieval KV head r (0 <= r < R_l) of position p lives at
  `cache[table[E + p // bs], :, p % bs, r]`.
* Streaming rings are pooled across layers. Layer l's ring `[W = sink + recent, S_l]` lives
  in the E streaming blocks of a host layer h (R_h > 0, possibly l itself), flattened to
  `E * bs * P_h` cells, from cell `offset_l` on: slot j of streaming head s is cell
  `offset_l + j * S_l + s`. Position p goes to slot `p` if p < sink else
  `sink + (p - sink) % recent`.
* A layer with R_l = 0 has no pages of its own. vLLM divides by every layer's page size, so
  its spec is a stub of one element per token row (1/head_dim of a head).

Pooling makes a request cost (ceil(T / bs) + E) * bs * sum_l R_l head rows, with E close to
W * sum_l S_l / (bs * sum_l R_l): the KV of the retrieval heads plus the rings, nothing else
(`plan_page_layout`). Without it a layer with few or no retrieval heads would need wide pages
for its ring in every token block. The scheduler reserves the E blocks when a
request first gets blocks (`DuoKVCacheManager`), frees them with the rest on finish, abort or
preemption, and vLLM's own "Maximum concurrency" counts them (`DuoAttentionSpec`).
Prefix caching is turned off: streaming rings are per request and cannot be shared.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec


@dataclass(frozen=True, kw_only=True)
class DuoAttentionSpec(FullAttentionSpec):
    """One layer's duo cache. `num_kv_heads` is P_l, the head slots per token row of a page."""

    sink: int
    recent: int
    streaming_blocks: int

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        return super().max_num_blocks_per_req(vllm_config, max_len) + self.streaming_blocks

    def max_memory_usage_bytes(self, vllm_config) -> int:
        max_len = vllm_config.model_config.max_model_len
        return (cdiv(max_len, self.block_size) + self.streaming_blocks) * self.page_size_bytes

    @classmethod
    def merge(cls, specs):
        if any(spec != specs[0] for spec in specs[1:]):
            # vLLM's grouping probes uniformity by catching AssertionError from merge().
            raise AssertionError("duo layers with different head counts form a UniformTypeKVCacheSpecs group")
        return copy.deepcopy(specs[0])


class DuoKVCacheManager(FullAttentionManager):
    """Full-attention manager that also reserves the E streaming blocks at the head of each request.

    The ring is bookkept as E * block_size extra token slots in front of the request's tokens,
    so allocation, admission and freeing reuse the full-attention logic unchanged.
    """

    def __init__(self, kv_cache_spec: DuoAttentionSpec, *args, **kwargs):
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.ring_tokens = kv_cache_spec.streaming_blocks * kv_cache_spec.block_size

    def get_num_blocks_to_allocate(self, request_id, num_tokens, *args, **kwargs) -> int:
        return super().get_num_blocks_to_allocate(request_id, num_tokens + self.ring_tokens, *args, **kwargs)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        return super().allocate_new_blocks(
            request_id, num_tokens + self.ring_tokens, num_tokens_main_model + self.ring_tokens
        )

    def num_held_blocks(self) -> int:
        """Blocks held by live requests, ring included: 0 once every request has ended."""
        return sum(len(blocks) for blocks in self.req_to_blocks.values())


STUB_HEAD_SIZE = 1  # head_size of the spec of a layer without pages (see `DuoAttentionBackend.kv_cache_spec`)


@dataclass(frozen=True)
class RingPlacement:
    """Where one layer's streaming ring lives: `offset` cells into the E streaming blocks of layer `host`."""

    host: int
    offset: int


@dataclass(frozen=True)
class PageLayout:
    """Per-layer page head slots P_l (0: no pages), the shared E, and each layer's ring placement."""

    page_heads: tuple[int, ...]
    streaming_blocks: int
    rings: tuple[RingPlacement | None, ...]

    def bytes_per_request(self, num_tokens: int, block_size: int, head_dim: int, dtype_bytes: int) -> int:
        blocks = cdiv(num_tokens, block_size) + self.streaming_blocks
        row = sum(p * head_dim if p else STUB_HEAD_SIZE for p in self.page_heads)
        return blocks * block_size * 2 * row * dtype_bytes


def _place_rings(ring_cells: list[int], host_cells: list[int]) -> list[RingPlacement | None] | None:
    """Best-fit decreasing: each ring into the fullest host it still fits; None if some ring fits nowhere."""
    used = [0] * len(host_cells)
    rings: list[RingPlacement | None] = [None] * len(ring_cells)
    for layer in sorted(range(len(ring_cells)), key=lambda i: -ring_cells[i]):
        if not ring_cells[layer]:
            continue
        fits = [h for h, cap in enumerate(host_cells) if cap and cap - used[h] >= ring_cells[layer]]
        if not fits:
            return None
        host = min(fits, key=lambda h: host_cells[h] - used[h])
        rings[layer] = RingPlacement(host, used[host])
        used[host] += ring_cells[layer]
    return rings


@functools.cache
def plan_page_layout(page_heads: tuple[int, ...], ring_heads: tuple[int, ...], sink: int, recent: int,
                     block_size: int) -> PageLayout:
    """Pages of `page_heads[l]` head slots (R_l) and the fewest ring blocks E that hold every layer's ring.

    `ring_heads[l]` is the streaming head count S_l whose ring of W = sink + recent slots layer l
    needs. Memory per request is (ceil(T / bs) + E) * bs * sum_l R_l head rows, the least the
    one-group layout allows: all rings (W * S_l cells each) are packed into the E streaming
    blocks of the layers with pages, E = ceil(W * sum S_l / (bs * sum R_l)) or a few blocks more
    where the rings do not pack exactly. Under tensor parallelism both are per-layer maxima over
    the ranks, since every rank must report the same specs (`DuoPlan.page_layout`).
    """
    pages = list(page_heads)
    if not any(pages):
        pages[0] = 1  # no retrieval head anywhere: layer 0 keeps one head slot per row to hold the rings
    ring_cells = [(sink + recent) * s for s in ring_heads]
    if not any(ring_cells):
        return PageLayout(tuple(pages), 0, (None,) * len(pages))
    blocks = cdiv(sum(ring_cells), block_size * sum(pages))
    while (rings := _place_rings(ring_cells, [blocks * block_size * p for p in pages])) is None:
        blocks += 1
    return PageLayout(tuple(pages), blocks, tuple(rings))
