# SPDX-License-Identifier: Apache-2.0
"""Shared test setup: markers, fast in-process vLLM engines on the CPU stack."""

import atexit
import os
import sys

from vllm_duo.tools import smollm2

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

EXIT_LOG = smollm2.DEFAULT_DIR.parent / "logs" / "tests-exit.log"


@atexit.register  # registered before torch and vLLM are imported: runs after their exit handlers
def _route_exit_stderr_to_log():
    """What the interpreter writes to stderr after the atexit handlers goes to EXIT_LOG. Triton's C extension
    (nanobind) reports the triton.ir objects still alive then ("nanobind: leaked N instances ..."), dozens of lines
    that ran into the next module's header in `make test`; triton silences the same report in its own workers."""
    EXIT_LOG.parent.mkdir(parents=True, exist_ok=True)
    log = os.open(EXIT_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(log, f"== exit of pytest {' '.join(sys.argv[1:])}\n".encode())
    sys.stderr.flush()
    os.dup2(log, 2)
    os.close(log)


import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run on the CPU interpreter; it must be chosen before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_dir():
    return str(smollm2.prepare())
