# SPDX-License-Identifier: Apache-2.0
"""Independent HF-transformers reference for DuoAttention logprobs under a per-KV-head retrieval/streaming mask."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache

ATTN_NAME = "duo_lambda"


def visible_mask(q_len: int, k_len: int, streaming: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Bool [num_kv_heads, q_len, k_len]: which keys each query sees; queries are the last q_len of k_len positions."""
    q_pos = torch.arange(k_len - q_len, k_len).view(-1, 1)
    k_pos = torch.arange(k_len).view(1, -1)
    causal = k_pos <= q_pos
    lam = causal & ((k_pos < sink) | (k_pos > q_pos - recent))
    streaming = streaming.view(-1, 1, 1).to(torch.bool)
    return torch.where(streaming, lam.unsqueeze(0), causal.unsqueeze(0))


def duo_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention-interface function: float32 masked softmax with the module's per-KV-head Λ mask.

    query [b, H, q_len, d], key/value [b, KVH, k_len, d]; returns ([b, q_len, H, d], None). The HF attention mask is
    ignored (a custom implementation gets None): sequences are unpadded and causal, queries are the last q_len
    positions of the k_len keys (true with or without a KV cache). Without `duo_streaming` on the module (or None),
    every head is full causal attention.
    """
    bsz, num_heads, q_len, _ = query.shape
    num_kv_heads, k_len = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    streaming = getattr(module, "duo_streaming", None)
    if streaming is None:
        streaming = torch.zeros(num_kv_heads, dtype=torch.bool)
        sink, recent = 0, 1
    else:
        sink, recent = module.duo_sink, module.duo_recent
    assert streaming.shape == (num_kv_heads,), (streaming.shape, num_kv_heads)
    mask = visible_mask(q_len, k_len, streaming, sink, recent)            # [KVH, q, k]
    mask = mask.repeat_interleave(group, dim=0).to(query.device)           # [H, q, k]; head i -> KV head i // group

    q = query.float()
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling               # [b, H, q, k]
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)                                           # [b, H, q, d]
    return out.transpose(1, 2).contiguous().to(query.dtype), None


AttentionInterface.register(ATTN_NAME, duo_attention_forward)


class DuoReference:
    """HF model + tokenizer with DuoAttention masking, for exact per-token logprobs and greedy decoding."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32):
        self.model_dir = str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype, attn_implementation=ATTN_NAME)
        self.model.eval()
        cfg = self.model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.attn_modules = {m.layer_idx: m for m in self.model.modules()
                             if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")}
        assert sorted(self.attn_modules) == list(range(self.num_layers)), sorted(self.attn_modules)

    def set_mask(self, retrieval_mask: np.ndarray | None, sink: int, recent: int) -> None:
        """Install the mask on every attention module (None = all heads full attention)."""
        if retrieval_mask is None:
            for m in self.attn_modules.values():
                m.duo_streaming = None
            return
        retrieval_mask = np.asarray(retrieval_mask)
        if retrieval_mask.dtype != np.bool_ or retrieval_mask.shape != (self.num_layers, self.num_kv_heads):
            raise ValueError(f"retrieval_mask must be bool [{self.num_layers}, {self.num_kv_heads}], "
                             f"got {retrieval_mask.dtype} {retrieval_mask.shape}")
        if sink < 0 or recent < 1:
            raise ValueError(f"need sink >= 0 and recent >= 1, got sink={sink} recent={recent}")
        for layer, m in self.attn_modules.items():
            m.duo_streaming = torch.from_numpy(~retrieval_mask[layer]).clone()
            m.duo_sink, m.duo_recent = int(sink), int(recent)

    @torch.inference_mode()
    def logprobs(self, token_ids: list[int], retrieval_mask: np.ndarray | None, sink: int, recent: int) -> torch.Tensor:
        """Float32 [len(token_ids) - 1]: log p(token_ids[i + 1] | token_ids[:i + 1]) under the masked model."""
        if len(token_ids) < 2:
            raise ValueError("need at least 2 tokens")
        self.set_mask(retrieval_mask, sink, recent)
        ids = torch.tensor([token_ids], dtype=torch.long)
        logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int, retrieval_mask: np.ndarray | None,
               sink: int, recent: int) -> list[int]:
        """Greedy continuation (new tokens only, no EOS stop): one prompt forward, then one token per step.

        Uses a full (unevicted) DynamicCache: the mask depends only on absolute positions, so each step equals a
        full recompute of the growing sequence.
        """
        self.set_mask(retrieval_mask, sink, recent)
        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        out: list[int] = []
        for _ in range(max_new_tokens):
            logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
            nxt = int(torch.argmax(logits.float()))
            out.append(nxt)
            ids = torch.tensor([[nxt]], dtype=torch.long)
        return out

    @torch.inference_mode()
    def greedy_recompute(self, prompt_ids: list[int], max_new_tokens: int, retrieval_mask: np.ndarray | None,
                         sink: int, recent: int) -> list[int]:
        """Greedy continuation by a full forward of the whole sequence per new token (slow; for cross-checks)."""
        self.set_mask(retrieval_mask, sink, recent)
        seq = list(prompt_ids)
        for _ in range(max_new_tokens):
            logits = self.model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
            seq.append(int(torch.argmax(logits.float())))
        return seq[len(prompt_ids):]
