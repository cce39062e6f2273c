# SPDX-License-Identifier: Apache-2.0
"""Shared test tables: prompts of mixed lengths, duo settings, and in-process vLLM engines on SmolLM2."""

from __future__ import annotations

import json

import numpy as np

SENTENCES = [
    "The grass on the hill is green after the long spring rain.",
    "A small boat crossed the quiet lake before the sun came up.",
    "Maria keeps her old letters in a wooden box under the bed.",
    "The library opens at nine and closes late on Thursdays.",
    "Bread from the corner bakery is still warm at seven.",
    "Two owls called to each other across the dark valley.",
    "The train to the coast was delayed by a fallen tree.",
    "He painted the fence blue because his daughter asked him to.",
]
QUESTION = "\nQuestion: What did Maria keep in the wooden box? Answer:"


def text_of_tokens(tokenizer, num_tokens: int, seed: int) -> list[int]:
    """Token ids of about `num_tokens` tokens of plain sentences, then a question (natural, confident text)."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    while len(ids) + len(question) < num_tokens:
        ids += tokenizer.encode(" " + SENTENCES[rng.integers(len(SENTENCES))], add_special_tokens=False)
    return ids[: max(num_tokens - len(question), 0)] + question


def random_pattern(path, num_layers=30, num_kv_heads=3, head_dim=64, seed=0, sink=64, recent=256) -> str:
    """A random-gate stand-in pattern for SmolLM2 (the tests must not depend on a trained one)."""
    gates = np.random.default_rng(seed).uniform(0, 1, (num_layers, num_kv_heads)).round(6)
    data = {"schema_version": 1,
            "model": {"name": "SmolLM2-135M-Instruct-test", "architecture": "LlamaForCausalLM",
                      "num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim},
            "gates": gates.tolist(), "sparsity": 0.5, "sink": sink, "recent": recent,
            "provenance": {"source": "tests", "method": f"uniform random gates, seed {seed}", "date": "2026-11-23"}}
    path.write_text(json.dumps(data))
    return str(path)


def make_llm(model: str, duo: dict | None = None, max_model_len: int = 4096, **kwargs):
    """A fast in-process float32 engine; `duo` None means vLLM's own dense CPU backend."""
    from vllm import LLM

    args = dict(model=model, max_model_len=max_model_len, dtype="float32", enforce_eager=True,
                distributed_executor_backend="uni", seed=0)
    args.update(kwargs)
    if duo is not None:
        args.update(attention_backend="duo", additional_config={"duo": duo})
    return LLM(**args)


def greedy(llm, prompts: list[list[int]], max_tokens: int, **params) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **params)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]
