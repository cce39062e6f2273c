# SPDX-License-Identifier: Apache-2.0
"""The report of `vllm-duo eval`: results.md (full attention's accuracy against the 90% an eval needs to see a loss,
accuracy per method and context, the difference from full attention with its paired 95% interval overall and per
context, KV size) and accuracy heatmaps."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

# Team rule (issue 20): if full attention answers under 90% of an eval's prompts, the eval cannot see a loss.
MIN_FULL_ACCURACY = 0.9


class WeakReference(Exception):
    """Full attention answered under MIN_FULL_ACCURACY of the prompts; the message is the summary and a warning."""


def reference_warning(results: dict) -> str | None:
    """The loud line for an eval whose full attention answers under MIN_FULL_ACCURACY (or that has none)."""
    full = next((m for m in results["methods"] if m["kind"] == "full"), None)
    if full is None:
        return "WARNING: no full-attention method in this eval: nothing says whether its prompts can show a loss."
    if full["accuracy"] < MIN_FULL_ACCURACY:
        return (f"WARNING: full attention answers {100 * full['accuracy']:.1f}% of the prompts, under "
                f"{100 * MIN_FULL_ACCURACY:.0f}%: this eval cannot see a loss. Fix the prompts before reading its "
                "numbers.")
    return None


def write_report(results: dict, out: Path) -> None:
    (out / "results.md").write_text(report(results), encoding="utf-8")
    write_heatmaps(results, out)


def paired_with_full(records: list[dict], full: str, method: str,
                     context_len: int | None = None) -> tuple[int, int, int, float, float]:
    """A method against full attention on the same prompts (of one context length if given): how far apart they can
    really be told.

    Returns (lost: full right and method wrong, gained: the reverse, prompts, and the 95% interval of the difference
    in points). The interval is Agresti and Min's (2005) adjusted Wald interval for paired proportions: half a
    prompt added to each cell of the 2 x 2 table keeps it honest when few or no answers differ."""
    def answers(name: str) -> dict:
        return {(r["context_len"], r["depth"], r["sample"]): r["correct"] for r in records
                if r["method"] == name and context_len in (None, r["context_len"])}

    theirs, mine = answers(full), answers(method)
    both = theirs.keys() & mine.keys()
    lost = sum(theirs[k] and not mine[k] for k in both)
    gained = sum(mine[k] and not theirs[k] for k in both)
    b, c, n = lost + 0.5, gained + 0.5, len(both) + 2
    center, spread = (c - b) / n, 1.96 * math.sqrt(b + c - (c - b) ** 2 / n) / n
    return lost, gained, len(both), 100 * max(center - spread, -1.0), 100 * min(center + spread, 1.0)


def report(results: dict) -> str:
    """results.md: full attention's accuracy (a warning under 90%), the summary table (accuracy per context, overall,
    points vs full with their paired 95% interval, KV vs dense), the paired intervals per context, accuracy per
    needle phrasing and haystack style, and grids."""
    settings, records = results["settings"], results["records"]
    contexts, depths = settings["contexts"], settings["depths"]
    full = next((m for m in results["methods"] if m["kind"] == "full"), None)
    warning = reference_warning(results)
    lines = [f"# Needle retrieval: {Path(settings['model']).name}", ""]
    if warning:
        lines += [f"**{warning}**", ""]
    else:
        lines += [f"Full attention answers {100 * full['accuracy']:.1f}% of the prompts (at least "
                  f"{100 * MIN_FULL_ACCURACY:.0f}% are needed for the eval to see a loss).", ""]
    # settings.get: results.json of the eval before issue 20 has no template, needles or haystacks
    needles, haystacks = settings.get("needles", ["passkey"]), settings.get("haystacks", ["story"])
    prompt = (f"{settings.get('template', 'plain')} template, needles {', '.join(needles)}, haystacks "
              f"{', '.join(haystacks)}")
    lines += [f"Command: `{results['command']}`", "",
              f"Machine: {results['machine']['device']}; vLLM {results['machine']['vllm_version']}, torch "
              f"{results['machine']['torch_version']}, vllm-duo {results['machine']['vllm_duo_commit']}; started "
              f"{results['started']}. Pattern: {results['pattern']}. {settings['samples']} prompt(s) per cell "
              f"({len(records) // max(1, len(results['methods']))} per method; {prompt}), greedy, "
              f"{settings['max_tokens']} new tokens; correct = the answer starts with the 5-digit key.", "",
              "| method | " + " | ".join(f"{c} tok" for c in contexts)
              + " | all | vs full (points) | lost / gained vs full | 95% interval (points) | KV vs dense |",
              "|---" * (len(contexts) + 6) + "|"]
    for m in results["methods"]:
        delta = paired = interval = ""
        if full is not None and m["kind"] != "full":
            delta = f"{100 * (m['accuracy'] - full['accuracy']):+.1f}"
            lost, gained, _, low, high = paired_with_full(records, full["method"], m["method"])
            paired, interval = f"{lost} / {gained}", f"{low:+.1f} to {high:+.1f}"
        kv = ", ".join(f"{100 * v:.0f}%" for v in m["kv_fraction"].values())
        lines.append(f"| {m['method']} | " + " | ".join(f"{100 * m['by_context'][str(c)]:.0f}%" for c in contexts)
                     + f" | {100 * m['accuracy']:.1f}% | {delta} | {paired} | {interval} | {kv} |")
    if full is not None and len(results["methods"]) > 1:
        lines += ["", "Difference from full attention per context, points (paired 95% interval):", "",
                  "| method | " + " | ".join(f"{c} tok" for c in contexts) + " |", "|---" * (len(contexts) + 1) + "|"]
        for m in results["methods"]:
            if m["kind"] != "full":
                cells = []
                for c in contexts:
                    lost, gained, n, low, high = paired_with_full(records, full["method"], m["method"], c)
                    cells.append(f"{100 * (gained - lost) / max(n, 1):+.1f} ({low:+.0f} to {high:+.0f})")
                lines.append(f"| {m['method']} | " + " | ".join(cells) + " |")
    kinds = [(field, sorted({r[field] for r in records if field in r})) for field in ("needle", "haystack")]
    if all(names for _, names in kinds):
        lines += ["", "Accuracy per needle phrasing and haystack style:", "",
                  "| method | " + " | ".join(f"{field} {name}" for field, names in kinds for name in names) + " |",
                  "|---" * (1 + sum(len(names) for _, names in kinds)) + "|"]
        for m in results["methods"]:
            mine = [r for r in records if r["method"] == m["method"]]
            lines.append(f"| {m['method']} | " + " | ".join(
                f"{100 * np.mean([r['correct'] for r in mine if r[field] == name]):.0f}%"
                for field, names in kinds for name in names) + " |")
    lines += ["", "Lost / gained: prompts full attention answers and the method misses / the reverse. The interval is "
              "the 95% interval of the method's difference from full attention on these paired prompts (Agresti-Min "
              "adjusted Wald): this grid cannot tell apart differences within it.", "",
              "KV vs dense: (token, KV head) slots per request as a fraction of dense, per context. duoXX: "
              "R T + (N - R) min(T, sink + recent), R = N - ceil(s (N - 1)) retrieval heads of N (zigzagXX: R = the "
              "heads of its retrieval layers); streamingXX: all "
              "N heads streaming with recent' = ceil((R T + (N - R)(sink + recent)) / N) - sink, the same budget "
              "as duoXX; T = context + generated tokens.", "",
              "Accuracy per context (rows) and needle depth (columns; among the places a streaming head with the duo "
              "sink and recent cannot see from the question: 0 = the first after the sink, 1 = the last before the "
              "recent window):", ""]
    for m in results["methods"]:
        lines += [f"**{m['method']}**", "", "| context | " + " | ".join(f"{d:g}" for d in depths) + " |",
                  "|---" * (len(depths) + 1) + "|"]
        lines += [f"| {c} | " + " | ".join(f"{100 * v:.0f}%" for v in row) + " |"
                  for c, row in zip(contexts, m["grid"])]
        lines.append("")
    lines += ["Engines (one per method; per context for streaming, whose window depends on it):", ""]
    lines += [f"- {e['method']}: {json.dumps(e['duo']) if e['duo'] else 'dense (vLLM default backend)'}; "
              f"{e['cases']} prompts, {e['wall_s']} s" for e in results["engines"]]
    return "\n".join(lines) + "\n"


def write_heatmaps(results: dict, out: Path) -> None:
    """heatmap-<method>.png per method and heatmaps.png with all of them: accuracy over context x depth."""
    from matplotlib.figure import Figure  # without pyplot: Agg, and the process-wide backend is left alone

    settings, methods = results["settings"], results["methods"]

    def draw(axes, method):
        grid = np.array(method["grid"])
        image = axes.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        axes.set_xticks(range(len(settings["depths"])), [f"{d:g}" for d in settings["depths"]])
        axes.set_yticks(range(len(settings["contexts"])), [str(c) for c in settings["contexts"]])
        axes.set_xlabel("needle depth")
        axes.set_ylabel("context (tokens)")
        axes.set_title(f"{method['method']}: {100 * method['accuracy']:.1f}%", fontsize=10)
        for (row, col), value in np.ndenumerate(grid):
            axes.text(col, row, f"{100 * value:.0f}", ha="center", va="center", fontsize=8)
        return image

    for method in methods:
        figure = Figure(figsize=(1.2 + 0.8 * len(settings["depths"]), 1.4 + 0.5 * len(settings["contexts"])),
                        layout="constrained")
        image = draw(figure.add_subplot(), method)
        figure.colorbar(image, label="accuracy")
        figure.savefig(out / f"heatmap-{method['method']}.png", dpi=110)
    figure = Figure(figsize=(0.2 + (1.0 + 0.8 * len(settings["depths"])) * len(methods),
                             1.4 + 0.5 * len(settings["contexts"])), layout="constrained")
    for index, method in enumerate(methods):
        draw(figure.add_subplot(1, len(methods), index + 1), method)
    figure.savefig(out / "heatmaps.png", dpi=110)



def summary_table(out: str, results: dict) -> str:
    """The console's summary: where the report is, and a row per method (accuracy overall and per context, points
    vs full attention)."""
    contexts = results["settings"]["contexts"]
    full = next((m for m in results["methods"] if m["kind"] == "full"), None)
    rows = [f"  {'method':<12} {'all':>6}  " + "".join(f"{f'{c} tok':>10}" for c in contexts) + "  vs full (points)"]
    for m in results["methods"]:
        delta = f"{100 * (m['accuracy'] - full['accuracy']):+.1f}" if full is not None and m is not full else ""
        rows.append((f"  {m['method']:<12} {100 * m['accuracy']:5.1f}%  "
                     + "".join(f"{100 * m['by_context'][str(c)]:9.0f}%" for c in contexts) + f"  {delta}").rstrip())
    warning = reference_warning(results)
    return f"wrote {out}/results.md, results.json, heatmaps\n" + "\n".join(rows) + (f"\n{warning}" if warning else "")
