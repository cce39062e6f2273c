# SPDX-License-Identifier: Apache-2.0
"""The physical model behind the "limit" column of `vllm-duo bench`'s tables: a roofline of a Llama-style decoder."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

MODEL_TEXT = """\
The physical model (`Roofline` in vllm_duo/tools/bench/roofline.py) is deliberately simple: every engine step costs
max(FLOPs / peak FLOP/s, bytes / peak bandwidth) on the device, for a Llama-style decoder read from config.json.

- Weights: 2 P FLOPs per token, P = the matmul weights (q, k, v, o, MLP, LM head); a decode step reads all P
  weights once, whatever its batch.
- Attention: 4 x head_dim x query heads x layers FLOPs per (query, visible key) pair (QK^T and PV); a decode step
  reads the K and V of every visible key (2 x KV heads x head_dim x dtype bytes per token and layer).
- Duo: a fraction r of the KV heads (the retrieval ratio the plugin logs), with their query heads, sees the whole
  context; the others see min(context, sink + recent) keys. A request of n tokens holds r n + (1 - r)(sink +
  recent) tokens' worth of KV (the ring is reserved whole), against n for dense.
- Prefill is compute-bound (weights are read once per chunk of thousands of tokens); a decode step takes whichever
  bound is larger. Offline batches are as large as vLLM's measured KV pool allows (its "Maximum concurrency" line,
  converted to the workload's request length), in waves of that size; latency runs use their fixed batch.
- "limit" is the model's duo/dense ratio of the table's headline metric; "reached" is the measured improvement
  divided by the model's (speedup for throughput and concurrency, dense time / duo time for latencies): 100% means
  duo gained all the model allows, above 100% that dense ran further from its own limit than duo did.
- Not modelled: scheduling gaps, kernel efficiency, prefix caching (the same setting on both sides; shared-prefix
  workloads report the hit rate they got), CUDA graphs, sampling and detokenization, and online serving (rate-limited; no limit is given for serve runs).
"""

# Dense BF16 tensor-core FLOP/s and memory bandwidth from the vendors' data sheets; the first name contained in the
# device name wins. Other devices (CPUs) are modelled as an H100 SXM and say so.
DEVICE_PEAKS = (("H200", 989e12, 4.8e12), ("H100 PCIe", 756e12, 2.0e12), ("H100", 989e12, 3.35e12),
                ("A100", 312e12, 2.0e12), ("L40S", 362e12, 0.864e12))
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, model_dir: str | Path) -> ModelShape | None:
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text())
            config = config.get("text_config", config)
            heads = config["num_attention_heads"]
            return cls(layers=config["num_hidden_layers"], hidden=config["hidden_size"], heads=heads,
                       kv_heads=config.get("num_key_value_heads") or heads,
                       head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                       intermediate=config["intermediate_size"], vocab=config["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def matmul_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attention + 3 * self.hidden * self.intermediate) + self.vocab * self.hidden


@dataclass(frozen=True)
class Roofline:
    shape: ModelShape
    flops: float  # FLOP/s
    bandwidth: float  # bytes/s
    dtype_bytes: int = 2  # weights
    retrieval: float = 1.0  # 1: dense
    window: int = 0  # sink + recent
    kv_bytes: int | None = None  # per K or V element; default dtype_bytes (1 for an fp8 KV cache)

    def kv_reserved(self, n: float) -> float:
        """Tokens' worth of KV memory one request of n tokens holds."""
        return self.retrieval * n + (1 - self.retrieval) * self.window

    def kv_read(self, n: float) -> float:
        """Tokens' worth of KV one decode step of a request at context n reads (and attends to)."""
        return self.retrieval * n + (1 - self.retrieval) * min(n, self.window)

    def prefill_s(self, length: int, prompts: int = 1) -> float:
        causal = length * (length + 1) / 2
        w = self.window
        streaming = causal if length <= w else w * (w + 1) / 2 + (length - w) * w
        pairs = self.retrieval * causal + (1 - self.retrieval) * streaming
        s = self.shape
        flops = 2 * s.matmul_params * length + 4 * s.head_dim * s.heads * s.layers * pairs
        return prompts * flops / self.flops

    def step_s(self, batch: int, context: float) -> float:
        s = self.shape
        kv = self.kv_read(context)
        flops = batch * (2 * s.matmul_params + 4 * s.head_dim * s.heads * s.layers * kv)
        kv_bytes_per_token = 2 * s.layers * s.kv_heads * s.head_dim * (self.kv_bytes or self.dtype_bytes)
        moved = s.matmul_params * self.dtype_bytes + batch * kv * kv_bytes_per_token
        return max(flops / self.flops, moved / self.bandwidth)

    def batch_cap(self, run: dict, length: int) -> int | None:
        """Requests of `length` tokens that fit at once, from the run's "Maximum concurrency" line."""
        if not run.get("max_concurrency") or not run.get("max_concurrency_len"):
            return None
        pool = run["max_concurrency"] * self.kv_reserved(run["max_concurrency_len"])
        return max(1, int(pool // self.kv_reserved(length)))

    def throughput_s(self, prompts: int, input_len: int, output_len: int, cap: int | None) -> float:
        batch = min(prompts, cap or prompts)
        total, left = self.prefill_s(input_len, prompts), prompts
        while left > 0:
            wave = min(batch, left)
            total += output_len * self.step_s(wave, input_len + output_len / 2)
            left -= wave
        return total

    def latency_s(self, batch: int, input_len: int, output_len: int) -> float:
        return self.prefill_s(input_len, batch) + (output_len - 1) * self.step_s(batch, input_len + output_len / 2)


def device_peaks(device: str) -> tuple[float, float, str]:
    for name, flops, bandwidth in DEVICE_PEAKS:
        if name.lower() in (device or "").lower():
            return flops, bandwidth, name
    return 989e12, 3.35e12, "H100 SXM (assumed: the device is not in the table)"


class PhysicalModel:
    """The roofline of one results.json: its model's shape (None when config.json was unreadable) on its device."""

    def __init__(self, results: dict, runs: list[dict]):
        shape = results.get("model_shape")
        self.shape = ModelShape(**shape) if shape else None
        device = results.get("device") or next((r.get("device") for r in runs if r.get("device")), "")
        self.flops, self.bandwidth, self.device_label = device_peaks(device)

    def roofline(self, run: dict) -> Roofline | None:
        if self.shape is None:
            return None
        dtype_bytes = _DTYPE_BYTES.get(run.get("dtype") or "bfloat16", 2)
        kv_bytes = 1 if (run.get("kv_cache_dtype") or "auto").startswith("fp8") else dtype_bytes
        if run.get("attention_backend") != "duo":
            return Roofline(self.shape, self.flops, self.bandwidth, dtype_bytes, kv_bytes=kv_bytes)
        if run.get("retrieval_ratio") is None:
            return None
        window = (run.get("sink") or 0) + (run.get("recent") or 0)
        return Roofline(self.shape, self.flops, self.bandwidth, dtype_bytes, run["retrieval_ratio"], window, kv_bytes)

    def limit_speedup(self, dense: dict | None, duo: dict | None, what: str) -> float | None:
        """The model's speedup of duo over dense (> 1: duo faster, or holds more) in `what`: capacity, throughput,
        tpot or latency."""
        if not dense or not duo or duo.get("attention_backend") != "duo":
            return None
        d, u = self.roofline(dense), self.roofline(duo)
        if d is None or u is None:
            return None
        i, o = duo["input_len"], duo["output_len"]
        if what == "capacity":
            length = duo.get("max_concurrency_len") or duo["max_model_len"]
            return d.kv_reserved(length) / u.kv_reserved(length)
        if what == "throughput":
            if duo.get("dataset", "random") != "random":  # the model knows no cache hits
                return None
            n = duo["num_prompts"]
            return (d.throughput_s(n, i, o, d.batch_cap(dense, i + o))
                    / u.throughput_s(n, i, o, u.batch_cap(duo, i + o)))
        if what == "tpot":
            b = duo["batch_size"]
            return d.step_s(b, i + o / 2) / u.step_s(b, i + o / 2)
        if what == "latency":
            b = duo["batch_size"]
            return d.latency_s(b, i, o) / u.latency_s(b, i, o)
        return None


def shape_json(model: str) -> dict | None:
    shape = ModelShape.from_config(model)
    return asdict(shape) if shape else None
