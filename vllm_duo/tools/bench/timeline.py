# SPDX-License-Identifier: Apache-2.0
"""Where a stretch of engine wall time went on the GPU: busy (some kernel or copy running) or idle, read from a torch
profiler trace (benchmarks/profile_steps.py --timeline). Idle time inside a burst of steps is time the GPU waited for
the host; busy time is what faster kernels could shorten. Each gap is charged to the launch of the device work that
ends it (the host op that issued it, found by the trace's correlation ids): a launch issued after the GPU went idle
means the host was late, and its op names the host work to shorten.

    wall        |<--------------------------------------------- window --------------------------------------->|
    kernels        [k1][k2]     [k3][k4][k5]            [k6]    [k7][k8]
    busy           ########     ############            ####    ########
    idle        ###        #####            ############    ####        ###
"""

from __future__ import annotations

import json
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # device activity in a Kineto chrome trace
HOST_CATEGORIES = ("cpu_op", "python_function", "user_annotation")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # cudaLaunchKernel, cuLaunchKernel (Triton), cudaGraphLaunch ...
QUEUED = "(queued before the gap)"  # the work after the gap was launched before it began: not the host's lateness


def load_trace(path: str | Path) -> list[dict]:
    """The complete ("X") events of a chrome trace written by `torch.profiler.profile.export_chrome_trace`."""
    trace = json.loads(Path(path).read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def gpu_timeline(events: list[dict], window: tuple[float, float], top: int = 10, min_gap_us: float = 200.0,
                 exclude: tuple[str, ...] = ()) -> dict:
    """Busy and idle milliseconds of the GPU within `window` (trace microseconds), and its `top` longest idle gaps of
    at least `min_gap_us`, each with the host events (but those named in `exclude`, e.g. the window's own
    annotation) that overlapped it the longest: what the host was doing meanwhile; the `top` kernels by device
    time within the window (what busy time is made of)."""
    start, end = window
    device = [e for e in events if e.get("cat") in GPU_CATEGORIES and _overlap(e, start, end) > 0]
    busy, gaps, covered, after_gap = 0.0, [], start, []  # after_gap[i]: the device event that ended gaps[i]
    for e in sorted(device, key=lambda e: e["ts"]):
        lo, hi = max(e["ts"], start), min(e["ts"] + e["dur"], end)
        if lo > covered:
            gaps.append((covered, lo))
            after_gap.append(e)
        if hi > covered:
            busy += hi - max(lo, covered)
            covered = hi
    if covered < end:
        gaps.append((covered, end))
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES and e.get("name") not in exclude]
    by_launch = _idle_by_launch(events, host, gaps, after_gap)
    long_gaps = [g for g in gaps if g[1] - g[0] >= min_gap_us]
    longest = sorted(long_gaps, key=lambda g: g[0] - g[1])[:top]
    scopes: dict[str, float] = {}  # host time by annotation (vLLM's profiling scopes), within the window
    for e in host:
        if e["cat"] == "user_annotation" and _overlap(e, start, end) > 0:
            scopes[e["name"]] = scopes.get(e["name"], 0.0) + _overlap(e, start, end) / 1e3
    kernels: dict[str, float] = {}  # device time by kernel name (truncated), within the window
    for e in device:
        kernels[e["name"][:80]] = kernels.get(e["name"][:80], 0.0) + _overlap(e, start, end) / 1e3
    return {"window_ms": (end - start) / 1e3, "busy_ms": busy / 1e3, "idle_ms": (end - start - busy) / 1e3,
            "idle_gaps": len(long_gaps),
            "longest_gaps": [{"at_ms": (lo - start) / 1e3, "ms": (hi - lo) / 1e3,
                              "host": _overlapping(host, lo, hi)} for lo, hi in longest],
            "host_ms_by_scope": dict(sorted(scopes.items(), key=lambda item: -item[1])),
            "device_ms_by_kernel": dict(sorted(kernels.items(), key=lambda item: -item[1])[:top]),
            "idle_ms_by_launch": dict(sorted(by_launch.items(), key=lambda item: -item[1]["ms"])[:top])}


def _idle_by_launch(events: list[dict], host: list[dict], gaps: list[tuple[float, float]],
                    after_gap: list[dict]) -> dict[str, dict]:
    """Idle ms and gap count by the launch of the device work after each gap: the innermost two host ops around the
    launch call ("outer > inner", `_launchers`), or `QUEUED` where the launch came before the gap began."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    charged, late = [], []  # (key, idle us); (launch call, idle us) of the gaps the host was late for
    for (lo, hi), work in zip(gaps, after_gap):
        launch = launches.get(work.get("args", {}).get("correlation"))
        if launch is None:
            charged.append(("(launch not in the trace)", hi - lo))
        elif launch["ts"] <= lo:
            charged.append((QUEUED, hi - lo))
        else:
            late.append((launch, hi - lo))
    charged += zip(_launchers(host, [launch for launch, _ in late]), (idle for _, idle in late))
    by_launch: dict[str, dict] = {}
    for key, idle in charged:
        entry = by_launch.setdefault(key, {"ms": 0.0, "gaps": 0})
        entry["ms"] += idle / 1e3
        entry["gaps"] += 1
    return by_launch


def _launchers(host: list[dict], launches: list[dict]) -> list[str]:
    """Per launch call, the two shortest host ops of its thread open at its time ("outer > inner"; the call's own
    name where none is). One sweep per thread over its ops by start time, keeping those still open: a burst's trace
    has ~1e5 ops and as many gaps."""
    ops_by_thread: dict[object, list[dict]] = {}
    for op in host:
        ops_by_thread.setdefault(op.get("tid"), []).append(op)
    names = [""] * len(launches)
    for tid in {launch.get("tid") for launch in launches}:
        ops = sorted(ops_by_thread.get(tid, []), key=lambda op: (op["ts"], -op["dur"]))
        calls = sorted((i for i, launch in enumerate(launches) if launch.get("tid") == tid),
                       key=lambda i: launches[i]["ts"])
        open_ops, next_op = [], 0
        for i in calls:
            t = launches[i]["ts"]
            while next_op < len(ops) and ops[next_op]["ts"] <= t:
                open_ops.append(ops[next_op])
                next_op += 1
            open_ops = [op for op in open_ops if op["ts"] + op["dur"] >= t]
            around = sorted(open_ops, key=lambda op: op["dur"])[:2]
            names[i] = " > ".join(op["name"][:60] for op in reversed(around)) or launches[i]["name"]
    return names


def _overlap(event: dict, lo: float, hi: float) -> float:
    """Microseconds of `event` inside [lo, hi] (<= 0: none)."""
    return min(event["ts"] + event["dur"], hi) - max(event["ts"], lo)


def _overlapping(host: list[dict], lo: float, hi: float, top: int = 4) -> list[str]:
    """The names of the host events that overlap [lo, hi] the longest, with the overlap in ms."""
    overlaps = sorted(((_overlap(e, lo, hi), e["name"]) for e in host if _overlap(e, lo, hi) > 0), reverse=True)
    return [f"{name[:80]} ({overlap / 1e3:.2f} ms)" for overlap, name in overlaps[:top]]
