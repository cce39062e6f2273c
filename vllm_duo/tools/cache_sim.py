# SPDX-License-Identifier: Apache-2.0
"""Prefix caching under a full KV cache, replayed without a model: `vllm-duo cache-sim`.

vLLM's own scheduler and KV cache manager run a trace of requests over shared documents, dense (vLLM's
FullAttentionSpec) and duo (DuoAttentionSpec and DuoKVCacheManager) at equal KV bytes. A stand-in model runner
returns one token for every request whose prompt is done, so the run takes seconds on a CPU, and what it
measures is what the cache decides: hit rate, prompt tokens computed (and computed again), requests running and
waiting, preemptions, and cached pages that no hit can reach (their window is gone); and the host time of vLLM's
scheduler a step (`schedule` and `update_from_output`, the KV cache manager's bookkeeping among them), which an
engine spends before each step on whatever host runs it.

The model is the Llama-3.1-8B shape of the GPU benchmarks with its bundled pattern: only the KV layout matters.
The defaults (`ISSUE_TRACE`, `ISSUE_ENGINE`) are the trace of the GPU benchmark shared_docs_full on an H100's fp8
cache.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_duo import vllm_seam
from vllm_duo.kernels import fp8

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": 128, "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "torch_dtype": "bfloat16", "vocab_size": 128256,
}
DUO = {"pattern": "Meta-Llama-3.1-8B-Instruct", "sparsity": 0.5, "sink": 64, "recent": 256}
KV_DTYPES = {"bf16": "bfloat16", "fp8": fp8.KV_CACHE_DTYPES["fp8"]}  # --kv-cache-dtype -> torch dtype name
BACKENDS = ("dense", "duo")
BLOCK_SIZE = 16


class CacheSimError(ValueError):
    """A bad setting of `vllm-duo cache-sim`, found before any replay; the message is one line."""


def _check_at_least(settings, minimum: int, *names: str) -> None:
    """Each field in `names` is at least `minimum`; the message names the field as its command-line option."""
    for name in names:
        if getattr(settings, name) < minimum:
            raise CacheSimError(f"--{name.replace('_', '-')} must be at least {minimum}, got {getattr(settings, name)}")


@dataclass(frozen=True)
class Trace:
    """Questions over shared documents: prompt = [system prefix][document][question], shuffled.

    `requests` questions are spread evenly over `documents`; a question has `question_len` tokens, or a number
    drawn uniformly up to `question_len_max`. With `turns` > 1 each request is a chat: turn i + 1 is sent when
    turn i's answer is in, and resends turn i's prompt and answer plus a new question.
    `arrivals_per_step` 0 sends everything at once (`vllm bench throughput`), else that many requests per step.
    """

    name: str
    documents: int
    document_len: int
    question_len: int
    output_len: int
    requests: int
    system_len: int = 0
    turns: int = 1
    arrivals_per_step: int = 0
    question_len_max: int = 0
    seed: int = 0

    def __post_init__(self):
        _check_at_least(self, 1, "documents", "document_len", "question_len", "output_len", "turns")
        _check_at_least(self, 0, "system_len", "arrivals_per_step", "question_len_max")
        if self.requests < self.documents:
            raise CacheSimError(f"--requests ({self.requests}) is below --documents ({self.documents}): every "
                                "document needs a question")
        if 0 < self.question_len_max < self.question_len:
            raise CacheSimError(f"--question-len-max ({self.question_len_max}) is below --question-len "
                                f"({self.question_len})")

    def longest_request(self) -> int:
        """A bound on any request's tokens, its answer included: the last turn of a chat of longest questions."""
        question = max(self.question_len, self.question_len_max)
        return self.system_len + self.document_len + question + self.turns * (self.output_len + question) + BLOCK_SIZE

    def describe(self) -> str:
        system = f"{self.system_len:,}-token system prompt + " if self.system_len else ""
        question = f"{self.question_len}-{self.question_len_max}" if self.question_len_max else self.question_len
        chat = f", chats of {self.turns} turns" if self.turns > 1 else ""
        arrivals = f", {self.arrivals_per_step} arrivals per step" if self.arrivals_per_step else ", all at once"
        return (f"{self.requests} requests: {system}{self.documents} documents x {self.document_len:,} tokens + "
                f"{question}-token question / {self.output_len} out{chat}{arrivals}")

    def first_prompts(self) -> list[list[int]]:
        """Each request's first prompt, in arrival order (token ids above the vocabulary's special ids)."""
        rng = random.Random(self.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(1000, 100000) for _ in range(n)]

        system = tokens(self.system_len)
        documents = [system + tokens(self.document_len) for _ in range(self.documents)]
        prompts = [documents[i % self.documents] + tokens(self._question_len(rng)) for i in range(self.requests)]
        rng.shuffle(prompts)
        return prompts

    def next_question(self, request_index: int, turn: int) -> list[int]:
        rng = random.Random(f"{self.seed}/{request_index}/{turn}")
        return [rng.randrange(1000, 100000) for _ in range(self._question_len(rng))]

    def _question_len(self, rng: random.Random) -> int:
        return rng.randint(self.question_len, self.question_len_max) if self.question_len_max else self.question_len


@dataclass(frozen=True)
class Engine:
    """The engine both backends get: KV bytes (given as dense's token capacity), KV dtype and scheduler limits
    (vLLM's H100 defaults of `LLM`: 16,384 batched tokens, 1,024 sequences, async scheduling)."""

    dense_kv_tokens: int
    kv_dtype: str = "fp8"
    max_model_len: int = 0  # 0: the trace's longest request
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 1024
    async_scheduling: bool = True
    duo: dict = field(default_factory=lambda: dict(DUO))

    def __post_init__(self):
        if self.kv_dtype not in KV_DTYPES:
            raise CacheSimError(f"--kv-cache-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        _check_at_least(self, 1, "dense_kv_tokens", "max_num_seqs")
        _check_at_least(self, 0, "max_model_len")
        if self.max_num_batched_tokens < self.max_num_seqs:  # vLLM's own rule
            raise CacheSimError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is below --max-num-seqs "
                                f"({self.max_num_seqs})")


ISSUE_TRACE = Trace("shared_docs_full", documents=40, document_len=20000, question_len=300, output_len=150,
                    requests=320)
ISSUE_ENGINE = Engine(dense_kv_tokens=915_000, kv_dtype="fp8")  # an H100's dense fp8 cache for Llama-3.1-8B


@dataclass
class Replay:
    """What one backend's run of a trace measured."""

    backend: str
    kv_tokens: int  # vLLM's token capacity of the KV cache (blocks x block size)
    requests: int
    hit_rate: float  # hit tokens / prompt tokens at admission, as vLLM's prefix-cache metrics count them
    prompt_tokens_computed: int
    recomputed_tokens: int  # prompt tokens computed although this run had computed them before
    steps: int
    mean_running: float
    peak_waiting: int
    preemptions: int
    peak_unreachable_pages: int  # cached pages beyond the longest hit of a prompt of the trace
    scheduler_ms: float  # host time of vLLM's schedule() and update_from_output() a step, mean over the replay
    series: list = field(default_factory=list)  # (step, running, waiting, KV usage, unreachable pages)


@functools.cache
def _model_folder() -> tempfile.TemporaryDirectory:
    """A folder holding the model's config.json alone (all that vLLM reads of a model here), one per process and
    removed at its exit."""
    folder = tempfile.TemporaryDirectory(prefix="vllm-duo-sim-")
    (Path(folder.name) / "config.json").write_text(json.dumps(LLAMA_31_8B))
    return folder


def build_scheduler(backend: str, engine: Engine, max_model_len: int):
    """vLLM's scheduler over a KV cache of `engine.dense_kv_tokens` dense tokens' bytes, laid out as `backend`."""
    vllm_seam.require("prefix_cache_lookups")  # before the imports that vLLM 0.33 moved
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_configs
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.structured_output import StructuredOutputManager

    args = dict(model=_model_folder().name, skip_tokenizer_init=True, max_model_len=max_model_len,
                block_size=BLOCK_SIZE, max_num_batched_tokens=engine.max_num_batched_tokens,
                max_num_seqs=engine.max_num_seqs,
                enable_prefix_caching=True, async_scheduling=engine.async_scheduling)
    if backend == "duo":
        args.update(attention_backend="duo", additional_config={"duo": engine.duo})
    vllm_config = EngineArgs(**args).create_engine_config()
    dtype = getattr(torch, KV_DTYPES[engine.kv_dtype])
    shape = LLAMA_31_8B
    names = [f"model.layers.{i}.self_attn.attn" for i in range(shape["num_hidden_layers"])]
    if backend == "duo":
        from vllm_duo.backend import DuoAttentionBackend, layer_kv_cache_spec

        specs = {name: layer_kv_cache_spec(vllm_config, i, shape["head_dim"], dtype) for i, name in enumerate(names)}
        layout_backends = [DuoAttentionBackend]
    else:
        specs = {name: FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=shape["num_key_value_heads"],
                                         head_size=shape["head_dim"], dtype=dtype) for name in names}
        layout_backends = []  # the dense GPU backends (FlashAttention) declare no layouts: vLLM's default preference
    vllm_seam.resolve_kv_cache_layout(vllm_config, layout_backends, specs.values())
    dense_bytes_per_token = len(names) * shape["num_key_value_heads"] * shape["head_dim"] * 2 * dtype.itemsize
    (config,) = get_kv_cache_configs(vllm_config, [specs], [engine.dense_kv_tokens * dense_bytes_per_token])
    config = generate_scheduler_kv_cache_config([config])
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    scheduler_class = AsyncScheduler if engine.async_scheduling else Scheduler
    return scheduler_class(vllm_config, config, StructuredOutputManager(vllm_config), block_size=BLOCK_SIZE,
                           log_stats=True)


class _Lookups:
    """Each admission's prefix-cache lookup (the last one before it is scheduled), as vLLM's metrics count."""

    def __init__(self, kv_cache_manager):
        self.last: dict[tuple[str, int], tuple[int, int]] = {}
        vllm_seam.record_prefix_cache_lookups(kv_cache_manager, self._record)

    def _record(self, request, hit_tokens: int) -> None:
        self.last[request.request_id, request.num_preemptions] = (request.num_tokens, hit_tokens)

    def hit_rate(self) -> float:
        first = [v for (_, preemptions), v in self.last.items() if preemptions == 0]
        return sum(hits for _, hits in first) / max(1, sum(tokens for tokens, _ in first))


def _unreachable_pages(scheduler, prompts: list[list[int]], hashes: dict[int, list]) -> int:
    """Cached pages (block ids) at positions past the longest hit of some prompt of the trace."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    unreachable = set()
    for index in hashes:
        block_hashes = hashes[index]
        hit = vllm_seam.longest_cache_hit(manager, block_hashes, len(prompts[index]) - 1)
        for block_hash in block_hashes[hit // BLOCK_SIZE:(len(prompts[index]) - 1) // BLOCK_SIZE]:
            page = pool.get_cached_block(block_hash, [0])
            if page is None:
                break
            unreachable.add(page[0].block_id)
    return len(unreachable)


def replay(backend: str, trace: Trace, engine: Engine, sample_every: int = 25) -> Replay:
    """Run `trace` through vLLM's scheduler with `backend`'s KV cache ("dense" or "duo")."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    prompts = trace.first_prompts()
    scheduler = build_scheduler(backend, engine, engine.max_model_len or trace.longest_request())
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    lookups = _Lookups(scheduler.kv_cache_manager)
    sampling = SamplingParams(max_tokens=trace.output_len, ignore_eos=True)

    sent: dict[str, Request] = {}

    def request(index: int, turn: int, prompt: list[int]) -> Request:
        sent[f"{index}.{turn}"] = Request(f"{index}.{turn}", prompt, sampling, None, block_hasher=hasher)
        return sent[f"{index}.{turn}"]

    waiting_to_send = collections.deque(request(i, 0, p) for i, p in enumerate(prompts))
    first_prompt_hashes: dict[int, list] = {}
    computed_blocks: set = set()
    in_flight: collections.deque = collections.deque()
    depth = 2 if engine.async_scheduling else 1
    steps = prompt_tokens = recomputed = peak_waiting = unreachable = 0
    running_sum = scheduler_s = 0
    series = []
    while waiting_to_send or scheduler.has_unfinished_requests() or in_flight:
        for _ in range(trace.arrivals_per_step or len(waiting_to_send)):
            if waiting_to_send:
                new = waiting_to_send.popleft()
                scheduler.add_request(new)
                if new.request_id.endswith(".0"):
                    first_prompt_hashes[int(new.request_id.split(".")[0])] = list(new.block_hashes)
        if scheduler.has_unfinished_requests():
            started = time.perf_counter()
            output = scheduler.schedule()
            scheduler_s += time.perf_counter() - started
            if not output.num_scheduled_tokens and not in_flight:  # nothing runs, so nothing will ever be freed
                raise CacheSimError(f"{backend}'s KV cache admits no waiting request (a prefill chunk's blocks must "
                                    "fit): raise --dense-kv-tokens or lower --max-num-batched-tokens")
            steps += 1
            ids = list(output.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                r = scheduler.requests[rid]
                end = r.num_computed_tokens
                start = end - output.num_scheduled_tokens[rid]
                for b in range(-(-start // BLOCK_SIZE), min(end, r.num_prompt_tokens) // BLOCK_SIZE):
                    recomputed += BLOCK_SIZE * (r.block_hashes[b] in computed_blocks)
                    computed_blocks.add(r.block_hashes[b])
                prompt_tokens += max(0, min(end, r.num_prompt_tokens) - start)
                sampled.append([7] if end >= r.num_prompt_tokens else [])
            in_flight.append((output, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                        sampled_token_ids=sampled)))
            running_sum += len(scheduler.running)
            peak_waiting = max(peak_waiting, len(scheduler.waiting))
            if steps % sample_every == 0:
                unreachable_now = _unreachable_pages(scheduler, prompts, first_prompt_hashes)
                unreachable = max(unreachable, unreachable_now)
                series.append((steps, len(scheduler.running), len(scheduler.waiting),
                               round(scheduler.kv_cache_manager.usage, 3), unreachable_now))
        if len(in_flight) >= depth or (in_flight and not scheduler.has_unfinished_requests()):
            output, model_output = in_flight.popleft()
            started = time.perf_counter()
            engine_outputs = scheduler.update_from_output(output, model_output)
            scheduler_s += time.perf_counter() - started
            for outputs in engine_outputs.values():
                for finished in outputs.outputs:
                    if finished.finish_reason is None:
                        continue
                    index, turn = (int(x) for x in finished.request_id.split("."))
                    if turn + 1 < trace.turns:
                        conversation = list(sent.pop(finished.request_id).all_token_ids)
                        question = trace.next_question(index, turn + 1)
                        waiting_to_send.append(request(index, turn + 1, conversation + question))
    preemptions = sum(1 for _, p in lookups.last if p > 0)
    return Replay(backend, scheduler.kv_cache_manager.block_pool.num_gpu_blocks * BLOCK_SIZE,
                  len(prompts) * trace.turns, round(lookups.hit_rate(), 4), prompt_tokens, recomputed, steps,
                  round(running_sum / max(steps, 1), 1), peak_waiting, preemptions, unreachable,
                  round(1e3 * scheduler_s / max(steps, 1), 3), series)


def _duo_plan(duo: dict):
    """The plan the plugin will make of the `duo` settings for the Llama shape: bad settings raise PatternError
    here, before any replay."""
    from vllm_duo.config import DuoSettings, ModelShape, build_plan
    from vllm_duo.pattern import resolve_pattern

    settings = DuoSettings.from_additional_config({"duo": duo})
    pattern, source = resolve_pattern(settings.pattern)
    llama = LLAMA_31_8B
    shape = ModelShape(name="Llama-3.1-8B shape", architecture=llama["architectures"][0],
                       num_layers=llama["num_hidden_layers"], num_kv_heads=llama["num_key_value_heads"],
                       num_heads=llama["num_attention_heads"], head_dim=llama["head_dim"])
    return build_plan(settings, pattern, source, shape)


def _check_fits(trace: Trace, engine: Engine, backends: list[str]) -> None:
    """vLLM refuses a KV cache that cannot hold one request of the trace's longest: say so before any replay."""
    longest = trace.longest_request()
    needs = {"dense": -(-longest // BLOCK_SIZE) * BLOCK_SIZE}  # whole blocks
    if "duo" in backends:  # duo's bytes for the request, as dense tokens (the ratio does not depend on the dtype)
        ratio = _duo_plan(engine.duo).paged_capacity_ratio(longest, 1, BLOCK_SIZE)
        needs["duo"] = math.ceil(longest / ratio)
    for backend in backends:
        if engine.dense_kv_tokens < needs[backend]:
            raise CacheSimError(f"--dense-kv-tokens {engine.dense_kv_tokens:,} cannot hold one request of the "
                                f"trace's longest ({longest:,} tokens): {backend} needs {needs[backend]:,}")


def compare(trace: Trace, engine: Engine, backends: list[str], json_path: str | None = None) -> str:
    """`vllm-duo cache-sim`: replay `trace` with each backend, write the replays, the trace and the engine to
    `json_path`, and return the table. Bad settings fail before any replay."""
    unknown = [backend for backend in backends if backend not in BACKENDS]
    if unknown:
        raise CacheSimError(f"--backends: no backend {unknown[0]!r}; the backends are {', '.join(BACKENDS)}")
    _check_fits(trace, engine, backends)
    replays = [replay(backend, trace, engine) for backend in backends]
    if json_path:
        results = {"trace": dataclasses.asdict(trace), "engine": dataclasses.asdict(engine),
                   "replays": [dataclasses.asdict(r) for r in replays]}
        Path(json_path).write_text(json.dumps(results, indent=1) + "\n")
    return (f"{trace.describe()}; KV cache of {engine.dense_kv_tokens:,} dense tokens ({engine.kv_dtype})\n\n"
            + format_table(replays))


def format_table(replays: list[Replay]) -> str:
    """A markdown table, one row per replay, and a line comparing duo with dense when both ran."""
    lines = ["| backend | KV cache tokens | hit rate | prompt tokens computed | recomputed tokens | steps | "
             "mean running | peak waiting | preemptions | peak unreachable pages | scheduler ms a step |",
             "|---|" + "---:|" * 10]
    for r in replays:
        lines.append(f"| {r.backend} | {r.kv_tokens:,} | {r.hit_rate:.1%} | {r.prompt_tokens_computed:,} | "
                     f"{r.recomputed_tokens:,} | {r.steps:,} | {r.mean_running:.1f} | {r.peak_waiting:,} | "
                     f"{r.preemptions:,} | {r.peak_unreachable_pages:,} | {r.scheduler_ms:.3f} |")
    by_backend = {r.backend: r for r in replays}
    if {"dense", "duo"} <= by_backend.keys():
        dense, duo = by_backend["dense"], by_backend["duo"]
        lines.append(f"\nduo vs dense: hit rate {100 * (duo.hit_rate - dense.hit_rate):+.1f} points, prompt tokens "
                     f"computed {duo.prompt_tokens_computed / dense.prompt_tokens_computed:.2f}x, steps "
                     f"{duo.steps / dense.steps:.2f}x, scheduler host time a step "
                     f"{duo.scheduler_ms / max(dense.scheduler_ms, 1e-9):.2f}x")
    return "\n".join(lines)
