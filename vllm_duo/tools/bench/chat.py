# SPDX-License-Identifier: Apache-2.0
"""`python -m vllm_duo.tools.bench.chat`: multi-turn chats against a vLLM server, each turn's prompt the whole
conversation so far, as a chat client sends it: what prefix caching saves grows with every turn.

`--conversations` chats run at once. Each opens with a document of `--first-len` tokens and a question; every later
turn sends the previous prompt, the answer the server streamed back, and a new question of `--turn-len` tokens, once
that answer is complete. Text is random numbers (dummy weights answer noise anyway); the prompt lengths in the
result are the server's own counts. The result JSON uses `vllm bench serve`'s keys for what both measure, so the
bench report reads it as a serve run, plus the median time to first token of each turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Turn:
    conversation: int
    turn: int
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    answer: str = ""


class TextOfTokens:
    """Random space-separated numbers of about `n` tokens of `tokenizer` (seeded)."""

    def __init__(self, tokenizer, seed: int):
        self.rng = random.Random(seed)
        sample = " ".join(str(self.rng.randrange(10_000)) for _ in range(1000))
        self.tokens_per_word = len(tokenizer.encode(sample, add_special_tokens=False)) / 1000

    def __call__(self, n: int) -> str:
        words = max(1, round(n / self.tokens_per_word))
        return " ".join(str(self.rng.randrange(10_000)) for _ in range(words))


async def _send(session, url: str, model: str, prompt: str, output_len: int, turn: Turn) -> None:
    """One streamed completion; fills in `turn` (ok stays False on any error)."""
    payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    pieces: list[str] = []
    async with session.post(url, json=payload) as response:
        if response.status != 200:
            return
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            if chunk.get("usage"):
                turn.prompt_tokens = chunk["usage"]["prompt_tokens"]
                turn.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                now = time.perf_counter()
                if pieces:
                    turn.itl_s.append(now - last)
                else:
                    turn.ttft_s = now - start
                last = now
                pieces.append(chunk["choices"][0]["text"])
    turn.latency_s = time.perf_counter() - start
    turn.answer = "".join(pieces)
    turn.ok = turn.output_tokens > 0


async def _conversation(session, url, model, index, args, text: TextOfTokens, turns: list[Turn]) -> None:
    prompt = text(args.first_len) + "\nQuestion: " + text(args.turn_len) + "\nAnswer:"
    for number in range(args.turns):
        turn = Turn(index, number)
        turns.append(turn)
        try:
            await _send(session, url, model, prompt, args.output_len, turn)
        except Exception:  # noqa: BLE001 - a failed turn ends its conversation; the others go on
            return
        if not turn.ok:
            return
        prompt += turn.answer + "\nQuestion: " + text(args.turn_len) + "\nAnswer:"


def summary(turns: list[Turn], duration: float, num_turns: int) -> dict:
    """`vllm bench serve`'s keys for the completed turns, the median TTFT of each turn number, and every turn's own
    record (`turns`: a slow median is then either a stall that hit many turns at once or a steady cost)."""
    done = [t for t in turns if t.ok]
    ms = lambda values, q: float(np.percentile(values, q) * 1e3) if values else None  # noqa: E731
    ttft = [t.ttft_s for t in done]
    itl = [x for t in done for x in t.itl_s]
    tpot = [(t.latency_s - t.ttft_s) / (t.output_tokens - 1) for t in done if t.output_tokens > 1]
    output = sum(t.output_tokens for t in done)
    return {"duration": duration, "completed": len(done), "failed": len(turns) - len(done),
            "request_throughput": len(done) / duration, "output_throughput": output / duration,
            "total_token_throughput": (output + sum(t.prompt_tokens for t in done)) / duration,
            "total_input_tokens": sum(t.prompt_tokens for t in done), "total_output_tokens": output,
            "mean_ttft_ms": float(np.mean(ttft) * 1e3) if ttft else None, "median_ttft_ms": ms(ttft, 50),
            "p99_ttft_ms": ms(ttft, 99), "mean_tpot_ms": float(np.mean(tpot) * 1e3) if tpot else None,
            "median_tpot_ms": ms(tpot, 50), "p99_tpot_ms": ms(tpot, 99),
            "mean_itl_ms": float(np.mean(itl) * 1e3) if itl else None, "median_itl_ms": ms(itl, 50),
            "p99_itl_ms": ms(itl, 99), "mean_e2el_ms": float(np.mean([t.latency_s for t in done]) * 1e3) if done
            else None, "p99_e2el_ms": ms([t.latency_s for t in done], 99),
            "median_ttft_ms_by_turn": [ms([t.ttft_s for t in done if t.turn == n], 50) for n in range(num_turns)],
            "mean_prompt_tokens_by_turn": [float(np.mean([t.prompt_tokens for t in done if t.turn == n]))
                                           if any(t.turn == n for t in done) else None for n in range(num_turns)],
            "turns": [{"conversation": t.conversation, "turn": t.turn, "ok": t.ok, "prompt_tokens": t.prompt_tokens,
                       "output_tokens": t.output_tokens, "ttft_ms": t.ttft_s * 1e3, "latency_ms": t.latency_s * 1e3}
                      for t in turns]}


async def run(args) -> dict:
    import aiohttp
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    url = f"http://{args.host}:{args.port}/v1/completions"
    turns: list[Turn] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        await asyncio.gather(*(_conversation(session, url, args.model, i, args,
                                             TextOfTokens(tokenizer, args.seed * 1000 + i), turns)
                               for i in range(args.conversations)))
        duration = time.perf_counter() - start
    return summary(turns, duration, args.turns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_duo.tools.bench.chat", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokenizer")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--conversations", type=int, required=True)
    parser.add_argument("--turns", type=int, required=True)
    parser.add_argument("--first-len", type=int, required=True, help="tokens of the opening document")
    parser.add_argument("--turn-len", type=int, required=True, help="tokens of each question")
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600, help="seconds without a streamed byte before failing")
    parser.add_argument("--result-file", required=True)
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    with open(args.result_file, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}))
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
