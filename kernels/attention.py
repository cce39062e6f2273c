# SPDX-License-Identifier: Apache-2.0
"""Duo attention of a mixed batch with the Triton kernels: same semantics as `reference.duo_attention`."""

from __future__ import annotations

import torch

from vllm_duo.kernels.cache_write import write_retrieval_kv, write_streaming_kv
from vllm_duo.kernels.decode import decode_attention, decode_num_splits
from vllm_duo.kernels.prefill import prefill_attention
from vllm_duo.kernels.reference import LayerHeads


def duo_attention_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                         heads: LayerHeads, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         block_table: torch.Tensor, scale: float, output: torch.Tensor, max_query_len: int,
                         max_seq_len: int, max_num_splits: int | None = None) -> None:
    """Write the batch's K/V into the duo cache and attend: single-token requests by decode.py, the rest by prefill.py.

    Launch order: retrieval write, attention, streaming write (a chunk may overwrite ring
    slots that its own earlier queries still read). With max_query_len == 1 only the decode
    kernels run, and nothing syncs with the host: a decode batch is CUDA-graph capturable when
    max_num_splits is fixed (or max_seq_len is, e.g. to max_model_len).

    Args:
        query: `[num_tokens, num_heads, head_dim]`
        key, value: `[num_tokens, num_kv_heads, head_dim]` (strided views of a fused qkv are fine).
        cache: `[num_blocks, 2, block_size, P, head_dim]`
        heads: the layer's `LayerHeads`, index tensors on the cache's device.
        query_start_loc: `[num_reqs + 1]` int32 on the device.
        seq_lens: `[num_reqs]` int32 on the device, context length after this step.
        block_table: `[num_reqs, max_blocks]` int32, E streaming blocks then retrieval blocks.
        output: `[num_tokens, num_heads, head_dim]`, written in place.
        max_query_len, max_seq_len: host ints bounding the batch (vLLM's metadata has them).
        max_num_splits: context splits per retrieval head in decode; default `decode_num_splits`.
    """
    if max_num_splits is None:
        max_num_splits = decode_num_splits(seq_lens.shape[0], heads.num_retrieval, max_seq_len, cache.device)
    write_retrieval_kv(key, value, cache, heads.retrieval_kv, query_start_loc, seq_lens, block_table,
                       heads.streaming_blocks)
    if max_query_len > 1:
        prefill_attention(query, key, value, cache, heads, query_start_loc, seq_lens, block_table, scale, output,
                          min_query_len=2)
    decode_attention(query, key, value, cache, heads, query_start_loc, seq_lens, block_table, scale, output,
                     max_num_splits)
    if heads.num_streaming:
        write_streaming_kv(key, value, cache, heads.streaming_kv, query_start_loc, seq_lens, block_table,
                           heads.sink, heads.recent)
