# SPDX-License-Identifier: Apache-2.0
"""kernels/launch.py: a launch goes straight to a compiled kernel only where Triton's own binder gives a
specialization it has launched before; every other launch goes through Triton.

The binder is Triton's own, made for an sm_90 target by a stand-in driver (no GPU here); Triton's compile-and-launch
path (`JITFunction.run`) is replaced by a recorder that returns a stand-in compiled kernel."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="kernel launches need Triton")
tl = pytest.importorskip("triton.language")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from vllm_duo.kernels import launch as launch_module  # noqa: E402
from vllm_duo.kernels.launch import launch  # noqa: E402


def _body(x_ptr, y_ptr, n, m, BLOCK: tl.constexpr):
    pass


class Driver:
    """Stands in for Triton's CUDA driver: device `device`, stream 1234, an sm_90 target."""

    device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1234

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class Compiled:
    """Stands in for a compiled kernel: records what its launcher is given."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, launches: list):
        self.launches = launches

    def run(self, *args):
        self.launches.append(("compiled", args))


@pytest.fixture
def kernel(monkeypatch):
    """A JIT function whose Triton path records ("triton", grid, args, kwargs) in `kernel.launches`."""
    driver = Driver()
    monkeypatch.setattr(triton.runtime.driver, "_active", driver)
    monkeypatch.setattr(launch_module, "_COMPILED", {})
    jit = JITFunction(_body, do_not_specialize=["m"])
    jit.launches, jit.driver = [], driver

    def triton_path(*args, grid, warmup, **kwargs):
        jit.launches.append(("triton", grid, args, kwargs))
        return Compiled(jit.launches)

    jit.run = triton_path
    return jit


X = torch.zeros(64, dtype=torch.bfloat16)


def plain(record):
    """A launch record with each tensor as (address, dtype, shape), comparable with ==."""
    if isinstance(record, torch.Tensor):
        return record.data_ptr(), record.dtype, tuple(record.shape)
    if isinstance(record, (tuple, list)):
        return type(record)(plain(item) for item in record)
    if isinstance(record, dict):
        return {key: plain(value) for key, value in record.items()}
    return record

# (what changes from the first launch, its arguments and options, whether it takes the compiled kernel)
LAUNCHES = [
    ("nothing", (X, X[8:], 16, 5), dict(BLOCK=32, num_warps=4), True),
    ("other tensors, same dtype and alignment", (X[16:], X[24:], 16, 5), dict(BLOCK=32, num_warps=4), True),
    ("another multiple of 16", (X, X[8:], 48, 5), dict(BLOCK=32, num_warps=4), True),
    ("an unspecialized int, same width", (X, X[8:], 16, 7), dict(BLOCK=32, num_warps=4), True),
    ("an unspecialized int past 32 bits", (X, X[8:], 16, 2 ** 40), dict(BLOCK=32, num_warps=4), False),
    ("a pointer off 16-byte alignment", (X, X[1:], 16, 5), dict(BLOCK=32, num_warps=4), False),
    ("an int not a multiple of 16", (X, X[8:], 17, 5), dict(BLOCK=32, num_warps=4), False),
    ("an int equal to 1", (X, X[8:], 1, 5), dict(BLOCK=32, num_warps=4), False),
    ("another dtype", (X, X.half()[8:], 16, 5), dict(BLOCK=32, num_warps=4), False),
    ("another constexpr", (X, X[8:], 16, 5), dict(BLOCK=64, num_warps=4), False),
    ("another launch option", (X, X[8:], 16, 5), dict(BLOCK=32, num_warps=8), False),
]


@pytest.mark.parametrize("what, args, kwargs, compiled", LAUNCHES, ids=[case[0] for case in LAUNCHES])
def test_a_launch_takes_the_compiled_kernel_only_for_a_specialization_launched_before(kernel, what, args, kwargs,
                                                                                   compiled):
    launch(kernel, (4, 2))(X, X[8:], 16, 5, BLOCK=32, num_warps=4)
    assert plain(kernel.launches) == plain([("triton", (4, 2), (X, X[8:], 16, 5), dict(BLOCK=32, num_warps=4))])
    launch(kernel, (3,))(*args, **kwargs)
    if compiled:  # the launcher gets the grid in three dimensions, the stream, and every argument in order
        assert plain(kernel.launches[-1]) == plain(("compiled", (3, 1, 1, 1234, "function", "metadata", None, None,
                                                                 None, *args, kwargs["BLOCK"])))
    else:
        assert plain(kernel.launches[-1]) == plain(("triton", (3,), args, kwargs))
        launch(kernel, (3,))(*args, **kwargs)  # its second launch takes its own compiled kernel
        assert kernel.launches[-1][0] == "compiled" and plain(kernel.launches[-1][1][9:13]) == plain(args)


def test_each_kernel_and_device_keeps_its_own_compiled_kernels(kernel):
    other = JITFunction(_body, do_not_specialize=["m"])
    other.launches = []
    other.run = lambda *args, grid, warmup, **kwargs: other.launches.append("triton") or Compiled(other.launches)
    launch(kernel, (1,))(X, X, 16, 5, BLOCK=32)
    launch(other, (1,))(X, X, 16, 5, BLOCK=32)  # same specialization, another kernel
    assert other.launches == ["triton"]
    kernel.driver.device = 1
    launch(kernel, (1,))(X, X, 16, 5, BLOCK=32)
    assert kernel.launches[-1][0] == "triton"


def test_launches_go_through_triton_while_a_launch_hook_is_set(kernel):
    hook = triton.knobs.runtime.launch_enter_hook
    launch(kernel, (1,))(X, X, 16, 5, BLOCK=32)
    seen = []
    if hasattr(hook, "add"):  # a HookChain (Triton 3.5+)
        hook.add(seen.append)
        try:
            launch(kernel, (1,))(X, X, 16, 5, BLOCK=32)
        finally:
            hook.remove(seen.append)
    else:
        triton.knobs.runtime.launch_enter_hook = seen.append
        try:
            launch(kernel, (1,))(X, X, 16, 5, BLOCK=32)
        finally:
            triton.knobs.runtime.launch_enter_hook = hook
    assert [entry[0] for entry in kernel.launches] == ["triton", "triton"]


def test_kernels_without_tritons_binder_launch_as_they_are():
    """The CPU interpreter's kernels and the tests' stand-ins (tests/test_warmup.py's Recorder) keep `kernel[grid]`."""
    launched = []

    class StandIn:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((grid, args, kwargs))

    launch(StandIn(), (2, 3))(X, 7, BLOCK=16)
    assert plain(launched) == plain([((2, 3), (X, 7), dict(BLOCK=16))])


def test_launch_shape_arithmetic_matches_tritons():
    """The plain-Python cdiv and next_power_of_2 give Triton's results (the launch shapes, and so the compiled
    kernels, stay those Triton's own helpers chose)."""
    from vllm_duo.kernels.launch import cdiv, next_power_of_2
    values = [*range(1, 300), 511, 512, 513, 4095, 4096, 4097, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 1, 10 ** 12]
    for n in values:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 100, 2 ** 20):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


@triton.jit
def _scaled_copy_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * scale, mask=offs < n)


@pytest.mark.gpu
def test_launches_through_the_compiled_kernel_compute_what_tritons_do(monkeypatch):
    """On a GPU: the second launch of a specialization goes to the compiled kernel (Triton's dispatch is not
    called), with every argument where the kernel reads it; a misaligned view goes through Triton once."""
    monkeypatch.setattr(launch_module, "_COMPILED", {})
    through_triton = []
    triton_run = _scaled_copy_kernel.run
    monkeypatch.setattr(_scaled_copy_kernel, "run", lambda *a, **k: through_triton.append(1) or triton_run(*a, **k))
    x = torch.randn(4096, device="cuda")
    for n, scale, offset in ((4000, 2.0, 0), (1000, -3.0, 0), (1000, 0.5, 16), (999, 1.5, 1), (999, 4.0, 1)):
        src, dst = x[offset:], torch.zeros(4096 - offset, device="cuda")
        launch(_scaled_copy_kernel, (launch_module.cdiv(n, 256),))(src, dst, n, scale, BLOCK=256)
        torch.testing.assert_close(dst[:n], src[:n] * scale)
        assert (dst[n:] == 0).all()
    # through Triton: n a multiple of 16; n not one; a misaligned source (a 64-byte offset keeps the alignment)
    assert len(through_triton) == 3
