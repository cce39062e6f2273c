# SPDX-License-Identifier: Apache-2.0
"""Duo in vLLM against an independent reference: HF transformers with the per-head Λ mask (hf_reference.py).

A 50% pattern with a small window (sink 16, recent 64), prompts of 530 and 1,100 tokens prefilled in
64-token chunks, then 16 greedy decode steps: every prompt and output logprob must match. The same
holds for the layer-exclusive (ZigzagAttention) pattern made from it, on one prompt.
"""


import numpy as np
import pytest

from engines import make_llm, random_pattern, release, text_of_tokens
from hf_reference import DuoReference

SINK, RECENT = 16, 64
PROMPT_LENGTHS = {"head_level": [530, 1100], "layer_exclusive": [700]}
DECODE_STEPS = 16
ATOL = 2e-3  # float32 on both sides; summation order differs


def pattern_file(kind: str, directory) -> str:
    from vllm_duo.pattern import HeadPattern
    from vllm_duo.tools.zigzag import zigzag_pattern

    path = random_pattern(directory / "head_level.json", seed=1, sink=SINK, recent=RECENT)
    if kind == "head_level":
        return path
    zigzag = directory / "layer_exclusive.json"
    zigzag.write_text(zigzag_pattern(HeadPattern.load(path), 0.5).model_dump_json())
    return str(zigzag)


@pytest.fixture(scope="module", params=list(PROMPT_LENGTHS))
def case(request, smollm2_dir, tmp_path_factory):
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    from vllm_duo.pattern import HeadPattern

    kind = request.param
    path = pattern_file(kind, tmp_path_factory.mktemp("pattern"))
    mask = HeadPattern.load(path).retrieval_mask_at(0.5)
    assert 0 < mask.sum() < mask.size
    if kind == "layer_exclusive":
        assert set(mask.sum(axis=1)) == {0, mask.shape[1]}
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [text_of_tokens(tokenizer, n, seed=n) for n in PROMPT_LENGTHS[kind]]
    llm = make_llm(smollm2_dir, {"pattern": path, "sparsity": 0.5}, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=DECODE_STEPS, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    release(llm)
    return mask, prompts, outputs


def chosen_logprobs(prompt_ids, output):
    """vLLM's logprob of each actual next token: prompt positions 1.. then the generated tokens."""
    prompt = [output.prompt_logprobs[i][tok].logprob for i, tok in enumerate(prompt_ids) if i > 0]
    completion = output.outputs[0]
    generated = [step[tok].logprob for tok, step in zip(completion.token_ids, completion.logprobs)]
    return np.array(prompt + generated)


def test_logprobs_match_lambda_mask_reference(case, smollm2_dir):
    mask, prompts, outputs = case
    reference = DuoReference(smollm2_dir)
    for prompt, output in zip(prompts, outputs):
        tokens = prompt + list(output.outputs[0].token_ids)
        expected = reference.logprobs(tokens, mask, SINK, RECENT).numpy()
        got = chosen_logprobs(prompt, output)
        assert got.shape == expected.shape
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
        # the window really bites: full attention gives clearly different logprobs on these prompts
        full = reference.logprobs(tokens, None, SINK, RECENT).numpy()
        assert np.abs(full - expected).max() > 10 * ATOL
