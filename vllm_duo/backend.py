# SPDX-License-Identifier: Apache-2.0
"""The duo attention backend: retrieval heads over paged blocks, streaming heads over their sink and window.

Each layer's heads are described by index maps (`LayerHeads`). At weight load the plugin reorders
the q/k/v/o weights of unquantized models so that retrieval heads come first (reorder.py); the
maps are then contiguous ranges. Layers whose weights vLLM quantizes keep the model's order and
the maps say where each head is; the kernels take the maps as arguments and read heads in place.
Under tensor parallelism each rank maps the KV heads it holds (`DuoPlan.retrieval_heads(layer,
rank, tp)`).

With `--kv-cache-dtype fp8` pages and page groups hold `fp8(x / scale)` with the layer's own k/v scales
(vLLM's `_k_scale` / `_v_scale`: from the checkpoint, 1.0, or `--calculate-kv-scales` on vLLM 0.26-0.27), written the
way the platform's dense backend writes them; the kernels dequantize in registers.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from vllm_duo import DUO_BLOCK_SIZE, vllm_seam
from vllm_duo.config import DuoSettings, LayerPlan, ServingPlan, attention_path, serving_plan
from vllm_duo.gpu_attention import duo_attention_gpu, retrieval_page_views
from vllm_duo.kernels.cache_write import check_batch
from vllm_duo.kernels.reference import FP8_CACHE_DTYPES, KVQuant, LayerHeads, duo_attention
from vllm_duo.kv_cache import STUB_HEAD_SIZE, DuoAttentionSpec
from vllm_duo.reorder import reorder_heads
from vllm_duo.squeeze import ClusteredContexts, SqueezeRows, SqueezeStep, centroid_dtype, window_pages
from vllm_duo.warmup import WARM_UP_STEPS

logger = init_logger(f"vllm.{__name__}")
ATTENTION_PATH = attention_path()  # on a GPU; the CPU takes the PyTorch path


class DuoAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto", "float16", "bfloat16", *FP8_CACHE_DTYPES]
    forward_includes_kv_cache_update = True

    @staticmethod
    def get_name() -> str:
        return "DUO"

    @staticmethod
    def get_impl_cls() -> type[DuoAttentionImpl]:
        return DuoAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[DuoAttentionMetadataBuilder]:
        return DuoAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]  # vLLM 0.31+ passes the layer's spec

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """duo's block size whatever the platform's default: vLLM 0.33's CPU platform picks its 128 after the model
        is loaded, when each layer is already bound to the page layout of the size duo set (platforms.py)."""
        return DUO_BLOCK_SIZE

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 80, 96, 112, 128, 256]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)  # vLLM 0.26-0.28 (vllm_seam: kv_cache_shape_5d)

    @classmethod
    def supported_kv_cache_layouts(cls):
        """vLLM 0.29+ binds each layer a 4D view in one of these layouts (vllm_seam: kv_cache_view_4d)."""
        return vllm_seam.duo_kv_cache_layouts()

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False

    @classmethod
    def kv_cache_spec(cls, layer, vllm_config) -> DuoAttentionSpec:
        """The duo cache spec of one attention layer (vLLM asks the layer; plugin.py routes it here)."""
        return layer_kv_cache_spec(vllm_config, extract_layer_index(layer.layer_name), layer.head_size,
                                   layer.kv_cache_torch_dtype)


def layer_kv_cache_spec(vllm_config, layer_index: int, head_size: int, dtype: torch.dtype) -> DuoAttentionSpec:
    """The duo cache spec of attention layer `layer_index`: its pages' head slots and the page groups' width."""
    serving = serving_plan(vllm_config)
    pages = serving.layers[layer_index].page_heads
    # A layer without pages (no retrieval heads, its streaming K/V elsewhere) still needs a page: vLLM divides
    # by the page size. A one-element-per-row stub costs 1/head_dim of one head.
    return DuoAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=pages or 1,
        head_size=head_size if pages else STUB_HEAD_SIZE,
        dtype=dtype,
        sink=serving.plan.sink,
        recent=serving.plan.recent,
        streaming_blocks=serving.layout.streaming_blocks,
    )


@dataclass
class DuoAttentionMetadata:
    """Per-step batch description, shared by all layers.

    `block_table` rows give each token block its page and its streaming page group (kv_cache.py);
    `retrieval_table` is their page columns alone, contiguous, for FlashAttention (CUDA; None on the
    CPU); where the squeeze is on, each squeezed row's from its context end on (`squeeze.window_pages`).
    The kernels read the device tensors; the PyTorch path (CPU) reads the host lists.
    `max_seq_len` bounds the batch's seq_lens: max_model_len in decode-only batches (see the builder).
    `flash_schedules` collects the step's FlashAttention-3 tile schedules as its layers make them, one per
    retrieval-head count; gpu_attention.py uses it in multi-token batches only (a decode batch may be a
    CUDA graph replay, whose FlashAttention calls schedule themselves). `squeeze`: which rows read a clustered
    context and which prefills build one (squeeze.py), where the squeeze is on.
    """

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    retrieval_table: torch.Tensor | None
    query_start_loc_host: list[int] | None
    seq_lens_host: list[int] | None
    flash_schedules: dict[int, torch.Tensor]
    squeeze: SqueezeRows | None = None


class DuoAttentionMetadataBuilder(AttentionMetadataBuilder[DuoAttentionMetadata]):
    """Batch metadata; decode-only batches may run in full CUDA graphs.

    In a decode-only batch the Triton path launches only fixed-grid kernels that read the batch from
    device tensors (kernels/decode.py). The one host-side choice, the number of context splits,
    follows max_seq_len, which a captured graph would freeze at its capture value: decode batches
    therefore size it for max_model_len (splits past a request's context exit at once). The page
    columns FlashAttention reads are copied once per step for all layers into a buffer that graphs
    replay from.
    """

    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    # vLLM builds metadata once per attention group, and duo's layers form several (their page widths differ:
    # 7 groups for the Llama-3.1-8B pattern), each from the same CommonAttentionMetadata object in a step. The
    # batch description is the same for all of them, so the first build of a step serves the others (it was
    # 7 builds and 7 table copies per step, ~0.3 ms of host time before every decode step's graph replay). The
    # batch's sizes are compared too, in case a vLLM version reused one object across steps.
    _last_build: tuple[CommonAttentionMetadata, tuple[int, ...], DuoAttentionMetadata] | None = None
    # The squeeze's plan of the step's rows (vllm_seam.StepRows, one object per step), staged once for every group's
    # build (vLLM's V2 runner builds each group's metadata from a CommonAttentionMetadata of its own).
    _last_plan: tuple[object, SqueezeRows] | None = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.max_model_len = vllm_config.model_config.max_model_len
        block_size = vllm_config.cache_config.block_size
        self.stride = serving_plan(vllm_config).layout.stride
        self.contexts = _CONTEXTS.get(id(serving_plan(vllm_config)))

        def page_columns(needed: bool) -> torch.Tensor | None:  # a page table buffer for FlashAttention (CUDA)
            if not (needed and device.type == "cuda"):
                return None
            return torch.zeros(max_batch_rows(vllm_config), cdiv(self.max_model_len, block_size), dtype=torch.int32,
                               device=device)

        self.retrieval_table = page_columns(self.stride > 1)
        self.window_table = page_columns(self.contexts is not None)  # the squeeze's, from each context end on

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> DuoAttentionMetadata:
        metadata = self.build(0, common_attn_metadata)
        metadata.seq_lens.fill_(1)  # as vLLM's Triton backend: warm-up runs need not read max_model_len keys
        return metadata

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> DuoAttentionMetadata:
        cam = common_attn_metadata
        batch = (cam.num_reqs, cam.num_actual_tokens, cam.max_query_len, cam.max_seq_len)
        last = DuoAttentionMetadataBuilder._last_build
        if last is not None and last[0] is cam and last[1] == batch:  # this step's batch, for another group
            return last[2]
        metadata = self._build(cam)
        DuoAttentionMetadataBuilder._last_build = (cam, batch, metadata)
        return metadata

    def _build(self, cam: CommonAttentionMetadata) -> DuoAttentionMetadata:
        num_reqs = cam.num_reqs
        on_host = self.device.type == "cpu" or ATTENTION_PATH == "torch"
        block_table = cam.block_table_tensor[:num_reqs]
        retrieval_table = block_table if self.stride == 1 else None
        if self.retrieval_table is not None:
            retrieval_table = self.retrieval_table[:num_reqs]
            pages = block_table[:, ::self.stride]
            retrieval_table[:, :pages.shape[1]].copy_(pages[:, :retrieval_table.shape[1]])
        if not on_host:  # for every layer of the step: each skips the check (DuoAttentionImpl.forward)
            check_batch(cam.query_start_loc[: num_reqs + 1], cam.seq_lens[:num_reqs], block_table, self.device)
        squeeze = None if self.contexts is None else self._squeeze_rows(cam)
        if squeeze is not None and self.window_table is not None:  # FlashAttention reads the squeezed rows' windows
            window_table = self.window_table[:num_reqs]
            window_pages(retrieval_table, squeeze.context_ends, self.contexts.block_size, window_table)
            retrieval_table = window_table
        return DuoAttentionMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            max_query_len=cam.max_query_len,
            max_seq_len=self.max_model_len if cam.max_query_len == 1 else cam.max_seq_len,
            query_start_loc=cam.query_start_loc[: num_reqs + 1],
            seq_lens=cam.seq_lens[:num_reqs],
            block_table=block_table,
            retrieval_table=retrieval_table,
            query_start_loc_host=cam.query_start_loc_cpu[: num_reqs + 1].tolist() if on_host else None,
            seq_lens_host=cam.seq_lens[:num_reqs].tolist() if on_host else None,
            flash_schedules={},
            squeeze=squeeze,
        )

    def _squeeze_rows(self, cam: CommonAttentionMetadata) -> SqueezeRows:
        """This step's squeeze plan (`ClusteredContexts.plan`), staged in the store's row buffer once per step for all
        groups. Outside a scheduled step (warm-up, CUDA graph capture) no row reads a context; rows past the input
        batch's (a graph's padding) none."""
        num_reqs = cam.num_reqs
        rows = vllm_seam.step_rows()
        planned = DuoAttentionMetadataBuilder._last_plan
        if rows is not None and planned is not None and planned[0] is rows:  # staged by the step's first group
            return planned[1]
        if rows is None or len(rows.req_ids) > num_reqs:
            step = SqueezeStep([-1] * num_reqs, [0] * num_reqs, [0] * num_reqs, [])
        else:
            starts = cam.query_start_loc_cpu[: len(rows.req_ids) + 1]
            step = self.contexts.plan(rows.req_ids, rows.prompt_lens, rows.computed,
                                      (starts[1:] - starts[:-1]).tolist(), rows.live, rows.prompt_of)
            for row, slot, end in step.builds:
                logger.info("duo squeeze: %s clusters its first %d tokens into slot %d (%d contexts clustered, %d "
                            "prompts read one clustered before)", rows.req_ids[row], end, slot, self.contexts.built,
                            self.contexts.shared)
            pad = num_reqs - len(rows.req_ids)
            step = SqueezeStep(step.context_ids + [-1] * pad, step.context_ends + [0] * pad, step.budget + [0] * pad,
                               step.builds)
        staged = self.contexts.stage(step, cam.seq_lens[:num_reqs])
        if rows is not None:
            DuoAttentionMetadataBuilder._last_plan = (rows, staged)
        return staged


class DuoAttentionImpl(AttentionImpl[DuoAttentionMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **unsupported) -> None:
        for name, value in dict(alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                                logits_soft_cap=logits_soft_cap, kv_sharing=kv_sharing_target_layer_name,
                                **unsupported).items():
            if value:
                raise NotImplementedError(f"duo attention does not support {name}={value!r}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8_dtype = FP8_CACHE_DTYPES.get(kv_cache_dtype)
        self.attn_type = attn_type
        self.vllm_config = get_current_vllm_config()  # set while vLLM builds the model
        self.heads: LayerHeads | None = None  # bound at load (bind_duo_layers), with the streaming host
        self.stream_host = None
        self.contexts: ClusteredContexts | None = None  # and the squeeze's store, where it is on
        self.checked_pages: int | None = None  # the cache whose layer call passed duo_attention_gpu's checks
        self.flash_pages: tuple[torch.Tensor, torch.Tensor] | None = None  # FlashAttention's views of its pages

    def bind(self, index: int, layer: LayerPlan, stream_host, reordered: bool, device: torch.device) -> None:
        """This layer's heads as the kernels read them, and the `Attention` layer whose cache holds its page groups
        (None: its own)."""
        serving = serving_plan(self.vllm_config)
        self.layer_index = index
        self.contexts = _CONTEXTS.get(id(serving))
        retrieval = list(range(len(layer.retrieval))) if reordered else list(layer.retrieval)
        self.heads = LayerHeads.build(retrieval, self.num_kv_heads, self.num_heads, serving.layout.stride,
                                      serving.plan.sink, serving.plan.recent,
                                      layer.placement.offset if layer.placement else 0, device=device)
        self.stream_host = stream_host

    def _stream_cache(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache whose page groups hold this layer's streaming K/V (kv_cache.py pools them across layers)."""
        return kv_cache if self.stream_host is None else vllm_seam.as_duo_pages(self.stream_host.kv_cache)

    def _pages(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's pages and the cache holding its page groups, in the dtype the kernels read."""
        kv_cache = vllm_seam.as_duo_pages(kv_cache)
        stream_cache = self._stream_cache(kv_cache)
        if self.fp8_dtype is not None:  # vLLM allocates fp8 caches as uint8
            kv_cache, stream_cache = kv_cache.view(self.fp8_dtype), stream_cache.view(self.fp8_dtype)
        return kv_cache, stream_cache

    def warm_up(self, layer) -> None:
        """Launch every kernel variant this layer's steps can launch (warmup.py), before serving."""
        kv_cache, stream_cache = self._pages(layer.kv_cache)
        quant = self._quant(layer, on_host=False)
        dtype = self.vllm_config.model_config.dtype
        for step in WARM_UP_STEPS:
            batch = step.inputs(self.num_heads, self.num_kv_heads, self.head_size, dtype, stream_cache.shape[2],
                                self.heads.stride, kv_cache.device)  # a layer without pages has a stub cache
            duo_attention_gpu(batch.pop("query"), batch.pop("key"), batch.pop("value"), kv_cache, self.heads,
                              scale=self.scale, stream_cache=stream_cache, quant=quant,
                              flash_allowed=ATTENTION_PATH == "flash", **batch)

    def _quant(self, layer, on_host: bool) -> KVQuant | None:
        """The layer's fp8 storage: its scales as the kernels read them (device tensors, which vLLM updates in
        place) or as floats for the PyTorch path, which on the CPU rounds toward zero as vLLM's CPU backend does."""
        if self.fp8_dtype is None:
            return None
        k_scale, v_scale, q_scale = vllm_seam.layer_kv_quant_scales(layer, on_host)
        if on_host:
            return KVQuant(k_scale, v_scale, q_scale, toward_zero=not layer.kv_cache.is_cuda)
        return KVQuant(k_scale, v_scale, q_scale)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: DuoAttentionMetadata | None, output: torch.Tensor,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        """Duo attention for one layer.

        Args:
            query: `[num_tokens, num_heads, head_size]`
            key, value: `[num_tokens, num_kv_heads, head_size]`
            kv_cache: `[num_blocks, 2, block_size, P, head_size]` (a stub if the layer has no pages); vLLM 0.29+ passes
                a 4D view of the same pages (`vllm_seam.as_duo_pages`)
            output: `[num_tokens, num_heads * head_size]`
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("duo attention does not fuse output quantization")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        m = attn_metadata
        n = m.num_actual_tokens
        heads = self.heads
        if heads is None:
            raise RuntimeError(f"duo layer {layer.layer_name} was not bound at weight load (bind_duo_layers): "
                               "load the model through vLLM's model loader")
        kv_cache, stream_cache = self._pages(kv_cache)
        q = query[:n].view(n, self.num_heads, self.head_size)
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        squeeze = m.squeeze
        if kv_cache.is_cuda and ATTENTION_PATH != "torch":
            quant = self._quant(layer, on_host=False)
            squeezed = None
            # a CUDA graph replays what its capture ran, whichever rows then read a context
            if squeeze is not None and (squeeze.step.squeezed or torch.cuda.is_current_stream_capturing()):
                squeezed = functools.partial(self.contexts.decode, self.layer_index, q, kv_cache, heads,
                                             m.query_start_loc, m.seq_lens, m.block_table, self.scale, out, squeeze,
                                             quant)
            # the caches and the token views' layout are the layer's own every step: checked at its first call (the
            # batch at every step's build), when FlashAttention's views of its pages are made too
            pages = kv_cache.data_ptr()
            checked = pages == self.checked_pages
            if not checked:
                self.flash_pages = retrieval_page_views(kv_cache, heads) if heads.num_retrieval else None
            duo_attention_gpu(q, k, v, kv_cache, heads, m.query_start_loc, m.seq_lens, m.block_table, self.scale,
                              out, m.max_query_len, m.max_seq_len, stream_cache=stream_cache, quant=quant,
                              retrieval_table=m.retrieval_table, flash_schedules=m.flash_schedules,
                              retrieval_seq_lens=None if squeeze is None else squeeze.flash_seq_lens,
                              squeezed=squeezed, flash_allowed=ATTENTION_PATH == "flash",
                              checked=checked, flash_pages=self.flash_pages)
            self.checked_pages = pages
        else:
            quant = self._quant(layer, on_host=True)
            duo_attention(q, k, v, kv_cache, heads, m.query_start_loc_host, m.seq_lens_host, m.block_table,
                          self.scale, out, stream_cache=stream_cache, quant=quant)
            if squeeze is not None and squeeze.step.squeezed:
                self.contexts.decode_reference(self.layer_index, q, kv_cache, heads, m.query_start_loc_host,
                                               m.seq_lens_host, m.block_table, self.scale, out, squeeze.step, quant)
        for row, slot, end in [] if squeeze is None else squeeze.step.builds:  # their keys are written now
            self.contexts.build(self.layer_index, slot, kv_cache, heads, m.block_table[row], end, quant)
        return output


# The squeeze's clustered contexts of each serving plan in this process (made at load, where the squeeze is on).
_CONTEXTS: dict[int, ClusteredContexts] = {}


def squeeze_of(vllm_config) -> ClusteredContexts:
    return _CONTEXTS[id(serving_plan(vllm_config))]


def max_batch_rows(vllm_config) -> int:
    """The most requests a step's metadata can hold: the scheduler's, or a padded CUDA graph batch's."""
    return max(vllm_config.scheduler_config.max_num_seqs,
               vllm_config.compilation_config.max_cudagraph_capture_size or 0)


def make_contexts(vllm_config, serving: ServingPlan, head_dim: int, device: torch.device) -> None:
    """Where the squeeze is on: its slots of clustered contexts, allocated at load so that vLLM counts them with
    the weights before it sizes the KV cache; and the step rows the metadata builder plans from."""
    settings = DuoSettings.from_additional_config(vllm_config.additional_config).squeeze
    if settings is None:
        return
    vllm_seam.record_step_rows()
    longest = min(settings.max_context_len, vllm_config.model_config.max_model_len - serving.plan.sink)
    tail = serving.plan.recent if settings.tail is None else settings.tail
    settings = settings.model_copy(update={"max_context_len": max(1, longest), "tail": tail})
    retrieval = [len(layer.retrieval) for layer in serving.layers]
    centroids = centroid_dtype(vllm_config.model_config.dtype, vllm_config.cache_config.cache_dtype)
    _CONTEXTS[id(serving)] = ClusteredContexts(retrieval, head_dim, serving.plan.sink, settings, device, centroids,
                                               max_batch_rows(vllm_config), vllm_config.cache_config.block_size)
    slot_bytes = ClusteredContexts.bytes_needed(retrieval, head_dim, settings, centroids) // settings.max_contexts
    logger.info(settings.summary(serving.plan.sink, slot_bytes, str(centroids).removeprefix("torch.")))


def bind_duo_layers(model: torch.nn.Module, device: torch.device) -> None:
    """The load step (vllm_seam: reorder_before_quant), before vLLM repacks or quantizes the weights: each duo
    layer's heads are reordered where its weights allow (reorder.py), and its impl gets its heads and streaming host
    once, from the serving plan the KV cache spec and the metadata builder read too; the squeeze's store is made; the
    worker's warm-up will run duo's (`warm_up_duo_layers`)."""
    attention = {extract_layer_index(module.layer_name): module for module in model.modules()
                 if isinstance(getattr(module, "impl", None), DuoAttentionImpl)}
    if attention:
        first = next(iter(attention.values()))
        make_contexts(first.impl.vllm_config, serving_plan(first.impl.vllm_config), first.impl.head_size, device)
    parents = {id(module.attn): module for module in model.modules() if getattr(module, "attn", None) is not None}
    kept = []
    for index, attn in attention.items():
        layer = serving_plan(attn.impl.vllm_config).layers[index]
        parent = parents.get(id(attn))
        reordered = parent is not None and reorder_heads(parent, attn, list(layer.retrieval))
        if not reordered:
            kept.append(attn.layer_name)
        host = attention[layer.placement.host] if layer.placement and layer.placement.host != index else None
        attn.impl.bind(index, layer, host, reordered, device)
    if kept:
        logger.info("duo: %d attention layers keep the model's head order (quantized or not a fused qkv "
                    "projection) and run on head index maps, e.g. %s", len(kept), kept[0])
    if attention:
        vllm_seam.warm_up_after_vllm()


def warm_up_duo_layers(model: torch.nn.Module) -> None:
    """The warm-up step (vllm_seam: kernel_warmup), after vLLM's own and before CUDA graph capture: each duo layer's
    kernels launched once per kind of step (warmup.py), so that no request waits on Triton compiling them."""
    layers = [module for module in model.modules() if isinstance(getattr(module, "impl", None), DuoAttentionImpl)]
    if not layers or not layers[0].kv_cache.is_cuda or ATTENTION_PATH == "torch":  # nothing compiles
        return
    start = time.perf_counter()
    with torch.inference_mode():
        for layer in layers:
            layer.impl.warm_up(layer)
    torch.cuda.synchronize()
    logger.info("duo: kernels warmed up in %.1f s (%d layers, %d steps each)", time.perf_counter() - start,
                len(layers), len(WARM_UP_STEPS))


vllm_seam.check("backend_interface")  # duo's overrides take what the installed vLLM passes
