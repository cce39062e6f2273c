# SPDX-License-Identifier: Apache-2.0
"""A run of vLLM's offline benchmarks (`bench throughput`, `bench latency`): one subprocess, its log and its JSON."""

from __future__ import annotations

import time
from pathlib import Path

from vllm_duo.tools.bench.logs import (estimated_ceiling, latency_metrics, read_json, started_ceiling,
                                       throughput_metrics)
from vllm_duo.tools.bench.machine import now
from vllm_duo.tools.bench.results import Results
from vllm_duo.tools.bench.settings import Settings, engine_args, run_env, vllm_cli
from vllm_duo.tools.bench.workloads import Variant, Workload
from vllm_duo.tools.processes import run_logged, shell_line


def offline_command(settings: Settings, workload: Workload, variant: Variant, output_len: int,
                    json_path: Path) -> list[str]:
    common = engine_args(settings, workload, variant)
    documents = workload.kind == "throughput" and workload.dataset == "documents"
    if documents:
        prompts = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(workload.input_len),
                   "--prefix-repetition-suffix-len", str(workload.question_len),
                   "--prefix-repetition-num-prefixes", str(workload.num_documents),
                   "--prefix-repetition-output-len", str(output_len)]
    else:
        prompts = ["--dataset-name", "random", "--random-input-len", str(workload.input_len),
                   "--random-output-len", str(output_len)]
    if workload.kind in ("throughput", "ceiling"):
        # shared documents: tokenized before the clock (it, not the engine, set the pace)
        return vllm_cli(pretokenized=documents) + ["bench", "throughput", *common, *prompts,
                                                   "--num-prompts", str(workload.num_prompts),
                                                   "--output-json", str(json_path)]
    return vllm_cli() + ["bench", "latency", *common, "--input-len", str(workload.input_len),
                         "--output-len", str(output_len), "--batch-size", str(workload.batch_size),
                         "--num-iters", str(workload.num_iters), "--num-iters-warmup", str(workload.num_iters_warmup),
                         "--output-json", str(json_path)]


def run_offline(results: Results, workload: Workload, variant: Variant, phase: str, progress) -> None:
    """One throughput, latency or ceiling run ("prefill": the latency run with one output token), recorded in
    `results`; a dry run prints its command."""
    settings = results.settings
    env = run_env(settings, workload)
    out = settings.out
    stem = f"{workload.name}__{variant.slug}" + ("" if phase == "main" else f"__{phase}")
    json_path, log_path = out / "json" / f"{stem}.json", out / "logs" / f"{stem}.log"
    output_len = 1 if phase == "prefill" else workload.output_len
    cmd = offline_command(settings, workload, variant, output_len, json_path.resolve())
    progress.set_postfix_str(f"{workload.name} {variant.label} {phase}")
    if settings.dry_run:
        print(shell_line(cmd, env))
        return
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.unlink(missing_ok=True)
    record = results.new_record(workload, variant, phase, shell_line(cmd, env),
                                log=str(log_path.relative_to(out)), started_at=now())
    start = time.monotonic()
    estimate = estimated_ceiling if workload.kind == "ceiling" else None
    code, timed_out = run_logged(cmd, log_path, settings.timeout, env, settled=estimate)
    record["wall_s"] = round(time.monotonic() - start, 1)
    record["finished_at"] = now()
    metrics_of = {"throughput": lambda raw, log: throughput_metrics(raw, log, workload),
                  "latency": lambda raw, log: latency_metrics(raw),
                  "ceiling": lambda raw, log: started_ceiling(workload)}[workload.kind]
    results.add(results.finish(record, log_path, code, timed_out, read_json(json_path), metrics_of,
                               estimate or (lambda log: None)), progress)
