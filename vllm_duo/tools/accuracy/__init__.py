# SPDX-License-Identifier: Apache-2.0
"""Which heads matter and what streaming the others costs: gate training (`vllm-duo identify`), attention-mass
scoring (`vllm-duo pattern score`) and the passkey eval through vLLM (`vllm-duo eval`), on synthetic passkey
prompts (passkey.py)."""
