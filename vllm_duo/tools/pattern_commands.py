# SPDX-License-Identifier: Apache-2.0
"""What the `vllm-duo pattern` commands do (convert, summarize, draw and check head patterns), and the pattern
files the trainers write from gates (identify, `pattern score`); none of it is needed to serve a pattern."""
from __future__ import annotations

import datetime
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_duo.pattern import (SCHEMA_VERSION, HeadPattern, PatternError, ideal_kv_slots, pattern_from_reference_dir,
                              read_hf_config, resolve_pattern)

_GIB = 1024**3
_LAYERS_PER_TABLE_ROW = 16
_NOTE_CHARS = 160  # an averaged pattern keeps this much of each input's notes
_RUN_FIELDS = (r"\bseed \d+", r"\b\d+ steps")  # what tells identify runs of one recipe apart, in their method


def pattern_from_gates(gates: np.ndarray, model_dir: str | Path, *, name: str | None,
                       aliases: list[str] | tuple[str, ...], sparsity: float, sink: int, recent: int, source: str,
                       method: str, notes: str | None, date: str | None = None,
                       license: str | None = None) -> HeadPattern:
    """A pattern of `gates` [layers, KV heads] for the model folder `model_dir` (shape from its config.json).

    Gates keep 6 decimals: readable JSON, and float noise from thread counts does not change the file.
    """
    shape = read_hf_config(model_dir)
    return HeadPattern.model_validate({
        "schema_version": SCHEMA_VERSION,
        "model": {"name": name or Path(model_dir).resolve().name, "aliases": list(aliases),
                  "architecture": shape.architecture, "num_layers": shape.num_layers,
                  "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim},
        "gates": np.round(gates, 6).tolist(),
        "sparsity": sparsity,
        "sink": sink,
        "recent": recent,
        "provenance": {"source": source, "method": method, "date": date or datetime.date.today().isoformat(),
                       "license": license, "notes": notes},
    })


def with_trained_mask(pattern: HeadPattern, sparsity: float, mask: np.ndarray,
                      note: str | None = None) -> HeadPattern:
    """`pattern` with `mask` (bool [layers, KV heads], True = retrieval) stored as the mask trained for `sparsity`,
    in place of a stored one for the same number of streaming heads; `note` is appended to the provenance notes."""
    data = pattern.model_dump()
    replaced = pattern.trained_mask_key(sparsity)
    kept = {key: stored for key, stored in (pattern.masks or {}).items() if key != replaced}
    data["masks"] = {**kept, str(sparsity): mask.astype(int).tolist()}
    if note is not None:
        old = pattern.provenance.notes
        data["provenance"] = {**data["provenance"], "notes": f"{old} {note}" if old else note}
    return HeadPattern.model_validate(data)


def convert(reference_dir: str, out: str, **reference_options) -> str:
    """Imports a duo-attention reference folder and writes it as a pattern JSON; returns a one-line summary.

    `reference_options` are those of pattern_from_reference_dir (name, model_config, architecture, ...).
    """
    pattern = pattern_from_reference_dir(reference_dir, **reference_options)
    pattern.save(out)
    return f"wrote {out}: {_shape_summary(pattern)}"


def show(spec: str, sparsity: float | None = None, context_len: int = 32768, heatmap: str | None = None) -> str:
    """Multi-line report: per-layer retrieval counts, retrieval ratio, sink/recent and the KV saving at context_len.

    With `heatmap`, also draws the pattern there as a PNG (see write_heatmap).
    """
    pattern, source = resolve_pattern(spec)
    counts = pattern.retrieval_counts(sparsity)
    num_retrieval = sum(counts)
    footprint = kv_footprint(pattern, context_len, sparsity)
    requested = sparsity if sparsity is not None else pattern.sparsity
    chosen = f"sparsity {requested:g}" if requested is not None else "stored mask"
    trained = pattern.trained_mask_key(sparsity)
    if trained is not None:
        chosen += f' (trained mask masks["{trained}"])'
    lines = [
        f"pattern    {pattern.model.name} ({source})",
        f"model      {pattern.model.architecture}, {_shape_summary(pattern)}",
        f"gates      {_gate_summary(pattern)}",
        f"heads      {chosen}: {num_retrieval} of {pattern.num_heads} KV heads are retrieval "
        f"(retrieval ratio {num_retrieval / pattern.num_heads:.3f}), {pattern.num_heads - num_retrieval} streaming",
        f"streaming  sink {pattern.sink} + recent {pattern.recent} tokens",
    ]
    if pattern.masks:
        lines.append(f"masks      trained for sparsity {', '.join(pattern.masks)}; the gates' ranking at others")
    lines.append(f"retrieval heads per layer (of {pattern.model.num_kv_heads}):")
    for start in range(0, len(counts), _LAYERS_PER_TABLE_ROW):
        layers = range(start, min(start + _LAYERS_PER_TABLE_ROW, len(counts)))
        lines.append("  layer " + "".join(f"{layer:4d}" for layer in layers))
        lines.append("  heads " + "".join(f"{counts[layer]:4d}" for layer in layers))
    lines.append(
        f"KV cache of one {context_len}-token sequence (bf16): dense {footprint.dense_bytes / _GIB:.2f} GiB, "
        f"duo {footprint.duo_bytes / _GIB:.2f} GiB ({footprint.ratio:.3f} of dense, saving {footprint.saving:.1%})")
    if heatmap is not None:
        write_heatmap(pattern, heatmap, sparsity)
        lines.append(f"heatmap    {heatmap}")
    return "\n".join(lines)


def write_heatmap(pattern: HeadPattern, out: str, sparsity: float | None = None) -> None:
    """Draws the gates as a [layers x KV heads] PNG with the retrieval heads at `sparsity` dotted in red."""
    # Imported here: only --heatmap needs matplotlib, and it is slow to import. Figure without pyplot draws with
    # Agg and leaves the process-wide backend alone.
    from matplotlib.figure import Figure

    mask = pattern.retrieval_mask_at(sparsity)
    values = np.array(pattern.gates) if pattern.gates is not None else mask.astype(float)
    num_layers, num_kv_heads = mask.shape
    figure = Figure(figsize=(3.0 + 0.3 * num_kv_heads, 2.0 + 0.2 * num_layers), layout="constrained")
    axes = figure.add_subplot()
    image = axes.imshow(values, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    layers, heads = np.nonzero(mask)
    axes.scatter(heads, layers, s=12, c="red", marker="o", label="retrieval head")
    axes.set_xlabel("KV head")
    axes.set_ylabel("layer")
    axes.set_title(f"{pattern.model.name}: {mask.sum()} of {mask.size} KV heads retrieval (red),\n"
                   f"sparsity {1 - mask.mean():.3f}, sink {pattern.sink} + recent {pattern.recent}", fontsize=9)
    figure.colorbar(image, ax=axes, label="gate" if pattern.gates is not None else "retrieval mask")
    figure.savefig(out, dpi=120)


def validate(spec: str, model_dir: str | None = None) -> str:
    """Loads the pattern (and checks it against model_dir's config.json, which also gives a reference folder's
    architecture and head_dim); returns one line starting with OK."""
    pattern, source = resolve_pattern(spec, model_dir)
    summary = f"OK: {source}: {pattern.model.name}, {_shape_summary(pattern)}, {sum(pattern.retrieval_counts())} " \
              f"retrieval heads by default, sink {pattern.sink}, recent {pattern.recent}"
    if model_dir is None:
        return summary
    shape = read_hf_config(model_dir)
    pattern.check_model(*shape, model_name=str(Path(model_dir)))
    return f"{summary}; matches model {model_dir} ({shape.architecture})"


def average(specs: list[str], out: str, name: str | None = None) -> str:
    """Writes the mean of the gates of several identify runs (e.g. seeds) to `out`: one run's ranking of heads near
    the threshold is noisy, the mean is steadier. Returns a one-line summary."""
    if len(specs) < 2:
        raise PatternError(f"average needs two or more patterns, got {len(specs)}: pass each run's JSON")
    loaded = [resolve_pattern(spec) for spec in specs]
    first, first_source = loaded[0]
    for pattern, source in loaded:
        _check_averageable(pattern, source, first, first_source)
    gates = np.mean([pattern.gates for pattern, _ in loaded], axis=0)
    runs = "; ".join(_run_label(pattern, source) for pattern, source in loaded)
    notes = " | ".join(f"{Path(source).name}: {textwrap.shorten(pattern.provenance.notes, _NOTE_CHARS)}"
                       for pattern, source in loaded if pattern.provenance.notes)
    data = first.model_dump()
    # an input's trained masks were chosen with its own gates, not the mean
    data.update(gates=np.round(gates, 6).tolist(), retrieval_mask=None, masks=None, layer_exclusive=False,
                model={**data["model"], "name": name or first.model.name},
                provenance={"source": first.provenance.source,
                            "method": f"mean of the gates of {len(loaded)} identify runs: {runs}. "
                                      f"{_shared_method(loaded)}",
                            "date": datetime.date.today().isoformat(), "license": first.provenance.license,
                            "notes": notes or None})
    averaged = HeadPattern.model_validate(data)
    averaged.save(out)
    return f"wrote {out}: mean of {len(loaded)} patterns, {_shape_summary(averaged)}, gates {_gate_summary(averaged)}"


def _check_averageable(pattern: HeadPattern, source: str, first: HeadPattern, first_source: str) -> None:
    """Gates of one model shape, deployed alike: otherwise their mean means nothing."""
    if pattern.gates is None:
        raise PatternError(f"{source} stores only a retrieval mask, not gates: average patterns with gates")
    shape, first_shape = _model_shape(pattern), _model_shape(first)
    if shape != first_shape:
        raise PatternError(f"{source} is for {shape} but {first_source} for {first_shape}: average runs of one model")
    differ = [f"{field} {getattr(pattern, field)} vs {getattr(first, field)}"
              for field in ("sparsity", "sink", "recent") if getattr(pattern, field) != getattr(first, field)]
    if differ:
        raise PatternError(f"{source} and {first_source} differ in {', '.join(differ)}: average patterns with "
                           "the same sparsity, sink and recent")


def _model_shape(pattern: HeadPattern) -> str:
    return f"{pattern.model.architecture}, {_shape_summary(pattern)}"


def _shared_method(loaded: list[tuple[HeadPattern, str]]) -> str:
    """The runs' recipe, so that the averaged pattern still says how its gates were trained: the first run's method
    when the others differ from it only in seed and step count, else a pointer to the inputs."""
    def recipe(pattern: HeadPattern) -> str:
        return re.sub("|".join(_RUN_FIELDS), "", pattern.provenance.method)

    first = loaded[0][0]
    if all(recipe(pattern) == recipe(first) for pattern, _ in loaded):
        return f"Each run: {first.provenance.method}"
    return "The runs' methods differ: see each input pattern's provenance."


def _run_label(pattern: HeadPattern, source: str) -> str:
    """'seed 42, 2000 steps' from an identify provenance, else the file name."""
    found = [re.search(regex, pattern.provenance.method) for regex in _RUN_FIELDS]
    return ", ".join(match.group() for match in found if match) or Path(source).name


@dataclass(frozen=True)
class KVFootprint:
    """KV-cache size of one sequence, dense vs DuoAttention, in (token, KV head) slots and bytes.

    dense = T * L * H; duo = T * sum(R_l) + min(T, sink + recent) * sum(S_l), with R_l / S_l the retrieval /
    streaming heads of layer l. A slot holds K and V: 2 * head_dim values.
    """

    context_len: int
    dense_slots: int
    duo_slots: int
    bytes_per_slot: int

    @property
    def ratio(self) -> float:
        """Duo size as a fraction of dense."""
        return self.duo_slots / self.dense_slots

    @property
    def saving(self) -> float:
        """Fraction of the dense KV cache that DuoAttention does not need."""
        return 1.0 - self.ratio

    @property
    def dense_bytes(self) -> int:
        return self.dense_slots * self.bytes_per_slot

    @property
    def duo_bytes(self) -> int:
        return self.duo_slots * self.bytes_per_slot


def kv_footprint(pattern: HeadPattern, context_len: int, sparsity: float | None = None,
                 dtype_bytes: int = 2) -> KVFootprint:
    """KV-cache footprint of one `context_len`-token sequence under `pattern` at `sparsity` (bf16 by default)."""
    if context_len <= 0:
        raise PatternError(f"context length {context_len} is not positive: pass a number of tokens, e.g. 32768")
    num_retrieval = sum(pattern.retrieval_counts(sparsity))
    num_streaming = pattern.num_heads - num_retrieval
    return KVFootprint(
        context_len=context_len,
        dense_slots=context_len * pattern.num_heads,
        duo_slots=ideal_kv_slots(context_len, num_retrieval, num_streaming, pattern.sink, pattern.recent),
        bytes_per_slot=2 * pattern.model.head_dim * dtype_bytes,
    )


def _shape_summary(pattern: HeadPattern) -> str:
    model = pattern.model
    return f"{model.num_layers} layers x {model.num_kv_heads} KV heads, head_dim {model.head_dim}"


def _gate_summary(pattern: HeadPattern) -> str:
    if pattern.gates is None:
        return "none (fixed retrieval mask)"
    gates = np.array(pattern.gates)
    return f"min {gates.min():.3f}, median {np.median(gates):.4f}, max {gates.max():.3f}"
