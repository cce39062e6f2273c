# SPDX-License-Identifier: Apache-2.0
"""vLLM platform plugin: the detected CUDA or CPU platform, plus duo's config checks.

A platform's `check_and_update_config` runs while vLLM builds its config, before any model or
GPU work: the one place to refuse what duo cannot serve (compatibility.py) or a bad pattern.
On CPU it also lets `--attention-backend duo` through (vLLM's CPU platform only knows CPU_ATTN).
Without duo selected both classes behave exactly as vLLM's own.
"""

from __future__ import annotations

from vllm.logger import init_logger

from vllm_duo import BACKEND_PATH, DUO_BLOCK_SIZE

TP_IMBALANCE_WARNING = 0.1  # warn when uneven retrieval counts across TP ranks cost more than 10% page memory
logger = init_logger(f"vllm.{__name__}")  # under vLLM's configured logger


class DuoPlatformMixin:
    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)
        from vllm_duo.plugin import is_duo

        if not is_duo(vllm_config.attention_config.backend):
            return
        from vllm.utils.torch_utils import get_dtype_size, kv_cache_dtype_str_to_dtype

        from vllm_duo.compatibility import refusal
        from vllm_duo.config import DuoConfigError, plan_from_vllm_config
        from vllm_duo.pattern import PatternError

        reason = refusal(vllm_config, fp8_capable=cls.device_type == "cpu" or cls.has_device_capability(89))
        if reason:
            raise DuoConfigError(reason)
        try:
            plan = plan_from_vllm_config(vllm_config)
        except PatternError as error:  # a ValueError: re-raised so that pydantic does not wrap it (see DuoConfigError)
            raise DuoConfigError(str(error)) from None
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        try:
            overhead = plan.tp_page_overhead(tp_size)
        except PatternError as error:
            raise DuoConfigError(str(error)) from None
        if overhead > TP_IMBALANCE_WARNING:
            logger.warning("duo: the pattern's retrieval heads are unevenly split over the %d tensor-parallel ranks; "
                           "pages sized for the busiest rank of each layer take %.0f%% more KV memory than an even "
                           "split would", tp_size, 100 * overhead)
        cache_config = vllm_config.cache_config
        if not cache_config.user_specified_block_size and cache_config.block_size != DUO_BLOCK_SIZE:
            # Small blocks keep the streaming page groups of a request's sink and window (whole blocks) few.
            cache_config.block_size = DUO_BLOCK_SIZE
        logger.info(plan.summary())
        kv_dtype = kv_cache_dtype_str_to_dtype(cache_config.cache_dtype, vllm_config.model_config)
        logger.info(plan.memory_summary(vllm_config.model_config.max_model_len, get_dtype_size(kv_dtype),
                                        cache_config.block_size, tp_size))

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        from vllm_duo.plugin import is_duo

        if is_duo(selected_backend) and cls.device_type == "cpu":
            return BACKEND_PATH
        return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)


def _subclass(name: str):
    if name == "DuoCpuPlatform":
        from vllm.platforms.cpu import CpuPlatform as base
    elif name == "DuoCudaPlatform":
        from vllm.platforms.cuda import CudaPlatform as base
    else:
        raise AttributeError(name)
    from vllm_duo import vllm_seam

    vllm_seam.check("platform_subclass")
    return type(name, (DuoPlatformMixin, base), {"__module__": __name__})


def __getattr__(name: str):
    """Build the platform subclass on first access, so importing this module imports no platform."""
    cls = _subclass(name)
    globals()[name] = cls
    return cls


def activate() -> str | None:
    """Entry point of `vllm.platform_plugins`: wrap whichever of CUDA / CPU vLLM would pick."""
    from vllm.platforms import cpu_platform_plugin, cuda_platform_plugin

    from vllm_duo import vllm_seam

    vllm_seam.check_version()  # outside the range: vLLM skips this platform; the general plugin stops startup
    vllm_seam.add_backend_member()
    if cuda_platform_plugin() is not None:
        return f"{__name__}.DuoCudaPlatform"
    if cpu_platform_plugin() is not None:
        return f"{__name__}.DuoCpuPlatform"
    return None
