# SPDX-License-Identifier: Apache-2.0
"""vllm-duo: DuoAttention (retrieval + streaming heads) as a vLLM attention backend."""

BACKEND_NAME = "DUO"
BACKEND_PATH = "vllm_duo.backend.DuoAttentionBackend"
DUO_BLOCK_SIZE = 16  # tokens per block unless the user passes --block-size: the page layout is planned for it
