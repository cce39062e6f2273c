# SPDX-License-Identifier: Apache-2.0
"""Which vLLM settings duo combines with. Each one it does not stops the server while vLLM builds its config.

The platform plugin calls `refusal` before it reads the head pattern; the first check that fails
names the setting and what to use instead, in one line. Supported and why:
* `--kv-cache-dtype auto|<model dtype>|fp8|fp8_e4m3|fp8_e5m2`: pages and page groups in the model's dtype or
  per-tensor fp8 (the layer's k/v scales, from the checkpoint, 1.0, or `--calculate-kv-scales` on vLLM 0.26-0.27).
* `--tensor-parallel-size` (kv_cache.py), quantized checkpoints (their layers run on head index
  maps), chunked prefill, CUDA graphs, data parallelism.
* cascade attention: duo declines it (`use_cascade_attention` is False), so vLLM never plans it.
* prefix caching (vLLM's default): pages and streaming page groups are hashed and shared (kv_cache.py).
* `duo.squeeze` (squeeze.py) on one GPU.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_duo.kernels import fp8

FP8_KV_CACHE_DTYPES = tuple(fp8.KV_CACHE_DTYPES)
DUO_KV_CACHE_DTYPES = ("auto", *FP8_KV_CACHE_DTYPES)  # and the model's own dtype by name
KERNEL_TILE = 16  # tokens: duo's block size must be a multiple (16 keeps a request's page groups, whole blocks, few)
DENSE = "serve it with vLLM's default attention backend"


def _model_kind(config) -> str | None:
    """Models whose attention is not plain causal softmax over one KV cache per decoder layer."""
    model = config.model_config
    hf = model.hf_text_config
    name = (getattr(model.hf_config, "architectures", None) or [model.model])[0]
    if model.is_encoder_decoder:
        return f"{name} is an encoder-decoder model; duo serves decoder-only models: {DENSE}"
    if model.is_attention_free or model.is_hybrid:
        return (f"{name} has state-space or linear-attention layers; duo needs every layer to be "
                f"softmax attention: {DENSE}")
    if model.use_mla:
        return f"{name} uses multi-head latent attention (MLA), which duo does not split: {DENSE}"
    if model.is_multimodal_model:
        return f"{name} is multimodal; duo is for text-only decoders: {DENSE}"
    if model.get_sliding_window() is not None:
        return (f"{name} has sliding-window layers (window {model.get_sliding_window()}); duo "
                f"needs full-attention layers: {DENSE}")
    if model.uses_alibi:
        return f"{name} uses ALiBi position biases, which duo's kernels do not add: {DENSE}"
    if getattr(hf, "attn_logit_softcapping", None):
        return f"{name} soft-caps attention logits, which duo's kernels do not: {DENSE}"
    return None


def _kv_cache_dtype(config) -> str | None:
    cache = config.cache_config
    dtype = cache.cache_dtype
    model_dtype = str(config.model_config.dtype).removeprefix("torch.")
    if dtype not in DUO_KV_CACHE_DTYPES and dtype != model_dtype:
        return (f"--kv-cache-dtype {dtype}: duo stores K/V in the model's dtype ({model_dtype}) or in per-tensor fp8; "
                "use --kv-cache-dtype auto or fp8")
    if dtype not in FP8_KV_CACHE_DTYPES:
        return None
    if cache.kv_cache_dtype_skip_layers:
        return ("--kv-cache-dtype-skip-layers: duo pools the streaming K/V of all layers in shared blocks, so every "
                "layer needs the same KV cache dtype; leave the option out")
    scheme = getattr(config.quant_config, "kv_cache_scheme", None) or {}
    if scheme.get("strategy") == "attn_head":
        return ("the checkpoint's per-head KV cache scales: duo reorders KV heads and reads one k/v scale per layer; "
                "use a checkpoint with per-tensor KV scales, or --kv-cache-dtype bfloat16")
    return None


def _block_size(config) -> str | None:
    cache = config.cache_config
    if cache.user_specified_block_size and cache.block_size % KERNEL_TILE:
        return (f"--block-size {cache.block_size}: duo's kernels read {KERNEL_TILE}-token tiles; use --block-size "
                f"{KERNEL_TILE} (its default: streaming heads keep whole blocks of their sink and window)")
    return None


def _speculative_decoding(config) -> str | None:
    if config.speculative_config is not None:
        return ("--speculative-config: duo has not been validated with draft tokens (verification batches, the draft "
                "model's own attention layers); serve without speculative decoding")
    return None


def _lora(config) -> str | None:
    if config.lora_config is not None:
        return ("--enable-lora: LoRA adapters are laid out in the model's KV head order, which duo permutes at load "
                "(retrieval heads first); serve without LoRA, or merge the adapter into the weights first")
    return None


def _kv_connectors_and_events(config) -> str | None:
    transfer = config.kv_transfer_config
    if transfer is not None and transfer.kv_connector is not None:
        return (f"--kv-transfer-config (connector {transfer.kv_connector}): KV connectors and offloading move dense "
                "KV blocks, and duo's blocks hold retrieval pages and pooled streaming page groups; leave it out")
    events = config.kv_events_config
    if events is not None and events.enable_kv_cache_events:
        return ("--kv-events-config with enable_kv_cache_events: the events describe dense blocks per KV cache group, "
                "and duo hashes streaming page groups under ids of their own; leave the events off")
    return None


def _parallelism(config) -> str | None:
    parallel = config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        return ("--pipeline-parallel-size: duo pools streaming rings across all layers, so it needs "
                "--pipeline-parallel-size 1; use --tensor-parallel-size to split the model instead")
    for option, size in (("--decode-context-parallel-size", parallel.decode_context_parallel_size),
                         ("--prefill-context-parallel-size", getattr(parallel, "prefill_context_parallel_size", 1))):
        if size > 1:
            return (f"{option} {size}: context parallelism splits a request's KV over ranks, and a streaming ring "
                    "must stay whole; use --tensor-parallel-size")
    return None


def _squeeze(config) -> str | None:
    from vllm_duo.config import DuoSettings
    from vllm_duo.pattern import PatternError

    try:
        if DuoSettings.from_additional_config(config.additional_config).squeeze is None:
            return None
    except PatternError:  # bad settings: the plan reports them, in one line
        return None
    if config.parallel_config.tensor_parallel_size > 1:
        return ("duo.squeeze with --tensor-parallel-size > 1: the squeeze has not been validated across ranks; serve "
                "it on one GPU, or leave duo.squeeze out")
    return None


def _attention_path(config) -> str | None:
    from vllm_duo.config import ATTENTION_PATHS, attention_path

    path = attention_path()
    if path not in ATTENTION_PATHS:
        return (f"VLLM_DUO_ATTENTION={path}: not a duo attention path; use one of "
                f"{', '.join(ATTENTION_PATHS)} (default flash)")
    return None


CHECKS: tuple[Callable[[object], str | None], ...] = (
    _model_kind, _kv_cache_dtype, _block_size, _speculative_decoding, _lora, _kv_connectors_and_events, _parallelism,
    _squeeze, _attention_path)


def refusal(vllm_config, fp8_capable: bool = True) -> str | None:
    """The first reason duo cannot serve `vllm_config`, as one line naming the setting and the fix; None if it can.

    `fp8_capable`: whether the platform runs duo's fp8 kernels (CUDA compute capability >= 8.9, or the CPU).
    """
    for check in CHECKS:
        reason = check(vllm_config)
        if reason:
            return reason
    dtype = vllm_config.cache_config.cache_dtype
    if dtype in FP8_KV_CACHE_DTYPES and not fp8_capable:
        return (f"--kv-cache-dtype {dtype}: duo's fp8 kernels need a GPU of compute capability 8.9 or newer (Ada, "
                "Hopper); use --kv-cache-dtype auto on this GPU")
    return None
