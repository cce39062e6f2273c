# SPDX-License-Identifier: Apache-2.0
"""`make run`: serve the bundled SmolLM2 with duo through vLLM's OpenAI server, chat once, compare capacity.

vLLM's output goes to log files (LOG_DIR), so that the terminal shows what the run is for: the server command, the
answer and the capacity table; when a step fails, the tail of its log instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from vllm_duo import capacity
from vllm_duo.tools import smollm2
from vllm_duo.tools.processes import (free_port, kv_cache_env, logged_child, server_command, shell_line, start_logged,
                                      stop, wait_healthy)

DUO = {"pattern": "SmolLM2-135M-Instruct", "sparsity": 0.5}  # the pattern's sink and recent
MAX_MODEL_LEN = 8192
QUESTION = "What is the capital of France? Answer in one sentence."
LOG_DIR = smollm2.DEFAULT_DIR.parent / "logs"
_LOG_TAIL_LINES = 40


def chat(port: int, question: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    reply = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                           max_tokens=64, temperature=0)
    return reply.choices[0].message.content


def serve_and_chat(model: str, log_path: Path) -> str:
    """Starts the server (its output into `log_path`), asks QUESTION, stops the server; returns the answer."""
    port = free_port()
    engine_args = ["--model", model, "--max-model-len", str(MAX_MODEL_LEN), "--attention-backend", "duo",
                   "--additional-config", json.dumps({"duo": DUO}), "--served-model-name", "smollm2"]
    command = server_command(engine_args, port)
    env = {**kv_cache_env(), "HF_HUB_OFFLINE": "1"}
    print("$", shell_line(command, env), flush=True)  # as start_logged runs it: pasted into a shell, it works
    with open(log_path, "w") as log:
        server = start_logged(command, log, env)
        try:
            not_ready = wait_healthy(port, server, timeout=300)
            if not_ready:
                raise RuntimeError(not_ready)
            return chat(port, QUESTION)
        finally:
            stop(server)


def compare_capacity(model: str, log_path: Path) -> str:
    """vLLM's maximum concurrency, dense vs duo, from engines built in a child process (its output into `log_path`)."""
    with logged_child(log_path) as child:
        dense, duo = child.submit(capacity.compare, model, MAX_MODEL_LEN, DUO).result()
    return capacity.report(dense, duo, MAX_MODEL_LEN)


def _failed(step: str, error: Exception, log_path: Path) -> int:
    lines = log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
    print(f"make run: {step} failed: {error!r}\nthe last {len(lines)} lines of {log_path}:", *lines, sep="\n",
          file=sys.stderr)
    return 1


def main() -> int:
    model = str(smollm2.prepare())
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    server_log, capacity_log = LOG_DIR / "server.log", LOG_DIR / "capacity.log"
    try:
        answer = serve_and_chat(model, server_log)
    except Exception as error:  # whatever failed, the server's log goes with it
        return _failed("serving", error, server_log)
    print(f"\nQ: {QUESTION}\nA: {answer}\n", flush=True)
    try:
        table = compare_capacity(model, capacity_log)
    except Exception as error:  # whatever failed, the engines' log goes with it
        return _failed("the capacity comparison", error, capacity_log)
    print(table)
    print(f"\nvLLM's logs: {server_log}, {capacity_log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
