# SPDX-License-Identifier: Apache-2.0
"""Launch-shape arithmetic on the host, in plain Python.

Since Triton 3.5 `triton.cdiv` and `triton.next_power_of_2` are constexpr functions: called from host code each
unwraps its arguments first, about a microsecond a call, several per launch and every layer of every eager step.
"""


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` for ints."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()
