# SPDX-License-Identifier: Apache-2.0
"""The clustered contexts of Squeezed Attention (vllm_duo/squeeze.py) on test_kernels.py's small cases, on the CPU
interpreter: what a build stores, the lookup against the references, and end to end that a budget of every clustered
key gives duo's own decode, also past the window."""

import functools
import math

import pytest
import torch
from test_kernels import PRESETS, Preset, assert_caches_equal, make_case, written_caches
from test_sparse_kernels import assert_retrieval_rows, duo_decode, run_sparse, sparse_reference

from vllm_duo.gpu_attention import duo_attention_gpu
from vllm_duo.kernels import sparse_reference as ref
from vllm_duo.kernels.reference import read_retrieval
from vllm_duo.kernels.selection import gather_positions
from vllm_duo.kernels.row_pages import WINDOW_KEYS
from vllm_duo.squeeze import (FP8_CENTROIDS, ClusteredContexts, SqueezeRows, SqueezeSettings, SqueezeStep,
                              centroid_dtype, window_pages)

CASE = PRESETS["decode_gqa3"]  # 5 decoding requests over 5-100 cached tokens, sink 4, recent 16, 2 retrieval heads
TWO_LAYERS = [2, 1]


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def built(case, cache, settings: SqueezeSettings, layer: int = 0,
          centroid_dtype: torch.dtype = torch.bfloat16) -> ClusteredContexts:
    """Every request's cached tokens (its prompt) clustered into its own slot."""
    contexts = ClusteredContexts([case.heads.num_retrieval] * 2, case.preset.head_dim, case.preset.sink, settings,
                                 centroid_dtype=centroid_dtype)
    for i, seq_len in enumerate(case.seq_lens):
        contexts.build(layer, i, cache, case.heads, case.block_table[i], seq_len - 1)
    return contexts


def select(contexts: ClusteredContexts, query, heads, query_start_loc, context_ids, budget, scale,
           max_selected: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's selection as decode makes it (`ClusteredContexts.runs`), as positions and counts."""
    runs = contexts.runs(0, query, heads, query_start_loc, context_ids, budget, scale, max_selected)
    return gather_positions(runs, contexts.positions[0], max_selected, context_ids)


def select_reference(contexts: ClusteredContexts, layer: int, case, slots: list[int], budget: list[int],
                     max_selected: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`select` by the kernels' PyTorch references, request by request."""
    scores = ref.centroid_scores(case.query, contexts.centroids[layer], contexts.sizes[layer], case.heads,
                                 case.query_start_loc, case.scale, slots, contexts.scales_of(layer),
                                 contexts.radii[layer], contexts.settings.radius_weight)
    budgets = torch.tensor(budget, dtype=torch.int32)[:, None].expand(-1, case.heads.num_retrieval)
    return ref.select_banded(scores, contexts.offsets[layer], contexts.positions[layer], budgets, max_selected, slots)


def settings_for(case, **kw) -> SqueezeSettings:
    longest = max(case.seq_lens) - case.preset.sink
    return SqueezeSettings(**{"keys_per_cluster": 4, "max_contexts": len(case.seq_lens), "max_context_len": longest,
                              **kw})


def test_a_build_lists_each_clustered_position_once():
    """... and keeps each cluster's radius: its farthest key from its centroid."""
    case = make_case(CASE)
    cache, _ = written_caches(case)
    contexts = built(case, cache, settings_for(case))
    for i, seq_len in enumerate(case.seq_lens):
        T = seq_len - 1 - CASE.sink
        assert contexts.clustered(i) == T and contexts.ends[i] == seq_len - 1
        keys, _ = read_retrieval(cache, case.block_table[i].long(), seq_len - 1, case.heads.num_retrieval,
                                 case.heads.stride)
        for r in range(case.heads.num_retrieval):
            offsets, sizes = contexts.offsets[0][i, r], contexts.sizes[0][i, r]
            assert offsets[0] == 0 and offsets[-1] == T and torch.equal(offsets[1:] - offsets[:-1], sizes)
            assert sorted(contexts.positions[0][i, r, :T].tolist()) == list(range(CASE.sink, seq_len - 1))
            for c in range(len(sizes)):
                members = keys[contexts.positions[0][i, r, offsets[c]:offsets[c + 1]].long(), r].float()
                far = (members - contexts.centroids[0][i, r, c].float()).norm(dim=-1).max() if len(members) else 0.0
                assert abs(float(contexts.radii[0][i, r, c]) - float(far)) < 0.05 * (1 + float(far))


@pytest.mark.parametrize("budget, centroid_dtype", [(0.1, torch.bfloat16), (0.3, torch.bfloat16),
                                                     (1.0, torch.bfloat16), (0.3, FP8_CENTROIDS)])
def test_select_matches_the_references(budget, centroid_dtype):
    case = make_case(CASE)
    cache, _ = written_caches(case)
    contexts = built(case, cache, settings_for(case, budget=budget), centroid_dtype=centroid_dtype)
    slots = [0, 0, 2, 4, 3]  # two requests over one context read the same copy
    keys = contexts.budget_keys(slots)
    width = contexts.settings.max_context_len
    ids = torch.tensor(slots, dtype=torch.int32)
    selected, counts = select(contexts, case.query, case.heads, case.qsl, ids, keys, case.scale, width)
    expected = select_reference(contexts, 0, case, slots, keys.tolist(), width)
    assert torch.equal(counts, expected[1])
    for i in range(len(slots)):
        for r in range(case.heads.num_retrieval):
            assert torch.equal(selected[i, r, :counts[i, r]], expected[0][i, r, :counts[i, r]])
            taken = set(selected[i, r, :counts[i, r]].tolist())
            assert counts[i, r] >= keys[i] and taken <= set(range(CASE.sink, case.seq_lens[slots[i]] - 1))


def test_fp8_centroids_hold_the_centroids_to_fp8_precision():
    """Beside an fp8 cache the centroids are stored in fp8 with a scale per (slot, head): scaled back they are the
    bf16 build's centroids (the same clustering) to within fp8's rounding, and no head's largest saturates."""
    case = make_case(CASE)
    cache, _ = written_caches(case)
    settings = settings_for(case)
    wide, narrow = built(case, cache, settings), built(case, cache, settings, centroid_dtype=FP8_CENTROIDS)
    assert narrow.centroids[0].dtype == FP8_CENTROIDS and narrow.centroid_scales[0].shape == (len(case.seq_lens), 2)
    for slot in range(len(case.seq_lens)):
        scales = narrow.centroid_scales[0][slot][:, None, None]
        restored = narrow.centroids[0][slot].float() * scales
        torch.testing.assert_close(restored, wide.centroids[0][slot].float(), rtol=0.07, atol=0.0)
        assert narrow.centroids[0][slot].float().abs().amax() == torch.finfo(FP8_CENTROIDS).max


def test_centroids_are_fp8_beside_an_e4m3_cache_only():
    assert centroid_dtype(torch.bfloat16, "fp8") == centroid_dtype(torch.float16, "fp8_e4m3") == FP8_CENTROIDS
    assert centroid_dtype(torch.bfloat16, "fp8_e5m2") == centroid_dtype(torch.bfloat16, "auto") == torch.bfloat16
    assert centroid_dtype(torch.float32, "auto") == torch.float32


def test_budget_of_every_key_equals_duo_decode():
    """End to end: with budget 1 every clustered position is selected, so the sparse decode is duo's decode."""
    case = make_case(CASE)
    cache, stream = written_caches(case)
    contexts = built(case, cache, settings_for(case, budget=1.0))
    slots = list(range(len(case.seq_lens)))
    ids = torch.tensor(slots, dtype=torch.int32)
    selected, counts = select(contexts, case.query, case.heads, case.qsl, ids, contexts.budget_keys(slots),
                                       case.scale, contexts.settings.max_context_len)
    full = duo_decode(case, cache, stream)
    assert_retrieval_rows(run_sparse(case, cache, selected, counts), full, case)


def test_the_served_layer_runs_the_squeeze_after_its_attention():
    """gpu_attention.duo_attention_gpu with the squeeze's decode as `squeezed` (on the CPU the Triton kernels take
    the whole layer, then the squeeze): the retrieval heads of the squeezed rows are the sparse decode's over the
    selection, not duo's; the streaming heads are duo's."""
    case = make_case(CASE)
    cache, stream = written_caches(case)
    contexts = built(case, cache, settings_for(case, budget=0.3))
    slots = list(range(len(case.seq_lens)))
    ids, keys, ends = torch.tensor(slots, dtype=torch.int32), contexts.budget_keys(slots), contexts.context_ends(slots)
    rows = SqueezeRows(step=None, context_ids=ids, context_ends=ends, budget=keys, flash_seq_lens=case.sl)
    out = case.poisoned_output()
    squeezed = functools.partial(contexts.decode, 0, case.query, cache, case.heads, case.qsl, case.sl,
                                 case.block_table, case.scale, out, rows, case.quant)
    duo_attention_gpu(case.query, case.key, case.value, cache, case.heads, case.qsl, case.sl, case.block_table,
                      case.scale, out, 1, max(case.seq_lens), stream_cache=stream, quant=case.quant, squeezed=squeezed)
    selected, counts = select(contexts, case.query, case.heads, case.qsl, ids, keys, case.scale,
                                       contexts.settings.max_selected())
    sparse = run_sparse(case, cache, selected, counts, context_ends=ends.tolist())
    full = duo_decode(case, cache, stream)
    retrieval, streaming = case.heads.retrieval_q, case.heads.streaming_q
    torch.testing.assert_close(out[:, retrieval], sparse[:, retrieval])
    torch.testing.assert_close(out[:, streaming], full[:, streaming])
    assert not torch.allclose(out[:, retrieval], full[:, retrieval])


def served_flash_layer(case, slots: list[int], window: int, squeeze: bool = True):
    """Layer 0 served where FlashAttention takes the retrieval heads (a torch stand-in on the CPU, the passes one after
    another): `slots[i]` (-1: none) holds request i's prompt clustered up to a window of 3 or more, the step's plan
    staged as serving stages it (`ClusteredContexts.stage`, `window_pages`). Returns the output, the plan, the
    contexts and the caches before the step; `squeeze` False: the same layer without the squeeze, for comparison."""
    case_cache, _ = written_caches(case)
    settings = settings_for(case, budget=0.3)
    contexts = ClusteredContexts([case.heads.num_retrieval] * 2, case.preset.head_dim, case.preset.sink, settings,
                                 max_rows=len(case.seq_lens), block_size=case.preset.block_size)
    contexts.row_window = window
    for i, slot in enumerate(slots):
        if slot >= 0:
            contexts.build(0, slot, case_cache, case.heads, case.block_table[i],
                           (case.seq_lens[i] - 3) // case.preset.block_size * case.preset.block_size)
    ends = [contexts.ends[slot] if slot >= 0 else 0 for slot in slots]
    rows = contexts.stage(SqueezeStep(slots, ends, [contexts.budget_of(slot) if slot >= 0 else 0 for slot in slots],
                                      []), case.sl)
    retrieval_table = case.block_table[:, ::case.heads.stride].contiguous()
    window_table = torch.zeros_like(retrieval_table)
    window_pages(retrieval_table, rows.context_ends, case.preset.block_size, window_table)
    out = case.poisoned_output()
    fresh, fresh_stream = case.fresh_caches()  # the layer writes the step's K/V itself
    squeezed = functools.partial(contexts.decode, 0, case.query, fresh, case.heads, case.qsl, case.sl,
                                 case.block_table, case.scale, out, rows, case.quant)
    options = dict(retrieval_table=window_table, retrieval_seq_lens=rows.flash_seq_lens, squeezed=squeezed)
    duo_attention_gpu(case.query, case.key, case.value, fresh, case.heads, case.qsl, case.sl, case.block_table,
                      case.scale, out, max(new for _, new in case.preset.requests), max(case.seq_lens),
                      stream_cache=fresh_stream, quant=case.quant,
                      **(options if squeeze else dict(retrieval_table=retrieval_table)))
    return out, rows, contexts, (fresh, fresh_stream)


@pytest.mark.parametrize("window", [WINDOW_KEYS, 2])
def test_the_served_layer_with_flash_attention_reads_the_squeeze_in_its_row_pass(window, monkeypatch):
    """`served_flash_layer`: the squeezed rows get the sparse decode's result over the same selection, their windows
    read by the row pass (`row_pages.WINDOW_KEYS`), or past their newest 2 keys partly by the window pass; the row
    that reads no context gets duo's retrieval decode."""
    from test_sparse_kernels import stand_in_flash

    from vllm_duo import vllm_seam

    monkeypatch.setattr(vllm_seam, "flash_attn_varlen", lambda device=None: stand_in_flash)
    case = make_case(CASE, dtype=torch.bfloat16)  # a dtype FlashAttention takes
    slots = [0, -1, -1, 3, 4]  # request 2 reads no context, nor request 1 (its 5 tokens fill no block past the sinks)
    out, rows, contexts, caches = served_flash_layer(case, slots, window)
    ids = torch.tensor(slots, dtype=torch.int32)
    selected, counts = select(contexts, case.query, case.heads, case.qsl, ids, rows.budget, case.scale,
                              contexts.settings.max_selected())
    full, written = case.reference()  # duo's step by the PyTorch reference
    sparse = sparse_reference(case, written[0], selected, counts, rows.context_ends.tolist())
    assert_caches_equal(caches, written)  # the layer wrote the step's K/V
    q = case.heads.retrieval_q
    read = [i for i, slot in enumerate(slots) if slot >= 0]
    plain = [i for i, slot in enumerate(slots) if slot < 0]
    assert (rows.flash_seq_lens[read] > 0).all() == (window == 2) and len(read) == 3
    bf16 = dict(rtol=2e-2, atol=4e-3)  # where two passes merge, the window pass's output was rounded to bf16 first
    torch.testing.assert_close(out[read][:, q], sparse[read][:, q], **bf16)
    torch.testing.assert_close(out[plain][:, q], full[plain][:, q], **bf16)
    assert not torch.allclose(out[read][:, q], full[read][:, q], **bf16)


def test_a_mixed_batch_with_the_squeeze_leaves_its_prefills_as_without(monkeypatch):
    """A batch of prefill chunks beside squeezed decode rows (`served_flash_layer`): the chunks' outputs are the
    layer's without the squeeze, bit for bit (the squeeze reads no prefill), and so is the decode row without one."""
    from test_sparse_kernels import FLASH_PASSES, stand_in_flash

    from vllm_duo import vllm_seam

    monkeypatch.setattr(vllm_seam, "flash_attn_varlen", lambda device=None: stand_in_flash)
    case = make_case(FLASH_PASSES["mixed"], dtype=torch.bfloat16)  # chunks of 30, 17 and 45 beside 3 decode rows
    slots = [-1, 1, -1, 3, -1, -1]
    squeezed, rows, _, _ = served_flash_layer(case, slots, WINDOW_KEYS)
    plain, _, _, _ = served_flash_layer(case, slots, WINDOW_KEYS, squeeze=False)
    assert rows.step.squeezed
    starts = case.qsl.tolist()
    unsqueezed = [t for i, slot in enumerate(slots) if slot < 0 for t in range(starts[i], starts[i + 1])]
    assert torch.equal(squeezed[unsqueezed], plain[unsqueezed])
    read = [starts[i] for i, slot in enumerate(slots) if slot >= 0]
    assert not torch.allclose(squeezed[read][:, case.heads.retrieval_q], plain[read][:, case.heads.retrieval_q])


def test_tokens_generated_past_the_window_are_read():
    """A context clustered 40 tokens before the current one (more than the 16-token window): with every clustered
    key selected and the window starting at the prompt's end, the sparse decode is still duo's decode."""
    case = make_case(Preset(8, 4, (0, 3), ((300, 1), (120, 1)), sink=4, recent=16))
    cache, stream = written_caches(case)
    contexts = ClusteredContexts([2], 64, 4, settings_for(case, budget=1.0))
    for i, seq_len in enumerate(case.seq_lens):
        contexts.build(0, i, cache, case.heads, case.block_table[i], seq_len - 41)
    slots = [0, 1]
    selected, counts = select(contexts, case.query, case.heads, case.qsl, torch.tensor(slots, dtype=torch.int32),
                                       contexts.budget_keys(slots), case.scale, contexts.settings.max_context_len)
    full = duo_decode(case, cache, stream)
    out = run_sparse(case, cache, selected, counts, context_ends=contexts.context_ends(slots).tolist())
    assert_retrieval_rows(out, full, case)
    assert not torch.allclose(run_sparse(case, cache, selected, counts)[:, case.heads.retrieval_q],
                              full[:, case.heads.retrieval_q])  # without the context ends those tokens are lost


def test_a_small_budget_reads_fewer_keys_and_stays_close():
    """A long context at budget 1/4: each retrieval head reads about a quarter of the clustered keys, and its
    output stays nearer duo's than attending the sinks and window alone (the clusters carry the mass)."""
    case = make_case(Preset(8, 4, (0, 3), ((600, 1), (400, 1)), sink=4, recent=16))
    cache, stream = written_caches(case)
    contexts = built(case, cache, settings_for(case, budget=0.25))
    ids = torch.tensor([0, 1], dtype=torch.int32)
    keys = contexts.budget_keys([0, 1])
    selected, counts = select(contexts, case.query, case.heads, case.qsl, ids, keys, case.scale,
                                       contexts.settings.max_context_len)
    clustered = torch.tensor([contexts.clustered(0), contexts.clustered(1)])[:, None]
    assert (counts >= keys[:, None]).all() and (counts < 0.25 * clustered + 64).all()
    full = duo_decode(case, cache, stream)
    squeezed = run_sparse(case, cache, selected, counts)
    window_only = run_sparse(case, cache, selected, torch.zeros_like(counts))
    q = case.heads.retrieval_q
    assert (squeezed[:, q] - full[:, q]).norm() < (window_only[:, q] - full[:, q]).norm()


def test_settings_memory_and_window():
    with pytest.raises(ValueError, match="budget"):
        SqueezeSettings(budget=0)
    with pytest.raises(ValueError, match="keys_per_cluster"):
        SqueezeSettings(keys_per_cluster=0)
    with pytest.raises(ValueError, match="radius_weight"):
        SqueezeSettings(radius_weight=-0.5)
    settings = SqueezeSettings(max_contexts=2, max_context_len=1000, keys_per_cluster=16)
    for dtype in (torch.bfloat16, FP8_CENTROIDS):
        contexts = ClusteredContexts(TWO_LAYERS, 64, 4, settings, centroid_dtype=dtype)
        kinds = (contexts.centroids, contexts.sizes, contexts.radii, contexts.offsets, contexts.positions,
                 contexts.centroid_scales)
        allocated = sum(t.nbytes for kind in kinds if kind is not None for t in kind)
        assert ClusteredContexts.bytes_needed(TWO_LAYERS, 64, settings, dtype) == allocated
    case = make_case(CASE)
    cache, _ = written_caches(case)
    with pytest.raises(ValueError, match="squeezed context holds"):
        contexts.build(0, 0, cache, case.heads, case.block_table[1], 4)  # nothing past the sinks
    contexts.build(0, 0, cache, case.heads, case.block_table[0], 36)
    assert contexts.context_ends([0, 0]).tolist() == [36, 36]
    contexts.free(0)
    assert contexts.clustered(0) == 0


def prompts_of(**lengths) -> dict:
    """A distinct prompt of each length, by request id."""
    return {req: [k + len(lengths) * i for i in range(n)] for k, (req, n) in enumerate(lengths.items())}


def test_plan_gives_slots_where_prefills_end_and_frees_them():
    """Serving's bookkeeping (`ClusteredContexts.plan`): a long enough prompt takes a free slot in the step its prefill
    ends (a prefix hit's last token too) and clusters it but its last `tail` tokens; its single-token rows read the
    slot once built; short prompts and prompts finding no slot are left to duo; a request gone from the worker leaves
    its slot idle, for the next context that needs one."""
    settings = SqueezeSettings(max_contexts=2, min_context_len=100, max_context_len=1000, keys_per_cluster=16,
                               budget=0.5, tail=20)
    contexts = ClusteredContexts(TWO_LAYERS, 64, 4, settings, max_rows=4)
    live = {"a", "b", "c", "short", "long"}
    prompts = prompts_of(a=200, b=300, c=400, short=50, long=2000)
    # a: prefill [0, 96) of 200; b: prefill ends (last chunk); short: a 50-token prompt ends; long: past the slots
    step = contexts.plan(["a", "b", "short", "long"], [200, 300, 50, 2000], [0, 250, 0, 0], [96, 50, 50, 96], live,
                         prompts.get)
    assert step.builds == [(1, 0, 280)] and step.context_ids == [-1] * 4 and not step.squeezed
    assert contexts.tokens[0] == prompts["b"][:280]
    contexts.ends[0] = 280  # what the layers' builds set
    # a ends its prefill (slot 1); b decodes from its slot; c (a prefix hit: only its last prompt token) finds none
    step = contexts.plan(["a", "b", "c"], [200, 300, 400], [96, 300, 399], [104, 1, 1], live, prompts.get)
    assert step.builds == [(0, 1, 180)]
    assert step.context_ids == [-1, 0, -1] and step.context_ends == [0, 280, 0]
    assert step.budget == [0, math.ceil(0.5 * (280 - 4)), 0]
    staged = contexts.stage(step, torch.tensor([200, 301, 400], dtype=torch.int32))  # the kernels' rows
    assert staged.context_ids.tolist() == [-1, 0, -1] and staged.context_ends.tolist() == [0, 280, 0]
    # FlashAttention's window pass: none of b's keys (its 21 after the context are its row pass's), a's and c's all
    assert staged.budget.tolist() == step.budget and staged.flash_seq_lens.tolist() == [200, 0, 400]
    # a's first decode step: its slot is not built yet (no layer ran), so it reads none; then b is gone
    step = contexts.plan(["a"], [200], [200], [1], live - {"b"}, prompts.get)
    assert step.context_ids == [-1] and contexts.readers == [set(), {"a"}] and contexts.clustered(0) == 276
    contexts.ends[1] = 180
    assert contexts.plan(["a"], [200], [201], [1], live, prompts.get).context_ids == [1]
    # a preempted request recomputing its prompt reads nothing until its prefill is past the prompt again
    assert contexts.plan(["a"], [200], [0], [1], live, prompts.get).context_ids == [-1]
    # c's prefill ends again: b's idle slot goes to it
    step = contexts.plan(["c"], [400], [0], [400], live, prompts.get)
    assert step.builds == [(0, 0, 380)] and contexts.ends[0] == 0 and contexts.built == 3


def test_plan_shares_a_context_between_prompts_that_start_with_it():
    """A document asked two questions is clustered once: the second prompt (its own question longer) reads the first
    one's slot; a prompt that adds a long enough part to it, or differs inside it, gets a slot of its own; with every
    slot read by a live request a new context finds none, and the least recently read idle slot goes first."""
    settings = SqueezeSettings(max_contexts=2, min_context_len=100, max_context_len=1000, keys_per_cluster=16,
                               tail=30)
    contexts = ClusteredContexts(TWO_LAYERS, 64, 4, settings, max_rows=4)
    document = list(range(1000, 1500))
    prompts = {"q1": document + [1] * 10, "q2": document + [2] * 40, "more": document + list(range(200)),
               "other": document[:100] + [7] + document[101:] + [1] * 10, "late": list(range(5000, 5300))}
    live = set(prompts)
    step = contexts.plan(["q1"], [510], [0], [510], live, prompts.get)
    assert step.builds == [(0, 0, 480)]
    contexts.ends[0] = 480
    step = contexts.plan(["q1", "q2", "more"], [510, 540, 700], [510, 0, 0], [1, 540, 700], live, prompts.get)
    assert step.builds == [(2, 1, 670)] and contexts.slot_of == {"q1": 0, "q2": 0, "more": 1}
    assert step.context_ids == [0, -1, -1] and contexts.shared == 1
    contexts.ends[1] = 670
    step = contexts.plan(["q2", "more"], [540, 700], [540, 700], [1, 1], live, prompts.get)
    assert step.context_ids == [0, 1] and step.context_ends == [480, 670]
    # every slot read: a prompt that differs inside the document's context finds none (not q1's)
    step = contexts.plan(["other"], [510], [0], [510], live, prompts.get)
    assert step.builds == [] and "other" not in contexts.slot_of
    # q1, q2 gone (slot 0 idle, read at step 3), more gone later (slot 1 idle, read at step 4): slot 0 goes first
    contexts.plan(["more"], [700], [701], [1], live - {"q1", "q2"}, prompts.get)
    step = contexts.plan(["late"], [300], [0], [300], live - {"q1", "q2", "more"}, prompts.get)
    assert step.builds == [(0, 0, 270)] and contexts.tokens[1] == prompts["more"][:670]
