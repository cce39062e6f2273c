# SPDX-License-Identifier: Apache-2.0
"""vllm-duo: DuoAttention (retrieval + streaming heads) as a vLLM attention backend."""

BACKEND_NAME = "DUO"
BACKEND_PATH = "vllm_duo.backend.DuoAttentionBackend"
