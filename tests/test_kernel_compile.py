# SPDX-License-Identifier: Apache-2.0
"""The Triton kernels compile for the H100 on this machine, GPU or not (sm90_compile.py, in a process without the
CPU interpreter): the interpreter runs them as Python and cannot see what only the GPU compiler rejects."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

NO_COMPILER = 77  # sm90_compile.py's exit code when Triton has no CUDA backend


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernels_compile_for_h100_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_compile.py"))], env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode == NO_COMPILER:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    kernels = re.findall(r"^(.*): registers \d+, spilled (\d+) B", run.stdout, re.M)
    assert len(kernels) >= 9, run.stdout
    spilled = [name for name, stack in kernels if int(stack)]
    assert not spilled, f"registers spill to the stack in {spilled}:\n{run.stdout}"
