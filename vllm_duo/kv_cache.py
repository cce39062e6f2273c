# SPDX-License-Identifier: Apache-2.0
"""Duo KV cache layout: retrieval heads on pages, streaming heads on page groups freed outside their window.

vLLM 0.26 gives each attention layer one cache tensor and one block table, and a KV cache group
shares block ids across its layers. Two caches per layer would need a second group whose layers
have equal page sizes, which per-layer retrieval counts R_l (3, 5, 6, 7 of 8 ...) break. So duo
keeps ONE group and gives each token block t of a request `stride` = 1 + m columns of its row:

    block table row:  [ r0 s0 | r1 s1 | r2 s2 | ... ]                 (m = 1)
                      [ r0 s0 s0' | r1 s1 s1' | ... ]                 (m = 2)

* r_t, the retrieval page: layer l's R_l retrieval heads for positions [t bs, (t + 1) bs),
  `cache[r_t, kv, p % bs, r]` (a layer's page has P_l = R_l head slots per row).
* s_t, the streaming page group: the S_l streaming heads of every layer for the same positions,
  pooled in m blocks: layer l's `[bs slots, S_l]` cells lie in the group's blocks of a host layer
  h (R_h > 0, possibly l itself), flattened from cell `offset_l` on, P_h cells per row
  (`plan_page_layout`). Without pooling a layer with few or no retrieval heads would need wide
  pages for its streaming heads in every block.
* A layer with R_l = 0 has no pages of its own. vLLM divides by every layer's page size, so its
  spec is a stub of one element per token row (1/head_dim of a head).

A streaming head's query at q sees the sinks [0, sink) and the window (q - recent, q]. The
manager (`DuoKVCacheManager`) frees s_t once t is past the sink blocks and wholly before the next
query's window, as vLLM's sliding-window manager frees blocks; r_t lives as long as the request.
With bs 4, sink 4, recent 6, a request at 21 tokens (its next query, 21, sees 0..3 and 16..21):

    tokens   0..3   4..7   8..11  12..15  16..19  20..
    pages    r0     r1     r2     r3      r4      r5
    groups   s0     --     --     --      s4      s5       s1..s3 freed: 4..15 is neither sink nor window

So a request holds ceil(T / bs) pages plus the page groups of its sink and window (and, during a
prefill chunk, of the chunk: a step stores all its tokens' K/V before it attends; with prefix
caching, of up to two more windows, below), freed on finish, abort or preemption; vLLM's own
"Maximum concurrency" counts them (`DuoAttentionSpec`).

Prefix caching: r_t and each block of s_t are hashed with token block t's hash (the pages under
the group's id, the streaming blocks under ids of their own), so a later request with the same
first tokens finds them. A hit of k token blocks needs r_0..r_{k-1}, and the groups of the sink
blocks and of the window before the first recomputed position k bs; the request then holds
`[r0 s0 | r1 -- | ... | r_{k-1} s_{k-1}]` with null columns where no query will look, and computes
from k bs on, exactly as if it had run all along (tests/test_prefix_caching.py). The longest hit
whose window survived is taken.

So cached pages are worth something only while a window before some hit end survives with them,
and a request cannot know where later prompts will leave its own. When its queries slide past a
group (bs 4, sink 4, recent 6; a 60-token prompt of which nothing was cached, after its prefill,
while other prompts have been sharing prefixes):

    token block  0  1  2  3  4  5  6  7  8  9  10 11 12 13 14
    sink         s
    window                                             w  w      the next query's window
    kept                                    k  k                 held to the end
    retained        r              r  r           r  r           freed, cached; queued again at the end
    uncached           x  x  x  x        x                       freed uncached: the pool reuses them first

* kept: the windows before the request's hit end and before the end of the pages others cached for
  its prompt (a prefix it shares whose window is gone), and, while recent prompts have been sharing
  prefixes, the window 2^L recent tokens before its prompt's end (rounded to blocks) if that lies
  past its hit, L the level that covered the median private part, the tokens after the shared
  prefix, of those prompts.
* retained: the windows of the other levels, 2^i recent tokens before the prompt's end, and every
  group from the level-1 window to the end. A later prompt that leaves this one's in its last
  2 recent tokens hits all of the prefix they share; further back, it hits up to the window below
  its divergence and computes again at most about twice the distance from the end, as long as
  the pool keeps them.
* uncached: no hit we expect can use them, so they do not push cached pages out.

A document shared by running requests thus stays reachable at their junctions for as long as they
run. While prefixes are being shared, a request's retained groups still cached when it ends are
queued again with its pages, tail first, so the pool evicts a document from its end, one reachable
prefix after another. A workload that shares nothing pays for none of this: no kept window, no
group queued again, and vLLM's "Maximum concurrency" counts none.
"""

from __future__ import annotations

import collections
import functools
import itertools
from dataclasses import dataclass, field

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

# Hash ids of the streaming blocks of a page group (STREAMING_HASH_GROUP + j for block j): apart from vLLM's
# KV cache group ids, which the retrieval pages use.
STREAMING_HASH_GROUP = 1 << 20
# Windows a request keeps to its end beyond its sink and current window (DuoKVCacheManager): where it hit, where it
# left a prefix others cached, and one at a level before its prompt's end; at most KEPT_WINDOWS. The last
# RECENT_PROMPTS prompts tell whether prefixes are being shared (else no level window is kept and no retained group
# queued again: a workload that shares nothing pays nothing, and the capacity figures count no kept window) and, by
# their median private part, the level.
KEPT_WINDOWS = 3
RECENT_PROMPTS = 64


@dataclass(frozen=True, kw_only=True)
class DuoAttentionSpec(FullAttentionSpec):
    """One layer's duo cache. `num_kv_heads` is P_l, the head slots per token row of a page."""

    sink: int
    recent: int
    streaming_blocks: int  # m: blocks of a token block's streaming page group (0: no streaming head anywhere)

    @property
    def stride(self) -> int:
        """Block table columns per token block."""
        return 1 + self.streaming_blocks

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        return self.stride * cdiv(max_len, self.block_size)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        held = blocks_held(vllm_config.model_config.max_model_len, self.streaming_blocks, self.sink, self.recent,
                           self.block_size)
        return held * self.page_size_bytes

    @classmethod
    def merge(cls, specs):
        if any(spec != specs[0] for spec in specs[1:]):
            # vLLM's grouping probes uniformity by catching AssertionError from merge().
            raise AssertionError("duo layers with different head counts form a UniformTypeKVCacheSpecs group")
        return specs[0]


def streaming_groups_held(num_tokens: int, sink: int, recent: int, block_size: int, kept: int = 0) -> int:
    """Token blocks whose streaming page group a request of `num_tokens` computed tokens keeps at most: the sink
    blocks, those reaching into the next query's window (positions >= num_tokens - recent + 1), and `kept` windows
    it keeps for later hits (`DuoKVCacheManager`)."""
    blocks = cdiv(num_tokens, block_size)
    freed = _first_window_block(num_tokens, recent, block_size) - cdiv(sink, block_size)
    held = blocks - max(0, min(freed, blocks - cdiv(sink, block_size)))
    return min(blocks, held + kept * cdiv(max(recent - 1, 0), block_size))


def blocks_held(num_tokens: int, streaming_blocks: int, sink: int, recent: int, block_size: int) -> int:
    """Blocks a request of `num_tokens` tokens holds between steps: its pages, and the `streaming_blocks`-block
    page groups of its sink and window (`streaming_groups_held`)."""
    groups = streaming_groups_held(num_tokens, sink, recent, block_size)
    return cdiv(num_tokens, block_size) + streaming_blocks * groups


KEPT, RETAINED = 2, 1  # a token block's role in `_Windows.roles` (0: its group is freed uncached)


@dataclass
class _Windows:
    """Which streaming page groups one request keeps when its queries slide past them (module docstring)."""

    roles: bytearray = field(default_factory=bytearray)  # per token block: KEPT (held to the end), RETAINED (freed
    # cached, queued again at the end) or 0; kept wins where windows overlap; blocks past its end are 0
    retained_freed: list[tuple[int, KVCacheBlock, object]] = field(default_factory=list)  # (column, block, hash)
    freed_up_to: int = 0  # token blocks below this are kept or freed
    planned: bool = False  # the prompt's windows are known (at its first cache_blocks)
    requeue: bool = False  # queue the retained groups again with the pages at the end (prefixes are shared)

    def mark(self, window: range, role: int) -> None:
        """Give the token blocks of `window` `role`, unless they have a stronger one."""
        if len(self.roles) < window.stop:
            self.roles.extend(bytes(window.stop - len(self.roles)))
        self.roles[window.start:window.stop] = bytes(max(r, role) for r in self.roles[window.start:window.stop])

    def role(self, token_block: int) -> int:
        return self.roles[token_block] if token_block < len(self.roles) else 0


class DuoKVCacheManager(SingleTypeKVCacheManager):
    """Per request: `stride` blocks per token block (page, then page group); frees streaming page groups that
    slid out of the window, keeping the windows later hits need, and hashes both kinds for prefix caching
    (module docstring).

    Beyond vLLM's manager interface it uses the block pool's `touch` (a retained group queued again at the end)
    and `evict_blocks` (a slid group no hit can use is freed uncached, so the pool reuses it first).
    `num_cached_block` counts token blocks here, not blocks.
    """

    def __init__(self, kv_cache_spec: DuoAttentionSpec, *args, **kwargs):
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.stride = kv_cache_spec.stride
        self.sink_blocks = cdiv(kv_cache_spec.sink, self.block_size)
        self.recent = kv_cache_spec.recent
        self._windows: dict[str, _Windows] = {}
        # per recent prompt: its tokens past the prefix it shared with earlier ones (None: it shared none)
        self._recent_prompts: collections.deque[int | None] = collections.deque(maxlen=RECENT_PROMPTS)

    def _windows_of(self, request_id: str) -> _Windows:
        """The request's `_Windows`, made at its first call."""
        windows = self._windows.get(request_id)
        if windows is None:
            windows = self._windows[request_id] = _Windows()
        return windows

    def _window(self, end_block: int) -> range:
        """Token blocks past the sinks whose groups a hit of `end_block` token blocks needs."""
        first = _first_window_block(end_block * self.block_size, self.recent, self.block_size)
        return range(max(self.sink_blocks, first), end_block)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens, num_tokens_main_model,
                                   apply_admission_cap: bool = False, prefill_end: int = 0) -> int:
        """New blocks for `num_tokens` token slots, plus hit blocks that leave the free queue.

        The admission check (`apply_admission_cap`, the whole prompt at once) counts the page groups a request
        keeps between steps (its sink, window and kept windows), not those of the chunks it will prefill:
        each is freed once the window moves on. `prefill_end` (vLLM 0.31+) is for Mamba's prefill checkpoints.
        """
        token_blocks = cdiv(num_tokens, self.block_size)
        held = self.req_to_blocks.get(request_id, ())
        if apply_admission_cap:  # blocks, not columns: a hit's null columns need none
            hit = len(new_computed_blocks) > self.sink_blocks * self.stride
            kept = KEPT_WINDOWS if self.enable_caching and (hit or self._sharing()) else 0
            groups = streaming_groups_held(num_tokens, self.kv_cache_spec.sink, self.recent, self.block_size, kept)
            missing = (token_blocks + (self.stride - 1) * groups
                       - sum(not b.is_null for b in itertools.chain(held, new_computed_blocks)))
        else:  # columns: allocate_new_blocks fills every one past the held ones
            missing = token_blocks * self.stride - len(held) - len(new_computed_blocks)
        return max(missing, 0) + self._get_num_evictable_blocks(new_computed_blocks)

    def add_local_computed_blocks(self, request_id, new_computed_blocks, num_local_computed_tokens,
                                  num_external_computed_tokens) -> None:
        super().add_local_computed_blocks(request_id, new_computed_blocks, num_local_computed_tokens,
                                          num_external_computed_tokens)
        hit_blocks = len(new_computed_blocks) // self.stride
        self.num_cached_block[request_id] = hit_blocks
        windows = self._windows_of(request_id)
        windows.freed_up_to = self._window(hit_blocks).start
        if hit_blocks > self.sink_blocks:
            windows.mark(self._window(hit_blocks), KEPT)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        """A page and a streaming page group for every new token block: a step stores all its tokens' K/V."""
        req_blocks = self.req_to_blocks[request_id]
        missing = cdiv(num_tokens, self.block_size) * self.stride - len(req_blocks)
        if missing <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(missing)
        req_blocks.extend(new_blocks)
        return new_blocks

    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None) -> None:
        """Free the streaming page groups of token blocks past the sink and wholly before the next query's window
        (positions < processed_computed_tokens - recent + 1) that the request does not keep; their columns become
        the null block. Retained groups stay cached; the others are freed uncached when no one else holds them."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or self.stride == 1:
            return
        windows = self._windows_of(request_id)
        end = min(_first_window_block(processed_computed_tokens, self.recent, self.block_size),
                  len(blocks) // self.stride)
        start = max(windows.freed_up_to, self.sink_blocks)
        if start >= end:
            return
        freed, useless = [], set()
        for t in range(start, end):
            role = windows.role(t)
            if role == KEPT:
                continue
            for column in range(t * self.stride + 1, (t + 1) * self.stride):
                block = blocks[column]
                if block.is_null:
                    continue
                if role == RETAINED:
                    windows.retained_freed.append((column, block, block.block_hash))
                elif block.ref_cnt == 1 and block.block_hash is not None:
                    useless.add(block.block_id)
                freed.append(block)
                blocks[column] = self._null_block
        if useless:
            self.block_pool.evict_blocks(useless)
        if freed:
            self.block_pool.free_blocks(freed)
        windows.freed_up_to = max(start, end)

    def cache_blocks(self, request, num_tokens: int, retention_interval: int | None = None, *,
                     replay_boundaries=()) -> None:
        """Hash the pages and the streaming blocks of the request's full token blocks (module docstring).
        `replay_boundaries` (vLLM 0.30+) tells sliding-window managers where to retain blocks; duo retains its own
        windows (`_plan_windows`)."""
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        windows = self._windows_of(request.request_id)
        if not windows.planned:
            self._plan_windows(request, windows, num_cached)
        blocks = self.req_to_blocks[request.request_id]
        for kind in range(self.stride):
            self.block_pool.cache_full_blocks(request=request, blocks=blocks[kind::self.stride],
                                              num_cached_blocks=num_cached, num_full_blocks=num_full,
                                              block_size=self.block_size,
                                              kv_cache_group_id=_hash_group(self.kv_cache_group_id, kind))
        self.num_cached_block[request.request_id] = num_full

    def _plan_windows(self, request, windows: _Windows, hit_blocks: int) -> None:
        """Before the request hashes its own pages: keep the window where its prompt leaves the pages other requests
        cached (a shared prefix: the run of cached pages past its hit, whose window is gone); while prefixes are
        being shared, keep the window at the level L where shared prefixes have lately ended; retain the windows of
        the other levels and every group from the level-1 window on."""
        from vllm.v1.core.kv_cache_utils import resolve_block_hashes

        windows.planned = True
        prompt_blocks = (request.num_prompt_tokens - 1) // self.block_size  # the longest hit a prompt can have
        hashes = resolve_block_hashes(request.block_hashes, self.block_pool.hash_block_size, self.block_size)
        shared = hit_blocks
        while shared < prompt_blocks and self.block_pool.get_cached_block(hashes[shared], [self.kv_cache_group_id]):
            shared += 1
        if shared > hit_blocks:
            windows.mark(self._window(shared), KEPT)
        shares = self._window(shared).start > self.sink_blocks  # a shared prefix longer than the sink and a window
        self._recent_prompts.append(request.num_prompt_tokens - shared * self.block_size if shares else None)
        windows.requeue = self._sharing()
        kept_level = self._kept_level() if self._sharing() else None
        for level in itertools.count():
            end = prompt_blocks - (2 ** level * self.recent) // self.block_size
            if end <= max(hit_blocks, self.sink_blocks) or self.recent == 0:
                break
            windows.mark(self._window(end), KEPT if level == kept_level else RETAINED)
            if level == 1:  # and every group from there to the prompt's end
                windows.mark(range(self._window(end).start, prompt_blocks), RETAINED)

    def _sharing(self) -> bool:
        """Whether any recent prompt shared a prefix longer than the sink and a window with an earlier one."""
        return any(length is not None for length in self._recent_prompts)

    def _kept_level(self) -> int:
        """The level i whose window, 2^i recent tokens before a prompt's end, covers the median private part
        (the tokens after the shared prefix) of the recent prompts that shared one. The median, not more: a few
        prompts that share only a short preamble must not move it off the documents' ends."""
        lengths = sorted(length for length in self._recent_prompts if length is not None)
        typical = lengths[len(lengths) // 2]
        return (cdiv(typical, self.recent) - 1).bit_length()

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, dcp_world_size=1, pcp_world_size=1):
        """The longest k (token blocks, within `max_length`) whose pages are cached, and the page groups of its
        sink blocks and of the window before position k * bs; `[r0 s0 | r1 -- | ...]` with nulls elsewhere."""
        from vllm.v1.core.kv_cache_utils import resolve_block_hashes

        (group,) = kv_cache_group_ids
        bs, stride = kv_cache_spec.block_size, kv_cache_spec.stride
        block_hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, bs,
                                            supports_fine_grained_hash_lookup=False, alignment_tokens=alignment_tokens)
        pages = []
        for block_hash in block_hashes[:max_length // bs]:
            page = block_pool.get_cached_block(block_hash, [group])
            if page is None:
                break
            pages.append(page[0])

        @functools.cache
        def streaming_group(t: int):
            return block_pool.get_cached_block(block_hashes[t], [_hash_group(group, j) for j in range(1, stride)])

        sink_blocks = cdiv(kv_cache_spec.sink, bs)
        k = len(pages)
        while k > 0 and stride > 1:
            first_window = max(sink_blocks, _first_window_block(k * bs, kv_cache_spec.recent, bs))
            seen = [*range(min(sink_blocks, k)), *range(first_window, k)]
            missing = next((t for t in reversed(seen) if not streaming_group(t)), None)
            if missing is None:
                break
            k = missing  # every longer hit needs that group too: end the hit before its token block
        first_window = max(sink_blocks, _first_window_block(k * bs, kv_cache_spec.recent, bs))
        hit = []
        for t in range(k):
            seen = t < sink_blocks or t >= first_window
            hit += [pages[t], *(streaming_group(t) if seen else [block_pool.null_block] * (stride - 1))]
        return (hit,), k * bs

    def pop_blocks_for_free(self, request_id):
        """The request's blocks, in the order vLLM frees them reversed (tail first), with the retained groups the
        pool still caches back in their columns: they are queued with the pages they make reachable."""
        windows = self._windows.pop(request_id, None)
        blocks = super().pop_blocks_for_free(request_id)
        if windows is not None and windows.requeue and blocks:
            requeued = [(column, block) for column, block, block_hash in windows.retained_freed
                        if block.ref_cnt == 0 and block_hash is not None and block.block_hash == block_hash]
            self.block_pool.touch([block for _, block in requeued])
            for column, block in requeued:
                blocks[column] = block
        return blocks

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        return 0  # duo declines cascade attention

    def num_held_blocks(self) -> int:
        """Blocks held by live requests, null columns excepted: 0 once every request has ended."""
        return sum(not b.is_null for blocks in self.req_to_blocks.values() for b in blocks)


def _hash_group(group: int, kind: int) -> int:
    """The hash id of column `kind` of a token block: 0 the page (the group's own id), j > 0 streaming block j."""
    return group if kind == 0 else STREAMING_HASH_GROUP + kind


def _first_window_block(next_position: int, recent: int, block_size: int) -> int:
    """The first token block that the query at `next_position` can see through its window: those before it hold
    only positions < next_position - recent + 1."""
    return max(0, next_position - recent + 1) // block_size


STUB_HEAD_SIZE = 1  # head_size of the spec of a layer without pages (see `DuoAttentionBackend.kv_cache_spec`)


@dataclass(frozen=True)
class StreamPlacement:
    """Where one layer's streaming K/V lives: `offset` cells into the page groups in layer `host`'s cache."""

    host: int
    offset: int


@dataclass(frozen=True)
class PageLayout:
    """Per-layer page head slots P_l (0: no pages), the blocks m of a streaming page group, and each layer's
    streaming placement."""

    page_heads: tuple[int, ...]
    streaming_blocks: int
    placements: tuple[StreamPlacement | None, ...]

    @property
    def stride(self) -> int:
        """Block table columns per token block: the page and the page group's blocks."""
        return 1 + self.streaming_blocks

    def bytes_per_request(self, num_tokens: int, block_size: int, head_dim: int, dtype_bytes: int, sink: int,
                          recent: int) -> int:
        """KV bytes a request of `num_tokens` tokens holds between steps (`blocks_held`)."""
        blocks = blocks_held(num_tokens, self.streaming_blocks, sink, recent, block_size)
        row = sum(p * head_dim if p else STUB_HEAD_SIZE for p in self.page_heads)
        return blocks * block_size * 2 * row * dtype_bytes


def _place(cells: list[int], host_cells: list[int]) -> list[StreamPlacement | None] | None:
    """Best-fit decreasing: each layer's cells into the fullest host they still fit; None if some fit nowhere."""
    used = [0] * len(host_cells)
    placements: list[StreamPlacement | None] = [None] * len(cells)
    for layer in sorted(range(len(cells)), key=lambda i: -cells[i]):
        if not cells[layer]:
            continue
        fits = [h for h, cap in enumerate(host_cells) if cap and cap - used[h] >= cells[layer]]
        if not fits:
            return None
        host = min(fits, key=lambda h: host_cells[h] - used[h])
        placements[layer] = StreamPlacement(host, used[host])
        used[host] += cells[layer]
    return placements


@functools.cache
def plan_page_layout(page_heads: tuple[int, ...], streaming_heads: tuple[int, ...], block_size: int) -> PageLayout:
    """Pages of `page_heads[l]` head slots (R_l) and the fewest blocks m per streaming page group that hold every
    layer's `[block_size, streaming_heads[l]]` streaming cells.

    A token block then costs (1 + m) blocks of sum_l R_l head rows while its page group lives, with
    m = ceil(sum S_l / sum R_l), or one more where the layers' cells do not pack exactly. Under tensor
    parallelism both counts are per-layer maxima over the ranks, since every rank must report the same
    specs (`DuoPlan.page_layout`).
    """
    pages = list(page_heads)
    if not any(pages):
        pages[0] = 1  # no retrieval head anywhere: layer 0 keeps one head slot per row to hold the page groups
    cells = [block_size * s for s in streaming_heads]
    if not any(cells):
        return PageLayout(tuple(pages), 0, (None,) * len(pages))
    blocks = cdiv(sum(cells), block_size * sum(pages))
    while (placements := _place(cells, [blocks * block_size * p for p in pages])) is None:
        blocks += 1
    return PageLayout(tuple(pages), blocks, tuple(placements))


from vllm_duo import vllm_seam  # noqa: E402  (after the classes it checks)

vllm_seam.check("manager_interface")  # duo's overrides take what the installed vLLM passes
