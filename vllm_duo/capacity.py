# SPDX-License-Identifier: Apache-2.0
"""Maximum concurrency as vLLM itself computes it, dense vs duo, at the same KV cache space."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

from vllm_duo.vllm_seam import inproc_engine_core as engine_core  # an `LLM`'s in-process EngineCore


@dataclass(frozen=True)
class Capacity:
    backend: str
    kv_cache_tokens: int
    max_concurrency: float


def engine_capacity(llm, backend: str) -> Capacity:
    """vLLM's own startup figures ("GPU KV cache size", "Maximum concurrency") of a live engine."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    core = engine_core(llm)
    tokens, concurrency = get_kv_cache_capacity(core.vllm_config, core.scheduler.kv_cache_config)
    return Capacity(backend, tokens, concurrency)


def held_blocks(llm) -> int:
    """KV cache blocks held by requests right now (0 when every request has ended)."""
    pool = engine_core(llm).scheduler.kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # block 0 is vLLM's null block


def measure(model: str, max_model_len: int, duo: dict | None, **engine_args) -> Capacity:
    """Build an engine with dummy weights, read its capacity, free it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # CPU stack: a fixed KV space, the same for both
    from vllm import LLM

    kwargs = dict(model=model, max_model_len=max_model_len, load_format="dummy", enforce_eager=True,
                  distributed_executor_backend="uni", **engine_args)
    if duo is not None:
        kwargs.update(attention_backend="duo", additional_config={"duo": duo})
    llm = LLM(**kwargs)
    try:
        return engine_capacity(llm, "duo" if duo is not None else "dense")
    finally:
        del llm
        gc.collect()


def compare(model: str, max_model_len: int, duo: dict, **engine_args) -> tuple[Capacity, Capacity]:
    return measure(model, max_model_len, None, **engine_args), measure(model, max_model_len, duo, **engine_args)


def report(dense: Capacity, duo: Capacity, max_model_len: int) -> str:
    return "\n".join([
        f"maximum concurrency at {max_model_len:,} tokens per request (vLLM's own figure):",
        f"  dense: {dense.max_concurrency:6.2f}x  ({dense.kv_cache_tokens:,} tokens of KV cache)",
        f"  duo:   {duo.max_concurrency:6.2f}x  ({duo.kv_cache_tokens:,} tokens of KV cache)",
        f"  duo / dense: {duo.max_concurrency / dense.max_concurrency:.2f}x",
    ])
