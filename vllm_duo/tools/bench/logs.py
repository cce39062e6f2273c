# SPDX-License-Identifier: Apache-2.0
"""What a bench run leaves behind, read back: vLLM's startup and stats lines in its log, and its JSON metrics."""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass
from pathlib import Path

from vllm_duo.tools.bench.workloads import Workload

# vLLM's startup line: "GPU KV cache size: N tokens" on every device up to 0.29 (0.28-0.29 with "Maximum concurrency
# ..." on the same line); from 0.30 "<device> KV cache size: N tokens, Maximum concurrency ...", the device "GPU" on
# CUDA, "CPU" on the CPU stack (0.32: "GPU + host" with HiSparse).
_KV_TOKENS = re.compile(r"\bKV cache size: ([\d,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_THROUGHPUT = re.compile(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s")
_RETRIEVAL = re.compile(r"retrieval ratio ([\d.]+)")
_DTYPE = re.compile(r"\bdtype=torch\.(\w+)")
# The engine's stats line, every 10 s while it is busy (vllm/v1/metrics/loggers.py); optional fields in between.
_ENGINE_STATS = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d).*?Avg prompt throughput: ([\d.]+) tokens/s, Avg generation "
                           r"throughput: ([\d.]+) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs.*?"
                           r"KV cache usage: ([\d.]+)%")
_HIT_RATE = re.compile(r"Prefix cache hit rate: ([\d.]+)%")
# vLLM's startup check when one request of max_model_len needs more KV than the cache has (kv_cache_utils.py).
_ESTIMATED_LEN = re.compile(r"the estimated maximum model length is (\d+)\.")


def read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def log_tail(log: str, lines: int = 40) -> str:
    return "\n".join(log.splitlines()[-lines:])


def read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


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


def throughput_metrics(raw: dict, log: str, workload: Workload) -> dict:
    """The run's rates; with vLLM's stats lines in the log, also its load and its last prefix-cache hit rate (vLLM's
    rate over its most recent lookups)."""
    elapsed = raw["elapsed_time"]
    metrics = {"elapsed_s": elapsed, "requests_per_s": raw["requests_per_second"],
               "total_tok_s": raw["tokens_per_second"],
               "output_tok_s": raw["num_requests"] * workload.output_len / elapsed}
    if match := _THROUGHPUT.search(log):  # vLLM's own count of generated tokens
        metrics["output_tok_s"] = float(match.group(3))
    if stats := [match.groups()[1:] for match in _ENGINE_STATS.finditer(log)]:
        metrics["peak_running"] = max(int(running) for _, _, running, _, _ in stats)
        metrics["peak_waiting"] = max(int(waiting) for _, _, _, waiting, _ in stats)
        metrics["peak_kv_usage_pct"] = max(float(kv) for *_, kv in stats)
    if rates := _HIT_RATE.findall(log):
        metrics["prefix_cache_hit_rate"] = float(rates[-1]) / 100
    return metrics


def estimated_ceiling(log: str) -> dict | None:
    """A ceiling run whose engine did not start: the longest max_model_len vLLM's check estimated would fit, if it
    got that far (else the run failed for another reason)."""
    if match := _ESTIMATED_LEN.search(log):
        return {"accepted_len": int(match.group(1)), "lower_bound": False}
    return None


def started_ceiling(workload: Workload) -> dict:
    """A ceiling run whose engine started: it accepts the length asked for, and maybe more."""
    return {"accepted_len": workload.max_model_len, "lower_bound": True}


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
    if "median_ttft_ms_by_turn" in raw:  # the multi-turn chat client's (chat.py)
        metrics["median_ttft_ms_by_turn"] = raw["median_ttft_ms_by_turn"]
    return metrics
