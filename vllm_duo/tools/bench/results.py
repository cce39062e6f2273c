# SPDX-License-Identifier: Apache-2.0
"""A suite's results.json: one record per run, written after every run, and merged from earlier folders."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
from pathlib import Path

from vllm_duo.tools.bench import report
from vllm_duo.tools.bench.logs import log_tail, read_json, read_log, startup_figures
from vllm_duo.tools.bench.machine import now
from vllm_duo.tools.bench.roofline import shape_json
from vllm_duo.tools.bench.settings import Settings
from vllm_duo.tools.bench.tables import ceiling_text
from vllm_duo.tools.bench.workloads import BenchError, Variant, Workload

SCHEMA_VERSION = 1


class Results:
    """The runs of a suite so far (with those of an earlier results.json in the same folder), rewritten to
    results.json and results.md after every run, so that a suite cut off still leaves its finished runs."""

    def __init__(self, settings: Settings, machine: dict, skipped_dense: dict[str, str], previous: dict | None):
        self.settings, self.machine, self.skipped_dense = settings, machine, skipped_dense
        self.previous = previous or {}
        self.runs: list[dict] = list(self.previous.get("runs", []))
        self.started_at = now()

    def new_record(self, workload: Workload, variant: Variant, phase: str, command: str, **fields) -> dict:
        """A new run's record: what was run (`command`, a shell line), where and how."""
        record = {"workload": workload.name, "kind": workload.kind, "backend": variant.label,
                  "attention_backend": variant.backend, "sparsity": variant.sparsity,
                  "kv_cache_dtype": variant.kv_cache_dtype, "phase": phase,
                  "input_len": workload.input_len,
                  "output_len": 1 if phase == "prefill" else workload.output_len,
                  "num_prompts": workload.num_prompts, "batch_size": workload.batch_size, "dataset": workload.dataset,
                  "max_model_len": workload.max_model_len, "command": command,
                  "model": self.settings.model, "load_format": self.settings.load_format, **self.machine}
        if variant.is_duo:
            record.update(pattern=self.settings.duo_config(variant).get("pattern"), sink=self.settings.sink,
                          recent=self.settings.recent, layer_exclusive=variant.layer_exclusive)
        record.update(fields)
        return record

    def finish(self, record: dict, log_path: Path, code: int | None, timed_out: bool, raw: dict | None,
               metrics_of, failure_metrics=lambda log: None) -> dict:
        """Adds a finished run's outcome to its record: startup figures, status, metrics or the error. A run that
        failed in a way that measures something (`failure_metrics` of its log: a ceiling run's estimate) is ok."""
        log = read_log(log_path)
        record.update(startup_figures(log))
        record["returncode"] = code
        record["raw"] = raw
        if code == 0 and raw is not None:
            try:
                record["metrics"], record["status"] = metrics_of(raw, log), "ok"
            except (KeyError, TypeError, ZeroDivisionError) as error:
                record["status"], record["error"] = "failed", f"vLLM's JSON lacks {error}"
        elif not timed_out and (measured := failure_metrics(log)):
            record["metrics"], record["status"] = measured, "ok"
        else:
            record["status"] = "timeout" if timed_out else "failed"
            record["error"] = (f"timed out after {self.settings.timeout:.0f} s" if timed_out else
                               f"exit code {code}" if code else "no JSON result")
        if record["status"] != "ok":
            record["log_tail"] = log_tail(log)
        return record

    def add(self, record: dict, progress) -> None:
        """Keeps a finished run (in place of an earlier one of the same workload, backend and phase), rewrites the
        results, and shows the run's line above the progress bar."""
        key = (record["workload"], record["backend"], record["phase"])
        self.runs = [r for r in self.runs if (r["workload"], r["backend"], r["phase"]) != key] + [record]
        self.write()
        progress.write(_run_line(record))
        progress.update(1)

    def write(self) -> None:
        out = self.settings.out
        out.mkdir(parents=True, exist_ok=True)
        current = {"schema_version": SCHEMA_VERSION, "started_at": self.started_at, "finished_at": now(),
                   **self.machine, "command_lines": [shlex.join(self.settings.argv)],
                   "settings": self._settings_json(), "model_shape": shape_json(self.settings.model),
                   "skipped_backends": self.skipped_dense, "workloads": {w.name: dataclasses.asdict(w)
                                                                        for w in self.settings.workloads},
                   "runs": []}
        results = merge_results([self.previous, current]) if self.previous else current
        results["runs"] = self.runs
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "results.md").write_text(report.markdown(results, out, plots=False))

    def _settings_json(self) -> dict:
        s = self.settings
        return {"model": s.model, "tokenizer": s.tokenizer, "load_format": s.load_format, "pattern": s.pattern,
                "sparsity": s.sparsity, "capacity_sparsity": s.capacity_sparsity,
                "zigzag_sparsity": s.zigzag_sparsity, "sink": s.sink, "recent": s.recent,
                "kv_cache_dtypes": s.kv_cache_dtypes,
                "engine_args": s.engine_args, "timeout_s": s.timeout,
                "env": {**{k: v for k, v in os.environ.items()
                           if k.startswith(("VLLM_", "CUDA_VISIBLE")) or k in ("HF_HUB_OFFLINE", "PYTHONPATH")},
                        **s.env}}


def _run_line(record: dict) -> str:
    metrics = record.get("metrics") or {}
    if record["status"] != "ok":
        figure = f"{record['status']}: {record.get('error')} (log: {record['log']})"
    elif "accepted_len" in metrics:
        figure = f"accepts max_model_len {ceiling_text(record)}"
    elif "output_tok_s" in metrics and metrics["output_tok_s"] is not None:
        figure = f"{metrics['output_tok_s']:,.1f} output tok/s"
    else:
        figure = f"{metrics.get('avg_latency_s', float('nan')):.3f} s latency"
    return (f"[{record['status']}] {record['workload']} {record['backend']} {record['phase']}: {figure} "
            f"({record.get('wall_s', 0):.0f} s)")


def load_results(folder: Path, out: Path) -> dict:
    """An earlier results.json; from another folder, its logs and vLLM JSON files are copied into `out` (same
    relative paths), so that a merged results folder stands alone."""
    results = read_json(folder / "results.json")
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
