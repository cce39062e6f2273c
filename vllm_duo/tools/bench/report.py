# SPDX-License-Identifier: Apache-2.0
"""`vllm-duo bench`'s results.md (header, a section per workload with its table, the physical model, plots, failed
runs, the commands) and its summary on the console."""

from __future__ import annotations

from pathlib import Path

from vllm_duo.tools.bench import tables
from vllm_duo.tools.bench.plots import draw_plots
from vllm_duo.tools.bench.roofline import MODEL_TEXT
from vllm_duo.tools.bench.run_index import RunIndex, metric, ok, request_rate
from vllm_duo.tools.bench.tables import fmt
from vllm_duo.tools.bench.workloads import Workload, is_baseline


class FailedRuns(Exception):
    """A run of the results failed; the message is the console summary, whose last line counts the failed runs."""


class Report:
    """results.md and the console summary of one results.json."""

    def __init__(self, results: dict, out: Path):
        self.index = RunIndex(results, out)
        self.failed = [run for run in self.index.runs if run.get("status") != "ok"]

    def header(self) -> list[str]:
        r, settings = self.index.results, self.index.results.get("settings", {})

        def distinct(key: str) -> str:
            values = list(dict.fromkeys(str(run.get(key)) for run in self.index.runs if run.get(key)))
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
                      "other (dense first) by the commands above, or side by side where a workload says so. "
                      "\"limit\" is the physical model's ratio (below) and \"reached\" the measured improvement as "
                      "a share of the model's. Each run's exact command is at the end; its log and vLLM's JSON are "
                      "under logs/ and json/.", ""]
        return lines

    def workload_section(self, name: str) -> list[str]:
        runs = self.index.of(name)
        spec = self.index.results.get("workloads", {}).get(name, {})
        kind = spec.get("kind") or runs[0]["kind"]
        lines = [f"## {name}", ""]
        if spec:
            workload = Workload.from_json(spec)
            lines += [f"{workload.describe()}. {workload.measures}.", ""]
        started = min(run.get("started_at") or "?" for run in runs)
        finished = max(run.get("finished_at") or "?" for run in runs)
        commits = ", ".join(dict.fromkeys(str(run.get("vllm_duo_commit")) for run in runs))
        lines += [f"Runs from {started} to {finished}, vllm-duo commit {commits}.", ""]
        if together := max((run.get("servers_side_by_side") or 0 for run in runs), default=0):
            lines += [f"The {together} servers ran side by side (`--side-by-side`), each with an equal share of the "
                      "GPU's memory, their clients in turn, in the opposite order at every other run of a point.", ""]
        if name == "capacity":
            lines += tables.capacity_table(self.index, name)
        elif kind == "ceiling":
            lines += tables.ceiling_table(self.index, name)
        elif kind == "throughput":
            lines += tables.throughput_table(self.index, name)
        elif kind == "latency":
            lines += tables.latency_table(self.index, name)
        else:
            lines += tables.serve_table(self.index, name)
            if repeated := tables.repeated_ttft_lines(self.index, name):
                lines += [""] + repeated
            if turns := tables.turns_table(self.index, name):
                lines += [""] + turns
            if load := tables.engine_load_table(self.index, name):
                lines += [""] + load
        return lines + [""]

    def model_section(self) -> list[str]:
        lines = ["## Physical model", ""]
        model = self.index.model
        if model.shape is None:
            return lines + ["Skipped: the model's config.json was not readable, so no limit is given.", ""]
        s = model.shape
        lines += [f"Model: {s.layers} layers, {s.heads} query / {s.kv_heads} KV heads of {s.head_dim}, hidden "
                  f"{s.hidden}, MLP {s.intermediate}, vocab {s.vocab}: {s.matmul_params / 1e9:.2f} G matmul "
                  f"weights. Device peaks: {model.flops / 1e12:.0f} TFLOP/s, {model.bandwidth / 1e12:.2f} TB/s "
                  f"({model.device_label}).", ""]
        lines += MODEL_TEXT.splitlines()
        retrieval = sorted({(r["sparsity"], r["retrieval_ratio"]) for r in self.index.runs
                            if r.get("retrieval_ratio") is not None and r.get("sparsity") is not None})
        if retrieval:
            lines += ["", "Retrieval ratios the plugin logged: "
                      + ", ".join(f"sparsity {s:g} -> r = {r:.3f}" for s, r in retrieval) + "."]
        return lines + [""]

    def failures(self) -> list[str]:
        if not self.failed:
            return []
        lines = ["## Failed runs", ""]
        for run in self.failed:
            lines += [f"<details><summary>{run['workload']} {run['backend']} {run['phase']}: {run.get('status')} "
                      f"({run.get('error')}); log {run.get('log')}</summary>", "", "```",
                      run.get("log_tail", ""), "```", "</details>", ""]
        return lines

    def commands(self) -> list[str]:
        lines = ["## Commands", "", "```"]
        servers = set()
        for run in self.index.runs:
            if run.get("server_command") and run["server_command"] not in servers:
                servers.add(run["server_command"])
                lines.append(f"# {run['workload']} {run['backend']}: server")
                lines.append(run["server_command"] + " &")
            lines.append(f"# {run['workload']} {run['backend']} {run['phase']}")
            lines.append(run["command"])
        return lines + ["```", ""]

    def markdown(self, plots: bool) -> str:
        lines = self.header()
        for name in self.index.workloads():
            if self.index.of(name):
                lines += self.workload_section(name)
        lines += ["## Capacity at every request length run", "",
                  "vLLM's own startup figures (\"KV cache size\", \"Maximum concurrency for N tokens per request\")"
                  " from every run's log.", ""] + tables.all_capacity_rows(self.index) + [""]
        lines += self.model_section()
        if plots:
            lines += ["## Plots", ""] + draw_plots(self.index) + [""]
        return "\n".join(lines + self.failures() + self.commands())

    def summary(self) -> str:
        """The console's summary: a row per workload and backend with its headline figure and ratio to its baseline
        (serve: at the first request rate), then where the report is."""
        rows = [("workload", "backend", "result", "vs baseline")]
        for name in self.index.workloads():
            runs = self.index.of(name)
            if not runs:
                continue
            phase = "main" if any(r["phase"] == "main" for r in runs) else runs[0]["phase"]  # serve: first rate
            for backend in self.index.backends(name):
                dense_main = self.index.baseline(name, backend, phase)
                run = self.index.find(name, backend, phase) or next((r for r in runs if r["backend"] == backend), None)
                if run is None or not ok(run):
                    rows.append((name, backend, run.get("status") if run else "missing", ""))
                    continue
                if run["kind"] == "ceiling":
                    ratio = tables.ceiling_ratio(run, dense_main) if not is_baseline(backend) else "-"
                    rows.append((name, backend, f"accepts {tables.ceiling_text(run)} tokens",
                                 "" if ratio == "-" else f"{ratio} {dense_main['backend']}"))
                    continue
                if name == "capacity":
                    value, base, unit = run.get("max_concurrency"), (dense_main or {}).get("max_concurrency"), "x conc"
                elif run["kind"] == "latency":
                    with_tpot = any(r["phase"] == "prefill" for r in runs)
                    value = self.index.latency_headline(name, backend, with_tpot)
                    base = self.index.latency_headline(name, dense_main["backend"], with_tpot) if dense_main else None
                    unit = " ms TPOT" if with_tpot else " s latency"
                else:
                    value, base = metric(run, "output_tok_s"), metric(dense_main, "output_tok_s")
                    unit = " out tok/s"
                    if phase != "main":  # serve: the first client's rate (and prompt length, in a sweep)
                        sweep = f", {run['input_len']:,}-token prompts" if phase.startswith("in=") else ""
                        unit += f" at {request_rate(run)} req/s{sweep}"
                ratio = (f"{value / base:.2f}x {dense_main['backend']}"
                         if value is not None and base and not is_baseline(backend) else "")
                rows.append((name, backend, f"{fmt(value, 2)}{unit}", ratio))
        widths = [max(len(row[column]) for row in rows) for column in range(4)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        results_md = self.index.out / "results.md"
        lines.append(f"{len(self.index.runs)} runs, {len(self.failed)} failed; results: {results_md}")
        return "\n".join(lines)

def markdown(results: dict, out: Path, plots: bool = True) -> str:
    return Report(results, out).markdown(plots)


def summary(results: dict, out: Path) -> str:
    return Report(results, out).summary()


def checked_summary(results: dict, out: Path) -> str:
    """The summary, raised as FailedRuns (the CLI exits with code 1) when a run failed."""
    report = Report(results, out)
    text = report.summary()
    if report.failed:
        raise FailedRuns(text)
    return text
