# SPDX-License-Identifier: Apache-2.0
"""`make run` prints the server command it runs: that line, pasted into a shell, runs the same command with the same
environment (the server replaced by a script that prints the variables it got)."""
import subprocess
import sys

import pytest

from vllm_duo.tools import quickstart
from vllm_duo.tools.processes import on_cpu_stack

SHOW_ENV = "import os; print('KV cache', os.environ.get('VLLM_CPU_KVCACHE_SPACE'), os.environ.get('HF_HUB_OFFLINE'))"


def test_the_printed_server_command_runs_pasted_into_a_shell(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(quickstart, "server_command", lambda engine_args, port: [sys.executable, "-c", SHOW_ENV, "'"])
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError, match="exited with code 0"):
        quickstart.serve_and_chat("/models/smol", log)
    printed = capsys.readouterr().out.strip()
    space = "1" if on_cpu_stack() else "None"  # vLLM reads VLLM_CPU_KVCACHE_SPACE on the CPU stack only
    env = "VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1" if on_cpu_stack() else "HF_HUB_OFFLINE=1"
    assert printed.startswith(f"$ {env} {sys.executable} -c ")
    assert log.read_text().splitlines() == [printed, f"KV cache {space} 1"]  # what ran
    pasted = subprocess.run(["bash", "-c", printed[2:]], capture_output=True, text=True, check=True)
    assert pasted.stdout == f"KV cache {space} 1\n"
