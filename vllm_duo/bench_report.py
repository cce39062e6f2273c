# SPDX-License-Identifier: Apache-2.0
"""results.md and plots of `vllm-duo bench`, and the physical model behind their "limit" column."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

MODEL_TEXT = """\
The physical model (`Roofline` in vllm_duo/bench_report.py) is deliberately simple: every engine step costs
max(FLOPs / peak FLOP/s, bytes / peak bandwidth) on the device, for a Llama-style decoder read from config.json.

- Weights: 2 P FLOPs per token, P = the matmul weights (q, k, v, o, MLP, LM head); a decode step reads all P
  weights once, whatever its batch.
- Attention: 4 x head_dim x query heads x layers FLOPs per (query, visible key) pair (QK^T and PV); a decode step
  reads the K and V of every visible key (2 x KV heads x head_dim x dtype bytes per token and layer).
- Duo: a fraction r of the KV heads (the retrieval ratio the plugin logs), with their query heads, sees the whole
  context; the others see min(context, sink + recent) keys. A request of n tokens holds r n + (1 - r)(sink +
  recent) tokens' worth of KV (the ring is reserved whole), against n for dense.
- Prefill is compute-bound (weights are read once per chunk of thousands of tokens); a decode step takes whichever
  bound is larger. Offline batches are as large as vLLM's measured KV pool allows (its "Maximum concurrency" line,
  converted to the workload's request length), in waves of that size; latency runs use their fixed batch.
- "limit" is the model's duo/dense ratio of the table's headline metric; "reached" is the measured improvement
  divided by the model's (speedup for throughput and concurrency, dense time / duo time for latencies): 100% means
  duo gained all the model allows, above 100% that dense ran further from its own limit than duo did.
- Not modelled: scheduling gaps, kernel efficiency, prefix caching (on for dense by default, off for duo), CUDA
  graphs, sampling and detokenization, and online serving (rate-limited; no limit is given for serve runs).
"""

# Dense BF16 tensor-core FLOP/s and memory bandwidth from the vendors' data sheets; the first name contained in the
# device name wins. Other devices (CPUs) are modelled as an H100 SXM and say so.
DEVICE_PEAKS = (("H200", 989e12, 4.8e12), ("H100 PCIe", 756e12, 2.0e12), ("H100", 989e12, 3.35e12),
                ("A100", 312e12, 2.0e12), ("L40S", 362e12, 0.864e12))
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, model_dir: str | Path) -> ModelShape | None:
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text())
            config = config.get("text_config", config)
            heads = config["num_attention_heads"]
            return cls(layers=config["num_hidden_layers"], hidden=config["hidden_size"], heads=heads,
                       kv_heads=config.get("num_key_value_heads") or heads,
                       head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                       intermediate=config["intermediate_size"], vocab=config["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def matmul_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attention + 3 * self.hidden * self.intermediate) + self.vocab * self.hidden


@dataclass(frozen=True)
class Roofline:
    shape: ModelShape
    flops: float  # FLOP/s
    bandwidth: float  # bytes/s
    dtype_bytes: int = 2  # weights
    retrieval: float = 1.0  # 1: dense
    window: int = 0  # sink + recent
    kv_bytes: int | None = None  # per K or V element; default dtype_bytes (1 for an fp8 KV cache)

    def kv_reserved(self, n: float) -> float:
        """Tokens' worth of KV memory one request of n tokens holds."""
        return self.retrieval * n + (1 - self.retrieval) * self.window

    def kv_read(self, n: float) -> float:
        """Tokens' worth of KV one decode step of a request at context n reads (and attends to)."""
        return self.retrieval * n + (1 - self.retrieval) * min(n, self.window)

    def prefill_s(self, length: int, prompts: int = 1) -> float:
        causal = length * (length + 1) / 2
        w = self.window
        streaming = causal if length <= w else w * (w + 1) / 2 + (length - w) * w
        pairs = self.retrieval * causal + (1 - self.retrieval) * streaming
        s = self.shape
        flops = 2 * s.matmul_params * length + 4 * s.head_dim * s.heads * s.layers * pairs
        return prompts * flops / self.flops

    def step_s(self, batch: int, context: float) -> float:
        s = self.shape
        kv = self.kv_read(context)
        flops = batch * (2 * s.matmul_params + 4 * s.head_dim * s.heads * s.layers * kv)
        kv_bytes_per_token = 2 * s.layers * s.kv_heads * s.head_dim * (self.kv_bytes or self.dtype_bytes)
        moved = s.matmul_params * self.dtype_bytes + batch * kv * kv_bytes_per_token
        return max(flops / self.flops, moved / self.bandwidth)

    def batch_cap(self, run: dict, length: int) -> int | None:
        """Requests of `length` tokens that fit at once, from the run's "Maximum concurrency" line."""
        if not run.get("max_concurrency") or not run.get("max_concurrency_len"):
            return None
        pool = run["max_concurrency"] * self.kv_reserved(run["max_concurrency_len"])
        return max(1, int(pool // self.kv_reserved(length)))

    def throughput_s(self, prompts: int, input_len: int, output_len: int, cap: int | None) -> float:
        batch = min(prompts, cap or prompts)
        total, left = self.prefill_s(input_len, prompts), prompts
        while left > 0:
            wave = min(batch, left)
            total += output_len * self.step_s(wave, input_len + output_len / 2)
            left -= wave
        return total

    def latency_s(self, batch: int, input_len: int, output_len: int) -> float:
        return self.prefill_s(input_len, batch) + (output_len - 1) * self.step_s(batch, input_len + output_len / 2)


def device_peaks(device: str) -> tuple[float, float, str]:
    for name, flops, bandwidth in DEVICE_PEAKS:
        if name.lower() in (device or "").lower():
            return flops, bandwidth, name
    return 989e12, 3.35e12, "H100 SXM (assumed: the device is not in the table)"


# ---------------------------------------------------------------------------------------------------- metrics


def _request_rate(run: dict) -> str:
    """A serve run's request rate: recorded, or the last `rate=` of its phase ("rate=2", "in=1024 rate=inf")."""
    return run.get("request_rate") or run["phase"].rsplit("=", 1)[1]


def _ok(run: dict | None) -> bool:
    return bool(run) and run.get("status") == "ok"


def _metric(run: dict | None, key: str) -> float | None:
    if not _ok(run):
        return None
    value = (run.get("metrics") or {}).get(key)
    return float(value) if isinstance(value, (int, float)) else None


def tpot_ms(main: dict | None, prefill: dict | None) -> float | None:
    """Decode time per output token from a latency run and its output-1 twin."""
    full, first = _metric(main, "avg_latency_s"), _metric(prefill, "avg_latency_s")
    if full is None or first is None or main["output_len"] < 2:
        return None
    return 1000 * (full - first) / (main["output_len"] - 1)


def _fmt(value, digits: int = 1, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int):
        return f"{value:,}{suffix}"
    return f"{value:,.{digits}f}{suffix}"


def _separator(head: str) -> str:
    return "|" + " --- |" * (head.count("|") - 1)


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def _reached(measured_speedup: float | None, limit_speedup: float | None) -> str:
    if measured_speedup is None or not limit_speedup:
        return "-"
    return f"{100 * measured_speedup / limit_speedup:.0f}%"


class Report:
    def __init__(self, results: dict, out: Path):
        self.results = results
        self.out = out
        self.runs: list[dict] = results.get("runs", [])
        shape = results.get("model_shape")
        self.shape = ModelShape(**shape) if shape else None
        device = results.get("device") or next((r.get("device") for r in self.runs if r.get("device")), "")
        self.flops, self.bandwidth, self.device_label = device_peaks(device)
        self.notes: list[str] = []

    # --- lookup

    def workloads(self) -> list[str]:
        order = list(self.results.get("workloads", {}))
        return order + [w for w in dict.fromkeys(r["workload"] for r in self.runs) if w not in order]

    def of(self, workload: str, phase: str | None = None) -> list[dict]:
        return [r for r in self.runs if r["workload"] == workload and (phase is None or r["phase"] == phase)]

    def find(self, workload: str, backend: str, phase: str) -> dict | None:
        return next((r for r in self.of(workload, phase) if r["backend"] == backend), None)

    def backends(self, workload: str) -> list[str]:
        labels = list(dict.fromkeys(r["backend"] for r in self.of(workload)))
        duo_kinds = ("duo", "zigzag")
        return sorted(labels, key=lambda b: (not is_baseline(b), b.startswith(duo_kinds), b.startswith("zigzag"), b))

    def kv_cache_dtype(self, workload: str, backend: str) -> str:
        run = next((r for r in self.of(workload) if r["backend"] == backend), {})
        return run.get("kv_cache_dtype") or "auto"

    def baseline(self, workload: str, backend: str, phase: str) -> dict | None:
        """The run a backend's ratio is against: vLLM's default backend at the same KV cache dtype and phase."""
        return self.find(workload, "dense" + kv_suffix(self.kv_cache_dtype(workload, backend)), phase)

    def roofline(self, run: dict) -> Roofline | None:
        if self.shape is None:
            return None
        dtype_bytes = _DTYPE_BYTES.get(run.get("dtype") or "bfloat16", 2)
        kv_bytes = 1 if (run.get("kv_cache_dtype") or "auto").startswith("fp8") else dtype_bytes
        if run.get("attention_backend") != "duo":
            return Roofline(self.shape, self.flops, self.bandwidth, dtype_bytes, kv_bytes=kv_bytes)
        if run.get("retrieval_ratio") is None:
            return None
        window = (run.get("sink") or 0) + (run.get("recent") or 0)
        return Roofline(self.shape, self.flops, self.bandwidth, dtype_bytes, run["retrieval_ratio"], window, kv_bytes)

    # --- the physical limit: model speedup of duo over dense (> 1: duo faster / holds more)

    def limit_speedup(self, dense: dict | None, duo: dict | None, what: str) -> float | None:
        if not dense or not duo or duo.get("attention_backend") != "duo":
            return None
        d, u = self.roofline(dense), self.roofline(duo)
        if d is None or u is None:
            return None
        i, o = duo["input_len"], duo["output_len"]
        if what == "capacity":
            length = duo.get("max_concurrency_len") or duo["max_model_len"]
            return d.kv_reserved(length) / u.kv_reserved(length)
        if what == "throughput":
            n = duo["num_prompts"]
            return (d.throughput_s(n, i, o, d.batch_cap(dense, i + o))
                    / u.throughput_s(n, i, o, u.batch_cap(duo, i + o)))
        if what == "tpot":
            b = duo["batch_size"]
            return d.step_s(b, i + o / 2) / u.step_s(b, i + o / 2)
        if what == "latency":
            b = duo["batch_size"]
            return d.latency_s(b, i, o) / u.latency_s(b, i, o)
        return None

    # --- tables

    def capacity_cells(self, run: dict | None) -> list[str]:
        run = run or {}
        return [_fmt(run.get("kv_cache_tokens")), _fmt(run.get("max_concurrency"), 2, "x")]

    def throughput_table(self, workload: str) -> list[str]:
        head = ("| backend | output tok/s | total tok/s | req/s | duo/dense | limit | reached | KV cache tokens "
                "| max concurrency | wall s |")
        lines = [head, _separator(head)]
        for backend in self.backends(workload):
            run, dense = self.find(workload, backend, "main"), self.baseline(workload, backend, "main")
            value = _metric(run, "output_tok_s")
            ratio = _ratio(value, _metric(dense, "output_tok_s")) if not is_baseline(backend) else None
            limit = self.limit_speedup(dense, run, "throughput") if _ok(run) else None
            lines.append(f"| {backend} | {self._value_or_status(run, value)} | {_fmt(_metric(run, 'total_tok_s'))} "
                         f"| {_fmt(_metric(run, 'requests_per_s'), 2)} | {_fmt(ratio, 2, 'x')} "
                         f"| {_fmt(limit, 2, 'x')} | {_reached(ratio, limit)} | "
                         + " | ".join(self.capacity_cells(run)) + f" | {_fmt((run or {}).get('wall_s'), 0)} |")
        return lines

    def capacity_table(self, workload: str) -> list[str]:
        """duo/dense at the same KV cache dtype; with other dtypes run too, also each run against plain dense."""
        mixed = any(self.kv_cache_dtype(workload, b) != "auto" for b in self.backends(workload))
        model_kv = " | vs dense with the model's KV dtype" if mixed else ""
        head = f"| backend | KV cache tokens | max concurrency | duo/dense{model_kv} | limit | reached | wall s |"
        lines = [head, _separator(head)]
        plain = (self.find(workload, "dense", "main") or {}).get("max_concurrency")
        for backend in self.backends(workload):
            run, dense = self.find(workload, backend, "main") or {}, self.baseline(workload, backend, "main")
            base = (dense or {}).get("max_concurrency")
            ratio = _ratio(run.get("max_concurrency"), base) if not is_baseline(backend) else None
            against_plain = f" | {_fmt(_ratio(run.get('max_concurrency'), plain) if backend != 'dense' else None, 2, 'x')}"
            limit = self.limit_speedup(dense, run, "capacity")
            status = "" if _ok(run) else f" ({run.get('status', 'missing')})"
            lines.append(f"| {backend}{status} | " + " | ".join(self.capacity_cells(run))
                         + f" | {_fmt(ratio, 2, 'x')}{against_plain if mixed else ''} | {_fmt(limit, 2, 'x')} "
                           f"| {_reached(ratio, limit)} | {_fmt(run.get('wall_s'), 0)} |")
        return lines

    def latency_table(self, workload: str) -> list[str]:
        with_tpot = any(r["phase"] == "prefill" for r in self.of(workload))
        output_len = next((r["output_len"] for r in self.of(workload, "main")), 0)
        headline = "TPOT ms" if with_tpot else ("TTFT s" if output_len == 1 else "latency s")
        twin = f"latency s with 1 output token | {headline} | " if with_tpot else ""
        head = (f"| backend | avg latency s | p50 s | p99 s | {twin}duo/dense ({headline}) | limit | reached "
                "| KV cache tokens | max concurrency | wall s (all its runs) |")
        lines = [head, _separator(head)]
        for backend in self.backends(workload):
            run, dense = self.find(workload, backend, "main"), self.baseline(workload, backend, "main")
            value = self._latency_headline(workload, backend, with_tpot)
            base = self._latency_headline(workload, dense["backend"], with_tpot) if dense else None
            ratio = _ratio(value, base) if not is_baseline(backend) else None  # duo/dense of a time: < 1 is faster
            limit = self.limit_speedup(dense, run, "tpot" if with_tpot else "latency") if _ok(run) else None
            limit_ratio = 1 / limit if limit else None
            speedup = 1 / ratio if ratio else None
            cells = [backend, self._value_or_status(run, _metric(run, "avg_latency_s"), 3),
                     _fmt(_metric(run, "p50_latency_s"), 3), _fmt(_metric(run, "p99_latency_s"), 3)]
            if with_tpot:
                prefill = self.find(workload, backend, "prefill")
                cells += [self._value_or_status(prefill, _metric(prefill, "avg_latency_s"), 3), _fmt(value, 2)]
            cells += [_fmt(ratio, 2, "x"), _fmt(limit_ratio, 2, "x"), _reached(speedup, limit),
                      *self.capacity_cells(run), _fmt(sum((r.get("wall_s") or 0) for r in self.of(workload)
                                                          if r["backend"] == backend), 0)]
            lines.append("| " + " | ".join(cells) + " |")
        return lines

    def _latency_headline(self, workload: str, backend: str, with_tpot: bool) -> float | None:
        run = self.find(workload, backend, "main")
        if with_tpot:
            return tpot_ms(run, self.find(workload, backend, "prefill"))
        return _metric(run, "avg_latency_s")

    def serve_table(self, workload: str) -> list[str]:
        head = ("| backend | input tokens | rate req/s | output tok/s | p99 TTFT ms | median TTFT ms | mean TPOT ms "
                "| p99 TPOT ms | median ITL ms | done/failed | duo/dense output tok/s | duo/dense p99 TTFT "
                "| duo/dense median ITL | KV cache tokens | max concurrency |")
        lines = [head, _separator(head)]
        phases = list(dict.fromkeys(r["phase"] for r in self.of(workload)))
        for phase in phases:
            for backend in self.backends(workload):
                run, dense = self.find(workload, backend, phase), self.baseline(workload, backend, phase)
                if run is None:
                    continue
                out_tok, ttft, itl = (_metric(run, key) for key in ("output_tok_s", "p99_ttft_ms", "median_itl_ms"))
                other = not is_baseline(backend)
                done = f"{_fmt(_metric(run, 'completed'), 0)}/{_fmt(_metric(run, 'failed'), 0)}"
                ratios = [_fmt(_ratio(value, _metric(dense, key)) if other else None, 2, "x")
                          for value, key in ((out_tok, "output_tok_s"), (ttft, "p99_ttft_ms"), (itl, "median_itl_ms"))]
                lines.append(
                    f"| {backend} | {run['input_len']:,} | {_request_rate(run)} "
                    f"| {self._value_or_status(run, out_tok)} | {_fmt(ttft, 0)} "
                    f"| {_fmt(_metric(run, 'median_ttft_ms'), 0)} | {_fmt(_metric(run, 'mean_tpot_ms'), 1)} "
                    f"| {_fmt(_metric(run, 'p99_tpot_ms'), 1)} | {_fmt(itl, 1)} | {done} | " + " | ".join(ratios)
                    + " | " + " | ".join(self.capacity_cells(run)) + " |")
        return lines

    def busy_engine_samples(self, run: dict) -> list:
        """The server's stats lines during a serve client's run, where it had requests running or waiting."""
        from vllm_duo.bench import engine_timeline, read_log

        if not (run.get("server_log") and run.get("started_at") and run.get("finished_at")):
            return []
        samples = engine_timeline(read_log(self.out / run["server_log"]), run["started_at"], run["finished_at"])
        return [s for s in samples if s.running or s.waiting]

    def engine_load_table(self, workload: str) -> list[str]:
        """The profile of a serve run: the server's 10-second stats lines, summed up per backend and rate."""
        head = ("| backend | rate req/s | busy s | peak running | peak waiting | s with requests waiting "
                "| peak KV usage | prompt tok/s while busy | generation tok/s while busy |")
        lines = [head, _separator(head)]
        runs = (self.find(workload, backend, phase) for phase in dict.fromkeys(r["phase"] for r in self.of(workload))
                for backend in self.backends(workload))
        for run in filter(None, runs):
            busy = self.busy_engine_samples(run)
            if not busy:
                continue
            lines.append(f"| {run['backend']} | {_request_rate(run)} | {10 * len(busy)} "
                         f"| {max(s.running for s in busy)} | {max(s.waiting for s in busy)} "
                         f"| {10 * sum(s.waiting > 0 for s in busy)} | {max(s.kv_usage_pct for s in busy):.1f}% "
                         f"| {_fmt(sum(s.prompt_tok_s for s in busy) / len(busy), 0)} "
                         f"| {_fmt(sum(s.generation_tok_s for s in busy) / len(busy), 0)} |")
        if len(lines) == 2:
            return []
        return ["Engine load: the server's own stats lines (one every 10 s while busy, each averaging the 10 s "
                "before it) during each client's run.", ""] + lines

    @staticmethod
    def _value_or_status(run: dict | None, value: float | None, digits: int = 1) -> str:
        if run is None:
            return "-"
        if run.get("status") != "ok":
            return f"**{run.get('status', 'failed')}**"
        return _fmt(value, digits)

    def all_capacity_rows(self) -> list[str]:
        """Every run's startup figures, by request length: the capacity comparison that all workloads give."""
        seen: dict[tuple, dict] = {}
        for run in self.runs:
            if run.get("max_concurrency") is not None:
                seen.setdefault((run["max_concurrency_len"], run["backend"], run["workload"]), run)
        if not seen:
            return ["No run logged vLLM's startup figures."]
        head = "| tokens per request | backend | workload | KV cache tokens | max concurrency | duo/dense |"
        lines = [head, _separator(head)]
        for (length, backend, workload), run in sorted(seen.items(), key=lambda kv: (kv[0][0], kv[0][2],
                                                                                     not is_baseline(kv[0][1]),
                                                                                     kv[0][1])):
            dense = seen.get((length, "dense" + kv_suffix(run.get("kv_cache_dtype") or "auto"), workload))
            ratio = (_ratio(run["max_concurrency"], dense["max_concurrency"])
                     if dense and not is_baseline(backend) else None)
            lines.append(f"| {length:,} | {backend} | {workload} | {_fmt(run.get('kv_cache_tokens'))} "
                         f"| {run['max_concurrency']:.2f}x | {_fmt(ratio, 2, 'x')} |")
        return lines

    # --- the document

    def header(self) -> list[str]:
        r, settings = self.results, self.results.get("settings", {})

        def distinct(key: str) -> str:
            values = list(dict.fromkeys(str(run.get(key)) for run in self.runs if run.get(key)))
            return ", ".join(values) or str(r.get(key) or "unknown")

        lines = ["# vllm-duo bench: vLLM's dense default backend vs duo", "",
                 f"- device: {distinct('device')}",
                 f"- vLLM {distinct('vllm_version')}, torch {distinct('torch_version')}, "
                 f"vllm-duo commit {distinct('vllm_duo_commit')}",
                 f"- runs from {r.get('started_at', '?')} to {r.get('finished_at', '?')}"]
        if settings:
            lines.append(f"- model `{settings.get('model')}` (load format {settings.get('load_format')}), tokenizer "
                         f"`{settings.get('tokenizer') or settings.get('model')}`; duo pattern "
                         f"`{settings.get('pattern') or '(found by model name)'}`, sink {settings.get('sink')}, "
                         f"recent {settings.get('recent')}")
        for command_line in r.get("command_lines", []):
            lines.append(f"- command: `{command_line}`")
        for name, reason in (r.get("skipped_backends") or {}).items():
            lines.append(f"- skipped dense backend {name}: {reason}")
        lines += ["", "Ratios are duo / dense at equal settings on the same machine, from runs made one after the "
                      "other (dense first) by the commands above. \"limit\" is the physical model's ratio (below) "
                      "and \"reached\" the measured improvement as a share of the model's. Each run's exact command "
                      "is at the end; its log and vLLM's JSON are under logs/ and json/.", ""]
        return lines

    def workload_section(self, name: str) -> list[str]:
        runs = self.of(name)
        spec = self.results.get("workloads", {}).get(name, {})
        kind = spec.get("kind") or runs[0]["kind"]
        lines = [f"## {name}", ""]
        if spec:
            from vllm_duo.bench import Workload

            workload = Workload(**{**spec, "request_rates": tuple(spec.get("request_rates", ())),
                                   "input_lens": tuple(spec.get("input_lens", ())),
                                   "engine_args": tuple(spec.get("engine_args", ()))})
            lines += [f"{workload.describe()}. {workload.measures}.", ""]
        started = min(run.get("started_at") or "?" for run in runs)
        finished = max(run.get("finished_at") or "?" for run in runs)
        commits = ", ".join(dict.fromkeys(str(run.get("vllm_duo_commit")) for run in runs))
        lines += [f"Runs from {started} to {finished}, vllm-duo commit {commits}.", ""]
        if name == "capacity":
            lines += self.capacity_table(name)
        elif kind == "throughput":
            lines += self.throughput_table(name)
        elif kind == "latency":
            lines += self.latency_table(name)
        else:
            lines += self.serve_table(name)
            if load := self.engine_load_table(name):
                lines += [""] + load
        return lines + [""]

    def model_section(self) -> list[str]:
        lines = ["## Physical model", ""]
        if self.shape is None:
            return lines + ["Skipped: the model's config.json was not readable, so no limit is given.", ""]
        s = self.shape
        lines += [f"Model: {s.layers} layers, {s.heads} query / {s.kv_heads} KV heads of {s.head_dim}, hidden "
                  f"{s.hidden}, MLP {s.intermediate}, vocab {s.vocab}: {s.matmul_params / 1e9:.2f} G matmul "
                  f"weights. Device peaks: {self.flops / 1e12:.0f} TFLOP/s, {self.bandwidth / 1e12:.2f} TB/s "
                  f"({self.device_label}).", ""]
        lines += MODEL_TEXT.splitlines()
        retrieval = sorted({(r["sparsity"], r["retrieval_ratio"]) for r in self.runs
                            if r.get("retrieval_ratio") is not None and r.get("sparsity") is not None})
        if retrieval:
            lines += ["", "Retrieval ratios the plugin logged: "
                      + ", ".join(f"sparsity {s:g} -> r = {r:.3f}" for s, r in retrieval) + "."]
        return lines + [""]

    def failures(self) -> list[str]:
        failed = [r for r in self.runs if r.get("status") != "ok"]
        if not failed:
            return []
        lines = ["## Failed runs", ""]
        for run in failed:
            lines += [f"<details><summary>{run['workload']} {run['backend']} {run['phase']}: {run.get('status')} "
                      f"({run.get('error')}); log {run.get('log')}</summary>", "", "```",
                      run.get("log_tail", ""), "```", "</details>", ""]
        return lines

    def commands(self) -> list[str]:
        lines = ["## Commands", "", "```"]
        servers = set()
        for run in self.runs:
            if run.get("server_command") and run["server_command"] not in servers:
                servers.add(run["server_command"])
                lines.append(f"# {run['workload']} {run['backend']}: server")
                lines.append(run["server_command"] + " &")
            lines.append(f"# {run['workload']} {run['backend']} {run['phase']}")
            lines.append(run["command"])
        return lines + ["```", ""]

    def markdown(self, plots: bool) -> str:
        lines = self.header()
        for name in self.workloads():
            if self.of(name):
                lines += self.workload_section(name)
        lines += ["## Capacity at every request length run", "",
                  "vLLM's own startup figures (\"GPU KV cache size\", \"Maximum concurrency for N tokens per request\")"
                  " from every run's log.", ""] + self.all_capacity_rows() + [""]
        lines += self.model_section()
        if plots:
            lines += ["## Plots", ""] + self.plots() + [""]
        return "\n".join(lines + self.failures() + self.commands())

    # --- plots

    def plots(self) -> list[str]:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return ["Skipped: matplotlib is not installed."]
        folder = self.out / "plots"
        lines = []
        for title, draw in (("Output throughput vs context length", self._plot_throughput),
                            ("Time per output token vs context length", self._plot_tpot),
                            ("Maximum concurrency vs sparsity", self._plot_concurrency),
                            ("Requests running and waiting while serving", self._plot_engine_load)):
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            why_not = draw(ax)
            if why_not:
                lines.append(f"- {title}: skipped, {why_not}.")
            else:
                folder.mkdir(parents=True, exist_ok=True)
                name = title.lower().replace(" ", "_") + ".png"
                ax.set_title(title)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
                fig.tight_layout()
                fig.savefig(folder / name, dpi=120)
                lines.append(f"![{title}](plots/{name})")
            plt.close(fig)
        return lines

    def _series(self, points: list[tuple[str, str, float, float, str]], ax, ylabel: str) -> str | None:
        """Points (backend, source, x, y, label): one colour per backend, one marker and line per source."""
        if len({x for _, _, x, _, _ in points}) < 2:
            return "the runs cover fewer than two context lengths"
        backends = list(dict.fromkeys(b for b, *_ in points))
        sources = list(dict.fromkeys(src for _, src, *_ in points))
        colors = {b: f"C{i}" for i, b in enumerate(backends)}
        for backend in backends:
            for n, source in enumerate(sources):
                mine = sorted((x, y, label) for b, src, x, y, label in points if b == backend and src == source)
                if not mine:
                    continue
                ax.plot([x for x, _, _ in mine], [y for _, y, _ in mine], marker="os^D"[n % 4], color=colors[backend],
                        label=f"{backend} ({source})" if len(sources) > 1 else backend)
                for x, y, label in mine:
                    ax.annotate(label, (x, y), fontsize=6, textcoords="offset points", xytext=(3, 3))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("mean context during decode (prompt + half the output), tokens")
        ax.set_ylabel(ylabel)
        return None

    def _plot_throughput(self, ax) -> str | None:
        points = [(r["backend"], "bench throughput", r["input_len"] + r["output_len"] / 2, r["metrics"]["output_tok_s"],
                   r["workload"]) for r in self.runs
                  if r["kind"] == "throughput" and r["workload"] != "capacity" and r["phase"] == "main" and _ok(r)
                  and r["metrics"].get("output_tok_s")]
        return self._series(points, ax, "output tokens/s")

    def _plot_tpot(self, ax) -> str | None:
        points = []
        for run in self.runs:
            context = run["input_len"] + run["output_len"] / 2
            if run["kind"] == "latency" and run["phase"] == "main":
                value = tpot_ms(run, self.find(run["workload"], run["backend"], "prefill"))
                if value is not None:
                    points.append((run["backend"], f"latency, batch {run['batch_size']}", context, value,
                                   run["workload"]))
            elif run["kind"] == "serve" and run.get("client_concurrency") and _metric(run, "median_itl_ms"):
                points.append((run["backend"], f"serve, median ITL, {run['client_concurrency']} at once", context,
                               run["metrics"]["median_itl_ms"], run["workload"]))
            elif run["kind"] == "serve" and _metric(run, "mean_tpot_ms") is not None:
                points.append((run["backend"], "serve, mean under load", context, run["metrics"]["mean_tpot_ms"],
                               f"{run['workload']} {run['phase']}"))
        return self._series(points, ax, "ms per output token (TPOT)")

    def _plot_concurrency(self, ax) -> str | None:
        groups: dict[int, dict[str, dict]] = {}
        for run in self.runs:
            if run.get("max_concurrency") is None:
                continue
            kv = run.get("kv_cache_dtype") or "auto"
            if run["backend"] == "dense" + kv_suffix(kv) or (run.get("sparsity") is not None
                                                            and not run.get("layer_exclusive")):
                groups.setdefault((run["max_concurrency_len"], kv), {}).setdefault(run["backend"], run)
        drawn = False
        for (length, kv), by_backend in sorted(groups.items()):
            duo_runs = sorted((r for r in by_backend.values() if r.get("sparsity") is not None),
                              key=lambda r: r["sparsity"])
            dense = by_backend.get("dense" + kv_suffix(kv))
            points = ([(0.0, dense["max_concurrency"])] if dense else []) + [
                (r["sparsity"], r["max_concurrency"]) for r in duo_runs]
            if len(points) < 2 or not duo_runs:
                continue
            line = ax.plot([x for x, _ in points], [y for _, y in points], marker="o",
                           label=f"{length:,} tokens per request{kv_suffix(kv)}")[0]
            if dense and duo_runs and self.shape is not None:
                window = (duo_runs[0].get("sink") or 0) + (duo_runs[0].get("recent") or 0)
                xs = [i / 50 for i in range(0, 1 + int(50 * max(r["sparsity"] for r in duo_runs)))]
                ys = [dense["max_concurrency"] * length / ((1 - x) * length + x * window) for x in xs]
                ax.plot(xs, ys, linestyle="--", color=line.get_color(), alpha=0.6,
                        label=f"{length:,}: physical model, r = 1 - sparsity")
            drawn = True
        if not drawn:
            return "no request length has both a dense and a duo startup figure, or two duo ones"
        ax.set_xlabel("sparsity (fraction of streaming heads; dense = 0)")
        ax.set_ylabel("maximum concurrency (vLLM's startup figure)")
        return None

    def _plot_engine_load(self, ax) -> str | None:
        """Each serve workload at its highest request rate: running (solid) and waiting (dashed) over time."""
        drawn = False
        for workload in self.workloads():
            runs = [r for r in self.of(workload) if r["kind"] == "serve"]
            if not runs:
                continue
            top = max(float(_request_rate(r)) for r in runs)
            for run in (r for r in runs if float(_request_rate(r)) == top):
                busy = self.busy_engine_samples(run)
                if not busy:
                    continue
                xs = [s.seconds - busy[0].seconds for s in busy]
                label = f"{run['backend']}, {workload} at {_request_rate(run)} req/s"
                line = ax.plot(xs, [s.running for s in busy], marker="o", markersize=3, label=f"{label}: running")[0]
                ax.plot(xs, [s.waiting for s in busy], linestyle="--", color=line.get_color(),
                        label=f"{run['backend']}: waiting")
                drawn = True
        if not drawn:
            return "no serve run has the server's stats lines in its log"
        ax.set_xlabel("seconds since the engine's first busy 10 s")
        ax.set_ylabel("requests")
        return None

    # --- console

    def summary(self) -> str:
        lines = []
        for name in self.workloads():
            runs = self.of(name)
            if not runs:
                continue
            phase = "main" if any(r["phase"] == "main" for r in runs) else runs[0]["phase"]  # serve: first rate
            parts = []
            for backend in self.backends(name):
                dense_main = self.baseline(name, backend, phase)
                run = self.find(name, backend, phase) or next((r for r in runs if r["backend"] == backend), None)
                if run is None or not _ok(run):
                    parts.append(f"{backend} {run.get('status') if run else 'missing'}")
                    continue
                if name == "capacity":
                    value, base, unit = run.get("max_concurrency"), (dense_main or {}).get("max_concurrency"), "x conc"
                elif run["kind"] == "latency":
                    with_tpot = any(r["phase"] == "prefill" for r in runs)
                    value = self._latency_headline(name, backend, with_tpot)
                    base = self._latency_headline(name, dense_main["backend"], with_tpot) if dense_main else None
                    unit = " ms TPOT" if with_tpot else " s latency"
                else:
                    value, base = _metric(run, "output_tok_s"), _metric(dense_main, "output_tok_s")
                    unit = " out tok/s"
                    if phase != "main":  # serve: the first client's rate (and prompt length, in a sweep)
                        sweep = f", {run['input_len']:,}-token prompts" if phase.startswith("in=") else ""
                        unit += f" at {_request_rate(run)} req/s{sweep}"
                ratio = (f" ({value / base:.2f}x {dense_main['backend']})"
                         if value is not None and base and not is_baseline(backend) else "")
                parts.append(f"{backend} {_fmt(value, 2)}{unit}{ratio}")
            lines.append(f"{name}: " + "; ".join(parts))
        failed = sum(r.get("status") != "ok" for r in self.runs)
        lines.append(f"{len(self.runs)} runs, {failed} failed; results: {self.out / 'results.md'}")
        return "\n".join(lines)


def kv_suffix(kv_cache_dtype: str) -> str:
    """A run label's KV cache dtype part ("" for the model's own dtype): "dense fp8", "duo s=0.5 fp8"."""
    return "" if kv_cache_dtype == "auto" else f" {kv_cache_dtype}"


def is_baseline(backend: str) -> bool:
    """vLLM's default backend at some KV cache dtype: the runs ratios are taken against."""
    return backend == "dense" or backend.startswith("dense ")


def markdown(results: dict, out: Path, plots: bool = True) -> str:
    return Report(results, out).markdown(plots)


def summary(results: dict, out: Path) -> str:
    return Report(results, out).summary()


def shape_json(model: str) -> dict | None:
    shape = ModelShape.from_config(model)
    return asdict(shape) if shape else None
