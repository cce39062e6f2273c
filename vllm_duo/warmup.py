# SPDX-License-Identifier: Apache-2.0
"""The steps that compile duo's Triton kernels at startup, before a request would wait on them.

Triton compiles a kernel at its first launch for each set of compile-time constants. vLLM's startup runs no prefill
through an attention backend (its profile run skips attention; CUDA graph capture runs decode batches), so without
these steps the first prompts a server takes wait on Triton compiling duo's prefill (a first burst of 32 x 1k
prompts took twice dense's time: benchmarks/results/2026-11-30-h200-kernels-mixed). What changes from step to
step (request, tile and token counts, the block table's width) is not specialized (each kernel's
`do_not_specialize`), so a layer's kernel variants follow from its heads, its cache and the kind of step, and these
steps launch every variant a served step can:

    decode only, once per decode split count (1, 2, 4, ... MAX_DECODE_SPLITS: `decode_num_splits`' choices)
    a multi-token step: a decode row, a prompt from scratch, a chunk after cached tokens

Their block tables point every token block at block 0, vLLM's null block, which no request holds: what the steps
write there is never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_duo.kernels.decode import MAX_DECODE_SPLITS


@dataclass(frozen=True)
class WarmUpStep:
    """A batch of requests, each (tokens cached, tokens new); a decode-only step names its split count."""

    requests: tuple[tuple[int, int], ...]
    max_num_splits: int | None = None

    def inputs(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int,
               stride: int, device: torch.device) -> dict:
        """`duo_attention_gpu`'s batch arguments for this step: q, k, v as views of one fused qkv (as vLLM passes
        them), the output, query_start_loc, seq_lens, a block table of zeros and the batch bounds."""
        new = [n for _, n in self.requests]
        seq_lens = [c + n for c, n in self.requests]
        num_tokens, q_width, kv_width = sum(new), num_heads * head_dim, num_kv_heads * head_dim
        qkv = torch.randn(num_tokens, q_width + 2 * kv_width, dtype=dtype, device=device)
        query, key, value = qkv.split([q_width, kv_width, kv_width], dim=-1)
        starts = torch.tensor([0] + new, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        columns = -(-max(seq_lens) // block_size) * stride
        return dict(query=query.view(num_tokens, num_heads, head_dim),
                    key=key.view(num_tokens, num_kv_heads, head_dim),
                    value=value.view(num_tokens, num_kv_heads, head_dim),
                    output=torch.empty(num_tokens, num_heads, head_dim, dtype=dtype, device=device),
                    query_start_loc=starts.to(device),
                    seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                    block_table=torch.zeros(len(new), columns, dtype=torch.int32, device=device),
                    max_query_len=max(new), max_seq_len=max(seq_lens), max_num_splits=self.max_num_splits)


def decode_split_counts() -> list[int]:
    return [1 << i for i in range(MAX_DECODE_SPLITS.bit_length())]


WARM_UP_STEPS = ([WarmUpStep(((40, 1), (300, 1)), splits) for splits in decode_split_counts()]
                 + [WarmUpStep(((40, 1), (0, 37), (300, 20)))])
