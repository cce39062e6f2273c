# SPDX-License-Identifier: Apache-2.0
"""Tests of the HF DuoAttention reference: full-attention equivalence, window coverage, mask indexing and boundaries."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_reference import DuoReference, duo_attention_forward, visible_mask

TEXT = ("The grass on the hill is green after the long spring rain. A small boat crossed the quiet lake before the "
        "sun came up. Maria keeps her old letters in a wooden box under the bed. The library opens at nine and "
        "closes late on Thursdays. Bread from the corner bakery is still warm at seven. ")


@pytest.fixture(scope="session")
def ref(smollm2_dir):
    """The reference, loaded once."""
    return DuoReference(smollm2_dir)


@pytest.fixture(scope="session")
def full(ref, smollm2_dir):
    """n -> (tokens(ref, n), their logprobs under the plain HF model with transformers' eager attention), memoized."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="eager").eval()
    memo = {}

    def get(n: int):
        if n not in memo:
            ids = tokens(ref, n)
            memo[n] = ids, eager_logprobs(model, ids)
        return memo[n]
    return get


def tokens(ref, n: int) -> list[int]:
    """Exactly n token ids of natural text."""
    ids = ref.tokenizer.encode(TEXT * (n // 40 + 2), add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


@torch.inference_mode()
def eager_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[:i + 1]) of the unmodified HF model."""
    t = torch.tensor([ids])
    logp = torch.log_softmax(model(input_ids=t, use_cache=False).logits[0, :-1].float(), dim=-1)
    return logp.gather(-1, t[0, 1:].unsqueeze(-1)).squeeze(-1)


def mixed_mask(ref, seed: int = 0) -> np.ndarray:
    """A random retrieval mask with both kinds of heads."""
    m = np.random.default_rng(seed).random((ref.num_layers, ref.num_kv_heads)) < 0.5
    assert m.any() and not m.all()
    return m


def test_all_retrieval_equals_eager(ref, full):
    ids, want = full(200)
    all_true = np.ones((ref.num_layers, ref.num_kv_heads), dtype=bool)
    for mask in (all_true, None):
        got = ref.logprobs(ids, mask, sink=4, recent=16)
        assert got.shape == (len(ids) - 1,) and got.dtype == torch.float32
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("sink, recent", [(4, 60), (0, 64), (16, 100)])
def test_streaming_window_covering_sequence_equals_full(ref, full, sink, recent):
    ids, want = full(64)    # sink + recent >= 64: the Λ mask is the causal mask
    got = ref.logprobs(ids, np.zeros((ref.num_layers, ref.num_kv_heads), dtype=bool), sink, recent)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


def test_short_window_changes_logprobs(ref, full):
    ids, want = full(64)
    all_stream = np.zeros((ref.num_layers, ref.num_kv_heads), dtype=bool)
    # two keys short of covering: only query 62 (which loses key 4) and 63 (not scored) see less
    got = ref.logprobs(ids, all_stream, sink=4, recent=58)
    assert torch.allclose(got[:-1], want[:-1], atol=1e-5, rtol=0)
    assert (got[-1] - want[-1]).abs() > 1e-6


def test_mixed_mask_differs_from_full(ref, full):
    ids, want = full(200)
    mask = mixed_mask(ref)
    got = ref.logprobs(ids, mask, sink=4, recent=16)
    diff = (got - want).abs()
    assert torch.isfinite(got).all()
    assert torch.allclose(got[:20], want[:20], atol=1e-5, rtol=0)   # queries < sink + recent see everything
    assert diff.max() > 0.05, diff.max()
    # a different mask gives different logprobs, the same mask the same ones
    other = ref.logprobs(ids, mixed_mask(ref, seed=1), sink=4, recent=16)
    assert (other - got).abs().max() > 1e-3
    assert torch.equal(ref.logprobs(ids, mask, sink=4, recent=16), got)


def explicit_attention(q, k, v, streaming, sink, recent, scaling):
    """Per query head, per query row: softmax over the visible keys only, in float64 (loops, no mask tensor)."""
    bsz, num_heads, q_len, d = q.shape
    num_kv, k_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv
    out = torch.zeros(bsz, q_len, num_heads, d, dtype=torch.float64)
    for b in range(bsz):
        for h in range(num_heads):
            kvh = h // group
            for i in range(q_len):
                qp = k_len - q_len + i
                keys = [kp for kp in range(qp + 1)
                        if not streaming[kvh] or kp < sink or kp > qp - recent]
                s = torch.stack([q[b, h, i].double() @ k[b, kvh, kp].double() for kp in keys]) * scaling
                w = torch.softmax(s, dim=0)
                out[b, i, h] = sum(w[j] * v[b, kvh, kp].double() for j, kp in enumerate(keys))
    return out


@pytest.mark.parametrize("q_len", [40, 3])
def test_model_layer_matches_explicit_per_head(ref, q_len):
    mask = mixed_mask(ref)
    layer = 7
    mask[layer] = [True, False, True]           # only KV head 1 (query heads 3, 4, 5) streams
    ref.set_mask(mask, sink=4, recent=8)
    module = ref.attn_modules[layer]
    assert module.layer_idx == layer and module.num_key_value_groups == 3
    g = torch.Generator().manual_seed(layer)
    k_len, d = 40, 64
    q = torch.randn(2, 9, q_len, d, generator=g)
    k = torch.randn(2, 3, k_len, d, generator=g)
    v = torch.randn(2, 3, k_len, d, generator=g)
    out, weights = duo_attention_forward(module, q, k, v, None, scaling=module.scaling, dropout=0.0)
    assert weights is None and out.shape == (2, q_len, 9, d)
    want = explicit_attention(q, k, v, [False, True, False], 4, 8, module.scaling)
    assert torch.allclose(out.double(), want, atol=1e-5, rtol=0), (out.double() - want).abs().max()
    # the streaming group really differs from full attention, the retrieval groups do not
    unmasked = explicit_attention(q, k, v, [False, False, False], 4, 8, module.scaling)
    same = torch.isclose(out.double(), unmasked, atol=1e-5, rtol=0).all(dim=(0, 1, 3))
    assert same.tolist() == [True] * 3 + [False] * 3 + [True] * 3


def test_boundaries_by_one_hot_values():
    sink, recent, k_len, num_kv, group = 4, 8, 48, 3, 3
    module = SimpleNamespace(layer_idx=0, num_key_value_groups=group, duo_streaming=torch.tensor([True, False, True]),
                             duo_sink=sink, duo_recent=recent)
    q = torch.zeros(1, num_kv * group, k_len, k_len)               # zero query: uniform over visible keys
    k = torch.randn(1, num_kv, k_len, k_len)
    v = torch.eye(k_len).expand(1, num_kv, k_len, k_len)           # value of key j = e_j: output = attention weights
    out, _ = duo_attention_forward(module, q, k, v, None, scaling=1.0)
    seen = out[0] > 0                                              # [q, H, k]
    for h in range(num_kv * group):
        streaming = h // group != 1
        for qp in range(k_len):
            row = seen[qp, h]
            n = int(row.sum())
            assert torch.allclose(out[0, qp, h][row], torch.full((n,), 1.0 / n))
            assert not row[qp + 1:].any()                          # causal
            assert row[qp]
            if not streaming:
                assert n == qp + 1
                continue
            assert bool(row[sink - 1]) == (qp >= sink - 1)         # k = sink - 1 always visible
            if qp - recent >= sink:
                assert not row[qp - recent]                        # k = q - recent: masked
            if qp >= sink:
                assert bool(row[sink]) == (sink > qp - recent)     # k = sink: masked once far from q
            if qp - recent + 1 >= 0:
                assert row[qp - recent + 1]                        # k = q - recent + 1: visible
            assert n == min(qp + 1, sink + recent)


def test_visible_mask_decode_rows_match_prefill():
    streaming = torch.tensor([True, False])
    full = visible_mask(30, 30, streaming, 2, 5)
    assert torch.equal(visible_mask(4, 30, streaming, 2, 5), full[:, -4:])
    assert full[0, 20].nonzero().flatten().tolist() == [0, 1, 16, 17, 18, 19, 20]
    assert full[1, 20].sum() == 21


def test_greedy_cached_equals_recompute(ref):
    ids = tokens(ref, 32)   # longer than sink + recent: the window slides during the prompt and the decode
    mask = mixed_mask(ref)
    fast = ref.greedy(ids, 4, mask, sink=2, recent=8)
    assert len(fast) == 4
    assert fast == ref.greedy_recompute(ids, 4, mask, sink=2, recent=8)


def test_bad_mask_rejected(ref):
    with pytest.raises(ValueError):
        ref.set_mask(np.ones((ref.num_layers, ref.num_kv_heads + 1), dtype=bool), 4, 16)
    with pytest.raises(ValueError):
        ref.set_mask(np.ones((ref.num_layers, ref.num_kv_heads), dtype=np.int64), 4, 16)
    with pytest.raises(ValueError):
        ref.set_mask(np.ones((ref.num_layers, ref.num_kv_heads), dtype=bool), 4, 0)
