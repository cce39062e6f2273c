# SPDX-License-Identifier: Apache-2.0
"""vLLM general plugin: makes `--attention-backend duo` exist in every vLLM process.

What duo patches in vLLM, and which vLLM releases each patch is for, is in vllm_seam.py; `register` checks the
installed vLLM (one line naming the supported range when it is outside) and installs them:
* the backend name DUO (`AttentionBackendEnum`: through its private maps up to 0.31, `register_backend` from 0.32);
* the KV cache spec comes from the `Attention` layer, not its backend: when the layer's backend is duo, ask the
  backend (`DuoAttentionBackend.kv_cache_spec`); other backends are untouched;
* block table rows wide enough for duo's streaming page group columns (vLLM 0.26-0.28; vLLM sizes them itself
  from `max_num_blocks_per_req` later);
* the spec/manager pair in vLLM's own `KVCacheSpecRegistry`;
* the model loader's post-load step first reorders each duo layer's KV heads, retrieval heads first (reorder.py).
"""

from __future__ import annotations

from vllm_duo import BACKEND_NAME


def add_backend_member() -> None:
    """Add DUO to AttentionBackendEnum (idempotent) so `AttentionBackendEnum["DUO"]` parses."""
    from vllm_duo import vllm_seam

    vllm_seam.add_backend_member()


def is_duo(backend) -> bool:
    return backend is not None and getattr(backend, "name", None) == BACKEND_NAME


def register() -> None:
    """Entry point of the `vllm.general_plugins` group."""
    from vllm_duo import vllm_seam

    vllm_seam.install()
