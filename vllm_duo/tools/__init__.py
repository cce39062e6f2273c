# SPDX-License-Identifier: Apache-2.0
"""Tools around the plugin (the `vllm-duo` command, `make run`, benchmarks, gate training, accuracy): nothing in
here runs inside vLLM, and the serving core imports none of it."""
