# SPDX-License-Identifier: Apache-2.0
"""The suite: every (workload, backend) pair in order, dense baselines first, each run recorded as it finishes."""

from __future__ import annotations

import importlib.util
import sys

from vllm_duo.tools.bench.machine import machine_info
from vllm_duo.tools.bench.offline import run_offline
from vllm_duo.tools.bench.results import Results
from vllm_duo.tools.bench.served import run_served, run_side_by_side
from vllm_duo.tools.bench.settings import Settings
from vllm_duo.tools.bench.workloads import Variant, Workload, dense, duo, kv_suffix, squeezed, zigzag

# Modules a dense backend needs before it is worth starting a run with it.
_BACKEND_MODULES = {"FLASHINFER": "flashinfer", "FLASH_ATTN": "vllm.vllm_flash_attn", "TRITON_ATTN": "triton",
                    "FLEX_ATTENTION": "torch"}


def variants_for(settings: Settings, workload: Workload, available_dense: list[str]) -> list[Variant]:
    """Dense baselines first, then duo, zigzag and duo with the squeeze, each at every --kv-cache-dtype. The
    workloads that only size the KV cache (capacity, ceiling) run duo at the capacity sparsities, and no zigzag or
    squeeze (their KV is duo's)."""
    sizes_cache = workload.name == "capacity" or workload.kind == "ceiling"
    sparsities = settings.capacity_sparsity if sizes_cache else settings.sparsity
    kv_dtypes = settings.kv_cache_dtypes
    baselines = [dense(kv) for kv in kv_dtypes] + [Variant(name + kv_suffix(kv), name, kv_cache_dtype=kv)
                                                   for name in available_dense for kv in kv_dtypes]
    duos = [duo(s, kv) for s in sparsities for kv in kv_dtypes]
    zigzags = [] if sizes_cache else [zigzag(s, kv) for s in settings.zigzag_sparsity for kv in kv_dtypes]
    squeezes = [] if sizes_cache else [squeezed(s, b, kv, settings.squeeze_keys_per_cluster) for s in sparsities
                                       for b in settings.squeeze for kv in kv_dtypes]
    return {"dense": baselines, "duo": duos, "zigzag": zigzags, "squeeze": squeezes}.get(
        settings.only, baselines + duos + zigzags + squeezes)


def check_dense_backends(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """The extra dense backends worth running here, and the skipped ones with the reason."""
    available, skipped = [], {}
    for name in names:
        module = _BACKEND_MODULES.get(name.upper())
        if module is None:
            skipped[name] = (f"unknown to this harness (known: {', '.join(_BACKEND_MODULES)}); vLLM would pick "
                             "its own fallback or stop")
        elif importlib.util.find_spec(module.split(".")[0]) is None or (
                "." in module and _find_spec_safe(module) is None):
            skipped[name] = f"`{module}` is not importable here"
        else:
            available.append(name.upper())
    return available, skipped


def _find_spec_safe(module: str):
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


class Suite:
    """Plans the runs of one invocation and runs them in order (or, dry, prints their commands)."""

    def __init__(self, settings: Settings, previous: dict | None = None):
        self.settings = settings
        self.available_dense, self.skipped_dense = check_dense_backends(settings.extra_dense_backends)
        machine = machine_info() if not settings.dry_run else {}
        self.results = Results(settings, machine, self.skipped_dense, previous)

    def planned(self) -> list[tuple[Workload, Variant]]:
        return [(w, v) for w in self.settings.workloads for v in variants_for(self.settings, w, self.available_dense)]

    def num_runs(self) -> int:
        per = {"throughput": lambda w: 1, "ceiling": lambda w: 1, "latency": lambda w: 2 if w.prefill_baseline else 1,
               "serve": lambda w: len(w.serve_points())}
        return sum(per[w.kind](w) for w, _ in self.planned())

    def run(self) -> dict:
        from tqdm import tqdm

        for name, reason in self.skipped_dense.items() if not self.settings.dry_run else ():
            print(f"vllm-duo bench: skipping dense backend {name}: {reason}", file=sys.stderr, flush=True)
        with tqdm(total=self.num_runs(), desc="vllm-duo bench", unit="run", disable=self.settings.dry_run,
                  file=sys.stderr, dynamic_ncols=True) as progress:
            served_together = set()
            for workload, variant in self.planned():
                if workload.kind == "serve" and self.settings.side_by_side:
                    if workload.name not in served_together:
                        served_together.add(workload.name)
                        run_side_by_side(self.results, workload, [v for w, v in self.planned() if w is workload],
                                         progress)
                    continue
                if workload.kind == "serve":
                    run_served(self.results, workload, variant, progress)
                    continue
                phases = ["main", "prefill"] if workload.prefill_baseline else ["main"]
                for phase in phases:
                    run_offline(self.results, workload, variant, phase, progress)
        if not self.settings.dry_run:
            self.results.write()
        return {"runs": self.results.runs}
