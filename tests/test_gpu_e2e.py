# SPDX-License-Identifier: Apache-2.0
"""End to end on the GPU: the Triton path equals the PyTorch path, CUDA graphs equal eager, and all-retrieval duo
equals FLASH_ATTN."""

import os

import pytest

from engines import assert_same_greedy, generate_in_subprocess, random_pattern

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return os.environ.get("VLLM_DUO_GPU_MODEL", "/tmp/smol")


def generate(model, backend, duo, eager=True, **env):
    engine = dict(model=model, max_model_len=4096, gpu_memory_utilization=0.3, enforce_eager=eager,
                  dtype="bfloat16", max_num_batched_tokens=256)
    return generate_in_subprocess(engine, backend, duo, (20, 300, 900, 2000), **env)


def test_triton_path_equals_torch_path(model, tmp_path):
    duo = {"pattern": random_pattern(tmp_path / "p.json"), "sparsity": 0.5, "sink": 16, "recent": 64}
    assert_same_greedy(generate(model, "duo", duo), generate(model, "duo", duo, VLLM_DUO_ATTENTION="torch"))


def test_all_retrieval_equals_flash_attn(model, tmp_path):
    duo = {"pattern": random_pattern(tmp_path / "p.json"), "sparsity": 0.0}
    assert_same_greedy(generate(model, "duo", duo), generate(model, "FLASH_ATTN", None))


def test_cuda_graphs_equal_eager(model, tmp_path):
    """Decode batches replay full CUDA graphs (UNIFORM_SINGLE_TOKEN_DECODE); the tokens must not change."""
    duo = {"pattern": random_pattern(tmp_path / "p.json"), "sparsity": 0.5, "sink": 16, "recent": 64}
    assert_same_greedy(generate(model, "duo", duo, eager=False), generate(model, "duo", duo))
