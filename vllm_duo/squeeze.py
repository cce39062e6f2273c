# SPDX-License-Identifier: Apache-2.0
"""Squeezed Attention on duo's retrieval heads (issue 33): the clustered contexts a worker keeps, and the decode
lookup over them. No vLLM here: the backend owns when a context is built and which requests read it.

A long context is clustered once, at the end of its prefill, layer by layer: each retrieval KV head's keys between
the sinks and the end of the prompt are grouped by spherical K-means (kernels/clustering.py, `keys_per_cluster` keys
per centroid on average, Squeezed Attention's n/16), and the context keeps per head its centroids, cluster sizes and
the CSR of positions per cluster. At decode each request scores its query against its context's centroids
(kernels/selection.py, the paper's Eq. 1, max over the GQA group), takes clusters from the best score band down
until their keys fill `budget` of the clustered positions (`select_banded`: bands of 12.5% in score, no sort), and
attends exactly over those keys plus the sinks and the recent window (kernels/sparse_decode.py):

    prompt of 4,096 tokens, sink 64, recent 256, keys_per_cluster 16, budget 0.25
    clustered positions  [64, 4,096)                  -> 252 clusters per retrieval KV head
    decode at seq_len 4,100, each retrieval KV head:
        sinks [0, 64)  +  best clusters' positions until >= 0.25 x 4,032 = 1,008 keys  +  window [3,844, 4,100)

Tokens generated after the prompt are not clustered: they are read whole, the sparse decode's window starting at
the prompt's end at the latest (`context_ends`).

Memory (per slot, per layer with R retrieval heads, C = ceil(T / keys_per_cluster) for T = max_context_len):
centroids R x C x head_dim in bf16 (the lookup reads all of them at every step: at 16 keys per centroid they are
as many bytes as the keys a 1/16 budget selects from an fp8 cache), sizes R x C and offsets R x (C + 1) int32,
positions R x T int32; all of it preallocated so that decode's lookup keeps fixed shapes (CUDA-graph capturable)
and a build allocates nothing but the clustering's scratch. `ClusteredContexts.bytes_needed` is that sum.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field

from vllm_duo.kernels.clustering import cluster_keys, to_csr
from vllm_duo.kernels.reference import KVQuant, LayerHeads, read_retrieval
from vllm_duo.kernels.selection import centroid_scores, select_banded


class SqueezeSettings(BaseModel):
    """budget: share of a context's clustered keys each retrieval head reads at decode (0 < budget <= 1);
    keys_per_cluster: mean keys per centroid; iters: Lloyd iterations at most; max_contexts: slots kept at once;
    max_context_len: the longest prompt a slot holds (longer ones are served by duo unsqueezed)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    budget: float = Field(default=0.25, gt=0.0, le=1.0)
    keys_per_cluster: int = Field(default=16, ge=1)
    iters: int = Field(default=10, ge=1)
    max_contexts: int = Field(default=4, ge=1)
    max_context_len: int = Field(default=131072, ge=1)

    def num_clusters(self, num_keys: int) -> int:
        return max(1, math.ceil(num_keys / self.keys_per_cluster))


class ClusteredContexts:
    """Per layer, `max_contexts` slots of clustered retrieval keys:

    - centroids `[slots, R, C, head_dim]` (`centroid_dtype`), sizes `[slots, R, C]` int32 (0: no such cluster);
    - offsets `[slots, R, C + 1]` int32 and positions `[slots, R, T]` int32: the CSR of positions per cluster;
    - `prompt_len[slot]`: where its prompt ends (0: free); `clustered(slot)` positions past the sinks are in its CSR.

    C and T are the largest a slot can need (`SqueezeSettings.max_context_len`); a smaller context leaves the
    rest as empty clusters.
    """

    def __init__(self, retrieval_per_layer: list[int], head_dim: int, sink: int, settings: SqueezeSettings,
                 device: torch.device | str = "cpu", centroid_dtype: torch.dtype = torch.bfloat16):
        self.settings, self.sink, self.device = settings, sink, torch.device(device)
        slots, T = settings.max_contexts, settings.max_context_len
        C = settings.num_clusters(T)
        self.centroids = [torch.zeros(slots, R, C, head_dim, dtype=centroid_dtype, device=device)
                          for R in retrieval_per_layer]
        self.sizes = [torch.zeros(slots, R, C, dtype=torch.int32, device=device) for R in retrieval_per_layer]
        self.offsets = [torch.zeros(slots, R, C + 1, dtype=torch.int32, device=device) for R in retrieval_per_layer]
        self.positions = [torch.zeros(slots, R, T, dtype=torch.int32, device=device) for R in retrieval_per_layer]
        self.prompt_len = [0] * slots

    @staticmethod
    def bytes_needed(retrieval_per_layer: list[int], head_dim: int, settings: SqueezeSettings,
                     centroid_dtype: torch.dtype = torch.bfloat16) -> int:
        T = settings.max_context_len
        C = settings.num_clusters(T)
        per_head = C * head_dim * centroid_dtype.itemsize + C * 4 + (C + 1) * 4 + T * 4
        return settings.max_contexts * sum(retrieval_per_layer) * per_head

    def build(self, layer: int, slot: int, cache: torch.Tensor, heads: LayerHeads, table_row: torch.Tensor,
              prompt_len: int, quant: KVQuant | None = None, seed: int = 0) -> None:
        """Cluster one context's retrieval keys of `layer` into `slot`: positions [sink, prompt_len) as attention
        sees them (fp8 dequantized with `quant`), read through the request's block table row."""
        T, R = prompt_len - self.sink, heads.num_retrieval
        if not 0 < T <= self.settings.max_context_len:
            raise ValueError(f"a squeezed context holds 1 to {self.settings.max_context_len} positions past the "
                             f"{self.sink} sinks, got a prompt of {prompt_len}")
        if R:
            keys, _ = read_retrieval(cache, table_row.long(), prompt_len, R, heads.stride, quant)
            keys = keys[self.sink:].transpose(0, 1).float()  # [R, T, D]
            C = self.settings.num_clusters(T)
            clusters = cluster_keys(keys, C, iters=self.settings.iters, seed=seed)
            offsets, positions = to_csr(clusters.labels, C, positions_offset=self.sink)
            self.centroids[layer][slot].zero_()
            self.sizes[layer][slot].zero_()
            self.centroids[layer][slot, :, :C] = clusters.centroids.to(self.centroids[layer].dtype)
            self.sizes[layer][slot, :, :C] = clusters.sizes
            self.offsets[layer][slot, :, :C + 1] = offsets
            self.offsets[layer][slot, :, C + 1:] = offsets[:, -1:]
            self.positions[layer][slot, :, :T] = positions
        self.prompt_len[slot] = prompt_len

    def free(self, slot: int) -> None:
        self.prompt_len[slot] = 0

    def clustered(self, slot: int) -> int:
        """How many positions the slot's CSR holds: [sink, prompt_len) of its context, 0 when free."""
        return max(self.prompt_len[slot] - self.sink, 0)

    def context_ends(self, slots: list[int]) -> torch.Tensor:
        """`[num_reqs]` int32: where each request's clustered positions end (its prompt's end), for
        `sparse_decode_attention`'s `context_ends`."""
        return torch.tensor([self.prompt_len[s] for s in slots], dtype=torch.int32, device=self.device)

    def budget_keys(self, slots: list[int]) -> torch.Tensor:
        """`[num_reqs]` int32: keys each retrieval head of a request reads beyond the sinks and window."""
        keys = [math.ceil(self.settings.budget * self.clustered(s)) for s in slots]
        return torch.tensor(keys, dtype=torch.int32, device=self.device)

    def select(self, layer: int, query: torch.Tensor, heads: LayerHeads, query_start_loc: torch.Tensor,
               context_ids: torch.Tensor, budget: torch.Tensor, scale: float,
               max_selected: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions each decoding request's retrieval heads read beyond the sinks and window: its context's
        best score bands of clusters (`context_ids` `[num_reqs]` int32 slots) to at least `budget` `[num_reqs]`
        keys, cut at `max_selected` -> selected `[num_reqs, R, max_selected]` int32, num_selected `[num_reqs, R]`
        int32."""
        R = heads.num_retrieval
        scores = centroid_scores(query, self.centroids[layer], self.sizes[layer], heads, query_start_loc, scale,
                                 context_ids)
        return select_banded(scores, self.offsets[layer], self.positions[layer], budget[:, None].expand(-1, R),
                             max_selected, context_ids)
