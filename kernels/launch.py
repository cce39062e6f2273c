# SPDX-License-Identifier: Apache-2.0
"""Kernel launches from the host: launch-shape arithmetic, and launches that skip Triton's per-call dispatch.

Eager steps (prefills, mixed batches) launch duo's kernels once per layer, outside CUDA graphs, and there the host
time of a launch adds to every step whose kernels are short. `kernel[grid](...)`: Triton's binder specializes the
arguments, then `JITFunction.run` builds a cache key (with `str(options)`), looks the kernel up, checks its globals
and packs launch metadata for the hooks. `launch` keeps Triton's binder, so it picks exactly the compiled kernel
Triton would, and launches it directly. On an H100 host that saves about what duo's Python wrapper around a launch
costs: 35-37 us a launch as served against 31-34 for the bare `kernel[grid]` and 10-12 for the compiled launcher
alone; the binder is most of the rest (kernels_bench.py --mixed, benchmarks/results/2026-12-06-h100-launch).

Triton 3.5+'s `triton.cdiv` and `triton.next_power_of_2` are constexpr functions: called from host code each
unwraps its arguments first, about a microsecond a call; the plain-Python ones below give the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import triton


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` for ints."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def launch(kernel, grid: tuple[int, ...]) -> Callable[..., None]:
    """`kernel[grid]`, launched through its compiled kernel wherever Triton's binder gives a specialization (and
    launch options) seen before for this kernel and device; the first launch of each goes through Triton, which
    compiles it if need be. Kernels that are not JIT functions as Triton 3.4-3.9 build them (the CPU interpreter's,
    tests' stand-ins), and launches while a Triton hook that sees launches is set (profilers), go through
    `kernel[grid]` unchanged. Triton's check that a kernel's globals have not changed since it compiled runs at
    each kernel's first launch only: duo's kernels read module constants that never change."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None or getattr(kernel, "pre_run_hooks", None) or _hooks_set():
        return kernel[grid]

    def run(*args, **kwargs) -> None:
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        entry = caches[device]
        if len(entry) != 5:  # another Triton's binder: its own path
            kernel[grid](*args, **kwargs)
            return
        bound, specialization, options = entry[4](*args, **kwargs)
        key = (id(kernel), device, tuple(specialization), tuple(options.items()))
        compiled = _COMPILED.get(key)
        if compiled is None:
            compiled = kernel[grid](*args, **kwargs)  # Triton specializes, compiles if need be and launches
            if callable(getattr(compiled, "run", None)):
                _COMPILED[key] = compiled
            return
        grid_3 = tuple(grid) + (1,) * (3 - len(grid))
        compiled.run(*grid_3, driver.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *bound.values())

    return run


def _hooks_set() -> bool:
    """Whether a Triton hook that sees launches is set: launch enter or exit (a HookChain with calls since Triton
    3.5, else a callable), or the stages inspection hook that adds to the compile key (Triton 3.6+). Without
    `triton.knobs` (before 3.4), as if set."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return True
    hooks = (runtime.launch_enter_hook, runtime.launch_exit_hook, getattr(runtime, "add_stages_inspection_hook", None))
    return any(getattr(hook, "calls", hook) for hook in hooks)


# compiled kernels by (id of the JIT function, device, Triton's specialization of the arguments, launch options)
_COMPILED: dict[tuple, object] = {}
