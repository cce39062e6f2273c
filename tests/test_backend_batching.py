# SPDX-License-Identifier: Apache-2.0
"""Requests that arrive, finish and get aborted at different times: each output equals the request served
alone, and once all have ended no KV block (ring blocks included) is still held."""


import pytest

from engines import greedy, make_llm, random_pattern, release, text_of_tokens
from vllm_duo.capacity import held_blocks

# (arrival step, prompt tokens, max new tokens, abort at step or None)
SCHEDULE = [
    (0, 300, 20, None),
    (0, 900, 8, None),
    (2, 150, 30, None),
    (3, 600, 25, 9),
    (5, 40, 12, None),
    (6, 1200, 16, None),
    (8, 450, 40, 14),
    (12, 80, 10, None),
]


@pytest.fixture(scope="module")
def engine(smollm2_dir, tmp_path_factory):
    pattern = random_pattern(tmp_path_factory.mktemp("pattern") / "p.json", seed=2, sink=16, recent=48)
    # a small cache: vLLM has to preempt some requests along the way
    llm = make_llm(smollm2_dir, {"pattern": pattern, "sparsity": 0.5}, max_model_len=2048,
                   max_num_batched_tokens=128, num_gpu_blocks_override=160)
    yield llm
    release(llm)


def test_staggered_batch_with_aborts_equals_solo_runs(engine, smollm2_dir):
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [text_of_tokens(tokenizer, n, seed=i) for i, (_, n, _, _) in enumerate(SCHEDULE)]
    engine_api = engine.llm_engine
    finished, step = {}, 0
    while step < 200 and (len(finished) < len(SCHEDULE) or engine_api.has_unfinished_requests()):
        for i, (arrival, _, max_tokens, abort_at) in enumerate(SCHEDULE):
            if arrival == step:
                engine_api.add_request(str(i), TokensPrompt(prompt_token_ids=prompts[i]),
                                       SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            if abort_at == step and str(i) not in finished:
                engine_api.abort_request([str(i)])
                finished[str(i)] = None
        for output in engine_api.step():
            if output.finished and output.request_id not in finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        step += 1
    assert not engine_api.has_unfinished_requests()
    assert held_blocks(engine) == 0
    completed = {int(k): v for k, v in finished.items() if v is not None}
    assert len(completed) == len([s for s in SCHEDULE if s[3] is None])
    for i, tokens in completed.items():
        assert tokens == greedy(engine, [prompts[i]], SCHEDULE[i][2])[0], f"request {i}"
    assert held_blocks(engine) == 0


def test_one_metadata_build_per_step(engine, smollm2_dir, monkeypatch):
    """Duo's layers form several attention groups (their page widths differ); vLLM asks each group's builder with
    the same CommonAttentionMetadata in a step, and only the first build does the work."""
    from transformers import AutoTokenizer

    from vllm_duo.backend import DuoAttentionMetadataBuilder

    asked, built = [], []
    build, do_build = DuoAttentionMetadataBuilder.build, DuoAttentionMetadataBuilder._build

    def counting_build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        asked.append(common_attn_metadata)
        return build(self, common_prefix_len, common_attn_metadata, fast_build)

    def counting_do_build(self, cam):
        built.append(cam)
        return do_build(self, cam)

    monkeypatch.setattr(DuoAttentionMetadataBuilder, "build", counting_build)
    monkeypatch.setattr(DuoAttentionMetadataBuilder, "_build", counting_do_build)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    greedy(engine, [text_of_tokens(tokenizer, 200, seed=0), text_of_tokens(tokenizer, 90, seed=1)], 4)
    steps = {id(cam) for cam in asked}
    assert len(asked) > len(steps) > 1  # several attention groups asked per step
    assert len(built) == len(steps)
