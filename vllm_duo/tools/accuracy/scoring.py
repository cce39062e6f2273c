# SPDX-License-Identifier: Apache-2.0
"""Head scoring without training: how much attention each KV head pays to a passkey outside its streaming window."""
from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vllm_duo.pattern import HeadPattern, PatternError, read_hf_config
from vllm_duo.tools.accuracy.passkey import PasskeyPrompt, passkey_prompt
from vllm_duo.tools.pattern_commands import pattern_from_gates

SOURCE = "vllm-duo scoring (vllm_duo/tools/accuracy/scoring.py)"
NOTES = "first pattern by attention-mass scoring; to be replaced by a trained pattern (vllm-duo identify)"
_ATTENTION = "duo_scoring"


class _NeedleProbe:
    """Measures, inside each layer's attention, the far-needle attention mass of the question and answer queries."""

    def __init__(self, prompt: PasskeyPrompt, num_layers: int, num_kv_heads: int, sink: int, recent: int):
        queries = torch.arange(prompt.question_start, len(prompt.input_ids))[:, None]
        keys = torch.arange(len(prompt.input_ids))[None, :]
        needle = torch.zeros(len(prompt.input_ids), dtype=torch.bool)
        needle[prompt.needle.start:prompt.needle.stop] = True
        self.queries = queries[:, 0]
        self.causal = keys <= queries
        # Keys that a streaming head drops for this query: not among the first `sink`, not among the last `recent`.
        self.far_needle = needle[None, :] & (keys >= sink) & (keys <= queries - recent)
        self.mass = np.zeros((num_layers, num_kv_heads))

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """query [1, H, T, D], key [1, KV, T, D] (before GQA expansion; query head h reads KV head h // (H / KV))."""
        num_kv_heads = key.shape[1]
        groups = query.shape[1] // num_kv_heads
        selected = query[0, :, self.queries].reshape(num_kv_heads, groups * len(self.queries), -1)
        logits = (selected @ key[0].transpose(1, 2) * scaling).view(num_kv_heads, groups, len(self.queries), -1)
        probs = logits.masked_fill(~self.causal, float("-inf")).softmax(dim=-1)
        self.mass[layer] = (probs * self.far_needle).sum(dim=-1).mean(dim=(1, 2)).numpy()


def _scoring_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, duo_probe=None,
                       **kwargs):
    """SDPA attention that also lets `duo_probe` (passed through the model's forward kwargs) look at Q and K."""
    if duo_probe is not None:
        duo_probe.record(module.layer_idx, query, key, scaling if scaling is not None else query.shape[-1] ** -0.5)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def score_heads(model_dir: str | Path, num_samples: int = 16, context_len: int = 2048, seed: int = 0, *,
                sink: int = 64, recent: int = 256, progress: bool = True) -> np.ndarray:
    """Scores [num_layers, num_kv_heads] in [0, 1]: how much each KV head needs tokens a streaming head drops.

    For `num_samples` passkey prompts of about `context_len` tokens (depths stratified over the allowed range),
    a head's raw score is the attention mass that the queries of the question and answer tokens, averaged over
    the query heads of its GQA group, put on needle tokens outside the sink + recent window. Raw scores are
    averaged over prompts and divided by the largest. Runs the Hugging Face model on CPU in float32;
    deterministic for a given seed.
    """
    if num_samples < 1 or context_len < 1 or sink < 0 or recent < 0:
        raise PatternError(f"samples {num_samples}, context length {context_len}, sink {sink}, recent {recent}: "
                           "samples and context length must be positive, sink and recent non-negative")
    AttentionInterface.register(_ATTENTION, _scoring_attention)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation=_ATTENTION)
    model.eval()
    config = model.config
    rng = random.Random(seed)
    depths = [(i + rng.random()) / num_samples for i in range(num_samples)]
    total = np.zeros((config.num_hidden_layers, config.num_key_value_heads))
    with torch.inference_mode():
        for depth in tqdm(depths, desc="scoring heads", unit="prompt", disable=not progress):
            prompt = passkey_prompt(tokenizer, context_len, rng, depth, sink=sink, recent=recent)
            probe = _NeedleProbe(prompt, config.num_hidden_layers, config.num_key_value_heads, sink, recent)
            model.base_model(torch.tensor([prompt.input_ids]), duo_probe=probe)  # no LM head: logits are unused
            total += probe.mass
    if total.max() <= 0.0:
        raise PatternError(f"no head attends to the passkey outside sink {sink} + recent {recent} tokens: "
                           "raise the context length or the number of samples")
    return total / total.max()


def score_pattern(model_dir: str | Path, *, name: str | None = None, aliases: Sequence[str] = (),
                  num_samples: int = 16, context_len: int = 2048, seed: int = 0, sink: int = 64, recent: int = 256,
                  sparsity: float = 0.5, date: str | None = None, license: str | None = None) -> HeadPattern:
    """A HeadPattern whose gates are score_heads' scores; `name` defaults to the model folder's name."""
    if not 0.0 <= sparsity <= 1.0:  # checked before minutes of scoring, not after
        raise PatternError(f"sparsity {sparsity} is outside [0, 1]: pass the fraction of streaming heads, e.g. 0.5")
    read_hf_config(model_dir)  # a bad config.json fails here, before minutes of scoring
    scores = score_heads(model_dir, num_samples, context_len, seed, sink=sink, recent=recent)
    method = (f"attention-mass scoring on synthetic passkey retrieval: per KV head, the mean attention of the "
              f"question and answer queries (its GQA group's query heads averaged) on the needle tokens outside "
              f"sink {sink} + recent {recent}, over {num_samples} prompts of up to {context_len} tokens (seed {seed}; "
              "one 5-digit passkey per prompt at a stratified random depth; varied filler sentences), divided by "
              "the largest head's score")
    return pattern_from_gates(scores, model_dir, name=name, aliases=aliases, sparsity=sparsity, sink=sink,
                              recent=recent, source=SOURCE, method=method, notes=NOTES, date=date, license=license)


def write_scored_pattern(model_dir: str, out: str, **options) -> str:
    """Scores the model's heads, writes the pattern JSON to `out` and returns a one-line summary.

    `options` are those of score_pattern (name, aliases, num_samples, context_len, seed, ...).
    """
    pattern = score_pattern(model_dir, **options)
    pattern.save(out)
    counts = pattern.retrieval_counts()
    return (f"wrote {out}: {pattern.model.num_layers} layers x {pattern.model.num_kv_heads} KV heads, "
            f"{sum(counts)} retrieval at sparsity {pattern.sparsity:g}")
