# SPDX-License-Identifier: Apache-2.0
"""Duo KV cache layout: retrieval heads on paged blocks, streaming heads in a fixed sink+recent ring.

vLLM 0.26 gives each attention layer one cache tensor and one block table, and a KV cache
group shares block ids across its layers. Two caches per layer would need a second group
whose layers have equal page sizes, which per-layer retrieval counts R_l (3, 5, 6, 7 of 8 ...)
break. So duo keeps ONE group and puts both kinds of storage in the same blocks:

    block table row of a request:  [ s_0 ... s_{E-1} | r_0 r_1 r_2 ... ]
                                     streaming ring     retrieval pages, one per block_size tokens

* Every layer's page holds `P_l = num_kv_heads` (of the spec) head slots per token row:
  `cache[block, kv, token, head, dim]`, shape `[num_blocks, 2, block_size, P_l, head_dim]`.
* Retrieval KV head r (0 <= r < R_l) of position p lives at
  `cache[table[E + p // bs], :, p % bs, r]`.
* The E streaming blocks, flattened to `E * bs * P_l` head slots, hold the ring
  `[W = sink + recent, S_l]`: slot j of streaming head s is flat index `j * S_l + s`.
  Position p goes to slot `p` if p < sink else `sink + (p - sink) % recent`.

E and P_l are chosen once per model (`plan_page_layout`): P_l >= R_l so a retrieval row fits,
and E * bs * P_l >= W * S_l so the ring fits. The scheduler reserves the E blocks when a
request first gets blocks (`DuoKVCacheManager`), frees them with the rest on finish, abort or
preemption, and vLLM's own "Maximum concurrency" counts them (`DuoAttentionSpec`).
Prefix caching is turned off: streaming rings are per request and cannot be shared.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec


@dataclass(frozen=True, kw_only=True)
class DuoAttentionSpec(FullAttentionSpec):
    """One layer's duo cache. `num_kv_heads` is P_l, the head slots per token row of a page."""

    num_retrieval_heads: int
    num_streaming_heads: int
    sink: int
    recent: int
    streaming_blocks: int

    @property
    def ring_size(self) -> int:
        return self.sink + self.recent

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


@dataclass(frozen=True)
class PageLayout:
    """Per-layer page head slots P_l and the shared number E of streaming blocks per request."""

    page_heads: tuple[int, ...]
    streaming_blocks: int

    def bytes_per_request(self, num_tokens: int, block_size: int, head_dim: int, dtype_bytes: int) -> int:
        blocks = cdiv(num_tokens, block_size) + self.streaming_blocks
        return blocks * block_size * sum(self.page_heads) * 2 * head_dim * dtype_bytes


def _page_heads(retrieval: list[int], streaming: list[int], ring: int, block_size: int, blocks: int) -> list[int]:
    heads = []
    for r, s in zip(retrieval, streaming):
        need_ring = cdiv(ring * s, block_size * blocks) if s else 0
        heads.append(max(r, need_ring, 1))
    return heads


def plan_page_layout(
    retrieval_counts: list[int], num_kv_heads: int, sink: int, recent: int, block_size: int, max_model_len: int
) -> PageLayout:
    """Choose E and P_l that minimise the KV bytes of a request of max_model_len tokens.

    Memory per request is (ceil(T / bs) + E) * bs * sum_l P_l(E), with
    P_l(E) = max(R_l, ceil(W * S_l / (bs * E)), 1): more streaming blocks mean thinner pages.
    """
    streaming = [num_kv_heads - r for r in retrieval_counts]
    ring = sink + recent
    if not any(streaming):
        return PageLayout(tuple(max(r, 1) for r in retrieval_counts), 0)
    token_blocks = cdiv(max_model_len, block_size)
    best = None
    max_blocks = cdiv(ring * num_kv_heads, block_size)  # enough for one head slot per row everywhere
    for blocks in range(1, max_blocks + 1):
        heads = _page_heads(retrieval_counts, streaming, ring, block_size, blocks)
        cost = (token_blocks + blocks) * sum(heads)
        if best is None or cost < best[0]:
            best = (cost, PageLayout(tuple(heads), blocks))
    return best[1]


def ring_slot(position: int, sink: int, recent: int) -> int:
    """Ring slot of a token position: sinks keep their place, the rest wrap in the recent window."""
    return position if position < sink else sink + (position - sink) % recent
