# SPDX-License-Identifier: Apache-2.0
"""What `vllm-duo bench` runs: the named workloads (shape and vLLM command) and the backend variants compared."""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass


class BenchError(ValueError):
    """A usage error of `vllm-duo bench` (bad option value); runs that fail are recorded, not raised."""


@dataclass(frozen=True)
class Workload:
    """One named benchmark shape; `kind` picks vLLM's `bench throughput`, `bench latency` or `bench serve`, or
    "ceiling": `bench throughput` whose result is vLLM's startup check of max_model_len."""

    name: str
    kind: str
    max_model_len: int
    input_len: int
    output_len: int
    num_prompts: int = 1  # throughput; serve: prompts per request rate
    batch_size: int = 1  # latency
    num_iters: int = 1  # latency
    num_iters_warmup: int = 1  # latency
    prefill_baseline: bool = False  # latency: also run with output 1; TPOT = (latency - that) / (output_len - 1)
    request_rates: tuple[float, ...] = ()  # serve
    input_lens: tuple[int, ...] = ()  # serve: one client per prompt length, all against one server (else input_len)
    max_concurrency: int = 0  # serve: requests in flight at most (bench serve --max-concurrency); 0: no limit
    repeats: int = 1  # serve: clients per (prompt length, rate), one after the other: the spread between runs
    engine_args: tuple[str, ...] = ()  # added to every engine of this workload, dense and duo alike
    dataset: str = "random"  # serve: "random" prompts, shared "documents", or multi-turn "chat" (below)
    question_len: int = 0  # documents, chat: tokens of each question after the input_len-token document
    num_documents: int = 0  # documents: num_prompts questions spread over this many documents, interleaved
    turns: int = 0  # chat: num_prompts conversations of this many turns, each sent when its last answer is in
    cpu: bool = False  # a CPU-stack check of the harness (figures meaningless); not part of "all"
    measures: str = ""

    @classmethod
    def from_json(cls, spec: dict) -> Workload:
        """A workload as results.json stores it (its tuples as lists)."""
        return cls(**{**spec, "request_rates": tuple(spec.get("request_rates", ())),
                      "input_lens": tuple(spec.get("input_lens", ())),
                      "engine_args": tuple(spec.get("engine_args", ()))})

    def serve_points(self) -> list[tuple[int, float, int]]:
        """(prompt length, request rate, run) of each `bench serve` client, all against one server of this
        workload."""
        return [(n, rate, run) for rate in self.request_rates for n in self.input_lens or (self.input_len,)
                for run in range(self.repeats)]

    def serve_phase(self, input_len: int, rate: float, run: int = 0) -> str:
        phase = f"rate={rate_text(rate)}"
        phase = f"in={input_len} {phase}" if self.input_lens else phase
        return f"{phase} run={run + 1}" if self.repeats > 1 else phase

    def describe(self) -> str:
        if self.kind == "ceiling":
            shape = (f"vLLM's startup check of one request's length, then (if the engine starts) "
                     f"{_prompts(self.num_prompts)} x {self.input_len:,} in / {self.output_len:,} out")
        elif self.kind == "latency":
            shape = f"batch {self.batch_size} x {self.input_len:,} in / {self.output_len:,} out"
        elif self.dataset == "documents":
            at_once = f", at most {self.max_concurrency} at once" if self.max_concurrency else ""
            rates = ", ".join(rate_text(r) for r in self.request_rates)
            arrival = f" at {rates} req/s{at_once}" if self.kind == "serve" else ", all at once"
            shape = (f"{_prompts(self.num_prompts)}: {self.question_len}-token questions on {self.num_documents} "
                     f"shared documents of {self.input_len:,} tokens, shuffled, / {self.output_len:,} out{arrival}")
        elif self.dataset == "chat":
            shape = (f"{self.num_prompts} chats at once of {self.turns} turns: a {self.input_len:,}-token document, "
                     f"then {self.question_len}-token questions, each turn the whole conversation so far "
                     f"/ {self.output_len:,} out")
        elif self.kind == "serve":
            rates = ", ".join(rate_text(r) for r in self.request_rates)
            lens = " or ".join(f"{n:,}" for n in self.input_lens or (self.input_len,))
            at_once = f", at most {self.max_concurrency} at once" if self.max_concurrency else ""
            shape = f"{_prompts(self.num_prompts)} x {lens} in / {self.output_len:,} out at {rates} req/s{at_once}"
        else:
            shape = f"{_prompts(self.num_prompts)} x {self.input_len:,} in / {self.output_len:,} out"
        extra = f", {' '.join(self.engine_args)}" if self.engine_args else ""
        bench = "throughput" if self.kind == "ceiling" else self.kind
        return f"`bench {bench}`, {shape}, max_model_len {self.max_model_len:,}{extra}"


def rate_text(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def _prompts(n: int) -> str:
    return f"{n} prompt" + ("" if n == 1 else "s")


_CPU_ARGS = ("--enforce-eager", "--dtype", "float32")  # no torch.compile on 2 cores; fp32 is the fast CPU path

WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("capacity", "throughput", 131072, 16, 1, num_prompts=1, engine_args=("--enforce-eager",),
             measures="vLLM's startup figures at 131,072 tokens per request (KV cache tokens, maximum concurrency); "
                      "one tiny prompt. Eager: no compilation or CUDA graphs, so a startup costs about half"),
    Workload("ceiling", "ceiling", 4194304, 16, 1, engine_args=("--enforce-eager", "--max-num-seqs", "1"),
             measures="the longest request one engine accepts: asked for 4,194,304 tokens, vLLM's startup check "
                      "fails with its estimate of the longest max_model_len whose KV fits (binary search over the "
                      "KV specs), read from the log; an engine that starts accepts at least that (a lower bound). "
                      "One startup per backend, eager, one sequence (block tables of 4M-token rows for vLLM's "
                      "default batch would take memory from the KV cache); run it with --kv-cache-dtype auto fp8"),
    Workload("decode_heavy", "throughput", 18500, 16000, 2000, num_prompts=64,
             measures="long-context decode: dense holds ~25 such requests at once on an H100, duo at 0.5 ~twice as "
                      "many, and every decode step reads the whole KV of the batch"),
    Workload("prefill_heavy", "throughput", 17000, 16000, 512, num_prompts=32,
             measures="long prefills with short answers: attention FLOPs of streaming heads drop from O(T^2) to "
                      "O(T (sink + recent))"),
    Workload("short", "throughput", 2400, 2000, 256, num_prompts=256,
             measures="short contexts, where duo can only lose (a 320-token ring per head is most of the context): "
                      "the overhead check"),
    Workload("tpot_64k", "latency", 66000, 65536, 128, batch_size=4, prefill_baseline=True,
             measures="time per output token at 64k context, batch 4: (latency - latency with 1 output token) / 127"),
    Workload("ttft_128k", "latency", 131072, 131000, 1, batch_size=1, num_iters=2,
             measures="time to first token of one 131k-token prompt (latency with 1 output token)"),
    Workload("serve_16k", "serve", 17000, 16000, 512, num_prompts=96, request_rates=(1.0, 2.0),
             measures="online serving through vLLM's OpenAI server: output tok/s and p99 TTFT at each Poisson "
                      "request rate; 2 req/s is past what dense sustains on an H100 (about 1 req/s of 16k "
                      "prefills), and 96 prompts keep it there for most of the run (24 did not: every request "
                      "still ran at once)"),
    Workload("tpot_sweep", "serve", 99000, 98304, 256, num_prompts=4, max_concurrency=4,
             request_rates=(float("inf"),), input_lens=(1024, 4096, 16384, 65536, 98304),
             measures="decode speed by context length, one server per backend: median inter-token latency of 4 "
                      "requests at once (the steps where all 4 decode), 1k to 96k (4 x 128k would not fit dense's "
                      "KV cache on an H100)"),
    Workload("short_itl", "serve", 99000, 1024, 256, num_prompts=32, max_concurrency=32,
             request_rates=(float("inf"),), input_lens=(1024, 4096), repeats=3,
             measures="short requests, where most deployments live: median inter-token latency and TTFT of 32 "
                      "requests at once at 1k and 4k tokens (tpot_sweep has them 4 at a time), on the server "
                      "tpot_sweep uses (max_model_len 99,000): duo must not be slower than dense here"),
    Workload("shared_docs", "serve", 33000, 24000, 256, num_prompts=64, request_rates=(2.0, 8.0),
             dataset="documents", question_len=64, num_documents=8, engine_args=("--enable-prefix-caching",),
             measures="question answering over shared documents: each 24k-token document is prefilled once and its "
                      "other questions hit the prefix cache; output tok/s, TTFT and hit rate at a rate dense "
                      "sustains and one it does not"),
    Workload("shared_docs_full", "throughput", 20736, 20000, 150, num_prompts=320, dataset="documents",
             question_len=300, num_documents=40, engine_args=("--enable-prefix-caching",),
             measures="shared documents beyond dense's cache: 40 documents of 20k tokens (800k tokens: dense's fp8 "
                      "cache on an H100 holds 915k, its bf16 cache 463k, duo's twice that), 8 questions each, "
                      "shuffled and sent at once, tokenized before the clock starts; output tok/s, prefix-cache "
                      "hit rate, running and waiting requests (vLLM's stats lines)"),
    Workload("shared_doc_64k", "throughput", 67000, 65536, 1024, num_prompts=32, dataset="documents",
             question_len=64, num_documents=1, engine_args=("--enable-prefix-caching",),
             measures="decode-heavy question answering over one shared 64k-token document: 32 questions at once, "
                      "1,024 tokens each answer; the document is prefilled once (prefix cache) and, with the "
                      "squeeze (--squeeze), clustered once; every decode step reads it once per question"),
    Workload("chat_turns", "serve", 20000, 16000, 256, num_prompts=16, request_rates=(float("inf"),),
             dataset="chat", question_len=128, turns=6, engine_args=("--enable-prefix-caching",),
             measures="multi-turn chat over a 16k-token document: every turn resends the conversation, so all but "
                      "its newest tokens should hit the prefix cache; output tok/s, TTFT by turn, hit rate"),
    Workload("repeat_32k", "serve", 33000, 32000, 16, num_prompts=9, max_concurrency=1,
             request_rates=(float("inf"),), dataset="documents", question_len=32, num_documents=1,
             engine_args=("--enable-prefix-caching",),
             measures="time to first token of a repeated 32k-token document: one request at a time, the first "
                      "cold, the other 8 hits (their median is the hit's TTFT)"),
    Workload("tiny", "throughput", 512, 128, 16, num_prompts=4, engine_args=_CPU_ARGS, cpu=True,
             measures="CPU check that the harness works (SmolLM2-135M); the figures mean nothing"),
    Workload("tiny_ceiling", "ceiling", 65536, 16, 1, engine_args=("--max-num-seqs", "1", *_CPU_ARGS), cpu=True,
             measures="CPU check of the ceiling path: 65,536 tokens (8x SmolLM2's own limit) is beyond dense's and "
                      "duo 50%'s KV on a 1 GiB CPU cache, so both report vLLM's estimate"),
    Workload("tiny_latency", "latency", 512, 128, 8, batch_size=2, prefill_baseline=True, engine_args=_CPU_ARGS,
             cpu=True, measures="CPU check of the latency path (with its output-1 baseline)"),
    Workload("tiny_serve", "serve", 512, 128, 16, num_prompts=4, request_rates=(float("inf"),),
             engine_args=_CPU_ARGS, cpu=True, measures="CPU check of the server path"),
    Workload("tiny_docs", "serve", 1024, 256, 8, num_prompts=6, request_rates=(float("inf"),), dataset="documents",
             question_len=32, num_documents=2, engine_args=("--enable-prefix-caching", *_CPU_ARGS), cpu=True,
             measures="CPU check of the shared-documents path and the hit rate"),
    Workload("tiny_docs_full", "throughput", 1024, 256, 8, num_prompts=6, dataset="documents", question_len=32,
             num_documents=2, engine_args=("--enable-prefix-caching", *_CPU_ARGS), cpu=True,
             measures="CPU check of the offline shared-documents path (prompts tokenized before the clock)"),
    Workload("tiny_chat", "serve", 1024, 200, 8, num_prompts=2, request_rates=(float("inf"),), dataset="chat",
             question_len=32, turns=3, engine_args=("--enable-prefix-caching", *_CPU_ARGS), cpu=True,
             measures="CPU check of the multi-turn chat client"),
)}
GPU_WORKLOADS = tuple(name for name, w in WORKLOADS.items() if not w.cpu)


def parse_workloads(names: list[str]) -> list[Workload]:
    chosen: list[str] = []
    for name in names:
        if name == "all":
            chosen += GPU_WORKLOADS
        elif name in WORKLOADS:
            chosen.append(name)
        else:
            raise BenchError(f"unknown workload {name!r}: choose from all, {', '.join(WORKLOADS)}")
    return [WORKLOADS[name] for name in dict.fromkeys(chosen)]


_FIXED = ("name", "kind", "cpu", "measures", "dataset")


def _coerce(workload: Workload, key: str, text: str):
    fields = {f.name: f for f in dataclasses.fields(Workload)}
    if key not in fields or key in _FIXED:
        settable = [n for n in fields if n not in _FIXED]
        raise BenchError(f"cannot set {key!r} of a workload: settable are {', '.join(settable)}")
    current = getattr(workload, key)
    try:
        if key == "request_rates":
            return tuple(float(part) for part in text.split(","))
        if key == "input_lens":
            return tuple(int(part) for part in text.split(","))
        if key == "engine_args":
            return tuple(shlex.split(text))
        if isinstance(current, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        return type(current)(text)
    except ValueError:
        raise BenchError(f"bad value {text!r} for {workload.name}.{key}") from None


def apply_overrides(workloads: list[Workload], max_model_len: list[str], sets: list[str]) -> list[Workload]:
    """`--max-model-len NAME=N` and `--set NAME.FIELD=VALUE` on the chosen workloads."""
    by_name = {w.name: w for w in workloads}
    changes = [(item, "max_model_len", item) for item in max_model_len] + [(item, None, item) for item in sets]
    for item, fixed_key, text in changes:
        if "=" not in text:
            raise BenchError(f"expected NAME=VALUE, got {item!r}")
        target, value = text.split("=", 1)
        name, key = (target, fixed_key) if fixed_key else (target.split(".", 1) + [""])[:2]
        if name not in by_name:
            raise BenchError(f"{item!r}: workload {name!r} is not among the chosen ({', '.join(by_name)})")
        by_name[name] = dataclasses.replace(by_name[name], **{key: _coerce(by_name[name], key, value)})
    return [by_name[w.name] for w in workloads]


@dataclass(frozen=True)
class Variant:
    """One attention backend configuration: vLLM's default ("dense"), another dense backend, or duo at a sparsity,
    with a KV cache dtype ("auto": the model's; else named in the label, e.g. "duo s=0.5 fp8")."""

    label: str
    backend: str | None = None  # --attention-backend; None: vLLM's default
    sparsity: float | None = None
    layer_exclusive: bool = False  # duo serving the pattern's ZigzagAttention form at `sparsity`
    squeeze: float | None = None  # duo with the squeeze at this budget
    kv_cache_dtype: str = "auto"
    keys_per_cluster: int | None = None  # the squeeze's keys per centroid (None: its default)

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9.]+", "-", self.label.lower()).strip("-")

    @property
    def is_duo(self) -> bool:
        return self.backend == "duo"


def kv_suffix(kv_cache_dtype: str) -> str:
    """A run label's KV cache dtype part ("" for the model's own dtype): "dense fp8", "duo s=0.5 fp8"."""
    return "" if kv_cache_dtype == "auto" else f" {kv_cache_dtype}"


def is_baseline(backend: str) -> bool:
    """vLLM's default backend at some KV cache dtype: the runs ratios are taken against."""
    return backend == "dense" or backend.startswith("dense ")


def dense(kv_cache_dtype: str = "auto") -> Variant:
    """vLLM's default backend: the baseline of every variant with the same KV cache dtype."""
    return Variant("dense" + kv_suffix(kv_cache_dtype), kv_cache_dtype=kv_cache_dtype)


def duo(sparsity: float, kv_cache_dtype: str = "auto") -> Variant:
    return Variant(f"duo s={sparsity:g}{kv_suffix(kv_cache_dtype)}", "duo", sparsity, kv_cache_dtype=kv_cache_dtype)


def squeezed(sparsity: float, budget: float, kv_cache_dtype: str = "auto",
             keys_per_cluster: int | None = None) -> Variant:
    keys = f" k{keys_per_cluster}" if keys_per_cluster else ""
    return Variant(f"duo s={sparsity:g} sq={budget:g}{keys}{kv_suffix(kv_cache_dtype)}", "duo", sparsity,
                   squeeze=budget, kv_cache_dtype=kv_cache_dtype, keys_per_cluster=keys_per_cluster)


def zigzag(sparsity: float, kv_cache_dtype: str = "auto") -> Variant:
    return Variant(f"zigzag s={sparsity:g}{kv_suffix(kv_cache_dtype)}", "duo", sparsity, layer_exclusive=True,
                   kv_cache_dtype=kv_cache_dtype)
