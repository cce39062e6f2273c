# SPDX-License-Identifier: Apache-2.0
"""Head-pattern JSON files shipped with vllm-duo (data package; see README.md here)."""
