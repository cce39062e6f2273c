# SPDX-License-Identifier: Apache-2.0
"""Squeezed Attention on duo's retrieval heads (issue 33): the clustered contexts a worker keeps, and the decode
lookup over them. No vLLM here: the backend owns when a context is built and which requests read it.

A long context is clustered once, at the end of its prefill, layer by layer: each retrieval KV head's keys between
the sinks and the end of the prompt are grouped by spherical K-means (kernels/clustering.py, `keys_per_cluster` keys
per centroid on average, Squeezed Attention's n/16), and the context keeps per head its centroids, cluster sizes and
radii and the CSR of positions per cluster. At decode each request scores its query against its context's centroids
(kernels/selection.py, the paper's Eq. 1 with each logit raised by `radius_weight` |q| x the cluster's radius, max
over the GQA group), takes clusters from the best score band down
until their keys fill `budget` of the clustered positions (`select_banded`: bands of 12.5% in score, no sort; in the
band that meets the budget, its clusters in cluster order until it is met), and attends exactly over those keys plus
the sinks and every position after the context (its window; FlashAttention's row pass, and a window pass for a
window longer than `row_pages.WINDOW_KEYS`, in gpu_attention.py, or kernels/sparse_decode.py):

    prompt of 4,352 tokens, sink 64, tail 256, keys_per_cluster 16, budget 0.25
    context [0, 4,096), clustered positions [64, 4,096)   -> 252 clusters per retrieval KV head
    decode at seq_len 4,360, each retrieval KV head:
        sinks [0, 64)  +  best clusters' positions until >= 0.25 x 4,032 = 1,008 keys  +  window [4,096, 4,360)

The prompt's tail and the tokens generated after it are not clustered: they are read whole, however many.
A context ends on a block boundary (`block_size`), so that FlashAttention's window pass starts at a page's start.

Serving (backend.py) plans each step once (`ClusteredContexts.plan`). A context is a prompt but its last `tail`
tokens: the slot keeps its tokens, and every later prompt that starts with them reads it, so a document asked many
questions is clustered once:

    tail 256, block size 16; request A: document (100,000 tokens) + question 60 -> context [0, 99,792) (100,060 - 256
        down to a block boundary), clustered [64, 99,792), built as A's prefill ends
    request B: the same document + question 120 -> its first 99,792 tokens are A's context: B reads A's slot,
        its retrieval heads reading [99,792, seq_len) whole
    request C: another document -> a free slot, or the least recently read one no request is reading

A long enough prompt takes its slot in the step where its prefill ends (or joins one whose context it starts with,
unless what it adds beyond that context is itself `min_context_len` long), and each layer clusters its keys into the
slot right after that layer's attention has written them; from the next step on, its single-token rows read the
slot. Requests without a slot (the prompt too short or too long, every slot read by a live request) are served by
duo unsqueezed. A slot outlives its requests until another context needs it.

Memory (per slot, per layer with R retrieval heads, C = ceil(T / keys_per_cluster) for T = max_context_len):
centroids R x C x head_dim in the model's dtype, or in fp8 (e4m3, with a float32 scale per head) beside an fp8 KV
cache, whose keys they summarize at that precision anyway (the lookup reads every centroid at every step: at 16
keys per centroid, bf16 centroids are as many bytes as the keys a 1/16 budget selects from an fp8 cache), sizes
R x C int32, radii R x C float32, offsets R x (C + 1) int32, positions R x T int32; all of it preallocated so that
decode's lookup keeps fixed shapes (CUDA-graph capturable) and a build allocates nothing but the clustering's
scratch.
`ClusteredContexts.bytes_needed` is that sum.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

import torch

from vllm_duo.config import SqueezeSettings
from vllm_duo.kernels import sparse_reference
from vllm_duo.kernels.clustering import cluster_keys, cluster_radii, to_csr
from vllm_duo.kernels.reference import FP8_CACHE_DTYPES, KVQuant, LayerHeads, read_retrieval
from vllm_duo.kernels.row_pages import WINDOW_KEYS, run_pages, window_pass_lens
from vllm_duo.kernels.selection import BandRuns, band_runs, centroid_scores, gather_positions
from vllm_duo.kernels.sparse_decode import sparse_decode_attention

FP8_CENTROIDS = torch.float8_e4m3fn  # the centroids' dtype beside an fp8 (e4m3) KV cache


def centroid_dtype(model_dtype: torch.dtype, cache_dtype: str) -> torch.dtype:
    """What the centroids are stored in: fp8 beside an e4m3 KV cache (`--kv-cache-dtype fp8|fp8_e4m3`), whose keys
    they summarize at that precision anyway; else the model's fp16 or fp32, or bf16."""
    if FP8_CACHE_DTYPES.get(cache_dtype) == FP8_CENTROIDS:
        return FP8_CENTROIDS
    return model_dtype if model_dtype in (torch.float16, torch.float32) else torch.bfloat16


def to_fp8_centroids(centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Centroids `[..., C, head_dim]` as stored in fp8: each head's divided by its scale (its largest magnitude over
    fp8's largest, so none saturates) -> (fp8 centroids, float32 scales `[...]`)."""
    centroids = centroids.float()
    scales = centroids.abs().amax(dim=(-2, -1)).clamp(min=1e-30) / torch.finfo(FP8_CENTROIDS).max
    return (centroids / scales[..., None, None]).to(FP8_CENTROIDS), scales


def window_pages(retrieval_table: torch.Tensor, context_ends: torch.Tensor, block_size: int,
                 into: torch.Tensor) -> None:
    """FlashAttention's page table for the squeeze's window pass, into `into` (a buffer CUDA graphs replay from): each
    row's retrieval pages from its context end's page on (ends are block aligned), `retrieval_table`
    `[num_reqs, columns]` shifted left by that many pages."""
    columns = min(retrieval_table.shape[1], into.shape[1])
    shift = torch.arange(columns, dtype=torch.int32, device=into.device) + context_ends[:, None] // block_size
    into[:, :columns].copy_(retrieval_table.gather(1, shift.clamp_(max=retrieval_table.shape[1] - 1).long()))


@dataclass
class SqueezeStep:
    """One step's plan, per batch row: the slot it reads (-1: none), where that context ends (0: none) and the keys
    its retrieval heads select (0: none); `builds` lists (row, slot, end) for each prefill that ends in this step and
    clusters its context, positions [sink, end), into `slot`."""

    context_ids: list[int]
    context_ends: list[int]
    budget: list[int]
    builds: list[tuple[int, int, int]]

    @functools.cached_property
    def squeezed(self) -> bool:  # read by every layer of the step
        return any(end > 0 for end in self.context_ends)


@dataclass
class SqueezeRows:
    """A step's plan as the kernels read it: `[num_reqs]` int32 tensors on the cache's device (slices of the store's
    one row buffer, which every layer and CUDA graph reads: `ClusteredContexts.stage`), and the plan itself for the
    PyTorch path and the builds. `flash_seq_lens` is what FlashAttention's window pass reads of each row's retrieval
    heads from the first page of `window_pages`' table (each row's retrieval pages from its context end's page on):
    at the rows that read a context the window less its newest keys, which their row pass reads
    (`row_pages.window_pass_lens`), elsewhere the step's seq_lens."""

    step: SqueezeStep
    context_ids: torch.Tensor
    context_ends: torch.Tensor
    budget: torch.Tensor
    flash_seq_lens: torch.Tensor


class ClusteredContexts:
    """Per layer, `max_contexts` slots of clustered retrieval keys:

    - centroids `[slots, R, C, head_dim]` (`centroid_dtype`; fp8 ones divided by `centroid_scales` `[slots, R]`
      float32, each head's largest magnitude over fp8's largest), sizes `[slots, R, C]` int32 (0: no such cluster),
      radii `[slots, R, C]` float32 (each cluster's largest key distance from its centroid);
    - offsets `[slots, R, C + 1]` int32 and positions `[slots, R, T]` int32: the CSR of positions per cluster;
    - `ends[slot]`: where its built context ends (0: none built); `clustered(slot)` positions past the sinks are in
      its CSR; `tokens[slot]`: that context's token ids (None: free), which a prompt must start with to read it.

    C and T are the largest a slot can need (`SqueezeSettings.max_context_len`); a smaller context leaves the
    rest as empty clusters.
    """

    def __init__(self, retrieval_per_layer: list[int], head_dim: int, sink: int, settings: SqueezeSettings,
                 device: torch.device | str = "cpu", centroid_dtype: torch.dtype = torch.bfloat16, max_rows: int = 1,
                 block_size: int = 1):
        self.settings, self.sink, self.device = settings, sink, torch.device(device)
        self.block_size = block_size  # contexts end on a block boundary, where FlashAttention's window pass starts
        self.row_window = WINDOW_KEYS  # a squeezed row's newest window keys that FlashAttention's row pass reads
        slots, T = settings.max_contexts, settings.max_context_len
        C = settings.num_clusters(T)
        self.centroids = [torch.zeros(slots, R, C, head_dim, dtype=centroid_dtype, device=device)
                          for R in retrieval_per_layer]
        self.centroid_scales = ([torch.ones(slots, R, dtype=torch.float32, device=device) for R in retrieval_per_layer]
                                if centroid_dtype == FP8_CENTROIDS else None)
        self.sizes = [torch.zeros(slots, R, C, dtype=torch.int32, device=device) for R in retrieval_per_layer]
        self.radii = [torch.zeros(slots, R, C, dtype=torch.float32, device=device) for R in retrieval_per_layer]
        self.offsets = [torch.zeros(slots, R, C + 1, dtype=torch.int32, device=device) for R in retrieval_per_layer]
        self.positions = [torch.zeros(slots, R, T, dtype=torch.int32, device=device) for R in retrieval_per_layer]
        self.ends = [0] * slots
        self.tokens: list[list[int] | None] = [None] * slots
        self.readers: list[set[str]] = [set() for _ in range(slots)]  # the live requests that read (or build) a slot
        self.slot_of: dict[str, int] = {}  # and the other way
        self.last_read = [0] * slots  # the step each slot was last read or claimed: the least recent goes first
        self.steps = 0
        self.built = self.shared = 0  # contexts clustered; prompts that read one clustered for an earlier prompt
        self.rows = torch.zeros(4, max_rows, dtype=torch.int32, device=device)  # `stage`'s buffer, up to max_rows rows
        # with `count_reads`, over every squeezed decode row and retrieval head so far: keys read beyond the sinks and
        # the window, keys there
        self.reads = torch.zeros(2, dtype=torch.int64, device=device)

    @staticmethod
    def bytes_needed(retrieval_per_layer: list[int], head_dim: int, settings: SqueezeSettings,
                     centroid_dtype: torch.dtype = torch.bfloat16) -> int:
        T = settings.max_context_len
        C = settings.num_clusters(T)
        per_head = C * head_dim * centroid_dtype.itemsize + 2 * C * 4 + (C + 1) * 4 + T * 4
        per_head += 4 if centroid_dtype == FP8_CENTROIDS else 0
        return settings.max_contexts * sum(retrieval_per_layer) * per_head

    def build(self, layer: int, slot: int, cache: torch.Tensor, heads: LayerHeads, table_row: torch.Tensor,
              end: int, quant: KVQuant | None = None, seed: int = 0) -> None:
        """Cluster one context's retrieval keys of `layer` into `slot`: positions [sink, end) as attention sees them
        (fp8 dequantized with `quant`), read through the request's block table row."""
        T, R = end - self.sink, heads.num_retrieval
        if not 0 < T <= self.settings.max_context_len:
            raise ValueError(f"a squeezed context holds 1 to {self.settings.max_context_len} positions past the "
                             f"{self.sink} sinks, got a context of {end}")
        if R:
            keys, _ = read_retrieval(cache, table_row.long(), end, R, heads.stride, quant)
            keys = keys[self.sink:].transpose(0, 1).float()  # [R, T, D]
            C = self.settings.num_clusters(T)
            clusters = cluster_keys(keys, C, iters=self.settings.iters, seed=seed, init=self.settings.init)
            offsets, positions = to_csr(clusters.labels, C, positions_offset=self.sink)
            self.centroids[layer][slot].zero_()
            self.sizes[layer][slot].zero_()
            self.radii[layer][slot].zero_()
            centroids = clusters.centroids
            if self.centroid_scales is not None:
                centroids, self.centroid_scales[layer][slot] = to_fp8_centroids(centroids)
            self.centroids[layer][slot, :, :C] = centroids.to(self.centroids[layer].dtype)
            self.sizes[layer][slot, :, :C] = clusters.sizes
            self.radii[layer][slot, :, :C] = cluster_radii(keys, clusters)
            self.offsets[layer][slot, :, :C + 1] = offsets
            self.offsets[layer][slot, :, C + 1:] = offsets[:, -1:]
            self.positions[layer][slot, :, :T] = positions
        self.ends[slot] = end

    def scales_of(self, layer: int) -> torch.Tensor | None:
        """The layer's `centroid_scales` (fp8 centroids), or None."""
        return None if self.centroid_scales is None else self.centroid_scales[layer]

    def free(self, slot: int) -> None:
        self.ends[slot] = 0
        self.tokens[slot] = None
        for req in self.readers[slot]:
            del self.slot_of[req]
        self.readers[slot].clear()

    def plan(self, req_ids: list[str], prompt_lens: list[int], computed: list[int], query_lens: list[int],
             live: Container[str], prompt_of: Callable[[str], Sequence[int] | None]) -> SqueezeStep:
        """This step's `SqueezeStep` for rows `req_ids` (their prompt lengths, tokens computed before the step and
        tokens in it); `live`: every request the worker still holds; `prompt_of(req)`: its prompt's token ids. Drops
        the requests gone, gives each long enough prompt whose prefill ends in this step a slot (`_assign`), and lets
        each single-token row past its prompt read its slot once built."""
        self.steps += 1
        for req in [req for req in self.slot_of if req not in live]:
            self.readers[self.slot_of.pop(req)].discard(req)
        num_rows = len(req_ids)
        step = SqueezeStep([-1] * num_rows, [0] * num_rows, [0] * num_rows, [])
        for row, (req, prompt_len, before, new) in enumerate(zip(req_ids, prompt_lens, computed, query_lens)):
            slot = self.slot_of.get(req)
            if slot is None:
                if before < prompt_len <= before + new:
                    self._assign(req, row, prompt_len, prompt_of, step)
            elif new == 1 and before >= prompt_len and self.ends[slot]:  # built, decoding
                step.context_ids[row] = slot
                step.context_ends[row] = self.ends[slot]
                step.budget[row] = self.budget_of(slot)
                self.last_read[slot] = self.steps
        return step

    def _assign(self, req: str, row: int, prompt_len: int, prompt_of: Callable[[str], Sequence[int] | None],
                step: SqueezeStep) -> None:
        """A slot for `req`, whose prefill ends in this step: the longest context its prompt starts with, unless what
        the prompt adds to it is itself long enough to squeeze; else a free slot, or the least recently read one that
        no live request reads, which it claims and `step` builds; else none."""
        settings = self.settings
        end = (prompt_len - settings.tail) // self.block_size * self.block_size
        if not (settings.min_context_len <= prompt_len and 0 < end - self.sink
                and prompt_len - self.sink <= settings.max_context_len):
            return
        prompt = prompt_of(req)
        if prompt is None or len(prompt) < prompt_len:
            return
        shared = [slot for slot, tokens in enumerate(self.tokens)
                  if tokens is not None and len(tokens) <= prompt_len and prompt[len(tokens) - 1] == tokens[-1]
                  and list(prompt[:len(tokens)]) == tokens]
        slot = max(shared, key=lambda slot: len(self.tokens[slot]), default=None)
        if slot is None or end - len(self.tokens[slot]) >= settings.min_context_len:
            idle = [slot for slot in range(len(self.tokens)) if not self.readers[slot]]
            if not idle:
                return
            slot = min(idle, key=lambda slot: (self.tokens[slot] is not None, self.last_read[slot]))
            self.free(slot)
            self.tokens[slot] = list(prompt[:end])
            step.builds.append((row, slot, end))
            self.built += 1
        else:
            self.shared += 1
        self.readers[slot].add(req)
        self.slot_of[req] = slot
        self.last_read[slot] = self.steps

    def stage(self, step: SqueezeStep, seq_lens: torch.Tensor) -> SqueezeRows:
        """`step` in the row buffer the kernels read, for `seq_lens` `[num_reqs]` (the step's): one buffer for all
        layers, so that a step stages its plan once and the CUDA graphs captured over it replay each step's plan."""
        buffer = self.rows[:, :seq_lens.shape[0]]
        host = torch.tensor([step.context_ids, step.context_ends, step.budget], dtype=torch.int32)
        # from pinned memory: a copy from pageable memory would wait for the GPU to finish the step before
        buffer[:3].copy_(host.pin_memory() if buffer.is_cuda else host, non_blocking=True)
        window_pass_lens(seq_lens, buffer[1], buffer[3], self.row_window)
        return SqueezeRows(step, *buffer)

    def clustered(self, slot: int) -> int:
        """How many positions the slot's CSR holds: [sink, end) of its context, 0 when none is built."""
        return max(self.ends[slot] - self.sink, 0)

    def context_ends(self, slots: list[int]) -> torch.Tensor:
        """`[num_reqs]` int32: where each request's clustered positions end (its context's end), for
        `sparse_decode_attention`'s `context_ends`."""
        return torch.tensor([self.ends[s] for s in slots], dtype=torch.int32, device=self.device)

    def budget_of(self, slot: int) -> int:
        """The keys each retrieval head selects from the slot's context: `budget` of its clustered positions."""
        return math.ceil(self.settings.budget * self.clustered(slot))

    def budget_keys(self, slots: list[int]) -> torch.Tensor:
        """`[num_reqs]` int32: `budget_of` each request's slot."""
        return torch.tensor([self.budget_of(s) for s in slots], dtype=torch.int32, device=self.device)

    def decode(self, layer: int, query: torch.Tensor, cache: torch.Tensor, heads: LayerHeads,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
               output: torch.Tensor, rows: SqueezeRows, quant: KVQuant | None = None,
               attend: Callable[..., None] | None = None) -> None:
        """The retrieval heads of the rows that read a context, by the Triton kernels: their lookup, then attention
        over sinks, selected keys and window, written into `output`; other rows are left as they are. `attend`
        (pages, lens, starts, context_ends, window_lens: `row_pages.run_pages`' lists of the sinks, selected keys
        and the window's newest keys, and what FlashAttention's window pass read of the rest) attends them and
        merges (gpu_attention.selected_rows_attention); None: the Triton sparse decode reads all of it. Fixed shapes
        and no host syncs: CUDA-graph capturable."""
        max_selected = self.settings.max_selected()
        runs = self.runs(layer, query, heads, query_start_loc, rows.context_ids, rows.budget, scale, max_selected)
        if attend is not None:
            attend(*run_pages(runs, self.positions[layer], rows.context_ids, rows.context_ends, seq_lens, block_table,
                              heads, cache, max_selected, self.row_window), rows.context_ends, rows.flash_seq_lens)
        if attend is None or self.settings.count_reads:
            selected, counts = gather_positions(runs, self.positions[layer], max_selected, rows.context_ids)
            if attend is None:
                sparse_decode_attention(query, cache, heads, query_start_loc, seq_lens, block_table, scale, output,
                                        selected, counts, quant=quant, checked=True, context_ends=rows.context_ends)
            self._count(selected, counts, seq_lens, rows.context_ends, heads)

    def decode_reference(self, layer: int, query: torch.Tensor, cache: torch.Tensor, heads: LayerHeads,
                         query_start_loc: list[int], seq_lens: list[int], block_table: torch.Tensor, scale: float,
                         output: torch.Tensor, step: SqueezeStep, quant: KVQuant | None = None) -> None:
        """`decode` by the PyTorch references (sparse_reference.py), from the host lists: the CPU's path."""
        if not heads.num_retrieval:
            return
        scores = sparse_reference.centroid_scores(query, self.centroids[layer], self.sizes[layer], heads,
                                                  query_start_loc, scale, step.context_ids, self.scales_of(layer),
                                                  self.radii[layer], self.settings.radius_weight)
        budget = torch.tensor(step.budget, dtype=torch.int32)[:, None].expand(-1, heads.num_retrieval)
        selected, counts = sparse_reference.select_banded(scores, self.offsets[layer], self.positions[layer], budget,
                                                          self.settings.max_selected(), step.context_ids)
        sparse_reference.sparse_decode_attention(query, cache, heads, query_start_loc, seq_lens, block_table, scale,
                                                 output, selected, counts, quant, context_ends=step.context_ends)
        self._count(selected, counts, torch.tensor(seq_lens), torch.tensor(step.context_ends), heads)

    def _count(self, selected: torch.Tensor, counts: torch.Tensor, seq_lens: torch.Tensor, context_ends: torch.Tensor,
               heads: LayerHeads) -> None:
        """With `count_reads`, add a layer's squeezed rows to `reads`: the keys read beyond the sinks and the window
        [sink, seq_len - recent), which are the selected positions there and, past the context's end, every position
        there; and the keys there. On the device, no sync: a CUDA graph replays the sums too."""
        if not self.settings.count_reads:
            return
        device = self.reads.device
        ends = context_ends.to(device)
        window = (seq_lens.to(device) - heads.recent).clamp(min=self.sink)  # [num_reqs]
        clustered_end = torch.minimum(window, ends)
        slot = torch.arange(selected.shape[-1], device=device)
        beyond = (selected >= self.sink) & (selected < clustered_end[:, None, None]) & (slot < counts[..., None])
        squeezed = ends > 0
        self.reads[0] += beyond.sum() + ((window - clustered_end) * squeezed).sum() * heads.num_retrieval
        self.reads[1] += ((window - self.sink) * squeezed).sum() * heads.num_retrieval

    def read_share(self) -> float | None:
        """With `count_reads`: keys read beyond the sinks and window / keys there, over the squeezed decode so far
        (None before any, or without `count_reads`)."""
        read, there = self.reads.tolist()
        return read / there if there else None

    def runs(self, layer: int, query: torch.Tensor, heads: LayerHeads, query_start_loc: torch.Tensor,
             context_ids: torch.Tensor, budget: torch.Tensor, scale: float, max_selected: int) -> BandRuns:
        """What each decoding request's retrieval heads read beyond the sinks and window, as runs of clusters
        (`selection.band_runs`): its context's best score bands of clusters (`context_ids` `[num_reqs]` int32 slots)
        to `budget` `[num_reqs]` keys (less than one cluster more), cut at `max_selected`."""
        R = heads.num_retrieval
        scores = centroid_scores(query, self.centroids[layer], self.sizes[layer], heads, query_start_loc, scale,
                                 context_ids, self.scales_of(layer), self.radii[layer], self.settings.radius_weight)
        return band_runs(scores, self.offsets[layer], budget[:, None].expand(-1, R), max_selected, context_ids)
