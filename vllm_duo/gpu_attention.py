# SPDX-License-Identifier: Apache-2.0
"""Duo attention on a GPU as served: FlashAttention-3 on the retrieval heads where it beats our Triton kernels,
the Triton kernels (kernels/) for the rest.

FlashAttention-3 (Hopper, vLLM's build) takes the retrieval heads of every prefill, and of decode over fp8 pages,
which it reads at about twice our decode kernel's rate (kernels_bench.py --fp8). Triton keeps the Λ-masked
streaming heads, and bf16 decode whole: FlashAttention on the retrieval heads, then the streaming heads, measured
35 us per layer at 4 x 1k, the one Triton launch about 32 (benchmarks/results/2026-11-25-h100-host). Where
FlashAttention decodes the retrieval heads, the streaming heads' Triton decode runs beside it on a second stream.
Where the squeeze is on, FlashAttention also reads the keys it selects and the window's newest, as pages of one cache
row, merged with its window pass over the rest of the window (`selected_rows_attention`), which runs beside the
lookup.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from vllm_duo import vllm_seam
from vllm_duo.kernels.attention import triton_attention, write_step
from vllm_duo.kernels.cache_write import as_scale, scale_tensors, write_kv
from vllm_duo.kernels.decode import _sm_count
from vllm_duo.kernels.queries import retrieval_queries
from vllm_duo.kernels.reference import KVQuant, LayerHeads
from vllm_duo.kernels.row_pages import merge_rows, row_views


def duo_attention_gpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                      heads: LayerHeads, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      block_table: torch.Tensor, scale: float, output: torch.Tensor, max_query_len: int,
                      max_seq_len: int, max_num_splits: int | None = None, stream_cache: torch.Tensor | None = None,
                      quant: KVQuant | None = None, retrieval_table: torch.Tensor | None = None,
                      flash_schedules: dict[int, torch.Tensor] | None = None,
                      retrieval_seq_lens: torch.Tensor | None = None,
                      squeezed: Callable[[Callable | None], None] | None = None, flash_allowed: bool = True,
                      store_in_streaming: bool = True, checked: bool = False,
                      flash_pages: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """`kernels.attention.duo_attention_triton`'s arguments and result, with the retrieval heads by FlashAttention-3
    where it is faster (where it is not available, the Triton kernels do all).

    Args (beyond duo_attention_triton's):
        quant: on an e4m3 cache FlashAttention-3 quantizes the retrieval heads' queries by `q_scale`, as vLLM's
            dense FLASH_ATTN backend does; the Triton kernels keep queries in the model's dtype.
        retrieval_table: `block_table[:, ::heads.stride]` contiguous, for FlashAttention (made here if None;
            the backend makes it once per step for all layers, in a buffer CUDA graphs can replay).
        flash_schedules: the step's FlashAttention-3 tile schedules by retrieval-head count, shared by its layers
            (`retrieval_flash_attention`); multi-token batches only, which run outside CUDA graphs.
        retrieval_seq_lens: where the squeeze is on, the keys FlashAttention reads of each row's retrieval heads
            from `retrieval_table`'s first page (at squeezed rows the window after the context but its newest keys,
            whose pages the table lists from there on: `SqueezeRows.flash_seq_lens`, `squeeze.window_pages`);
            FlashAttention then takes the retrieval heads of decode too.
        squeezed: the squeeze's lookup and attention over the selected keys (`ClusteredContexts.decode`), given
            how to attend them (`selected_rows_attention`, merging with FlashAttention's window pass, or None: the
            Triton sparse decode). At decode the window pass and then the streaming heads run beside the lookup on
            a second stream (`squeezed_decode`); a batch with prefills runs the window pass first.
        flash_allowed: False leaves FlashAttention out (`VLLM_DUO_ATTENTION=triton`).
        store_in_streaming: in a multi-token step beside FlashAttention over 16-bit caches, the streaming heads'
            launch stores the step's K/V (one launch fewer a layer); False stores it by `write_kv` first
            (kernels_bench.py).
        checked: the caller has checked these inputs as `write_step` does (the backend: a layer's caches and token
            layout at its first call, the batch once a step), which costs host time every layer of an eager step.
        flash_pages: `retrieval_page_views(cache, heads)`, made once by the caller (the backend: per layer), else here.
    """
    cache, stream_cache, max_num_splits = write_step(query, key, value, cache, heads, query_start_loc, seq_lens,
                                                     block_table, output, max_seq_len, max_num_splits, stream_cache,
                                                     quant, write=False, checked=checked)
    write = functools.partial(write_kv, key, value, cache, heads, query_start_loc, seq_lens, block_table,
                              stream_cache, quant, checked=True)
    flash = (vllm_seam.flash_attn_varlen(cache.device)
             if flash_allowed and (query.dtype, cache.dtype) in FLASH_DTYPES else None)
    by_flash = flash is not None and (max_query_len > 1 or cache.dtype == torch.float8_e4m3fn
                                      or retrieval_seq_lens is not None)
    two_streams = max_query_len == 1 and cache.is_cuda  # a decode step's passes side by side; elsewhere in turn
    squeezed_step = squeezed is not None and two_streams and by_flash and heads.num_retrieval
    # a multi-token step beside FlashAttention stores its K/V in the streaming heads' launch (16-bit caches)
    store = (store_in_streaming and by_flash and max_query_len > 1 and squeezed is None
             and key.dtype == cache.dtype == stream_cache.dtype)
    flash_reads_retrieval = by_flash and heads.num_retrieval
    # a decode step's streaming heads beside FlashAttention
    beside_flash = two_streams and flash_reads_retrieval and heads.num_streaming and squeezed is None
    # the step's K/V stored first, over fp8 in the launch that quantizes FlashAttention's queries (flash_queries);
    # else beside the lookup (squeezed_decode) or by the streaming heads' launch
    queries = None
    if flash_reads_retrieval and not (squeezed_step or store):
        queries = flash_queries(query, heads, cache, quant, write)
    elif not (squeezed_step or store):
        write()
    streaming = functools.partial(triton_attention, query, cache, heads, query_start_loc, seq_lens, block_table,
                                  scale, output, max_query_len, max_num_splits, stream_cache, quant,
                                  streaming_only=by_flash, fresh_kv=(key, value), store=store)
    if not flash_reads_retrieval:
        streaming()
        if squeezed is not None:
            squeezed(None)
        return
    if retrieval_table is None:
        retrieval_table = block_table[:, ::heads.stride].contiguous()
    flash_part = functools.partial(
        retrieval_flash_attention, flash, query, cache, heads, query_start_loc,
        seq_lens if retrieval_seq_lens is None else retrieval_seq_lens, retrieval_table, scale,
        output, max_query_len, max_seq_len, quant,
        num_splits=min(max_num_splits, FLASH_MAX_SPLITS) if max_query_len == 1 else 0,
        schedules=flash_schedules if max_query_len > 1 else None, pages=flash_pages, queries=queries)
    rows_part = functools.partial(selected_rows_attention, flash, cache=cache, heads=heads,
                                  query_start_loc=query_start_loc, scale=scale, output=output, quant=quant)
    if squeezed_step:
        squeezed_decode(functools.partial(flash_queries, query, heads, cache, quant, write), flash_part, rows_part,
                        streaming if heads.num_streaming else None, squeezed, query.device)
    elif beside_flash:
        beside(streaming, flash_part, query.device)
    elif store:  # FlashAttention reads the retrieval pages once the streaming heads' launch stored them
        streaming()
        flash_part()
    else:
        window = flash_part(with_lse=squeezed is not None)
        if squeezed is not None:
            squeezed(functools.partial(rows_part, window[0], lambda: window[1]))
        streaming()


def squeezed_decode(store_and_make_queries: Callable[[], torch.Tensor], window_part, rows_part,
                    streaming: Callable[[], None] | None, squeezed: Callable[[Callable], None],
                    device: torch.device) -> None:
    """The squeeze's decode step on two streams. On the current one the lookup, then FlashAttention's row pass over
    the sinks, the selected keys and the window's newest (this step's among them), then the merge; beside it the
    step's K/V store and the retrieval queries as FlashAttention takes them (`store_and_make_queries`: one launch
    over fp8), the window pass over the rest of the window (in most steps no key: a few launches) and the streaming
    heads, in launches that leave most SMs idle, as the lookup's do.

        current: logits, scores, bands, ends, row pages | wait queries and K/V | row pass | wait window | merge
        beside:  K/V store and queries | window pass | streaming heads
    """
    main, side = torch.cuda.current_stream(device), side_stream(device)
    made = {}
    stored, window_done = torch.cuda.Event(), torch.cuda.Event()

    def beside_lookup() -> None:
        made["queries"] = store_and_make_queries()
        stored.record(side)
        made["window_lse"] = window_part(with_lse=True, queries=made["queries"])[1]
        window_done.record(side)
        if streaming is not None:
            streaming()

    def joined() -> torch.Tensor:
        main.wait_event(window_done)
        return made["window_lse"]

    def attend(*selection: torch.Tensor) -> None:
        main.wait_event(stored)
        rows_part(made["queries"], joined, *selection)

    beside(beside_lookup, lambda: squeezed(attend), device)


def beside(side_work, main_work, device: torch.device) -> None:
    """`side_work` on a second stream while `main_work` runs on the current one; both start after everything queued
    so far and finish before anything queued after.

    Decode over a long context is FlashAttention streaming the retrieval heads' pages; the streaming heads' few
    hundred keys per head are a chain of short dependent tiles that leave most SMs idle, so beside it they cost less
    than after it (the 32-layer step at 4 x 64k fp8: 4.22 against 4.55 ms; they still stretch it by about their own
    time, waiting for the SMs its CTAs hold: benchmarks/results/2026-12-07-h100-decode-variants). Inside a CUDA graph
    capture the second stream joins the capture as a parallel branch (its allocations come from the graph's pool,
    as the capture stream's do)."""
    main, side = torch.cuda.current_stream(device), side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        side_work()
    main_work()
    main.wait_stream(side)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """`beside`'s second stream on `device`, made on first use."""
    side = _SIDE_STREAMS.get(device.index)
    if side is None:
        side = _SIDE_STREAMS[device.index] = torch.cuda.Stream(device)
    return side


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # by device index


# (query, cache) dtypes FlashAttention-3 takes: 16-bit, or fp8 e4m3 KV with queries quantized to it;
# float32 models and e5m2 caches keep the Triton prefill.
FLASH_DTYPES = {(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                (torch.float16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn)}
# Decode passes FlashAttention a fixed number of KV splits (ours, capped as vLLM's FLASH_ATTN caps its own for CUDA
# graphs): its own choice per call would size buffers at capture time that a replay cannot change.
FLASH_MAX_SPLITS = 32


def retrieval_flash_attention(flash, query: torch.Tensor, cache: torch.Tensor, heads: LayerHeads,
                              query_start_loc: torch.Tensor, seq_lens: torch.Tensor, retrieval_table: torch.Tensor,
                              scale: float, output: torch.Tensor, max_query_len: int, max_seq_len: int,
                              quant: KVQuant | None = None, num_splits: int = 0,
                              schedules: dict[int, torch.Tensor] | None = None, with_lse: bool = False,
                              queries: torch.Tensor | None = None,
                              pages: tuple[torch.Tensor, torch.Tensor] | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Causal attention of the retrieval heads over their paged rows, by FlashAttention on strided views.

    `cache[:, 0, :, :R]` is a `[num_blocks, block_size, R, head_dim]` paged K (V likewise) and
    `retrieval_table` lists each request's retrieval pages in token order. The retrieval heads' queries
    and outputs are slices where the weights put them first (reorder.py; FlashAttention writes its
    slice of `output` in place), else gathered and scattered back. On an fp8 cache the queries are
    quantized by the layer's q scale (one launch, queries.py) and FlashAttention descales q, k and v,
    as vLLM's dense FLASH_ATTN backend does. `num_splits` 0 lets FlashAttention choose its KV splits.

    Without a schedule, each call allocates one and launches a kernel to compute it before attending;
    vLLM's FLASH_ATTN computes it once per step for all layers. `schedules` does the same for the
    layers of one retrieval-head count: the first computes it with this call's own arguments, the
    others of the step reuse it (a schedule fits only the head counts, dtype and batch it was made for).

    `with_lse`: returns the queries as FlashAttention took them, `[num_tokens, R * G, head_dim]`, and the
    log-sum-exp `[R * G, num_tokens]` of each retrieval query head, for a pass that merges with this one.
    `queries`: those queries made beforehand (`flash_queries`); `pages`: `retrieval_page_views(cache, heads)`, likewise.
    """
    R = heads.num_retrieval
    options = {}  # the fp8 descales, the step's schedule
    q = flash_queries(query, heads, cache, quant) if queries is None else queries
    if cache.dtype == torch.float8_e4m3fn:
        options = fp8_descales(quant, cache, (seq_lens.shape[0], R))
    if schedules is not None:
        if R not in schedules:
            schedules[R] = vllm_seam.flash_scheduler()(
                batch_size=seq_lens.shape[0], max_seqlen_q=max_query_len, max_seqlen_k=max_seq_len,
                num_heads_q=R * heads.group_size, num_heads_kv=R, headdim=cache.shape[-1], cache_seqlens=seq_lens,
                qkv_dtype=cache.dtype, cu_seqlens_q=query_start_loc, page_size=cache.shape[2], causal=True,
                num_splits=num_splits)
        options["scheduler_metadata"] = schedules[R]
    # FlashAttention-3 returns its fp8 path's output in bf16: a bf16 model's output slice takes it in place
    out_dtype = torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype
    into = output[:, :R * heads.group_size] if heads.retrieval_first and out_dtype == output.dtype else None
    k_pages, v_pages = retrieval_page_views(cache, heads) if pages is None else pages
    out = flash(q=q, k=k_pages, v=v_pages,
                cu_seqlens_q=query_start_loc, max_seqlen_q=max_query_len, seqused_k=seq_lens,
                max_seqlen_k=max_seq_len, softmax_scale=scale, causal=True,
                block_table=retrieval_table, num_splits=num_splits, out=into, return_softmax_lse=with_lse,
                **options)
    out, lse = out if with_lse else (out, None)
    if into is None and heads.retrieval_first:
        output[:, :R * heads.group_size].copy_(out)
    elif into is None:
        output[:, heads.retrieval_q] = out.to(output.dtype)
    return (q, lse) if with_lse else None


def retrieval_page_views(cache: torch.Tensor, heads: LayerHeads) -> tuple[torch.Tensor, torch.Tensor]:
    """The retrieval heads' K and V pages as FlashAttention reads them, `[num_blocks, block_size, R, head_dim]` views
    of the cache (two view ops, a few microseconds of host time: the backend makes them once per layer)."""
    R = heads.num_retrieval
    return cache[:, 0, :, :R], cache[:, 1, :, :R]


def flash_queries(query: torch.Tensor, heads: LayerHeads, cache: torch.Tensor, quant: KVQuant | None = None,
                  write: Callable[..., None] | None = None) -> torch.Tensor:
    """The retrieval heads' queries `[num_tokens, R * G, head_dim]` as FlashAttention takes them: over an fp8 cache
    quantized by the layer's q scale (one launch), else as they are (a view where the weights put them first).
    `write`: the step's `write_kv`, run too; over an fp8 cache its launch is the one that quantizes."""
    if cache.dtype == torch.float8_e4m3fn:
        return retrieval_queries(query, heads, cache.dtype, flash_q_scale(quant, cache), write)
    return retrieval_queries(query, heads, write=write)


def selected_rows_attention(flash, queries: torch.Tensor, window_lse: Callable[[], torch.Tensor],
                            pages: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor,
                            context_ends: torch.Tensor, window_lens: torch.Tensor, *, cache: torch.Tensor,
                            heads: LayerHeads, query_start_loc: torch.Tensor, scale: float, output: torch.Tensor,
                            quant: KVQuant | None) -> None:
    """The squeeze's row pass: FlashAttention over pages of one cache row listing each squeezed row's sinks,
    selected keys and window's newest keys per retrieval head (`row_pages.run_pages`' lists), merged into `output`
    with the window pass that `retrieval_flash_attention(..., with_lse=True)` wrote there over `window_lens` keys
    (its `queries`, and `window_lse()` its log-sum-exp once the merge may read it: where the window pass runs on
    another stream, the call joins it); where that pass read none, the row pass's output alone.

    One batch entry per (request, retrieval KV head), its G query heads at the request's last token; rows without a
    context have empty lists and are not merged. Fixed shapes, no host syncs: CUDA-graph capturable."""
    R, G, num_reqs = heads.num_retrieval, heads.group_size, context_ends.shape[0]
    if queries.shape[0] != num_reqs:  # a mixed batch: each request's last token
        queries = queries[query_start_loc[1:] - 1]
    options = {}
    if cache.dtype == torch.float8_e4m3fn:
        options = fp8_descales(quant, cache, (num_reqs * R, 1))
    k_rows, v_rows = row_views(cache)
    out, lse = flash(q=queries.reshape(num_reqs * R, G, -1), k=k_rows, v=v_rows, cu_seqlens_q=starts,
                     max_seqlen_q=1, seqused_k=lens, max_seqlen_k=pages.shape[1], softmax_scale=scale, causal=False,
                     block_table=pages, num_splits=row_splits(num_reqs * R, cache.device), return_softmax_lse=True,
                     **options)
    merge_rows(output, window_lse(), out, lse, heads, query_start_loc, context_ends, window_lens)


def row_splits(entries: int, device: torch.device) -> int:
    """FlashAttention's KV splits for the row pass: about 4 programs per SM over all entries, at most
    FLASH_MAX_SPLITS (at 16 entries of 8k keys on an H100, 32 splits read at 0.91 ms a step, its own choice 1.04);
    1 off CUDA (the tests' stand-in)."""
    if device.type != "cuda":
        return 1
    return max(1, min(FLASH_MAX_SPLITS, -(-4 * _sm_count(device.index) // max(entries, 1))))


def flash_q_scale(quant: KVQuant | None, cache: torch.Tensor) -> torch.Tensor:
    """The layer's q scale as a float32 tensor on the cache's device: what `flash_queries` quantizes by over an fp8
    cache, and FlashAttention descales them by."""
    return as_scale((quant or KVQuant()).q_scale, cache.device)


def fp8_descales(quant: KVQuant | None, cache: torch.Tensor, shape: tuple[int, int]) -> dict:
    """FlashAttention-3's descales over an fp8 cache, `shape` (batch entries, KV heads): the queries'
    (`flash_q_scale`), the layer's k and v scales."""
    k_scale, v_scale = scale_tensors(quant, cache)
    return dict(q_descale=flash_q_scale(quant, cache).expand(shape), k_descale=k_scale.expand(shape),
                v_descale=v_scale.expand(shape))
