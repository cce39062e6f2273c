# SPDX-License-Identifier: Apache-2.0
"""The tables of `vllm-duo bench`'s results.md, one function a table: measured figures, duo/dense ratios against the
baseline at the same KV cache dtype, and the physical model's limit."""

from __future__ import annotations

import math

from vllm_duo.tools.bench.run_index import RunIndex, metric, ok, rate_and_run, request_rate
from vllm_duo.tools.bench.workloads import is_baseline, kv_suffix


def fmt(value, digits: int = 1, suffix: str = "") -> str:
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


def _value_or_status(run: dict | None, value: float | None, digits: int = 1) -> str:
    if run is None:
        return "-"
    if run.get("status") != "ok":
        return f"**{run.get('status', 'failed')}**"
    return fmt(value, digits)


def _capacity_cells(run: dict | None) -> list[str]:
    run = run or {}
    return [fmt(run.get("kv_cache_tokens")), fmt(run.get("max_concurrency"), 2, "x")]


def throughput_table(index: RunIndex, workload: str) -> list[str]:
    """Rates against dense; where the engine logged its stats (shared documents), its hit rate and peak load."""
    runs = [index.find(workload, backend, "main") for backend in index.backends(workload)]
    loaded = any(metric(run, "peak_running") is not None for run in runs)
    load_head = "| prefix cache hits | peak running | peak waiting | peak KV usage " if loaded else ""
    head = ("| backend | output tok/s | total tok/s | req/s | duo/dense | limit | reached " + load_head
            + "| KV cache tokens | max concurrency | wall s |")
    lines = [head, _separator(head)]
    for backend, run in zip(index.backends(workload), runs):
        dense = index.baseline(workload, backend, "main")
        value = metric(run, "output_tok_s")
        ratio = _ratio(value, metric(dense, "output_tok_s")) if not is_baseline(backend) else None
        limit = index.model.limit_speedup(dense, run, "throughput") if ok(run) else None
        hits = metric(run, "prefix_cache_hit_rate")
        load = (f"| {fmt(None if hits is None else 100 * hits, 1, '%')} | {fmt(metric(run, 'peak_running'), 0)} "
                f"| {fmt(metric(run, 'peak_waiting'), 0)} | {fmt(metric(run, 'peak_kv_usage_pct'), 1, '%')} "
                if loaded else "")
        lines.append(f"| {backend} | {_value_or_status(run, value)} | {fmt(metric(run, 'total_tok_s'))} "
                     f"| {fmt(metric(run, 'requests_per_s'), 2)} | {fmt(ratio, 2, 'x')} "
                     f"| {fmt(limit, 2, 'x')} | {_reached(ratio, limit)} " + load + "| "
                     + " | ".join(_capacity_cells(run)) + f" | {fmt((run or {}).get('wall_s'), 0)} |")
    return lines


def capacity_table(index: RunIndex, workload: str) -> list[str]:
    """duo/dense at the same KV cache dtype; with other dtypes run too, also each run against plain dense."""
    mixed = any(index.kv_cache_dtype(workload, b) != "auto" for b in index.backends(workload))
    model_kv = " | vs dense with the model's KV dtype" if mixed else ""
    head = f"| backend | KV cache tokens | max concurrency | duo/dense{model_kv} | limit | reached | wall s |"
    lines = [head, _separator(head)]
    plain = (index.find(workload, "dense", "main") or {}).get("max_concurrency")
    for backend in index.backends(workload):
        run, dense = index.find(workload, backend, "main") or {}, index.baseline(workload, backend, "main")
        base = (dense or {}).get("max_concurrency")
        ratio = _ratio(run.get("max_concurrency"), base) if not is_baseline(backend) else None
        against_plain = f" | {fmt(_ratio(run.get('max_concurrency'), plain) if backend != 'dense' else None, 2, 'x')}"
        limit = index.model.limit_speedup(dense, run, "capacity")
        status = "" if ok(run) else f" ({run.get('status', 'missing')})"
        lines.append(f"| {backend}{status} | " + " | ".join(_capacity_cells(run))
                     + f" | {fmt(ratio, 2, 'x')}{against_plain if mixed else ''} | {fmt(limit, 2, 'x')} "
                       f"| {_reached(ratio, limit)} | {fmt(run.get('wall_s'), 0)} |")
    return lines


def ceiling_text(run: dict | None) -> str:
    """A ceiling run's accepted length: "≥ N" where the engine started (the ceiling lies higher), else vLLM's
    estimate; a failed run's status."""
    if not ok(run):
        return _value_or_status(run, None)
    metrics = run["metrics"]
    return f"{'≥ ' if metrics['lower_bound'] else ''}{metrics['accepted_len']:,}"


def ceiling_ratio(run: dict | None, base: dict | None) -> str:
    """One accepted length over another; a lower bound over an estimate is a lower bound ("≥"), the other way round an
    upper bound, two lower bounds say nothing."""
    if not (ok(run) and ok(base)):
        return "-"
    (value, above), (base_value, base_above) = ((r["metrics"]["accepted_len"], r["metrics"]["lower_bound"])
                                                for r in (run, base))
    if above and base_above:
        return "-"
    return f"{'≥ ' if above else '≤ ' if base_above else ''}{value / base_value:.2f}x"


def ceiling_table(index: RunIndex, workload: str) -> list[str]:
    """The longest request each backend accepts, against dense at the same KV cache dtype and dense at the model's."""
    head = "| backend | longest request (tokens) | duo/dense | vs dense with the model's KV dtype | wall s |"
    lines = [head, _separator(head)]
    plain = index.find(workload, "dense", "main")
    for backend in index.backends(workload):
        run, dense = index.find(workload, backend, "main"), index.baseline(workload, backend, "main")
        same = ceiling_ratio(run, dense) if not is_baseline(backend) else "-"
        against_plain = ceiling_ratio(run, plain) if backend != "dense" else "-"
        lines.append(f"| {backend} | {ceiling_text(run)} | {same} | {against_plain} "
                     f"| {fmt((run or {}).get('wall_s'), 0)} |")
    return lines


def latency_table(index: RunIndex, workload: str) -> list[str]:
    with_tpot = any(r["phase"] == "prefill" for r in index.of(workload))
    output_len = next((r["output_len"] for r in index.of(workload, "main")), 0)
    headline = "TPOT ms" if with_tpot else ("TTFT s" if output_len == 1 else "latency s")
    twin = f"latency s with 1 output token | {headline} | " if with_tpot else ""
    head = (f"| backend | avg latency s | p50 s | p99 s | {twin}duo/dense ({headline}) | limit | reached "
            "| KV cache tokens | max concurrency | wall s (all its runs) |")
    lines = [head, _separator(head)]
    for backend in index.backends(workload):
        run, dense = index.find(workload, backend, "main"), index.baseline(workload, backend, "main")
        value = index.latency_headline(workload, backend, with_tpot)
        base = index.latency_headline(workload, dense["backend"], with_tpot) if dense else None
        ratio = _ratio(value, base) if not is_baseline(backend) else None  # duo/dense of a time: < 1 is faster
        limit = index.model.limit_speedup(dense, run, "tpot" if with_tpot else "latency") if ok(run) else None
        limit_ratio = 1 / limit if limit else None
        speedup = 1 / ratio if ratio else None
        cells = [backend, _value_or_status(run, metric(run, "avg_latency_s"), 3),
                 fmt(metric(run, "p50_latency_s"), 3), fmt(metric(run, "p99_latency_s"), 3)]
        if with_tpot:
            prefill = index.find(workload, backend, "prefill")
            cells += [_value_or_status(prefill, metric(prefill, "avg_latency_s"), 3), fmt(value, 2)]
        cells += [fmt(ratio, 2, "x"), fmt(limit_ratio, 2, "x"), _reached(speedup, limit),
                  *_capacity_cells(run), fmt(sum((r.get("wall_s") or 0) for r in index.of(workload)
                                                      if r["backend"] == backend), 0)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def serve_table(index: RunIndex, workload: str) -> list[str]:
    head = ("| backend | input tokens | rate req/s (run) | output tok/s | mean TTFT ms | p99 TTFT ms | median TTFT ms "
            "| mean TPOT ms | p99 TPOT ms | median ITL ms | engine mean ITL ms | done/failed | prefix cache hits "
            "| duo/dense output tok/s | duo/dense mean TTFT | duo/dense p99 TTFT | duo/dense median ITL "
            "| KV cache tokens | max concurrency |")
    lines = [head, _separator(head)]
    phases = list(dict.fromkeys(r["phase"] for r in index.of(workload)))
    for phase in phases:
        for backend in index.backends(workload):
            run, dense = index.find(workload, backend, phase), index.baseline(workload, backend, phase)
            if run is None:
                continue
            keys = ("output_tok_s", "mean_ttft_ms", "p99_ttft_ms", "median_itl_ms")
            out_tok, mean_ttft, ttft, itl = (metric(run, key) for key in keys)
            other = not is_baseline(backend)
            done = f"{fmt(metric(run, 'completed'), 0)}/{fmt(metric(run, 'failed'), 0)}"
            hits = metric(run, "prefix_cache_hit_rate")
            ratios = [fmt(_ratio(value, metric(dense, key)) if other else None, 2, "x")
                      for value, key in zip((out_tok, mean_ttft, ttft, itl), keys)]
            lines.append(
                f"| {backend} | {run['input_len']:,} | {rate_and_run(run)} "
                f"| {_value_or_status(run, out_tok)} | {fmt(mean_ttft, 0)} | {fmt(ttft, 0)} "
                f"| {fmt(metric(run, 'median_ttft_ms'), 0)} | {fmt(metric(run, 'mean_tpot_ms'), 1)} "
                f"| {fmt(metric(run, 'p99_tpot_ms'), 1)} | {fmt(itl, 1)} | {fmt(metric(run, 'engine_mean_itl_ms'), 1)} "
                f"| {done} "
                f"| {fmt(None if hits is None else 100 * hits, 1, '%')} | " + " | ".join(ratios)
                + " | " + " | ".join(_capacity_cells(run)) + " |")
    return lines


def repeated_ttft_lines(index: RunIndex, workload: str) -> list[str]:
    """Mean TTFT over a repeated serve point's runs after each server's first (whose first burst also pays the
    server's cold start), per backend, with the spread of the runs and the baseline's TTFT over the backend's: one
    run of a burst varies with how its arrivals split over the first steps, so a ratio of single runs says little."""
    points: dict[tuple, dict[str, dict[int, float]]] = {}
    for run in index.of(workload):
        value = metric(run, "mean_ttft_ms")
        if (run.get("repeat") or 0) > 1 and value is not None:
            point = points.setdefault((run["input_len"], request_rate(run)), {})
            point.setdefault(run["backend"], {})[run["repeat"]] = value
    lines = []
    for (input_len, rate), by_backend in points.items():
        for backend in index.backends(workload):
            runs = by_backend.get(backend)
            if not runs:
                continue
            mean = sum(runs.values()) / len(runs)
            base = by_backend.get(index.baseline_backend(workload, backend))
            speed = (f"; dense/{backend} {sum(base.values()) / len(base) / mean:.3f}x"
                     if base and not is_baseline(backend) else "")
            lines.append(f"- {input_len:,} tokens at {rate} req/s, {backend}: {mean:.1f} ms over runs "
                         f"{min(runs)}-{max(runs)} (each {min(runs.values()):.1f}-{max(runs.values()):.1f}){speed}")
    if not lines:
        return []
    return ["Mean TTFT of the repeated runs after each server's first (dense's time over the backend's: above 1x "
            "the backend is faster):", ""] + lines


def turns_table(index: RunIndex, workload: str) -> list[str]:
    """A multi-turn chat's median time to first token by turn: how much of each resent conversation the cache saves."""
    by_turn = [(run["backend"], run["metrics"]["median_ttft_ms_by_turn"]) for run in index.of(workload)
               if ok(run) and (run.get("metrics") or {}).get("median_ttft_ms_by_turn")]
    if not by_turn:
        return []
    head = "| backend | " + " | ".join(f"turn {n + 1} TTFT ms" for n in range(len(by_turn[0][1]))) + " |"
    return ["Median time to first token by turn (turn 1 sends the document; later turns resend the conversation):",
            "", head, _separator(head)] + [f"| {backend} | " + " | ".join(fmt(v, 0) for v in values) + " |"
                                           for backend, values in by_turn]


def engine_load_table(index: RunIndex, workload: str) -> list[str]:
    """The profile of a serve run: the server's 10-second stats lines, summed up per backend and rate."""
    head = ("| backend | rate req/s (run) | busy s | peak running | peak waiting | s with requests waiting "
            "| peak KV usage | prompt tok/s while busy | generation tok/s while busy |")
    lines = [head, _separator(head)]
    served = (index.find(workload, backend, phase) for phase in dict.fromkeys(r["phase"] for r in index.of(workload))
            for backend in index.backends(workload))
    for run in filter(None, served):
        busy = index.busy_engine_samples(run)
        if not busy:
            continue
        lines.append(f"| {run['backend']} | {rate_and_run(run)} | {10 * len(busy)} "
                     f"| {max(s.running for s in busy)} | {max(s.waiting for s in busy)} "
                     f"| {10 * sum(s.waiting > 0 for s in busy)} | {max(s.kv_usage_pct for s in busy):.1f}% "
                     f"| {fmt(sum(s.prompt_tok_s for s in busy) / len(busy), 0)} "
                     f"| {fmt(sum(s.generation_tok_s for s in busy) / len(busy), 0)} |")
    if len(lines) == 2:
        return []
    return ["Engine load: the server's own stats lines (one every 10 s while busy, each averaging the 10 s "
            "before it) during each client's run.", ""] + lines


def all_capacity_rows(index: RunIndex) -> list[str]:
    """Every run's startup figures, by request length: the capacity comparison that all workloads give."""
    seen: dict[tuple, dict] = {}
    for run in index.runs:
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
        lines.append(f"| {length:,} | {backend} | {workload} | {fmt(run.get('kv_cache_tokens'))} "
                     f"| {run['max_concurrency']:.2f}x | {fmt(ratio, 2, 'x')} |")
    return lines
