# SPDX-License-Identifier: Apache-2.0
"""vLLM general plugin: makes `--attention-backend duo` exist in every vLLM process.

vLLM 0.26 has three gaps a backend plugin must bridge, each bridged here once:
* `AttentionBackendEnum` is closed (only CUSTOM can be registered): add the member DUO.
* the KV cache spec comes from the `Attention` layer, not its backend: when the layer's backend
  is duo, ask the backend (`DuoAttentionBackend.kv_cache_spec`); other backends are untouched.
* a single-group model's block table is sized by `UniformTypeKVCacheSpecs`, which ignores its
  layers' own `max_num_blocks_per_req`: use the widest layer (same result for built-in specs).
  The V2 model runner (the GPU default) ignores `max_num_blocks_per_req` altogether and sizes rows
  for max_model_len tokens: widen its rows by duo's streaming page group columns.
The spec/manager pair goes into vLLM's own `KVCacheSpecRegistry`. And the model loader's post-load
step first reorders each duo layer's KV heads, retrieval heads first (reorder.py).
"""

from __future__ import annotations

from vllm_duo import BACKEND_NAME, BACKEND_PATH


def add_backend_member() -> None:
    """Add DUO to AttentionBackendEnum (idempotent) so `AttentionBackendEnum["DUO"]` parses."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if BACKEND_NAME in AttentionBackendEnum.__members__:
        return
    member = object.__new__(AttentionBackendEnum)
    member._name_ = BACKEND_NAME
    member._value_ = BACKEND_PATH
    member.__objclass__ = AttentionBackendEnum
    AttentionBackendEnum._member_map_[BACKEND_NAME] = member
    AttentionBackendEnum._value2member_map_[BACKEND_PATH] = member
    AttentionBackendEnum._member_names_.append(BACKEND_NAME)


def is_duo(backend) -> bool:
    return backend is not None and getattr(backend, "name", None) == BACKEND_NAME


def _route_kv_cache_spec_to_backend() -> None:
    from vllm.model_executor.layers.attention.attention import Attention

    if getattr(Attention.get_kv_cache_spec, "_duo_routed", False):
        return
    layer_spec = Attention.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        backend = self.get_attn_backend()
        if getattr(backend, "get_name", lambda: None)() == BACKEND_NAME:
            return backend.kv_cache_spec(self, vllm_config)
        return layer_spec(self, vllm_config)

    get_kv_cache_spec._duo_routed = True
    Attention.get_kv_cache_spec = get_kv_cache_spec


def _size_block_table_by_widest_layer() -> None:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if "max_num_blocks_per_req" in UniformTypeKVCacheSpecs.__dict__:
        return

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        return max(spec.max_num_blocks_per_req(vllm_config, max_len) for spec in self.kv_cache_specs.values())

    UniformTypeKVCacheSpecs.max_num_blocks_per_req = max_num_blocks_per_req


def _duo_extra_tokens(kv_cache_config, vllm_config, max_len: int) -> int:
    """Tokens' worth of block table columns that a duo row has beyond `max_len` tokens of pages (its page groups)."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    from vllm_duo.kv_cache import DuoAttentionSpec

    extra = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        layers = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        if any(isinstance(layer, DuoAttentionSpec) for layer in layers):
            blocks = spec.max_num_blocks_per_req(vllm_config, max_len) - cdiv(max_len, spec.block_size)
            extra = max(extra, blocks * spec.block_size)
    return extra


def _widen_v2_block_tables() -> None:
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except ImportError:  # a vLLM without the V2 model runner
        return
    if getattr(GPUModelRunner.initialize_kv_cache, "_duo_widened", False):
        return
    initialize = GPUModelRunner.initialize_kv_cache

    def initialize_kv_cache(self, kv_cache_config):
        # The V2 runner reads self.max_model_len only here, for the rows' width (`block_table_max_model_len`).
        extra = _duo_extra_tokens(kv_cache_config, self.vllm_config, self.max_model_len)
        self.max_model_len += extra
        try:
            return initialize(self, kv_cache_config)
        finally:
            self.max_model_len -= extra

    initialize_kv_cache._duo_widened = True
    GPUModelRunner.initialize_kv_cache = initialize_kv_cache


def _register_kv_cache_spec() -> None:
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from vllm_duo.kv_cache import DuoAttentionSpec, DuoKVCacheManager

    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(DuoAttentionSpec, DuoKVCacheManager, uniform_type_base_spec=DuoAttentionSpec)


def _reorder_heads_after_loading() -> None:
    from vllm.model_executor.model_loader import base_loader

    process = base_loader.process_weights_after_loading
    if getattr(process, "_duo_reorders", False):
        return

    def process_weights_after_loading(model, model_config, target_device):
        from vllm_duo.reorder import reorder_model_heads

        reorder_model_heads(model)  # before vLLM repacks or quantizes the weights
        process(model, model_config, target_device)

    process_weights_after_loading._duo_reorders = True
    base_loader.process_weights_after_loading = process_weights_after_loading


def register() -> None:
    """Entry point of the `vllm.general_plugins` group."""
    add_backend_member()
    _route_kv_cache_spec_to_backend()
    _size_block_table_by_widest_layer()
    _widen_v2_block_tables()
    _register_kv_cache_spec()
    _reorder_heads_after_loading()
