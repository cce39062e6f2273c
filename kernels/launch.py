# SPDX-License-Identifier: Apache-2.0
"""Programmatic dependent launch (Hopper and later) for the decode step's chains of short kernels.

A kernel launched this way may be scheduled while the kernel before it on its stream is still running, so its
launch and its first loads overlap that kernel's tail instead of following it: at 4 x 128k the squeeze's lookup is
four dependent launches a layer of 4-12 us each. The rules that keep it correct, in every kernel that takes `PDL`:

- before `inputs_ready` it reads only what no kernel of this step writes (metadata copied in before the step,
  centroids and CSR offsets written at prefill) and writes nothing: the caching allocator may have given its
  buffers to this kernel from a kernel that is still running;
- it reaches `inputs_ready` on every path, before any early return: a kernel that ended without waiting could end
  before its predecessor, and the next kernel's wait, which waits for this one, would not cover that one.

`inputs_ready` waits for every earlier kernel of the stream to finish and its writes to show, then lets the next
kernel launch. Without PDL it is nothing and the launch is an ordinary one (the CPU interpreter, older GPUs).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra import cuda as triton_cuda
except ImportError:  # a Triton without a CUDA backend: PDL stays off
    triton_cuda = None

PDL = True  # off: ordinary launches everywhere (kernels_bench.py's sweep times both)


@functools.cache
def _triton_launches_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(triton_cuda, "gdc_wait")


@functools.cache
def _capability(device_index: int | None) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def pdl_options(device: torch.device) -> dict:
    """The launch arguments of a kernel that takes `PDL`: with PDL on a CUDA device of compute capability 9 or more
    whose Triton launches that way, else the constant off."""
    on = PDL and device.type == "cuda" and _triton_launches_pdl() and _capability(device.index) >= 9
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


@triton.jit
def inputs_ready(PDL: tl.constexpr):
    """Wait until the stream's earlier kernels have finished and their writes show, then let the next one launch."""
    if PDL:
        triton_cuda.gdc_wait()
        triton_cuda.gdc_launch_dependents()
