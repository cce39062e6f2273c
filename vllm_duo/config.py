# SPDX-License-Identifier: Apache-2.0
"""Duo settings from vLLM's --additional-config, resolved once per process into a head plan."""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vllm_duo.pattern import HeadPattern, PatternError, ideal_kv_slots, resolve_pattern

ADDITIONAL_CONFIG_KEY = "duo"
# VLLM_DUO_ATTENTION, what attends on a GPU: "flash" FlashAttention-3 on the retrieval heads where it beats the Triton
# kernels (gpu_attention.py), "triton" the Triton kernels alone, "torch" the PyTorch path (the kernels' reference).
# FlashAttention-3's results move with the number of KV blocks, dense's as duo's; the other two are the same in any
# cache size (benchmarks/results/2026-11-29-h200-prefill-kv-size).
ATTENTION_PATHS = ("flash", "triton", "torch")


def attention_path() -> str:
    return os.environ.get("VLLM_DUO_ATTENTION", "flash")


class DuoConfigError(Exception):
    """Bad duo settings found while vLLM builds its config; the message is one line naming the problem and the fix.

    Deliberately not a ValueError: vLLM's VllmConfig is a pydantic dataclass, and pydantic folds a ValueError
    raised during its validation into a multi-line ValidationError. This one passes through unchanged, so a
    server's last line of stderr is `vllm_duo.config.DuoConfigError: <message>`.
    """


class SqueezeSettings(BaseModel):
    """budget: share of a context's clustered keys each retrieval head reads at decode (0 < budget <= 1);
    keys_per_cluster: mean keys per centroid; iters: Lloyd iterations at most, from `init` seeds; radius_weight: w in
    a cluster's logit q.C + w |q| r (r its largest key distance from C; 0 Squeezed Attention's Eq. 1, 1 a bound on
    every key's logit; 0.5 on SmolLM2's needles brought decode's next-token distribution 3-100x closer to duo's than
    0 at equal keys read, benchmarks/results/2026-11-27-cpu-squeeze-radius); max_contexts: slots
    kept at once; min_context_len / max_context_len: the prompts a slot takes (others are served by duo unsqueezed;
    the longest sizes every slot); tail: a prompt's last tokens, read whole rather than clustered, so that prompts
    which differ only there (one document, other questions) share one clustered context (default the pattern's
    recent window: a squeezed row then reads at least the window duo reads, every token after its context)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    budget: float = Field(default=0.25, gt=0.0, le=1.0)
    keys_per_cluster: int = Field(default=16, ge=1)
    iters: int = Field(default=10, ge=1)
    init: Literal["random", "k-means++"] = "random"  # k-means++ draws its C seeds one after another: 65 s at 128k
    radius_weight: float = Field(default=0.5, ge=0.0)
    max_contexts: int = Field(default=4, ge=1)
    min_context_len: int = Field(default=4096, ge=1)
    max_context_len: int = Field(default=131072, ge=1)
    tail: int | None = Field(default=None, ge=0)
    count_reads: bool = False  # count the keys decode reads beyond sinks and window (`ClusteredContexts.read_share`)

    def num_clusters(self, num_keys: int) -> int:
        return max(1, math.ceil(num_keys / self.keys_per_cluster))

    def max_selected(self) -> int:
        """Positions a row's selection holds: the budget of the longest context, with room for the cluster that meets
        it (`select_banded` takes less than one cluster more than the budget) up to 4 average clusters."""
        T = self.max_context_len
        return min(T, math.ceil(self.budget * T) + 4 * self.keys_per_cluster)

    def summary(self, sink: int, slot_bytes: int, centroids: str) -> str:
        return (f"duo squeeze: retrieval heads of prompts of {self.min_context_len} to {self.max_context_len + sink} "
                f"tokens read {self.budget:g} of their clustered keys at decode ({self.keys_per_cluster} keys per "
                f"cluster, {self.iters} Lloyd iterations from {self.init} seeds, scored with radius weight "
                f"{self.radius_weight:g}), plus sinks and window; "
                f"{self.max_contexts} contexts kept, each a prompt but its last {self.tail} tokens and read by every "
                f"prompt that starts with it, {slot_bytes * self.max_contexts / 2 ** 30:.3g} GiB kept beside "
                f"the KV cache ({centroids} centroids)")


class DuoSettings(BaseModel):
    """What a user may put under `--additional-config '{"duo": {...}}'`.

    Every field is optional: the head pattern carries defaults for sparsity, sink and recent.
    """

    model_config = ConfigDict(extra="forbid")

    pattern: str | None = None
    sparsity: float | None = Field(default=None, ge=0.0, le=1.0)
    sink: int | None = Field(default=None, ge=0)
    recent: int | None = Field(default=None, ge=0)
    squeeze: SqueezeSettings | None = None  # Squeezed Attention on the retrieval heads of long prompts (squeeze.py)

    @classmethod
    def from_additional_config(cls, additional_config: dict | None) -> DuoSettings:
        raw = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {})
        if not isinstance(raw, dict):
            raise PatternError(
                f'--additional-config "duo" must be a JSON object, got {raw!r}: '
                'write e.g. \'{"duo": {"pattern": "NAME", "sparsity": 0.5}}\''
            )
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "duo"
            allowed = ", ".join(cls.model_fields)
            raise PatternError(
                f"bad --additional-config duo.{field}: {err['msg']} (got {err.get('input')!r}); "
                f"allowed keys: {allowed}; sparsity in [0, 1], sink and recent >= 0"
            ) from None


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of the model being served, as the pattern must match it."""

    name: str
    architecture: str
    num_layers: int
    num_kv_heads: int
    num_heads: int
    head_dim: int


@dataclass(frozen=True)
class DuoPlan:
    """The resolved per-head decision for one model: which KV heads keep the full context.

    `retrieval_mask[l, h]` is True for a retrieval (full-context) KV head of layer l.
    """

    retrieval_mask: np.ndarray
    sparsity: float
    sink: int
    recent: int
    pattern_source: str
    shape: ModelShape

    def rank_mask(self, rank: int = 0, tp_size: int = 1) -> np.ndarray:
        """The mask of the KV heads that tensor-parallel `rank` holds, in its local head order."""
        return self.retrieval_mask[:, rank_kv_heads(self.shape.num_kv_heads, tp_size, rank)]

    def retrieval_heads(self, layer: int, rank: int = 0, tp_size: int = 1) -> list[int]:
        """Local indices of the retrieval KV heads of `layer` on `rank`."""
        return [int(h) for h in np.flatnonzero(self.rank_mask(rank, tp_size)[layer])]

    @property
    def retrieval_counts(self) -> list[int]:
        return [int(c) for c in self.retrieval_mask.sum(axis=1)]

    def page_layout(self, block_size: int, tp_size: int = 1):
        """The KV page layout every rank uses (kv_cache.py): vLLM needs the same specs on all TP ranks, so pages
        are sized for the rank with the most retrieval heads in each layer, page groups for the most streaming.
        """
        from vllm_duo.kv_cache import plan_page_layout

        masks = np.stack([self.rank_mask(r, tp_size) for r in range(tp_size)])  # [ranks, layers, local heads]
        retrieval = masks.sum(axis=2)
        pages = tuple(int(c) for c in retrieval.max(axis=0))
        streaming = tuple(int(c) for c in (masks.shape[2] - retrieval).max(axis=0))
        return plan_page_layout(pages, streaming, block_size)

    def tp_page_overhead(self, tp_size: int) -> float:
        """Extra page memory from uneven retrieval counts across ranks: sum_l max_r R_lr / mean_r sum_l R_lr - 1."""
        retrieval = np.stack([self.rank_mask(r, tp_size).sum(axis=1) for r in range(tp_size)])
        if not retrieval.any():
            return 0.0
        return float(retrieval.max(axis=0).sum() / retrieval.sum(axis=1).mean() - 1.0)

    @property
    def retrieval_ratio(self) -> float:
        return float(self.retrieval_mask.mean())

    def kv_bytes_per_token(self, dtype_bytes: int) -> tuple[int, int]:
        """KV bytes per token of context: dense (all L * H heads) and duo (the retrieval heads only)."""
        per_head = 2 * self.shape.head_dim * dtype_bytes  # K and V
        return self.retrieval_mask.size * per_head, int(self.retrieval_mask.sum()) * per_head

    def window_bytes(self, dtype_bytes: int) -> int:
        """KV bytes of one request's streaming heads, ideally, once it has sink + recent tokens: those of each."""
        return (self.sink + self.recent) * int((~self.retrieval_mask).sum()) * 2 * self.shape.head_dim * dtype_bytes

    def capacity_ratio(self, num_tokens: int, dtype_bytes: int) -> float:
        """Requests of `num_tokens` tokens that fit in a KV cache, duo / dense, ideally (`ideal_kv_slots`: no page
        padding, and a request shorter than sink + recent keeps only its tokens in the streaming heads)."""
        dense, _ = self.kv_bytes_per_token(dtype_bytes)
        num_retrieval = int(self.retrieval_mask.sum())
        duo_slots = ideal_kv_slots(num_tokens, num_retrieval, self.retrieval_mask.size - num_retrieval, self.sink,
                                   self.recent)
        return dense * num_tokens / (duo_slots * 2 * self.shape.head_dim * dtype_bytes)

    def paged_capacity_ratio(self, num_tokens: int, dtype_bytes: int, block_size: int, tp_size: int = 1) -> float:
        """The same in duo's paged layout (kv_cache.py), which vLLM's "Maximum concurrency" counts (per rank)."""
        layout = self.page_layout(block_size, tp_size)
        paged = layout.bytes_per_request(num_tokens, block_size, self.shape.head_dim, dtype_bytes, self.sink,
                                         self.recent)
        local_heads = len(rank_kv_heads(self.shape.num_kv_heads, tp_size, 0))
        dense = self.shape.num_layers * local_heads * 2 * self.shape.head_dim * dtype_bytes * num_tokens
        return dense / paged

    def summary(self) -> str:
        return (
            f"duo: pattern {self.pattern_source}; retrieval ratio {self.retrieval_ratio:.3f} "
            f"(sparsity {self.sparsity:g}); sink {self.sink}, recent {self.recent}; "
            f"retrieval heads per layer {self.retrieval_counts}"
        )

    def memory_summary(self, max_model_len: int, dtype_bytes: int, block_size: int, tp_size: int = 1) -> str:
        dense, duo = self.kv_bytes_per_token(dtype_bytes)
        return (
            f"duo: KV per token dense {_size(dense)} vs duo {_size(duo)} + {_size(self.window_bytes(dtype_bytes))} "
            f"streaming window per request ({dtype_bytes}-byte KV); expected capacity at max_model_len {max_model_len}: "
            f"{self.capacity_ratio(max_model_len, dtype_bytes):.2f}x dense ideally, "
            f"{self.paged_capacity_ratio(max_model_len, dtype_bytes, block_size, tp_size):.2f}x in duo's "
            f"{block_size}-token pages (what vLLM's Maximum concurrency counts)"
        )


def rank_kv_heads(num_kv_heads: int, tp_size: int, rank: int) -> list[int]:
    """The model's KV heads that tensor-parallel `rank` holds, as vLLM's QKVParallelLinear shards them:
    contiguous slices when tp_size divides num_kv_heads, one replicated head per rank when tp_size is a multiple.
    """
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise PatternError(f"{num_kv_heads} KV heads do not split over --tensor-parallel-size {tp_size}: "
                               "use a size that divides the KV head count")
        per_rank = num_kv_heads // tp_size
        return list(range(rank * per_rank, (rank + 1) * per_rank))
    if tp_size % num_kv_heads:
        raise PatternError(f"--tensor-parallel-size {tp_size} is not a multiple of the {num_kv_heads} KV heads: "
                           "use a multiple or a divisor of the KV head count")
    return [rank * num_kv_heads // tp_size]


def _size(num_bytes: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB"):
        if num_bytes < 1024:
            break
        num_bytes /= 1024
    else:
        unit = "GiB"
    return f"{num_bytes:.4g} {unit}"


def build_plan(settings: DuoSettings, pattern: HeadPattern, source: str, shape: ModelShape) -> DuoPlan:
    """Check the pattern against the model and binarize it at the chosen sparsity."""
    pattern.check_model(shape.architecture, shape.num_layers, shape.num_kv_heads, shape.head_dim, model_name=shape.name)
    sparsity = pattern.sparsity if settings.sparsity is None else settings.sparsity
    sink = pattern.sink if settings.sink is None else settings.sink
    recent = pattern.recent if settings.recent is None else settings.recent
    if sink + recent == 0:
        raise PatternError("duo sink and recent are both 0: streaming heads would see nothing; set sink or recent > 0")
    mask = np.asarray(pattern.retrieval_mask_at(sparsity), dtype=bool)
    return DuoPlan(
        retrieval_mask=mask,
        sparsity=float(1.0 - mask.mean()) if settings.sparsity is None else sparsity,
        sink=sink,
        recent=recent,
        pattern_source=source,
        shape=shape,
    )


def model_shape(model_config) -> ModelShape:
    """Read the attention shape from a vLLM ModelConfig."""
    hf = model_config.hf_text_config
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    archs = getattr(model_config.hf_config, "architectures", None) or ["unknown"]
    return ModelShape(
        name=str(model_config.model),
        architecture=archs[0],
        num_layers=hf.num_hidden_layers,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        num_heads=num_heads,
        head_dim=head_dim,
    )


@functools.lru_cache(maxsize=8)
def _cached_plan(settings_json: str, model_path: str, shape: ModelShape) -> DuoPlan:
    settings = DuoSettings.model_validate_json(settings_json)
    pattern, source = resolve_pattern(settings.pattern, model_path)
    return build_plan(settings, pattern, source, shape)


def plan_from_vllm_config(vllm_config) -> DuoPlan:
    """The duo plan of the model in `vllm_config`; computed once per process."""
    settings = DuoSettings.from_additional_config(vllm_config.additional_config)
    shape = model_shape(vllm_config.model_config)
    return _cached_plan(
        json.dumps(settings.model_dump(), sort_keys=True), str(vllm_config.model_config.model), shape
    )


@dataclass(frozen=True)
class LayerPlan:
    """What duo decided for one attention layer, as this tensor-parallel rank serves it.

    `retrieval`: the rank's retrieval KV heads in the model's order (the load step puts them first where the
    weights allow, reorder.py); `page_heads`: head slots of the layer's pages, the same on every rank (0: the layer
    has none, a stub page); `placement`: where its streaming K/V lives (`offset` cells into the page groups of layer
    `host`; None: no streaming heads).
    """

    retrieval: tuple[int, ...]
    page_heads: int
    placement: object | None  # kv_cache.StreamPlacement


@dataclass(frozen=True)
class ServingPlan:
    """The plan as one rank of one engine serves it, resolved once per process from the vLLM config and read by
    the KV cache spec, the load step, the metadata builder and every layer's attention (`layers[l]`: layer l)."""

    plan: DuoPlan
    layout: object  # kv_cache.PageLayout
    layers: tuple[LayerPlan, ...]


_SERVING_PLANS: dict[tuple, ServingPlan] = {}


def serving_plan(vllm_config) -> ServingPlan:
    """`ServingPlan` of the engine in `vllm_config` on this process's tensor-parallel rank."""
    plan = plan_from_vllm_config(vllm_config)
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    rank = 0
    if tp_size > 1:
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
    key = (id(plan), vllm_config.cache_config.block_size, tp_size, rank)
    if key not in _SERVING_PLANS or _SERVING_PLANS[key].plan is not plan:  # plans are cached (`_cached_plan`)
        layout = plan.page_layout(vllm_config.cache_config.block_size, tp_size)
        layers = tuple(LayerPlan(tuple(plan.retrieval_heads(index, rank, tp_size)), layout.page_heads[index],
                                 layout.placements[index]) for index in range(plan.shape.num_layers))
        _SERVING_PLANS[key] = ServingPlan(plan, layout, layers)
    return _SERVING_PLANS[key]

