"""Predicted KV capacity (dense bytes / duo bytes a request holds) of the Llama-3.1-8B pattern at 50%, sink 64,
recent 256, bf16, by request length: the shipped layout (m = 2), the same pages with one streaming block (m = 1,
which no whole-layer packing of these pages allows), and pages 4 head slots wider that do pack with m = 1 (checked
with kv_cache._place). usage: python capacity_layouts.py > capacity_layouts.json"""
import dataclasses
import json

from vllm_duo.kv_cache import _place
from vllm_duo.tools.cache_sim import DUO, _duo_plan

layout = _duo_plan(dict(DUO)).page_layout(16)
streaming = [8 - r for r in layout.page_heads]
padded_pages = (3, 3, 4, 1, 4, 3, 2, 6, 4, 6, 6, 6, 2, 8, 4, 5, 4, 6, 3, 4, 5, 2, 4, 5, 3, 3, 3, 4, 5, 5, 8, 1)
assert _place([16 * s for s in streaming], [16 * p for p in layout.page_heads]) is None  # m = 1 does not pack
assert _place([16 * s for s in streaming], [16 * p for p in padded_pages]) is not None  # padded pages do
layouts = {"shipped (m=2)": layout, "m=1 (not packable)": dataclasses.replace(layout, streaming_blocks=1),
           "pages +4 slots, m=1": dataclasses.replace(layout, page_heads=padded_pages, streaming_blocks=1)}
lengths = (1024, 4096, 16384, 131072)
dense = {n: n * 32 * 8 * 128 * 2 * 2 for n in lengths}
print(json.dumps({"page_slots": {name: sum(lay.page_heads) for name, lay in layouts.items()},
                  "capacity_vs_dense": {name: {n: round(dense[n] / lay.bytes_per_request(n, 16, 128, 2, 64, 256), 3)
                                               for n in lengths} for name, lay in layouts.items()}}, indent=1))
