# SPDX-License-Identifier: Apache-2.0
"""Duo under tensor parallelism: head slicing per rank, page sizing shared by all ranks, and real TP engines.

SmolLM2's 3 KV heads split over 3 ranks on the CPU stack (one KV head and 3 query heads each), so the
engines here run `--tensor-parallel-size 3` with vLLM's multiprocessing executor.
"""


import numpy as np
import pytest

from engines import make_llm, prompts_of, random_pattern, release
from vllm_duo.config import DuoPlan, ModelShape, rank_kv_heads
from vllm_duo.pattern import PatternError

RANK_HEADS = [  # (num_kv_heads, tp_size, rank, KV heads held), vLLM's QKVParallelLinear sharding
    (8, 2, 0, [0, 1, 2, 3]),
    (8, 2, 1, [4, 5, 6, 7]),
    (8, 8, 5, [5]),
    (3, 3, 2, [2]),
    (2, 4, 1, [0]),  # fewer KV heads than ranks: each head is replicated on 2 ranks
    (2, 4, 3, [1]),
]


@pytest.mark.parametrize("num_kv_heads, tp_size, rank, expected", RANK_HEADS)
def test_rank_kv_heads(num_kv_heads, tp_size, rank, expected):
    assert rank_kv_heads(num_kv_heads, tp_size, rank) == expected


@pytest.mark.parametrize("num_kv_heads, tp_size", [(3, 2), (2, 3), (8, 3)])
def test_rank_kv_heads_rejects_uneven_splits(num_kv_heads, tp_size):
    with pytest.raises(PatternError, match="tensor-parallel-size"):
        rank_kv_heads(num_kv_heads, tp_size, 0)


def plan_of(mask, sink=4, recent=12) -> DuoPlan:
    mask = np.array(mask, dtype=bool)
    shape = ModelShape("m", "LlamaForCausalLM", mask.shape[0], mask.shape[1], 2 * mask.shape[1], 64)
    return DuoPlan(mask, float(1 - mask.mean()), sink, recent, "test", shape)


UNEVEN = [[1, 1, 0, 0],  # layer 0: rank 0 holds both retrieval heads, rank 1 none
          [1, 0, 1, 0],  # layer 1: one each
          [0, 0, 0, 1]]  # layer 2: one on rank 1


def test_each_rank_maps_its_own_slice():
    plan = plan_of(UNEVEN)
    assert [plan.retrieval_heads(0, rank, 2) for rank in (0, 1)] == [[0, 1], []]
    assert [plan.retrieval_heads(2, rank, 2) for rank in (0, 1)] == [[], [1]]
    assert plan.retrieval_heads(2) == [3]


def test_pages_fit_the_busiest_rank_and_page_groups_the_most_streaming_heads():
    plan = plan_of(UNEVEN)
    layout = plan.page_layout(block_size=16, tp_size=2)
    assert layout.page_heads == (2, 1, 1)  # max over ranks of the local retrieval counts
    streaming_cells = [16 * s for s in (2, 1, 2)]  # max over ranks of the local streaming counts, 16 slots each
    for layer, cells in enumerate(streaming_cells):
        placement = layout.placements[layer]
        assert placement.offset + cells <= layout.streaming_blocks * 16 * layout.page_heads[placement.host]
    assert plan.page_layout(block_size=16).page_heads == (2, 2, 1)  # one rank: the real counts


def test_imbalance_overhead():
    assert plan_of([[1, 0, 1, 0], [0, 1, 0, 1]]).tp_page_overhead(2) == 0.0
    # ranks hold 3 and 2 retrieval heads; pages fit the per-layer maxima, 2 + 1 + 1 = 4 vs 2.5 on average
    assert plan_of(UNEVEN).tp_page_overhead(2) == pytest.approx(4 / 2.5 - 1)
    assert plan_of(UNEVEN).tp_page_overhead(1) == 0.0


PROMPT_LENGTHS = [200, 450]
MAX_TOKENS = 8
TP = 3


def run(model, prompts, duo, tp_size):
    """Greedy tokens and their logprobs; TP engines use vLLM's multiprocessing executor, one thread per worker."""
    from vllm import SamplingParams, TokensPrompt

    with pytest.MonkeyPatch.context() as env:
        kwargs = {}
        if tp_size > 1:
            env.setenv("OMP_NUM_THREADS", "1")  # 3 workers on a 2-core CI machine: no thread pinning, one each
            env.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            import vllm.envs

            vllm.envs.disable_envs_cache()  # an earlier in-process engine froze vLLM's env reads
            kwargs = dict(tensor_parallel_size=tp_size, distributed_executor_backend="mp")
        llm = make_llm(model, duo, max_model_len=1024, max_num_batched_tokens=128, **kwargs)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        release(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outputs]
    return tokens, np.array(logprobs)


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    return prompts_of(smollm2_dir, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def pattern(tmp_path_factory):
    return random_pattern(tmp_path_factory.mktemp("tp") / "p.json", seed=1, sink=16, recent=64)


def test_tp3_duo_matches_tp1_duo(smollm2_dir, prompts, pattern):
    duo = {"pattern": pattern, "sparsity": 0.5}
    tp_tokens, tp_logprobs = run(smollm2_dir, prompts, duo, TP)
    tokens, logprobs = run(smollm2_dir, prompts, duo, 1)
    assert tp_tokens == tokens
    np.testing.assert_allclose(tp_logprobs, logprobs, atol=1e-4, rtol=0)


def test_tp3_duo_all_retrieval_matches_dense(smollm2_dir, prompts, pattern):
    tp_tokens, tp_logprobs = run(smollm2_dir, prompts, {"pattern": pattern, "sparsity": 0.0}, TP)
    tokens, logprobs = run(smollm2_dir, prompts, None, 1)
    assert tp_tokens == tokens
    np.testing.assert_allclose(tp_logprobs, logprobs, atol=1e-4, rtol=0)
