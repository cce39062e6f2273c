# SPDX-License-Identifier: Apache-2.0
"""`vllm-duo bench`: vLLM's own benchmarks for the dense default backend and for duo, side by side, in one invocation.

Every run is one subprocess of vLLM's CLI (`bench throughput`, `bench latency`, or `bench serve` against an OpenAI
server started here for that backend), with its output kept in a log. The harness reads vLLM's --output-json and the
startup lines "KV cache size" and "Maximum concurrency" from the log, records a failed run with the tail of its
log and goes on, and rewrites results.json and results.md after every run (report.py draws tables and plots).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
from pathlib import Path

from vllm_duo.tools.bench import report
from vllm_duo.tools.bench.logs import read_json
from vllm_duo.tools.bench.machine import default_out, device_name
from vllm_duo.tools.bench.results import load_results, merge_results
from vllm_duo.tools.bench.settings import Settings
from vllm_duo.tools.bench.suite import Suite
from vllm_duo.tools.bench.workloads import BenchError, apply_overrides, parse_workloads
from vllm_duo.tools.processes import kv_cache_env, kv_cache_line, stop_runs_on_sigterm


def command_line(args: argparse.Namespace, settings: Settings) -> list[str]:
    """This invocation as one explicit `vllm-duo bench` command line (defaults spelled out)."""
    argv = ["vllm-duo", "bench", "--model", settings.model]
    argv += ["--tokenizer", settings.tokenizer] if settings.tokenizer else []
    argv += ["--load-format", settings.load_format]
    argv += ["--pattern", settings.pattern] if settings.pattern else []
    argv += ["--sparsity", *(f"{s:g}" for s in settings.sparsity)]
    argv += ["--capacity-sparsity", *(f"{s:g}" for s in args.capacity_sparsity)] if args.capacity_sparsity else []
    argv += ["--zigzag-sparsity", *(f"{s:g}" for s in settings.zigzag_sparsity)] if settings.zigzag_sparsity else []
    argv += ["--squeeze", *(f"{b:g}" for b in settings.squeeze)] if settings.squeeze else []
    keys = settings.squeeze_keys_per_cluster
    argv += ["--squeeze-keys-per-cluster", str(keys)] if keys else []
    argv += ["--sink", str(settings.sink), "--recent", str(settings.recent), "--workloads", *args.workloads]
    argv += ["--kv-cache-dtype", *settings.kv_cache_dtypes]
    argv += ["--max-model-len", *args.max_model_len] if args.max_model_len else []
    argv += ["--set", *args.set] if args.set else []
    argv += ["--extra-dense-backends", *settings.extra_dense_backends] if settings.extra_dense_backends else []
    argv += ["--engine-args", args.engine_args] if args.engine_args else []
    argv += ["--only", settings.only] if settings.only else []
    argv += ["--side-by-side"] if settings.side_by_side else []
    argv += ["--kv-cache-space", settings.env["VLLM_CPU_KVCACHE_SPACE"]] if settings.env else []
    return argv + ["--timeout", f"{settings.timeout:g}", "--out", str(settings.out)]


def command(args: argparse.Namespace) -> str:
    """The `vllm-duo bench` handler: runs the suite (or only reports), returns a summary to print; raises
    report.FailedRuns with it when a run failed."""
    if args.report_only:
        if not args.out:
            raise BenchError("--report-only needs --out: the folder to (re)write the report in")
        return report_only(Path(args.out), [Path(folder) for folder in args.merge])
    workloads = apply_overrides(parse_workloads(args.workloads), args.max_model_len, args.set)
    model = args.model
    if model is None:
        if not all(w.cpu for w in workloads):
            raise BenchError("--model is required for the GPU workloads (e.g. --model /tmp/llama8b)")
        from vllm_duo.tools import smollm2

        model = str(smollm2.prepare())
    if any(not 0 <= s <= 1 for s in args.sparsity + (args.capacity_sparsity or []) + args.zigzag_sparsity):
        raise BenchError("sparsity values are fractions of streaming heads, in [0, 1]")
    if any(not 0 < b <= 1 for b in args.squeeze):
        raise BenchError("--squeeze budgets are shares of the clustered keys, in (0, 1]")
    if args.squeeze_keys_per_cluster is not None and (args.squeeze_keys_per_cluster < 1 or not args.squeeze):
        raise BenchError("--squeeze-keys-per-cluster is the keys per centroid of the --squeeze runs: at least 1, "
                         "with --squeeze")
    out = Path(args.out) if args.out else default_out(device_name())
    settings = Settings(model=model, tokenizer=args.tokenizer, load_format=args.load_format, pattern=args.pattern,
                        sparsity=args.sparsity, capacity_sparsity=args.capacity_sparsity or args.sparsity,
                        zigzag_sparsity=args.zigzag_sparsity, squeeze=args.squeeze,
                        squeeze_keys_per_cluster=args.squeeze_keys_per_cluster, sink=args.sink, recent=args.recent,
                        workloads=workloads,
                        extra_dense_backends=args.extra_dense_backends, engine_args=shlex.split(args.engine_args or ""),
                        out=out, timeout=args.timeout, dry_run=args.dry_run, only=args.only,
                        kv_cache_dtypes=list(dict.fromkeys(args.kv_cache_dtype)),
                        env=kv_cache_env(args.kv_cache_space), side_by_side=args.side_by_side)
    settings.argv = command_line(args, settings)
    settings.write_zigzag_patterns()
    if args.dry_run:
        suite = Suite(settings)
        print(f"# {suite.num_runs()} runs into {out}", flush=True)
        if settings.env:
            print(f"# {kv_cache_line(settings.env)}")
        for name, reason in suite.skipped_dense.items():
            print(f"# skipping dense backend {name}: {reason}")
        suite.run()
        return ""

    if settings.env:
        print(f"vllm-duo bench: {kv_cache_line(settings.env)}", file=sys.stderr, flush=True)
    previous_handler = stop_runs_on_sigterm()
    try:
        parts = [load_results(out, out)] if (out / "results.json").exists() else []  # same folder: add, replace
        parts += [load_results(Path(folder), out) for folder in args.merge]
        Suite(settings, merge_results(parts) if parts else None).run()
    finally:  # called in-process (tests, a Python caller): its own SIGTERM handling comes back
        signal.signal(signal.SIGTERM, previous_handler)
    results = read_json(out / "results.json")
    (out / "results.md").write_text(report.markdown(results, out, plots=True))
    return report.checked_summary(results, out)


def report_only(out: Path, merge: list[Path]) -> str:
    """Rebuilds results.json (merged), results.md and the plots from earlier runs; runs nothing."""
    parts = [load_results(out, out)] if (out / "results.json").exists() else []
    parts += [load_results(folder, out) for folder in merge]
    if not parts:
        raise BenchError(f"nothing to report: no results.json in {out} or the --merge folders")
    results = merge_results(parts)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(report.markdown(results, out, plots=True))
    return report.checked_summary(results, out)
