# SPDX-License-Identifier: Apache-2.0
"""The squeeze served end to end (duo.squeeze, squeeze.py): SmolLM2 in an in-process engine, prompts prefilled in
small chunks, against duo without it. A budget of every clustered key must give duo's answers; a small budget must
change the squeezed prompt's logprobs and no others (a short prompt, and a prompt that found no free slot, are duo's);
a slot outlives its request, and a later prompt that starts with its context reads it without clustering again."""

import pytest

from engines import assert_same_greedy, greedy_with_logprobs, make_llm, prompts_of, random_pattern, release

PROMPT_LENGTHS = [120, 400, 700]  # the first is below min_context_len
MAX_TOKENS = 16
CHUNK = 256  # prefills over several steps
DUO = {"sparsity": 0.5, "sink": 16, "recent": 64}
SQUEEZE = {"min_context_len": 300, "max_contexts": 2, "keys_per_cluster": 8, "tail": 64}


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    return prompts_of(smollm2_dir, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def pattern(tmp_path_factory):
    return random_pattern(tmp_path_factory.mktemp("squeeze") / "p.json")


def run(model, prompts, duo, check=None, **engine) -> dict:
    llm = make_llm(model, duo, max_model_len=2048, **{"max_num_batched_tokens": CHUNK, **engine})
    try:
        out = greedy_with_logprobs(llm, prompts, MAX_TOKENS)
        if check is not None:
            check(llm)
        return out
    finally:
        release(llm)


@pytest.fixture(scope="module")
def duo_run(smollm2_dir, prompts, pattern):
    return run(smollm2_dir, prompts, dict(DUO, pattern=pattern))


def test_budget_of_every_key_gives_duos_answers(smollm2_dir, prompts, pattern, duo_run):
    squeezed = run(smollm2_dir, prompts, dict(DUO, pattern=pattern, squeeze=dict(SQUEEZE, budget=1.0)))
    assert_same_greedy(squeezed, duo_run)
    assert_same_greedy(duo_run, squeezed)
    assert squeezed["PROMPT_LOGPROBS"] == duo_run["PROMPT_LOGPROBS"]  # the squeeze reads no prefill


def test_small_budget_changes_only_the_squeezed_prompt_and_frees_its_slot(smollm2_dir, prompts, pattern):
    """Three prompts whose prefills all end in the first step, one slot: the short prompt is below min_context_len,
    one long prompt takes the slot, the other finds none; only the squeezed one's logprobs move."""
    def slot_kept_and_shared(llm):
        from vllm_duo import backend

        contexts = backend.squeeze_of(llm.llm_engine.vllm_config)
        assert 0.02 < contexts.read_share() < 0.2  # keys read beyond sinks and window, at a budget of 0.1
        assert contexts.built == 1
        document = contexts.tokens[0]  # the squeezed prompt but its last `tail` tokens
        reads = contexts.reads.tolist()
        greedy_with_logprobs(llm, [document + prompts[0][-30:]], 4)  # another question about it
        assert contexts.built == 1 and contexts.shared == 1 and contexts.tokens[0] is document
        assert contexts.readers[0] == {*contexts.slot_of}  # the first prompt's request is gone
        assert contexts.reads[1] > reads[1]  # its decode read the slot

    one_step = dict(max_num_batched_tokens=2048)
    expected = run(smollm2_dir, prompts, dict(DUO, pattern=pattern), **one_step)
    duo = dict(DUO, pattern=pattern, squeeze=dict(SQUEEZE, max_contexts=1, budget=0.1, count_reads=True))
    squeezed = run(smollm2_dir, prompts, duo, slot_kept_and_shared, **one_step)
    changed = [got != want for got, want in zip(squeezed["GAPS"], expected["GAPS"])]
    assert changed in ([False, True, False], [False, False, True]), changed
