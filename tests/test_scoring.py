# SPDX-License-Identifier: Apache-2.0
"""Test of passkey head scoring on the bundled SmolLM2: shape, range, determinism and a valid pattern."""
import random

import numpy as np
from transformers import AutoTokenizer

from vllm_duo.pattern import HeadPattern, read_hf_config
from vllm_duo.tools import smollm2
from vllm_duo.tools.accuracy import passkey, scoring


def test_score_heads_tiny_run_is_deterministic_and_makes_a_valid_pattern():
    model_dir = smollm2.prepare()
    options = dict(num_samples=1, context_len=300, seed=3, sink=8, recent=32, progress=False)
    scores = scoring.score_heads(model_dir, **options)
    shape = read_hf_config(model_dir)
    assert scores.shape == (shape.num_layers, shape.num_kv_heads)
    assert scores.min() >= 0.0 and scores.max() == 1.0
    assert len(np.unique(scores)) > 1
    # same seed, same prompts: the scores agree up to float32 noise (CPU BLAS does not promise equal bits between
    # two runs: a CI run once differed by 1.6e-4 relative)
    np.testing.assert_allclose(scoring.score_heads(model_dir, **options), scores, rtol=1e-3, atol=1e-6)

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = passkey.passkey_prompt(tokenizer, 300, random.Random(0), 0.5, sink=8, recent=32)
    assert len(prompt.input_ids) <= 300
    assert tokenizer.decode(prompt.input_ids[prompt.answer_start:]).strip() == prompt.passkey
    assert prompt.passkey in tokenizer.decode(prompt.input_ids[prompt.needle.start:prompt.needle.stop])
    assert 8 <= prompt.needle.start and prompt.needle.stop - 1 <= prompt.question_start - 32

    pattern = HeadPattern.model_validate({
        "schema_version": 1,
        "model": {"name": "SmolLM2-135M-Instruct", "architecture": shape.architecture,
                  "num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim},
        "gates": scores.tolist(), "sparsity": 0.5, "sink": 8, "recent": 32,
        "provenance": {"source": scoring.SOURCE, "method": "test", "date": "2026-11-23"},
    })
    pattern.check_model(*shape)
    assert sum(pattern.retrieval_counts()) == shape.num_layers * shape.num_kv_heads // 2
