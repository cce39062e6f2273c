# SPDX-License-Identifier: Apache-2.0
"""vLLM's own "Maximum concurrency" figure with duo, against dense at the same KV cache space.

The issue's targets: >= 1.8x at 50% and >= 1.25x at 25% for SmolLM2 at 8,192 tokens, sink 64,
recent 256. The pooled page-group layout (kv_cache.py) reaches them; the test pins what vLLM reports
to what the layout predicts, and the layout's placement is checked on random patterns.
"""

import random

import pytest

from vllm_duo import capacity
from vllm_duo.kv_cache import plan_page_layout, streaming_groups_held
from vllm_duo.pattern import find_bundled, HeadPattern

MAX_MODEL_LEN, SINK, RECENT, BLOCK = 8192, 64, 256, 16
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


@pytest.mark.parametrize("sparsity, at_least", [(0.5, 1.8), (0.25, 1.25)])
def test_reported_concurrency_matches_layout(smollm2_dir, sparsity, at_least):
    duo = {"pattern": "SmolLM2-135M-Instruct", "sparsity": sparsity, "sink": SINK, "recent": RECENT}
    dense, duo_cap = capacity.compare(smollm2_dir, MAX_MODEL_LEN, duo)
    counts = HeadPattern.load(find_bundled("SmolLM2-135M-Instruct")).retrieval_counts(sparsity)
    layout = plan_page_layout(tuple(counts), tuple(KV_HEADS - c for c in counts), BLOCK)
    dense_bytes = MAX_MODEL_LEN * LAYERS * KV_HEADS * 2 * HEAD_DIM
    predicted = dense_bytes / layout.bytes_per_request(MAX_MODEL_LEN, BLOCK, HEAD_DIM, 1, SINK, RECENT)
    measured = duo_cap.max_concurrency / dense.max_concurrency
    print(capacity.report(dense, duo_cap, MAX_MODEL_LEN))
    assert measured == pytest.approx(predicted, rel=0.02)
    assert measured >= at_least


@pytest.mark.parametrize("seed", range(20))
def test_pooled_streaming_cells_fit_their_hosts_without_overlap(seed):
    rng = random.Random(seed)
    layers, kv_heads, block = rng.randint(1, 12), rng.randint(1, 8), rng.choice([16, 32])
    counts = [rng.randint(0, kv_heads) for _ in range(layers)]
    layout = plan_page_layout(tuple(counts), tuple(kv_heads - c for c in counts), block)
    assert [p for p in layout.page_heads if p] == [r for r in counts if r] or not any(counts)
    used = {}
    for layer, placement in enumerate(layout.placements):
        cells = block * (kv_heads - counts[layer])
        if not cells:
            assert placement is None
            continue
        capacity = layout.streaming_blocks * block * layout.page_heads[placement.host]
        assert 0 <= placement.offset and placement.offset + cells <= capacity
        used.setdefault(placement.host, []).append((placement.offset, placement.offset + cells))
    for spans in used.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    total = block * sum(kv_heads - r for r in counts)
    lower_bound = -(-total // (block * sum(layout.page_heads))) if total else 0
    assert layout.streaming_blocks >= lower_bound


@pytest.mark.parametrize("num_tokens, held", [(1, 1), (64, 4), (320, 20), (321, 21), (336, 20), (337, 21),
                                              (8192, 4 + 16), (8200, 4 + 17)])
def test_streaming_groups_held(num_tokens, held):
    """Sink 64 and recent 256 in 16-token blocks: the 4 sink blocks and the blocks of the next query's window."""
    assert streaming_groups_held(num_tokens, SINK, RECENT, BLOCK) == held
