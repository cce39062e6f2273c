# SPDX-License-Identifier: Apache-2.0
"""The plots of `vllm-duo bench`'s results.md: throughput and time per token by context length, capacity by
sparsity, and a serve run's queue over time."""

from __future__ import annotations

from vllm_duo.tools.bench.run_index import RunIndex, metric, ok, rate_and_run, request_rate, tpot_ms
from vllm_duo.tools.bench.workloads import kv_suffix


def draw_plots(index: RunIndex) -> list[str]:
    """Draws the plots under `index.out`/plots; returns their markdown lines (or why a plot was skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["Skipped: matplotlib is not installed."]
    folder = index.out / "plots"
    lines = []
    for title, draw in (("Output throughput vs context length", _plot_throughput),
                        ("Time per output token vs context length", _plot_tpot),
                        ("Maximum concurrency vs sparsity", _plot_concurrency),
                        ("Requests running and waiting while serving", _plot_engine_load)):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        why_not = draw(index, ax)
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


def _series(points: list[tuple[str, str, float, float, str]], ax, ylabel: str) -> str | None:
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


def _plot_throughput(index: RunIndex, ax) -> str | None:
    points = [(r["backend"], "bench throughput", r["input_len"] + r["output_len"] / 2, r["metrics"]["output_tok_s"],
               r["workload"]) for r in index.runs
              if r["kind"] == "throughput" and r["workload"] != "capacity" and r["phase"] == "main" and ok(r)
              and r["metrics"].get("output_tok_s")]
    return _series(points, ax, "output tokens/s")


def _plot_tpot(index: RunIndex, ax) -> str | None:
    points = []
    for run in index.runs:
        context = run["input_len"] + run["output_len"] / 2
        if run["kind"] == "latency" and run["phase"] == "main":
            value = tpot_ms(run, index.find(run["workload"], run["backend"], "prefill"))
            if value is not None:
                points.append((run["backend"], f"latency, batch {run['batch_size']}", context, value,
                               run["workload"]))
        elif run["kind"] == "serve" and run.get("client_concurrency") and metric(run, "median_itl_ms"):
            points.append((run["backend"], f"serve, median ITL, {run['client_concurrency']} at once", context,
                           run["metrics"]["median_itl_ms"], run["workload"]))
        elif run["kind"] == "serve" and metric(run, "mean_tpot_ms") is not None:
            points.append((run["backend"], "serve, mean under load", context, run["metrics"]["mean_tpot_ms"],
                           f"{run['workload']} {run['phase']}"))
    return _series(points, ax, "ms per output token (TPOT)")


def _plot_concurrency(index: RunIndex, ax) -> str | None:
    groups: dict[int, dict[str, dict]] = {}
    for run in index.runs:
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
        if dense and duo_runs and index.model.shape is not None:
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


def _plot_engine_load(index: RunIndex, ax) -> str | None:
    """Each serve workload at its highest request rate: running (solid) and waiting (dashed) over time."""
    drawn = False
    for workload in index.workloads():
        served = [r for r in index.of(workload) if r["kind"] == "serve"]
        if not served:
            continue
        top = max(float(request_rate(r)) for r in served)
        for run in (r for r in served if float(request_rate(r)) == top):
            busy = index.busy_engine_samples(run)
            if not busy:
                continue
            xs = [s.seconds - busy[0].seconds for s in busy]
            label = f"{run['backend']}, {workload} at {rate_and_run(run)} req/s"
            line = ax.plot(xs, [s.running for s in busy], marker="o", markersize=3, label=f"{label}: running")[0]
            ax.plot(xs, [s.waiting for s in busy], linestyle="--", color=line.get_color(),
                    label=f"{run['backend']}: waiting")
            drawn = True
    if not drawn:
        return "no serve run has the server's stats lines in its log"
    ax.set_xlabel("seconds since the engine's first busy 10 s")
    ax.set_ylabel("requests")
    return None
