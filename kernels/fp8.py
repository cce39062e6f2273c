# SPDX-License-Identifier: Apache-2.0
"""The fp8 formats of duo's KV cache: the one table the kernels, the backend and the tools derive theirs from.

Names only (no torch, no vLLM), so that the CLI and the platform plugin read it without importing torch;
kernels/reference.py maps the names to torch dtypes (`FP8_FORMATS`, `FP8_DTYPES`, `FP8_CACHE_DTYPES`).
"""

# torch dtype name -> the kernels' FP8 constant, the grid they round to (cache_write.fp8_grid)
FORMATS = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
# vLLM's --kv-cache-dtype -> torch dtype name. vLLM stores fp8 caches as uint8; "fp8" is e4m3 on CUDA and CPU alike
# (ROCm's fnuz format is not supported).
KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", **{f"fp8_{grid}": name for name, grid in FORMATS.items()}}
