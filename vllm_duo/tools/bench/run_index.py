# SPDX-License-Identifier: Apache-2.0
"""A results.json's runs as the report reads them: found by workload, backend and phase, each with its baseline."""

from __future__ import annotations

from pathlib import Path

from vllm_duo.tools.bench.logs import EngineSample, engine_timeline, read_log
from vllm_duo.tools.bench.roofline import PhysicalModel
from vllm_duo.tools.bench.workloads import is_baseline, kv_suffix


def request_rate(run: dict) -> str:
    """A serve run's request rate: recorded, or the `rate=` of its phase ("rate=2", "in=1024 rate=inf run=1")."""
    return run.get("request_rate") or next(part for part in run["phase"].split() if part.startswith("rate="))[5:]


def rate_and_run(run: dict) -> str:
    """A serve run's rate, and its number where the point was repeated ("inf (2)"): recorded, as the rate is."""
    return f"{request_rate(run)} ({run['repeat']})" if run.get("repeat") else request_rate(run)


def ok(run: dict | None) -> bool:
    return bool(run) and run.get("status") == "ok"


def metric(run: dict | None, key: str) -> float | None:
    if not ok(run):
        return None
    value = (run.get("metrics") or {}).get(key)
    return float(value) if isinstance(value, (int, float)) else None


def tpot_ms(main: dict | None, prefill: dict | None) -> float | None:
    """Decode time per output token from a latency run and its output-1 twin."""
    full, first = metric(main, "avg_latency_s"), metric(prefill, "avg_latency_s")
    if full is None or first is None or main["output_len"] < 2:
        return None
    return 1000 * (full - first) / (main["output_len"] - 1)


class RunIndex:
    """The runs of one results.json (its logs under `out`), and the physical model of its model and device."""

    def __init__(self, results: dict, out: Path):
        self.results = results
        self.out = out
        self.runs: list[dict] = results.get("runs", [])
        self.model = PhysicalModel(results, self.runs)

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

    def baseline_backend(self, workload: str, backend: str) -> str:
        """The backend a backend's ratios are against: vLLM's default backend at the same KV cache dtype."""
        return "dense" + kv_suffix(self.kv_cache_dtype(workload, backend))

    def baseline(self, workload: str, backend: str, phase: str) -> dict | None:
        """The run a backend's ratio is against: the baseline backend's at the same phase."""
        return self.find(workload, self.baseline_backend(workload, backend), phase)

    def latency_headline(self, workload: str, backend: str, with_tpot: bool) -> float | None:
        """A latency workload's figure: TPOT in ms when it has output-1 twins, else the average latency in s."""
        run = self.find(workload, backend, "main")
        if with_tpot:
            return tpot_ms(run, self.find(workload, backend, "prefill"))
        return metric(run, "avg_latency_s")

    def busy_engine_samples(self, run: dict) -> list[EngineSample]:
        """The server's stats lines during a serve client's run, where it had requests running or waiting."""
        if not (run.get("server_log") and run.get("started_at") and run.get("finished_at")):
            return []
        samples = engine_timeline(read_log(self.out / run["server_log"]), run["started_at"], run["finished_at"])
        return [s for s in samples if s.running or s.waiting]
