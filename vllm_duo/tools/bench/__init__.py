# SPDX-License-Identifier: Apache-2.0
"""`vllm-duo bench`: vLLM's own benchmarks, dense vs duo, into results.json, results.md and plots.

command.py is the entry (the CLI handler); suite.py plans and runs, one vLLM subprocess a run (offline.py,
served.py); results.py keeps results.json; report.py, tables.py and plots.py draw results.md from it, with the
roofline model's limits (roofline.py).
"""
