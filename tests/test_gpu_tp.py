# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism on two GPUs: TP=2 duo equals TP=1 duo, and TP=2 all-retrieval duo equals TP=2 FLASH_ATTN.

The model has the Llama-3.1-8B attention shape (32 query / 8 KV heads, head_dim 128) in 4 layers, with random
weights saved to disk: vLLM's dummy loader draws each rank's shard on its own, so TP=1 and TP=2 runs of
`--load-format dummy` would not be the same model.
"""

import os

import numpy as np
import pytest
import torch

from engines import assert_same_greedy, generate_in_subprocess, random_pattern

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (kind nvidia-h200-x2)")]

LAYERS, KV_HEADS, HEAD_DIM = 4, 8, 128
PROMPT_LENGTHS = (300, 1500, 3000)
LOGPROB_ATOL = 0.1  # bf16: TP=2 all-reduces the attention and MLP outputs in another order


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama_shape")
    config = LlamaConfig(hidden_size=KV_HEADS * 4 * HEAD_DIM, num_attention_heads=KV_HEADS * 4,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=4096,
                         num_hidden_layers=LAYERS, vocab_size=49152, max_position_embeddings=8192)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(os.environ.get("VLLM_DUO_GPU_MODEL", "/tmp/smol")).save_pretrained(folder)
    return str(folder)


def generate(model, tp_size, backend, duo):
    engine = dict(model=model, max_model_len=4096, gpu_memory_utilization=0.3, enforce_eager=True,
                  dtype="bfloat16", max_num_batched_tokens=512, tensor_parallel_size=tp_size)
    return generate_in_subprocess(engine, backend, duo, PROMPT_LENGTHS)


def assert_prompt_logprobs_close(got, expected):
    for a, b in zip(got["PROMPT_LOGPROBS"], expected["PROMPT_LOGPROBS"]):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=LOGPROB_ATOL, rtol=0)


def pattern(tmp_path):
    return random_pattern(tmp_path / "p.json", num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


def test_tp2_duo_equals_tp1_duo(model, tmp_path):
    duo = {"pattern": pattern(tmp_path), "sparsity": 0.5, "sink": 16, "recent": 64}
    tp2, tp1 = generate(model, 2, "duo", duo), generate(model, 1, "duo", duo)
    assert_prompt_logprobs_close(tp2, tp1)
    assert_same_greedy(tp2, tp1)


def test_tp2_all_retrieval_equals_flash_attn(model, tmp_path):
    duo = {"pattern": pattern(tmp_path), "sparsity": 0.0}
    duo_run, dense = generate(model, 2, "duo", duo), generate(model, 2, "FLASH_ATTN", None)
    assert_prompt_logprobs_close(duo_run, dense)
    assert_same_greedy(duo_run, dense)
