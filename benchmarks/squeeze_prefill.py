# SPDX-License-Identifier: Apache-2.0
"""Does the squeeze change prefill on the GPU? (issue 33: at fp8 the squeezed run's prompt logprobs lay 0.01-0.03 nats
a token from duo's, on the prompts long enough to squeeze, though the squeeze reads no prefill; on the CPU they are
equal.) The fp8 end-to-end test's engine and prompts (tests/test_gpu_e2e.py), SmolLM2 with its bundled pattern at
50%, one engine at a time:

  duo, duo again (is duo's prefill the same run to run?), duo in less memory (another number of KV blocks, as the
  squeeze's store leaves), duo with the squeeze of every key, and the squeeze on but never clustering
  (min_context_len past every prompt: its store and metadata path alone, no build and no squeezed row).

Prints each run's mean |prompt logprob difference| from duo's, per prompt, and where it starts; writes all runs
(`engines.greedy_with_logprobs`' fields) to `--out`. Usage: python benchmarks/squeeze_prefill.py --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import json
import sys

sys.path.insert(0, "tests")
from engines import generate_in_subprocess  # noqa: E402
from test_gpu_e2e import SQUEEZE_ALL as EVERY_KEY  # noqa: E402

LENGTHS = (20, 300, 900, 2000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/smol")
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--out", default="squeeze_prefill.json")
    args = parser.parse_args()
    engine = dict(model=args.model, max_model_len=4096, gpu_memory_utilization=0.3, enforce_eager=False,
                  dtype="bfloat16", max_num_batched_tokens=256, kv_cache_dtype=args.kv_cache_dtype)
    duo = {"pattern": "SmolLM2-135M-Instruct", "sparsity": 0.5, "sink": 16, "recent": 64}
    variants = [("duo", engine, duo), ("duo again", engine, duo),
                ("duo in less memory", dict(engine, gpu_memory_utilization=0.25), duo),
                ("squeeze of every key", engine, dict(duo, squeeze=EVERY_KEY)),
                ("squeeze never clustering", engine, dict(duo, squeeze=dict(EVERY_KEY, min_context_len=4096)))]
    runs = {}
    for name, engine_args, settings in variants:
        runs[name] = generate_in_subprocess(engine_args, "duo", settings, LENGTHS)
        json.dump(runs, open(args.out, "w"))
        if name == "duo":
            continue
        report = []
        for length, ours, theirs in zip(LENGTHS, runs[name]["PROMPT_LOGPROBS"], runs["duo"]["PROMPT_LOGPROBS"]):
            apart = [abs(a - b) for a, b in zip(ours, theirs)]
            first = next((i + 1 for i, d in enumerate(apart) if d), None)
            report.append(f"{length}: {sum(apart) / len(apart):.4f} (from token {first})")
        print(f"{args.kv_cache_dtype} {name} from duo, prompt logprobs: " + ", ".join(report), flush=True)


if __name__ == "__main__":
    main()
