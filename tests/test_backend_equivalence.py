# SPDX-License-Identifier: Apache-2.0
"""Duo must reduce to dense attention when no head is streaming, or when the window covers everything."""


import pytest

from engines import greedy, make_llm, prompts_of, random_pattern, release

PROMPT_LENGTHS = [7, 33, 120, 250, 511, 900]
MAX_TOKENS = 16
CHUNK = 96  # small prefill chunks: long prompts take many scheduler steps


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    return prompts_of(smollm2_dir, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def dense_tokens(smollm2_dir, prompts):
    llm = make_llm(smollm2_dir, max_num_batched_tokens=CHUNK)
    tokens = greedy(llm, prompts, MAX_TOKENS)
    release(llm)
    return tokens


def duo_tokens(model, prompts, duo):
    llm = make_llm(model, duo, max_num_batched_tokens=CHUNK)
    tokens = greedy(llm, prompts, MAX_TOKENS)
    release(llm)
    return tokens


def test_all_retrieval_pattern_equals_dense(smollm2_dir, prompts, dense_tokens, tmp_path):
    pattern = random_pattern(tmp_path / "p.json")
    assert duo_tokens(smollm2_dir, prompts, {"pattern": pattern, "sparsity": 0.0}) == dense_tokens


def test_window_covering_everything_equals_dense(smollm2_dir, prompts, dense_tokens, tmp_path):
    pattern = random_pattern(tmp_path / "p.json")
    window = max(PROMPT_LENGTHS) + MAX_TOKENS
    assert duo_tokens(smollm2_dir, prompts, {"pattern": pattern, "sparsity": 0.5, "sink": 64,
                                             "recent": window}) == dense_tokens
