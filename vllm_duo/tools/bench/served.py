# SPDX-License-Identifier: Apache-2.0
"""A serve workload for one backend: vLLM's OpenAI server started here, then one `bench serve` client per
(prompt length, request rate), each a run with its own log and JSON; the server's log holds the engine's side."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from vllm_duo.tools.bench.logs import read_json, read_log, log_tail, serve_metrics, startup_figures
from vllm_duo.tools.bench.machine import now
from vllm_duo.tools.bench.results import Results
from vllm_duo.tools.bench.settings import Settings, engine_args, vllm_cli
from vllm_duo.tools.bench.workloads import Variant, Workload, rate_text
from vllm_duo.tools.processes import (free_port, run_logged, server_command, shell_line, start_logged, stop,
                                      wait_healthy)


def client_command(settings: Settings, workload: Workload, input_len: int, rate: float, port: int,
                   json_path: Path, seed: int = 0) -> list[str]:
    """The client of one serve point: `vllm bench serve` on random or shared-document prompts, or the multi-turn
    chat client. `seed` differs between the points of one server, so a point does not hit the cache of another."""
    tokenizer = ["--tokenizer", settings.tokenizer] if settings.tokenizer else []
    server = ["--model", settings.model, *tokenizer, "--host", "127.0.0.1", "--port", str(port), "--seed", str(seed)]
    if workload.dataset == "chat":
        return [sys.executable, "-m", "vllm_duo.tools.bench.chat", *server,
                "--conversations", str(workload.num_prompts), "--turns", str(workload.turns),
                "--first-len", str(input_len), "--turn-len", str(workload.question_len),
                "--output-len", str(workload.output_len), "--result-file", str(json_path)]
    if workload.dataset == "documents":
        prompts = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(input_len),
                   "--prefix-repetition-suffix-len", str(workload.question_len),
                   "--prefix-repetition-num-prefixes", str(workload.num_documents),
                   "--prefix-repetition-output-len", str(workload.output_len)]
    else:
        prompts = ["--dataset-name", "random", "--random-input-len", str(input_len),
                   "--random-output-len", str(workload.output_len)]
    at_once = ["--max-concurrency", str(workload.max_concurrency)] if workload.max_concurrency else []
    return vllm_cli() + ["bench", "serve", "--backend", "vllm", *server, *prompts,
                         "--num-prompts", str(workload.num_prompts), "--request-rate", rate_text(rate), *at_once,
                         "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                         "--save-result", "--result-dir", str(json_path.parent), "--result-filename", json_path.name]


# The server's Prometheus counters a client's run is read by (before and after it): prefix-cache lookups, and the
# engine's own token latencies, stamped where the engine core emits each step's tokens. The client's ITL is the gap
# between the chunks it receives: when the API server falls behind (detokenizing beside a 1M-token prompt), it
# sends several tokens in one chunk and the client's TTFT, TPOT and ITL no longer count engine steps.
_COUNTERS = {"queries": ("vllm:prefix_cache_queries_total",), "hits": ("vllm:prefix_cache_hits_total",),
             # vLLM's inter-token histogram, under its older name where the newer is absent
             "itl_s": ("vllm:inter_token_latency_seconds_sum", "vllm:time_per_output_token_seconds_sum"),
             "itl_count": ("vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"),
             "ttft_s": ("vllm:time_to_first_token_seconds_sum",),
             "ttft_count": ("vllm:time_to_first_token_seconds_count",),
             # a TTFT's parts in the engine core: waiting to be scheduled, then scheduled until its first token
             "queue_s": ("vllm:request_queue_time_seconds_sum",),
             "queue_count": ("vllm:request_queue_time_seconds_count",),
             "prefill_s": ("vllm:request_prefill_time_seconds_sum",),
             "prefill_count": ("vllm:request_prefill_time_seconds_count",),
             # the engine's steps and the tokens they scheduled (prompt and generated)
             "steps": ("vllm:iteration_tokens_total_count",),
             "step_tokens": ("vllm:iteration_tokens_total_sum",)}
# ... and how many steps scheduled at most N tokens, by the histogram's bucket bounds N (a step with more tokens than
# the batch has requests carries prefill)
_STEP_BUCKETS = "vllm:iteration_tokens_total_bucket"


def server_counters(port: int) -> dict[str, float]:
    """The server's counters of `_COUNTERS` from its /metrics (summed over its label sets), and its steps by size
    (`steps<=N`, from `_STEP_BUCKETS`); {} if unreachable."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return {}
    by_name: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name == _STEP_BUCKETS and 'le="' in line:
                name = "steps<=" + line.split('le="', 1)[1].split('"', 1)[0].removesuffix(".0")
            by_name[name] = by_name.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    counters = {name: count for name, count in by_name.items() if name.startswith("steps<=")}
    for key, names in _COUNTERS.items():
        if found := next((name for name in names if name in by_name), None):
            counters[key] = by_name[found]
    return counters


def client_counts(before: dict[str, float], after: dict[str, float]) -> dict:
    """One client's prefix-cache hits, the engine's mean inter-token latency and TTFT over its requests (and the
    TTFT's queueing and prefill parts), and its steps: the counters' growth while it ran."""
    grew = {key: after[key] - before[key] for key in before.keys() & after.keys()}
    counts = {}
    if "queries" in grew and "hits" in grew:
        counts.update(prefix_cache_queries=grew["queries"], prefix_cache_hits=grew["hits"],
                      prefix_cache_hit_rate=grew["hits"] / grew["queries"] if grew["queries"] else None)
    for name, total, count in (("engine_mean_itl_ms", "itl_s", "itl_count"),
                               ("engine_mean_ttft_ms", "ttft_s", "ttft_count"),
                               ("engine_mean_queue_ms", "queue_s", "queue_count"),
                               ("engine_mean_prefill_ms", "prefill_s", "prefill_count")):
        if grew.get(count) and total in grew:
            counts[name] = 1e3 * grew[total] / grew[count]
    if grew.get("steps"):
        counts.update(engine_steps=grew["steps"], engine_tokens_per_step=grew.get("step_tokens", 0) / grew["steps"])
        counts["engine_steps_by_tokens"] = {key.removeprefix("steps"): grew[key] for key in sorted(
            (key for key in grew if key.startswith("steps<=")), key=lambda key: float(key.removeprefix("steps<=")))}
    return counts


def _file_part(phase: str) -> str:
    """A serve phase ("rate=2", "in=1024 rate=inf") as a file name part ("rate-2", "in-1024__rate-inf")."""
    return phase.replace("=", "-").replace(" ", "__")


def _client_files(settings: Settings, workload: Workload, variant: Variant, input_len: int,
                  rate: float, run: int) -> tuple[str, Path, Path]:
    """A serve client's phase, and the paths of its vLLM JSON and its log."""
    phase = workload.serve_phase(input_len, rate, run)
    stem = f"{workload.name}__{variant.slug}__{_file_part(phase)}"
    return phase, settings.out / "json" / f"{stem}.json", settings.out / "logs" / f"{stem}.log"


# At most this share of the GPU's memory for all servers of a workload run side by side (vLLM's default for one is 0.9)
SIDE_BY_SIDE_MEMORY = 0.88


@dataclass
class Server:
    """One variant's server of a serve workload, as its clients need it: its port is taken when it starts (a server
    already up opens ports of its own while it starts)."""

    variant: Variant
    engine_args: list[str]
    log: Path
    port: int = 0
    startup_s: float = 0.0
    not_ready: str | None = None
    process: subprocess.Popen | None = None

    def take_port(self) -> None:
        self.port = free_port()

    @property
    def command(self) -> list[str]:
        return server_command(self.engine_args, self.port)


def run_served(results: Results, workload: Workload, variant: Variant, progress) -> None:
    """The server for `variant`, then each client against it, recorded in `results`; a dry run prints the
    commands."""
    run_side_by_side(results, workload, [variant], progress)


def run_side_by_side(results: Results, workload: Workload, variants: list[Variant], progress) -> None:
    """The servers of `variants` started one after another and kept up together (each with an equal share of the
    GPU's memory where there are several and the engine arguments size none), then each serve point's clients
    against them in turn, in the opposite order at every other run of a repeated point (A B, B A, A B, ...): a drift
    over the runs (a warming GPU, the host's other load) falls on every variant alike, where one server after the
    other puts it all on the later ones. Every client against a server ends before the next starts, so one burst
    has the GPU to itself. A dry run prints the commands."""
    settings = results.settings
    servers = [_server(settings, workload, variant, len(variants)) for variant in variants]
    points = list(enumerate(workload.serve_points()))
    if settings.dry_run:
        for server in servers:
            server.take_port()
            print(shell_line(server.command, settings.env) + " &")
        for seed, (input_len, rate, run) in points:
            for server in _in_turn(servers, run):
                _, json_path, _ = _client_files(settings, workload, server.variant, input_len, rate, run)
                print(shlex.join(client_command(settings, workload, input_len, rate, server.port,
                                                json_path.resolve(), seed)))
        return
    (settings.out / "json").mkdir(parents=True, exist_ok=True)
    logs = []
    try:
        for server in servers:
            server.log.parent.mkdir(parents=True, exist_ok=True)
            logs.append(open(server.log, "w"))
            progress.set_postfix_str(f"{workload.name} {server.variant.label} server")
            start = time.monotonic()
            server.take_port()
            server.process = start_logged(server.command, logs[-1], settings.env)
            server.not_ready = wait_healthy(server.port, server.process, settings.timeout)
            server.startup_s = round(time.monotonic() - start, 1)
        for seed, (input_len, rate, run) in points:
            for server in _in_turn(servers, run):
                _run_client(results, workload, server, (input_len, rate, run), seed, progress,
                            side_by_side=len(servers) if len(servers) > 1 else None)
    finally:
        for server in servers:
            if server.process is not None:
                stop(server.process)
        for log in logs:
            log.close()


def _server(settings: Settings, workload: Workload, variant: Variant, together: int) -> Server:
    """`variant`'s server of `workload`, one of `together` side by side."""
    args = engine_args(settings, workload, variant)
    if together > 1 and not {"--gpu-memory-utilization", "--kv-cache-memory-bytes"} & {
            arg.split("=", 1)[0] for arg in args}:
        args += ["--gpu-memory-utilization", f"{int(100 * SIDE_BY_SIDE_MEMORY / together) / 100:g}"]
    return Server(variant, args, settings.out / "logs" / f"{workload.name}__{variant.slug}__server.log")


def _in_turn(servers: list[Server], run: int) -> list[Server]:
    """The servers in the order of a point's run: as given at even runs, reversed at odd ones."""
    return servers[::-1] if run % 2 else servers


def _run_client(results: Results, workload: Workload, server: Server, point: tuple[int, float, int], seed: int,
                progress, side_by_side: int | None = None) -> None:
    settings = results.settings
    out = settings.out
    variant, port, server_cmd, server_log = server.variant, server.port, server.command, server.log
    startup_s, not_ready = server.startup_s, server.not_ready
    input_len, rate, run = point
    phase, json_path, log_path = _client_files(settings, workload, variant, input_len, rate, run)
    cmd = client_command(settings, workload, input_len, rate, port, json_path.resolve(), seed)
    progress.set_postfix_str(f"{workload.name} {variant.label} {phase}")
    record = results.new_record(workload, variant, phase, shlex.join(cmd), log=str(log_path.relative_to(out)),
                                server_log=str(server_log.relative_to(out)),
                                server_command=shell_line(server_cmd, settings.env),
                                server_startup_s=startup_s, request_rate=rate_text(rate), input_len=input_len,
                                repeat=run + 1 if workload.repeats > 1 else None,
                                client_concurrency=workload.max_concurrency or None, started_at=now(),
                                **({"servers_side_by_side": side_by_side} if side_by_side else {}))
    if not_ready:
        log = read_log(server_log)
        record.update(startup_figures(log), status="failed", error=not_ready, log_tail=log_tail(log),
                      returncode=None, wall_s=0.0, finished_at=now())
        results.add(record, progress)
        return
    json_path.unlink(missing_ok=True)
    counters = server_counters(port)
    start = time.monotonic()
    code, timed_out = run_logged(cmd, log_path, settings.timeout)
    counts = client_counts(counters, server_counters(port))
    record["wall_s"] = round(time.monotonic() - start, 1)
    record["finished_at"] = now()
    record = results.finish(record, log_path, code, timed_out, read_json(json_path),
                            lambda raw, log: {**serve_metrics(raw), **counts})
    record.update({k: v for k, v in startup_figures(read_log(server_log)).items()
                   if v not in (None, [])})  # the engine is the server's: its startup lines are in its log
    if record["status"] == "ok" and (record["metrics"].get("failed") or 0) > 0:
        record["error"] = f"{record['metrics']['failed']} requests failed"
    results.add(record, progress)
