# SPDX-License-Identifier: Apache-2.0
"""Duo attention kernels: Triton kernels, each with its plain PyTorch reference (reference.py)."""
