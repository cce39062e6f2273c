# SPDX-License-Identifier: Apache-2.0
"""Issue 33's mapping question, on the CPU: which key selection on duo's retrieval heads gives the better accuracy
per key read at decode, Squeezed Attention's token-level K-means clusters or page-level summaries (LServe, Quest)?

SmolLM2-135M-Instruct in float32 through Hugging Face transformers. Each prompt (the eval's two families, a seed
the eval's reported numbers do not use) is prefilled with duo: retrieval heads causal-full, streaming heads
Λ-masked (sink + recent). Its reference answer (" " and the key's five digits) is then teacher-forced as decode
steps; at those steps only, each retrieval KV head attends to the sink, the window (the prompt's last pages from
`ctx_end` = the page-aligned start of its last `recent` tokens, plus the answer so far) and the keys that a method
selects from the selectable context [sink, ctx_end); streaming heads stay Λ-masked. One selection per KV head and
decode step, shared by its GQA group's query heads. A prompt is a hit when the argmax at every answer position is
the teacher token (the first one comes from the prefill, which no method changes).

Methods, each at budgets of 1/16, 1/8, 1/4 of the selectable keys (per layer, retrieval KV head and step):
  oracle       the budget's top tokens by exact attention probability summed over the group's query heads
  squeeze-cN   Squeezed Attention, 1 level: spherical K-means (k-means++ init, kernels/clustering.py) over the
               selectable keys, n/N clusters; centroid = mean of the cluster's raw keys (as the authors' code); per
               query head Eq. 1, S_i = exp(q.C_i) / sum_j N_j exp(q.C_j); clusters taken by S_i until the budget is met
  squeeze-c16-fp8  squeeze-c16's clusters with each centroid rounded to fp8 (e4m3, no scale): what a lookup that
               reads half the centroid bytes would select
  squeeze-c16-chunkS  the same K-means per S-token chunk [kS, (k+1)S) of absolute positions (chunk 0 starts at the
               sink), 1/16 of the chunk's keys as clusters, so a chunk's clusters depend on its tokens only (the
               clustering vLLM pages can hold); selection stays global: all chunks' centroids scored by Eq. 1
               together. The partial last chunk (the selectable keys after the last complete chunk) is always read
               in full, on top of the budget (clusters fill the budget); the whole region when no chunk is complete
  pageP-mean   P-token pages of the paged cache (absolute positions), summary = the page's mean key, scored as Eq. 1
  pageP-quest  P-token pages, Quest's bound sum_c max(q_c max_c, q_c min_c), normalized as Eq. 1
GQA: `max` ranks a unit by the largest S_i of the group's query heads, `sum` by their sum (clusters only: on
pages the two differed by at most one hit in a first trial). Units are taken in score
order while the keys taken so far are under the budget (the last unit may overshoot it: the keys actually read are
reported). Bounds: `duo` (every selectable key: the served duo) and `sink+recent` (none). `--methods` keeps only
the listed method names (duo always runs: the KL reference).

`--reuse 1 2 4` also runs each unit family with its selection made at every 2nd and 4th decode step only, the
steps between reading the last one (LServe's reused selection: a lookup in every Kth step).
`--query own prev-input prev-mid prev-query` also scores each unit family with a query speculated from an earlier
point of the residual stream (InfiniGen's idea: a lookup that could run while the layer before computes): layer L's
own input norm, q projection and RoPE applied to the input of layer L - 1 (`prev-input`) or to its residual after
attention (`prev-mid`), instead of layer L's own query; or (`prev-query`) `prev-input` recovered from layer L - 1's
own query alone, as an attention backend sees it (rounded to bf16, RoPE undone): n = pinv(W_q diag(g)) q of layer
L - 1 (singular values under QUERY_PINV_RCOND of the largest dropped), then layer L's W_q diag(g) n and RoPE, one
matrix per layer (`prev-query-bf16`, `prev-query-fp8`: that matrix stored in bf16, or in fp8 e4m3 with a scale per
row, as a GPU would keep it).
Layer 0 keeps its own. Attention still uses the true query.

Reported per method and budget: hits per family, recall of the exact attention mass over the selectable region
(per layer, retrieval KV head and step: selected mass / region mass, summed over the group's query heads, then the
mean), keys read / selectable keys (and the share of them that the partial chunk reads), the lookup's reads
(summary vectors / selectable keys), the mean KL divergence of the decode steps' next-token distributions from
duo's; and the K-means time and centroid memory.

  PYTHONPATH=/tmp/duo-overlay DUO_ROOT=$PWD HF_HUB_OFFLINE=1 python benchmarks/squeeze_study.py --prompts 40 --seed 7
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_duo.kernels.clustering import cluster_keys, cluster_radii
from vllm_duo.pattern import resolve_pattern
from vllm_duo.squeeze import to_fp8_centroids
from vllm_duo.tools import smollm2
from vllm_duo.tools.accuracy.needles import DEFAULT_NEEDLES, HAYSTACKS, NEEDLES, needle_prompt
from vllm_duo.tools.accuracy.passkey import classic_passkey_text
from vllm_duo.tools.accuracy.training import _Mixing
from vllm_duo.tools.bench.machine import machine_info, now

ATTENTION = "duo_squeeze_study"
PAGE = 16  # vLLM's block size: the selectable region starts and ends on a page boundary
NEEDLE_CONTEXTS = (2000, 3000, 4000, 5000, 6000)
PASSKEY_REPEATS = (80, 130, 180, 230, 280)  # 2.0k-6.8k tokens on SmolLM2
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
BUDGETS = (16, 8, 4)  # budget = selectable keys / this
CLUSTERS = (8, 16, 64)  # K-means clusters = selectable keys / this
# squeeze-c16-radW: squeeze-c16's clusters scored optimistically, q.C + W |q| r for the cluster's radius r (the largest
# distance of its raw keys from C; W = 1 bounds every key's logit): a cluster with one far key can still be chosen
RADIUS_WEIGHTS = (0.25, 0.5, 1.0)
CHUNKS = (512, 1024, 2048, 4096)  # squeeze-c16-chunkS: K-means per S-token chunk, chunk keys / 16 clusters
CHUNK_CLUSTERS = 16
PAGES = (16, 64)
AGGREGATES = ("max", "sum")
# squeeze-c16-bandsB: squeeze-c16's clusters taken by score band, not score (kernels/selection.py's select_banded):
# bands of float32 bits >> 20 (12.5%) below the row's top; the bands better than the cut whole, then the cut band's
# clusters in cluster order. B, the bands: 2048 every float32 score's own; 64 the last holding every score 63 steps
# (~1/256) below the top or more; 128 64 steps, then 64 bands of two octaves; 256 the last at 255 steps (1/2^32)
BAND_RULES = (2048, 64, 128, 256)


@dataclass
class Units:
    """A retrieval layer's selectable keys grouped into units (clusters or pages), per retrieval KV head:
    labels [h, n] (unit of each key), sizes [h, U], and the summaries the score reads."""

    labels: torch.Tensor
    sizes: torch.Tensor
    mean: torch.Tensor | None = None  # [h, U, d]
    high: torch.Tensor | None = None  # Quest's per-channel max and min [h, U, d]
    low: torch.Tensor | None = None
    always: torch.Tensor | None = None  # [U] bool: units read whatever their score (the partial chunk)
    radius: torch.Tensor | None = None  # [h, U]: with `radius_weight`, added to the score as weight |q| radius
    radius_weight: float = 0.0

    def scores(self, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Per query head, the unit's estimated log attention logit: q.mean, or Quest's upper bound. q [h, g, A, d]
        -> [h, g, A, U]."""
        if self.mean is not None:
            logits = torch.einsum("hgad,hud->hgau", q, self.mean)
            if self.radius is not None:
                logits = logits + self.radius_weight * q.norm(dim=-1)[..., None] * self.radius[:, None, None]
            return logits * scale
        qe = q[:, :, :, None, :]  # [h, g, A, 1, d]
        return torch.maximum(qe * self.high[:, None, None], qe * self.low[:, None, None]).sum(-1) * scale


def page_units(keys: torch.Tensor, sink: int, page: int, kind: str) -> Units:
    """Units of `page` consecutive absolute positions (the selectable region starts at `sink`, a page multiple);
    the last page may be partial. Summary: the mean key, or Quest's per-channel max and min."""
    h, n, d = keys.shape
    positions = torch.arange(sink, sink + n)
    labels = (positions // page - sink // page).expand(h, n).contiguous()
    count = int(labels[0, -1]) + 1
    sizes = torch.zeros(h, count).scatter_add_(1, labels, torch.ones(h, n))
    index = labels[:, :, None].expand(h, n, d)
    if kind == "mean":
        sums = torch.zeros(h, count, d).scatter_add_(1, index, keys)
        return Units(labels=labels, sizes=sizes, mean=sums / sizes[:, :, None])
    high = torch.full((h, count, d), -math.inf).scatter_reduce_(1, index, keys, "amax")
    low = torch.full((h, count, d), math.inf).scatter_reduce_(1, index, keys, "amin")
    return Units(labels=labels, sizes=sizes, high=high, low=low)


@dataclass
class Method:
    """One selection rule at one budget (keys = selectable / budget); kind: duo, sink+recent, oracle, or a unit
    family name (squeeze-cN, pageP-mean, pageP-quest) with a GQA aggregate, its selection made afresh at every
    decode step or at every `reuse`-th (LServe's reused page selection: the steps between read the last one's)."""

    kind: str
    budget: int = 0
    aggregate: str = ""
    reuse: int = 1  # a unit family's selection made at every `reuse`-th decode step and kept until the next
    query: str = "own"  # what scores the units: the layer's own query, or one speculated (`speculated_query`)

    @property
    def rule(self) -> str:
        return self.kind + (f"/{self.aggregate}" if self.aggregate else "")

    @property
    def name(self) -> str:
        return (self.rule + (f"/reuse{self.reuse}" if self.reuse > 1 else "")
                + (f"/q-{self.query}" if self.query != "own" else ""))


@dataclass
class Study:
    """Passed through the model's forward kwargs to the attention function: the prompt's cached keys and values,
    the retrieval mask, the units per layer, the method of the current decode run and its statistics."""

    retrieval: torch.Tensor  # [layers, kv heads] bool
    sink: int
    recent: int
    phase: str = "prefill"
    prompt_len: int = 0
    ctx_end: int = 0
    keys: dict = field(default_factory=dict)  # layer -> [kv heads, T, d] buffers
    values: dict = field(default_factory=dict)
    units: dict = field(default_factory=dict)  # (unit family, layer) -> Units
    method: Method | None = None
    stats: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)  # the model's decoder layers (`speculated_query`)
    inputs: dict = field(default_factory=dict)  # layer -> (its input hidden states, position embeddings), at decode
    mids: dict = field(default_factory=dict)  # layer -> its residual after attention, at decode
    queries: dict = field(default_factory=dict)  # layer -> its query [heads, A, d] (after RoPE), at decode
    query_maps: dict = field(default_factory=dict)  # (layer, query) -> `prev-query`'s matrix, made on first use

    def __post_init__(self):
        self.mixing = _Mixing(self.sink, self.recent)


def study_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, study=None, **kwargs):
    """Duo attention for the study: at prefill, retrieval heads causal over the whole prompt and streaming heads
    Λ-masked, caching the prompt's keys and values; at decode (the teacher-forced answer after the prompt), the
    retrieval heads see sink + window + the current method's selection. The HF mask is ignored."""
    layer, groups = module.layer_idx, query.shape[1] // key.shape[1]
    retrieval = study.retrieval[layer]
    rq = retrieval.repeat_interleave(groups)
    if study.phase == "prefill":
        length = key.shape[2]
        study.keys[layer] = torch.empty(key.shape[1], length + 16, key.shape[3])
        study.values[layer] = torch.empty_like(study.keys[layer])
        study.keys[layer][:, :length], study.values[layer][:, :length] = key[0], value[0]
        out = torch.empty_like(query)
        k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        if rq.any():
            out[:, rq] = F.scaled_dot_product_attention(query[:, rq], k[:, rq], v[:, rq], is_causal=True,
                                                        scale=scaling)
        if (~rq).any():
            out[:, ~rq] = study.mixing.streaming(query[:, ~rq], k[:, ~rq], v[:, ~rq], scaling)
        return out.transpose(1, 2).contiguous(), None
    return decode_attention(study, layer, query[0], key[0], value[0], scaling, retrieval, groups)


def decode_attention(study: Study, layer: int, query, key, value, scale, retrieval, groups):
    """The decode steps [heads, A, d] over the cached prompt and the answer so far, with the method's selection."""
    prompt, steps = study.prompt_len, query.shape[1]
    total = prompt + steps
    study.keys[layer][:, prompt:total], study.values[layer][:, prompt:total] = key, value
    keys, values = study.keys[layer][:, :total], study.values[layer][:, :total]
    heads, kv_heads = query.shape[0], keys.shape[0]
    study.queries[layer] = query
    logits = torch.einsum("had,htd->hat", query, keys.repeat_interleave(groups, 0)) * scale
    q_pos = torch.arange(prompt, total)[:, None]
    k_pos = torch.arange(total)[None, :]
    causal = k_pos <= q_pos  # [A, T]
    streaming_view = causal & ((k_pos < study.sink) | (k_pos > q_pos - study.recent))
    allowed = streaming_view.expand(heads, steps, total).clone()
    if retrieval.any():
        sink, end = study.sink, study.ctx_end
        r_index = retrieval.nonzero()[:, 0]
        q_r = query.view(kv_heads, groups, steps, -1)[r_index]  # [h, g, A, d]
        full = torch.softmax(logits.masked_fill(~causal, -math.inf), -1).view(kv_heads, groups, steps, total)
        region_p = full[r_index][..., sink:end].sum(1)  # [h, A, n]: the group's exact mass per selectable key
        if study.method.query != "own" and layer > 0:
            q_r = speculated_query(study, layer).view(kv_heads, groups, steps, -1)[r_index]
        selected, read, lookup, forced = select(study, layer, q_r, region_p, scale)
        base = causal & ((k_pos < sink) | (k_pos >= end))
        view = base.expand(len(r_index), steps, total).clone()
        view[..., sink:end] |= selected
        rq_index = (r_index[:, None] * groups + torch.arange(groups)).flatten()
        allowed[rq_index] = view.repeat_interleave(groups, 0)
        mass = region_p.sum(-1)
        recall = (region_p * selected).sum(-1) / mass.clamp_min(1e-30)
        n = end - sink
        stats = study.stats
        stats["recall"] = stats.get("recall", 0.0) + float(recall.sum())
        stats["read"] = stats.get("read", 0.0) + float(read.sum()) / n
        stats["forced"] = stats.get("forced", 0.0) + forced * recall.numel() / n
        stats["count"] = stats.get("count", 0) + recall.numel()
        stats["lookup"] = lookup / n
    probs = torch.softmax(logits.masked_fill(~allowed, -math.inf), -1)
    out = torch.einsum("hat,htd->had", probs, values.repeat_interleave(groups, 0))
    return out.transpose(0, 1)[None].contiguous(), None


def keep_input(study: Study, layer: int, _module, args, kwargs) -> None:
    """A decoder layer's forward pre-hook: its input and position embeddings, at decode."""
    if study.phase == "decode":
        study.inputs[layer] = (args[0] if args else kwargs["hidden_states"], kwargs["position_embeddings"])


def keep_mid(study: Study, layer: int, _module, args) -> None:
    """The post-attention norm's forward pre-hook: the layer's residual after attention, at decode."""
    if study.phase == "decode":
        study.mids[layer] = args[0]


def speculated_query(study: Study, layer: int) -> torch.Tensor:
    """Layer `layer`'s query `[heads, A, d]` speculated one layer earlier (`study.method.query`): that layer's input
    norm, q projection and RoPE on layer - 1's input (prev-input) or residual after attention (prev-mid), or
    `query_map` on layer - 1's query with its RoPE undone (prev-query[-bf16|-fp8]), then RoPE."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = study.inputs[layer][1]
    target = study.layers[layer]
    if study.method.query.startswith("prev-query"):
        before = study.queries[layer - 1].to(torch.bfloat16).float()[None]  # [1, heads, A, d]
        before = apply_rotary_pos_emb(before, before, cos, -sin)[0]  # RoPE undone
        key = (layer, study.method.query)
        if key not in study.query_maps:
            study.query_maps[key] = query_map(study.layers[layer - 1], target, study.method.query[len("prev-query-"):])
        flat = before.transpose(1, 2).flatten(2) @ study.query_maps[key].T  # [1, A, heads * d]
    else:
        source = study.inputs[layer - 1][0] if study.method.query == "prev-input" else study.mids[layer - 1]
        flat = target.self_attn.q_proj(target.input_layernorm(source))
    q = flat.view(*flat.shape[:2], -1, target.self_attn.head_dim).transpose(1, 2)
    return apply_rotary_pos_emb(q, q, cos, sin)[0][0]


QUERY_PINV_RCOND = 1e-3  # `prev-query`: singular values of the layer before's map under this share of its largest


def query_map(before, layer, stored: str = "") -> torch.Tensor:
    """`prev-query`'s matrix: layer `layer`'s W_q diag(g) after pinv(W_q diag(g)) of layer `before` (g: the input
    norm's weight), which takes a query of `before` (RoPE undone) to `layer`'s query of the same normalized input;
    `stored` bf16 or fp8: as stored in bf16, or in e4m3 with a scale per row."""
    def to_query(decoder_layer):
        return decoder_layer.self_attn.q_proj.weight * decoder_layer.input_layernorm.weight[None, :]
    matrix = to_query(layer) @ torch.linalg.pinv(to_query(before), rtol=QUERY_PINV_RCOND)
    if stored == "bf16":
        return matrix.to(torch.bfloat16).float()
    if stored != "fp8":
        return matrix
    rows, scales = to_fp8_centroids(matrix[:, None, :])  # each row as one fp8 centroid group, its own scale
    return rows[:, 0].float() * scales[:, None]


def select(study: Study, layer: int, q: torch.Tensor, region_p: torch.Tensor, scale: float):
    """The selected selectable keys [h, A, n] (bool) of the current method, the keys read [h, A], the summary
    vectors the lookup reads per head and the keys per head read whatever the scores (the partial chunk)."""
    method, (h, steps, n) = study.method, region_p.shape
    if method.kind == "duo":
        return torch.ones(h, steps, n, dtype=torch.bool), torch.full((h, steps), float(n)), 0, 0
    if method.kind == "sink+recent":
        return torch.zeros(h, steps, n, dtype=torch.bool), torch.zeros(h, steps), 0, 0
    budget = max(1, round(n / method.budget))
    if method.kind == "oracle":
        top = region_p.topk(budget, -1).indices
        chosen = torch.zeros(h, steps, n, dtype=torch.bool).scatter_(-1, top, True)
        return chosen, torch.full((h, steps), float(budget)), 0, 0
    units = study.units[(method.kind, layer)]
    always = torch.zeros(units.sizes.shape[1], dtype=torch.bool) if units.always is None else units.always
    sizes = units.sizes[:, None, :].expand(h, steps, -1)  # [h, A, U]
    estimate = units.scores(q, scale).masked_fill((sizes[:, None] == 0) | always, -math.inf)
    log_s = estimate - torch.logsumexp(estimate + sizes[:, None].log(), -1, keepdim=True)  # Eq. 1, per head
    score = log_s.amax(1) if method.aggregate == "max" else torch.logsumexp(log_s, 1)
    score = score.masked_fill(always, math.inf)  # taken first
    forced = float(units.sizes[0, always].sum())
    order = score.argsort(-1, descending=True)
    if "-bands" in method.kind:
        order = band_order(score, int(method.kind.rsplit("bands", 1)[1]))
    ranked = sizes.gather(-1, order)
    take = (ranked.cumsum(-1) - ranked) < budget + forced  # the forced keys come on top of the budget
    chosen_units = torch.zeros_like(take).scatter_(-1, order, take)
    chosen = chosen_units.gather(-1, units.labels[:, None, :].expand(h, steps, n))
    read = (chosen_units * sizes).sum(-1)
    if method.reuse > 1:  # step a reads the selection of step a - a % reuse
        made = torch.arange(steps) // method.reuse * method.reuse
        chosen, read = chosen[:, made], read[:, made]
    vectors = int((~always).sum()) * (2 if units.high is not None else 1)
    return chosen, read, vectors, forced


def band_order(log_score: torch.Tensor, bands: int) -> torch.Tensor:
    """Units by band of exp(log_score) below the row's top (`BAND_RULES`), ties in unit order: [.., U] indices."""
    bits = (log_score.exp().float().view(torch.int32) >> 20).long()
    steps = bits.amax(-1, keepdim=True) - bits
    if bands == 128:
        steps = torch.where(steps < 64, steps, 64 + (steps - 64) // 16)
    band = steps if bands == 2048 else steps.clamp(max=bands - 1)
    return torch.sort(band, dim=-1, stable=True).indices


@dataclass
class Prompt:
    family: str
    input_ids: list[int]
    answer: list[int]
    key: str
    needle_start: int
    depth: float


def make_prompts(tokenizer, count: int, seed: int, sink: int, recent: int,
                 contexts: tuple[int, ...] = NEEDLE_CONTEXTS, repeats_grid: tuple[int, ...] = PASSKEY_REPEATS
                 ) -> list[Prompt]:
    """`count` prompts per family, lengths and depths cycling over the grids; seeded as the eval seeds its cells.
    needles: needles.needle_prompt (plain template), phrasing and haystack cycling; passkey: the classic test."""
    prompts = []
    haystacks = tuple(HAYSTACKS)
    for i in range(count):
        context, depth = contexts[i % len(contexts)], DEPTHS[(i // len(contexts)) % len(DEPTHS)]
        rng = random.Random(f"{seed}/{context}/{depth}/{i}")
        p = needle_prompt(tokenizer, context, rng, depth, NEEDLES[DEFAULT_NEEDLES[i % len(DEFAULT_NEEDLES)]],
                          HAYSTACKS[haystacks[i % len(haystacks)]], chat=False, sink=sink, recent=recent)
        answer = tokenizer(" " + p.key, add_special_tokens=False).input_ids
        prompts.append(Prompt("needles", p.input_ids, answer, p.key, p.needle.start, depth))
    for i in range(count):
        repeats = repeats_grid[i % len(repeats_grid)]
        rng = random.Random(f"{seed}/passkey/{repeats}/{i}")
        depth = round(rng.uniform(min(DEPTHS), max(DEPTHS)), 4)
        key = str(rng.randint(10000, 99999))
        text, needle_at = classic_passkey_text(repeats, depth, key)
        encoded = tokenizer(text, return_offsets_mapping=True)
        needle_start = next(j for j, (_, end) in enumerate(encoded.offset_mapping) if end > needle_at)
        answer = tokenizer(" " + key, add_special_tokens=False).input_ids
        prompts.append(Prompt("passkey", encoded.input_ids, answer, key, needle_start, depth))
    return prompts


def unit_families() -> list[str]:
    return ([f"squeeze-c{c}" for c in CLUSTERS] + ["squeeze-c16-fp8"] + [f"squeeze-c16-bands{b}" for b in BAND_RULES]
            + [f"squeeze-c16-rad{w:g}" for w in RADIUS_WEIGHTS]
            + [f"squeeze-c{CHUNK_CLUSTERS}-chunk{s}" for s in CHUNKS]
            + [f"page{p}-{kind}" for p in PAGES for kind in ("mean", "quest")])


def methods(names: list[str] | None = None, reuses: tuple[int, ...] = (1,),
            queries: tuple[str, ...] = ("own",)) -> list[Method]:
    """Every method (duo first), or those whose rule is in `names` and duo; each unit family's at every reuse of
    `reuses` and with every query of `queries`."""
    listed = [Method("duo"), Method("sink+recent")]
    for budget in BUDGETS:
        listed.append(Method("oracle", budget))
        listed += [Method(kind, budget, agg, reuse, query) for kind in unit_families()
                   for agg in (AGGREGATES if kind.startswith("squeeze") else AGGREGATES[:1]) for reuse in reuses
                   for query in queries]
    return [m for m in listed if names is None or m.kind == "duo" or m.rule in names]


def chunk_units(keys: torch.Tensor, sink: int, size: int, iters: int, seed: int) -> tuple[list[Units], dict]:
    """squeeze-c16-chunk`size` of the stacked retrieval heads' selectable keys [H, n, d] (from `sink`): K-means of each
    complete chunk [k size, (k + 1) size) on its own, chunk keys / 16 clusters (chunks 1.. batched as heads, chunk 0
    shortened by the sink alone), and the partial last chunk one unit read in full. Returns the units per head
    (one Units of [H, ...]) and the K-means timing."""
    h, n, d = keys.shape
    complete = (sink + n) // size  # chunks that end inside the region
    tail = sink if complete == 0 else complete * size  # the partial chunk's start (absolute)
    centroids, sizes, labels, seconds, clusters = [], [], [], 0.0, 0
    pieces = []
    if complete:
        pieces.append(keys[:, :size - sink])  # chunk 0
    if complete > 1:
        pieces.append(keys[:, size - sink:tail - sink].reshape(h * (complete - 1), size, d))
    for piece in pieces:
        chunks = piece.shape[0] // h
        k = piece.shape[1] // CHUNK_CLUSTERS
        start = time.perf_counter()
        result = cluster_keys(piece, k, iters, seed=seed)
        seconds += time.perf_counter() - start
        offset = clusters + torch.arange(chunks)[:, None] * k  # each chunk's first unit
        labels.append((result.labels.view(h, chunks, -1) + offset).reshape(h, -1))
        centroids.append(result.centroids.view(h, chunks * k, d))
        sizes.append(result.sizes.view(h, chunks * k).float())
        clusters += chunks * k
    partial = sink + n - tail
    if partial:
        labels.append(torch.full((h, partial), clusters))
        centroids.append(keys[:, tail - sink:].mean(1, keepdim=True))
        sizes.append(torch.full((h, 1), float(partial)))
    always = torch.zeros(clusters + bool(partial), dtype=torch.bool)
    always[clusters:] = True
    units = Units(labels=torch.cat(labels, 1), sizes=torch.cat(sizes, 1), mean=torch.cat(centroids, 1), always=always)
    timing = {"chunks": complete, "clusters": clusters, "partial": partial, "seconds": round(seconds, 3),
              "seconds_per_head": round(seconds / h, 4), "seconds_per_chunk": round(seconds / max(h * complete, 1), 5)}
    return units, timing


def build_units(study: Study, families: set[str], iters: int, generator: torch.Generator) -> dict:
    """The unit families in `families` (clusters and pages) of every retrieval head's selectable keys; K-means
    batched over all retrieval heads of the prompt (the regions have one length). Returns the K-means timings."""
    sink, end = study.sink, study.ctx_end
    layers = [layer for layer in range(study.retrieval.shape[0]) if study.retrieval[layer].any()]
    per_layer = {layer: study.keys[layer][study.retrieval[layer], sink:end] for layer in layers}
    for layer, keys in per_layer.items():
        for page in PAGES:
            for kind in ("mean", "quest"):
                if f"page{page}-{kind}" in families:
                    study.units[(f"page{page}-{kind}", layer)] = page_units(keys, sink, page, kind)
    stacked = torch.cat([per_layer[layer] for layer in layers])  # [all retrieval heads, n, d]
    n, timing = stacked.shape[1], {}
    for c in CLUSTERS:
        derived = any(f.startswith(("squeeze-c16-fp8", "squeeze-c16-bands", "squeeze-c16-rad")) for f in families)
        if f"squeeze-c{c}" not in families and not (c == 16 and derived):
            continue
        k = max(1, n // c)
        start = time.perf_counter()
        clusters = cluster_keys(stacked, k, iters, seed=int(torch.randint(2 ** 31, (), generator=generator)))
        seconds = time.perf_counter() - start
        units = Units(labels=clusters.labels, sizes=clusters.sizes.float(), mean=clusters.centroids)
        split_units(study, f"squeeze-c{c}", units, layers, per_layer)
        if c == 16:
            rounded = clusters.centroids.to(torch.float8_e4m3fn).float()
            split_units(study, "squeeze-c16-fp8", dataclasses.replace(units, mean=rounded), layers, per_layer)
            for bands in BAND_RULES:
                split_units(study, f"squeeze-c16-bands{bands}", units, layers, per_layer)
            radius = cluster_radii(stacked, clusters)
            for weight in RADIUS_WEIGHTS:
                split_units(study, f"squeeze-c16-rad{weight:g}",
                            dataclasses.replace(units, radius=radius, radius_weight=weight), layers, per_layer)
        timing[f"squeeze-c{c}"] = {"clusters": k, "iterations": clusters.iterations, "seconds": round(seconds, 3),
                                   "seconds_per_head": round(seconds / stacked.shape[0], 4)}
    for size in CHUNKS:
        family = f"squeeze-c{CHUNK_CLUSTERS}-chunk{size}"
        if family in families:
            seed = int(torch.randint(2 ** 31, (), generator=generator))
            units, timing[family] = chunk_units(stacked, sink, size, iters, seed)
            split_units(study, family, units, layers, per_layer)
    return timing


def split_units(study: Study, family: str, units: Units, layers: list[int], per_layer: dict) -> None:
    """Store the stacked heads' units per layer."""
    offset = 0
    for layer in layers:
        heads = slice(offset, offset + per_layer[layer].shape[0])
        study.units[(family, layer)] = Units(labels=units.labels[heads], sizes=units.sizes[heads],
                                             mean=units.mean[heads], always=units.always,
                                             radius=None if units.radius is None else units.radius[heads],
                                             radius_weight=units.radius_weight)
        offset = heads.stop


def run_prompt(model, study: Study, prompt: Prompt, chosen: list[Method], iters: int,
               generator: torch.Generator) -> dict:
    """Prefill once, build the units the methods `chosen` (duo first) use, then one teacher-forced decode pass
    per method."""
    ids = torch.tensor([prompt.input_ids])
    length, answer = len(prompt.input_ids), prompt.answer
    study.phase, study.prompt_len, study.keys, study.values, study.units = "prefill", length, {}, {}, {}
    study.ctx_end = (length - study.recent) // PAGE * PAGE
    start = time.perf_counter()
    with torch.no_grad():
        first = model(input_ids=ids, use_cache=False, study=study, logits_to_keep=1).logits[0, -1]
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    kmeans = build_units(study, {m.kind for m in chosen}, iters, generator)
    units_s = time.perf_counter() - start
    study.phase = "decode"
    steps = torch.tensor([answer[:-1]])
    positions = torch.arange(length, length + len(answer) - 1)[None]
    first_ok = int(first.argmax()) == answer[0]
    runs, reference = {}, None
    start = time.perf_counter()
    for method in chosen:
        study.method, study.stats = method, {}
        with torch.no_grad():
            logits = model(input_ids=steps, position_ids=positions, use_cache=False, study=study).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        if reference is None:
            reference = logp  # duo runs first
        hit = first_ok and logits.argmax(-1).tolist() == answer[1:]
        count = max(study.stats.get("count", 0), 1)
        kl = float((reference.exp() * (reference - logp)).sum(-1).mean())
        runs[f"{method.name}@{method.budget}"] = {
            "hit": hit, "recall": study.stats.get("recall", 0.0) / count, "read": study.stats.get("read", 0.0) / count,
            "lookup": study.stats.get("lookup", 0.0), "forced": study.stats.get("forced", 0.0) / count, "kl": kl}
    decode_s = time.perf_counter() - start
    return {"family": prompt.family, "tokens": length, "depth": prompt.depth, "needle_start": prompt.needle_start,
            "ctx_end": study.ctx_end, "selectable": study.ctx_end - study.sink, "key": prompt.key,
            "needle_selectable": study.sink <= prompt.needle_start < study.ctx_end, "kmeans": kmeans,
            "seconds": {"prefill": round(prefill_s, 2), "units": round(units_s, 2), "decode": round(decode_s, 2)},
            "runs": runs}


def summarize(records: list[dict], chosen: list[Method]) -> list[dict]:
    """Per method and budget: hits per family, mean recall, keys read (and of them read in the partial chunk) and
    lookup reads, KL."""
    rows = []
    for method in chosen:
        key = f"{method.name}@{method.budget}"
        row = {"method": method.name, "budget": method.budget}
        for family in ("needles", "passkey"):
            mine = [r["runs"][key] for r in records if r["family"] == family]
            row[family] = sum(m["hit"] for m in mine)
            row[f"{family}_of"] = len(mine)
        every = [r["runs"][key] for r in records]
        for stat in ("recall", "read", "lookup", "forced", "kl"):
            row[stat] = sum(m[stat] for m in every) / max(len(every), 1)
        rows.append(row)
    return rows


def kmeans_cost(records: list[dict]) -> dict:
    """Per K-means family: the mean seconds per retrieval head (chunked: also per head and chunk, the chunks and the
    partial chunk's keys), global: Lloyd iterations and the centroid memory per head (bf16 centroids + int32
    labels) against the head's bf16 K and V of the selectable region."""
    cost = {}
    for family in records[0]["kmeans"]:
        times = [r["kmeans"][family] for r in records]
        cost[family] = {"selectable_mean": sum(r["selectable"] for r in records) / len(records)}
        for stat in ("seconds_per_head", "seconds_per_chunk", "iterations", "chunks", "partial"):
            if stat in times[0]:
                cost[family][f"{stat}_mean"] = sum(t[stat] for t in times) / len(times)
        if "iterations" in times[0]:
            cost[family]["memory_vs_kv"] = (2 * 64 / int(family.split("-c")[1]) + 4) / (2 * 2 * 64)
    return cost


def table(rows: list[dict]) -> str:
    """Markdown: method x budget."""
    lines = ["| method | budget | needles hits | passkey hits | mass recall | keys read | partial share "
             "| lookups | total reads | KL |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        budget = f"1/{row['budget']}" if row["budget"] else ("all" if row["method"] == "duo" else "0")
        lines.append(f"| {row['method']} | {budget} | {row['needles']}/{row['needles_of']} | "
                     f"{row['passkey']}/{row['passkey_of']} | {row['recall']:.3f} | {row['read']:.3f} | "
                     f"{row['forced'] / max(row['read'], 1e-9):.3f} | {row['lookup']:.3f} | "
                     f"{row['read'] + row['lookup']:.3f} | {row['kl']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=40, help="prompts per family")
    parser.add_argument("--seed", type=int, default=7, help="prompt seed (the eval reports seed 0)")
    parser.add_argument("--out", default="benchmarks/results/2026-11-26-cpu-squeeze-study", help="results folder")
    parser.add_argument("--model", default=None, help="HF folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--pattern", default=None, help="head pattern (default: the model's bundled one)")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--kmeans-iters", type=int, default=20, help="Lloyd iterations at most")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", type=int, nargs="+", default=NEEDLE_CONTEXTS,
                        help="needle prompt lengths in tokens, cycled")
    parser.add_argument("--passkey-repeats", type=int, nargs="+", default=PASSKEY_REPEATS,
                        help="classic passkey repeats, cycled (24 tokens each)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="method names to run, e.g. oracle squeeze-c16/max page16-mean/max (default: all)")
    parser.add_argument("--reuse", type=int, nargs="+", default=[1],
                        help="unit selections made at every Kth decode step, for each K listed (default 1: every)")
    parser.add_argument("--query", nargs="+", default=["own"],
                        choices=("own", "prev-input", "prev-mid", "prev-query", "prev-query-bf16", "prev-query-fp8"),
                        help="what scores the units, each listed (default own: the layer's query)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM, AutoTokenizer
    import transformers

    model_dir = args.model or str(smollm2.prepare())
    pattern, pattern_source = resolve_pattern(args.pattern, model_dir)
    retrieval = torch.tensor(pattern.retrieval_mask_at(args.sparsity), dtype=torch.bool)
    AttentionInterface.register(ATTENTION, study_attention)
    AttentionMaskInterface.register(ATTENTION, lambda *a, **k: None)  # the attention function builds its own
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=ATTENTION)
    model.eval()
    study = Study(retrieval=retrieval, sink=pattern.sink, recent=pattern.recent, layers=list(model.model.layers))
    for i, layer in enumerate(study.layers):
        layer.register_forward_pre_hook(functools.partial(keep_input, study, i), with_kwargs=True)
        layer.post_attention_layernorm.register_forward_pre_hook(functools.partial(keep_mid, study, i))
    prompts = make_prompts(tokenizer, args.prompts, args.seed, pattern.sink, pattern.recent, tuple(args.contexts),
                           tuple(args.passkey_repeats))
    prompts = [p for pair in zip(prompts[:args.prompts], prompts[args.prompts:]) for p in pair]  # alternate families
    generator = torch.Generator().manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = methods(args.methods, tuple(args.reuse), tuple(args.query))
    records, started, wall, machine = [], now(), time.perf_counter(), machine_info()
    for i, prompt in enumerate(prompts):
        record = run_prompt(model, study, prompt, chosen, args.kmeans_iters, generator)
        records.append(record)
        duo = record["runs"]["duo@0"]["hit"]
        print(f"[{i + 1}/{len(prompts)}] {prompt.family} {record['tokens']} tokens duo hit {duo} "
              f"{record['seconds']} {time.perf_counter() - wall:.0f}s", file=sys.stderr, flush=True)
        results = {"command": " ".join(["python", "benchmarks/squeeze_study.py", *(argv or sys.argv[1:])]),
                   "started": started, "wall_s": round(time.perf_counter() - wall, 1), "machine": machine,
                   "transformers_version": transformers.__version__, "python": platform.python_version(),
                   "threads": args.threads, "pattern": pattern_source, "sparsity": args.sparsity,
                   "retrieval_kv_heads": int(retrieval.sum()), "sink": pattern.sink, "recent": pattern.recent,
                   "kmeans_iters": args.kmeans_iters, "summary": summarize(records, chosen),
                   "kmeans": kmeans_cost(records),
                   "records": records}
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    rows = summarize(records, chosen)
    print(table(rows))


if __name__ == "__main__":
    main()
