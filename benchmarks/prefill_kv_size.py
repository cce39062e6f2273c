# SPDX-License-Identifier: Apache-2.0
"""Do prompt logprobs on the GPU move with the KV cache's size, and which attention moves them? (issue 33: at fp8 the
squeezed run's prompt logprobs lay 0.01-0.03 nats a token from duo's, though the squeeze reads no prefill; on the
CPU they are equal.) The fp8 end-to-end test's engine and prompts (tests/test_gpu_e2e.py), SmolLM2 with its bundled
pattern at 50%, one engine at a time, each run set against the first run of its pair:

  squeeze: duo; duo again (is a run the same run to run?); duo in less memory (fewer KV blocks, as the squeeze's
           store leaves); duo with the squeeze of every key; the squeeze on but never clustering (min_context_len
           past every prompt: its store and metadata path alone, no build and no squeezed row); then duo and the
           squeeze of every key in 2 GiB of KV each (`kv_cache_memory_bytes`: equal KV blocks).
  kv_size: dense FLASH_ATTN, duo by its Triton kernels alone (`VLLM_DUO_ATTENTION=triton`) and duo's PyTorch path
           (`torch`, eager), each in the full and in less memory.

Prints each run's mean and largest |prompt logprob difference| from its pair's first, per prompt, and where it
starts; writes all runs (`engines.greedy_with_logprobs`' fields) to `--out`.
Usage: python benchmarks/prefill_kv_size.py --kv-cache-dtype fp8 --runs squeeze kv_size
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, "tests")
from engines import generate_in_subprocess  # noqa: E402
from test_gpu_e2e import EQUAL_KV, SQUEEZE_ALL as EVERY_KEY  # noqa: E402

LENGTHS = (20, 300, 900, 2000)
DUO = {"pattern": "SmolLM2-135M-Instruct", "sparsity": 0.5, "sink": 16, "recent": 64}
LESS_MEMORY = dict(gpu_memory_utilization=0.25)


def run_sets(engine: dict) -> dict[str, list[tuple[str, str | None, dict, str, dict | None, dict]]]:
    """Per set, its runs as (name, reference run or None, engine args, backend, duo settings, env)."""
    less, fixed = dict(engine, **LESS_MEMORY), dict(engine, **EQUAL_KV)
    every_key, never = dict(DUO, squeeze=EVERY_KEY), dict(DUO, squeeze=dict(EVERY_KEY, min_context_len=4096))
    return {
        "squeeze": [("duo", None, engine, "duo", DUO, {}), ("duo again", "duo", engine, "duo", DUO, {}),
                    ("duo in less memory", "duo", less, "duo", DUO, {}),
                    ("squeeze of every key", "duo", engine, "duo", every_key, {}),
                    ("squeeze never clustering", "duo", engine, "duo", never, {}),
                    ("duo, 2 GiB of KV", None, fixed, "duo", DUO, {}),
                    ("squeeze of every key, 2 GiB of KV", "duo, 2 GiB of KV", fixed, "duo", every_key, {})],
        "kv_size": [(f"{name}{where}", name if where else None,
                     dict(args, enforce_eager=True) if path == "torch" else args, backend, duo, env)
                    for name, backend, duo, env, path in [
                        ("dense", "FLASH_ATTN", None, {}, None),
                        ("duo by Triton", "duo", DUO, {"VLLM_DUO_ATTENTION": "triton"}, "triton"),
                        ("duo by PyTorch", "duo", DUO, {"VLLM_DUO_ATTENTION": "torch"}, "torch")]
                    for where, args in (("", engine), (" in less memory", less))],
    }


def apart(ours: list[list[float]], theirs: list[list[float]]) -> str:
    report = []
    for length, mine, other in zip(LENGTHS, ours, theirs):
        gaps = [abs(a - b) for a, b in zip(mine, other)]
        first = next((i + 1 for i, gap in enumerate(gaps) if gap), None)
        report.append(f"{length}: {sum(gaps) / len(gaps):.4f} max {max(gaps):.3f} (from token {first})")
    return ", ".join(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/smol")
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--runs", nargs="+", default=["squeeze"], choices=["squeeze", "kv_size"])
    parser.add_argument("--out", default="prefill_kv_size.json")
    args = parser.parse_args()
    engine = dict(model=args.model, max_model_len=4096, gpu_memory_utilization=0.3, enforce_eager=False,
                  dtype="bfloat16", max_num_batched_tokens=256, kv_cache_dtype=args.kv_cache_dtype)
    sets, runs = run_sets(engine), {}
    for set_name in args.runs:
        for name, reference, engine_args, backend, duo, env in sets[set_name]:
            runs[name] = generate_in_subprocess(engine_args, backend, duo, LENGTHS, **env)
            Path(args.out).write_text(json.dumps(runs))
            if reference is not None:
                same = [a == b for a, b in zip(runs[name]["TOKENS"], runs[reference]["TOKENS"])]
                print(f"{args.kv_cache_dtype} {name} from {reference}, prompt logprobs: "
                      f"{apart(runs[name]['PROMPT_LOGPROBS'], runs[reference]['PROMPT_LOGPROBS'])}; "
                      f"same tokens: {same}", flush=True)


if __name__ == "__main__":
    main()
