# SPDX-License-Identifier: Apache-2.0
"""The warm-up's steps (vllm_duo/warmup.py) launch every Triton kernel variant that served steps launch.

Each launch is recorded as Triton keys its compiled kernels: the compile-time constants and launch options, each
tensor's dtype and 16-byte alignment, and each specialized int's class (1, a multiple of 16, other). Launches are
recorded, not run; FlashAttention-3 is a no-op stand-in (it compiles nothing at run time). Decode splits are chosen
as on an H200 (132 SMs)."""

import contextlib
import inspect

import pytest
import torch
from test_kernels import Preset, make_case

from vllm_duo import gpu_attention, vllm_seam
from vllm_duo.kernels import attention, cache_write, decode, prefill, queries
from vllm_duo.kernels.reference import KVQuant
from vllm_duo.warmup import WARM_UP_STEPS, WarmUpStep, decode_split_counts

KERNELS = {prefill: ["_prefill_kernel"], decode: ["_decode_kernel", "_merge_kernel"],
           cache_write: ["_write_kv_kernel"], queries: ["_quantize_kernel"]}
BLOCK_SIZE = 16
CPU = torch.device("cpu")
# served steps: decode batches (vLLM passes max_model_len as their max_seq_len), mixed and prefill steps, each with
# block tables as wide as max_model_len needs
DECODE_ROWS = (1, 2, 3, 5, 16, 33, 100, 256, 512)
MAX_MODEL_LENS = (4096, 99000, 131072, 1_000_000)
MIXED = ([(0, 1024)], [(0, 1024)] * 8, [(1000, 1)] * 31 + [(0, 256)], [(16000, 1)] * 15 + [(16384, 384)],
         [(0, 7)], [(0, 2), (5, 1)], [(300, 17)] * 3, [(0, 4096), (0, 4096)], [(40, 1), (0, 8191)])
# layer shapes: Llama-3.1-8B's and SmolLM2's heads, retrieval heads first (weights reordered) or in place
LAYERS = {"retrieval first": Preset(32, 8, (0, 1, 2, 3), ((0, 1),), head_dim=128),
          "one retrieval head": Preset(9, 3, (0,), ((0, 1),)),
          "heads in place": Preset(32, 8, (1, 4, 6), ((0, 1),), head_dim=128),
          "no retrieval head": Preset(9, 3, (), ((0, 1),)),
          "all retrieval": Preset(9, 3, (0, 1, 2), ((0, 1),))}


def specialization(value, name: str, unspecialized: set) -> object:
    if isinstance(value, torch.Tensor):
        return str(value.dtype), value.data_ptr() % 16 == 0
    if isinstance(value, bool) or not isinstance(value, int):
        return type(value).__name__
    if name in unspecialized:
        return None
    return "1" if value == 1 else "16k" if value % 16 == 0 else "other"


class Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` records the launch's compile key."""

    def __init__(self, name: str, kernel, keys: set):
        self.name, self.keys = name, keys
        self.params = inspect.signature(kernel.fn).parameters
        options = getattr(kernel, "kwargs", None) or {}  # the CPU interpreter's kernels keep them there
        self.unspecialized = set(getattr(kernel, "do_not_specialize", None) or options.get("do_not_specialize")
                                 or [])

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            bound = dict(zip(self.params, args))
            bound.update({k: v for k, v in kwargs.items() if k in self.params})
            options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.params))
            self.keys.add((self.name, options, tuple(
                (name, value if "constexpr" in str(self.params[name].annotation)
                 else specialization(value, name, self.unspecialized)) for name, value in bound.items())))
        return launch


@contextlib.contextmanager
def recording(keys: set):
    """Duo's kernels replaced by Recorders that add their launches' keys to `keys`."""
    with pytest.MonkeyPatch.context() as patch:
        for module, names in KERNELS.items():
            for name in names:
                patch.setattr(module, name, Recorder(name, getattr(module, name), keys))
        yield


def no_flash(q, k, v, *args, out=None, return_softmax_lse=False, **kwargs):
    out = torch.zeros(q.shape, dtype=torch.float32) if out is None else out
    lse = torch.zeros(q.shape[1], q.shape[0])
    return (out, lse) if return_softmax_lse else out


def served_steps(p: Preset, stride: int, dtype) -> list[dict]:
    steps = []
    for max_model_len in MAX_MODEL_LENS:
        batches = [([(37, 1)] * rows, True) for rows in DECODE_ROWS] + [(requests, False) for requests in MIXED]
        for requests, decode_only in batches:
            if max(c + n for c, n in requests) > max_model_len:
                continue
            inputs = WarmUpStep(tuple(requests)).inputs(p.num_heads, p.num_kv_heads, p.head_dim, dtype, BLOCK_SIZE,
                                                        stride, CPU)
            inputs["block_table"] = torch.zeros(len(requests), -(-max_model_len // BLOCK_SIZE) * stride,
                                                dtype=torch.int32)
            if decode_only:
                inputs["max_seq_len"] = max_model_len
            steps.append(inputs)
    return steps


@pytest.mark.parametrize("path", ["flash", "triton", "flash fp8"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_the_warm_up_launches_every_variant_served_steps_launch(layer, path, monkeypatch):
    p, dtype, fp8 = LAYERS[layer], torch.bfloat16, path.endswith("fp8")
    case = make_case(p, dtype=dtype, kv_dtype=torch.float8_e4m3fn if fp8 else dtype)
    cache, stream = case.fresh_caches()
    quant = KVQuant(*(torch.tensor(x) for x in (0.5, 0.25, 1.0))) if fp8 else None
    monkeypatch.setattr(vllm_seam, "flash_attn_varlen", lambda device=None: no_flash)
    splits_on = decode.decode_num_splits
    monkeypatch.setattr(attention, "decode_num_splits",
                        lambda n, r, length, device: splits_on(n, r, length, torch.device("cuda", 0)))
    monkeypatch.setattr(decode, "_sm_count", lambda index: 132)

    def launched(steps) -> set:
        keys = set()
        with recording(keys):
            for step in steps:
                gpu_attention.duo_attention_gpu(step.pop("query"), step.pop("key"), step.pop("value"), cache,
                                                case.heads, scale=0.125, stream_cache=stream, quant=quant,
                                                flash_allowed=path.startswith("flash"), **step)
        return keys

    warmed = launched([step.inputs(p.num_heads, p.num_kv_heads, p.head_dim, dtype, BLOCK_SIZE, case.heads.stride,
                                   CPU) for step in WARM_UP_STEPS])
    served = launched(served_steps(p, case.heads.stride, dtype))
    kernels = {key[0] for key in served}
    assert "_write_kv_kernel" in kernels and ("_prefill_kernel" in kernels or p.num_kv_heads == len(p.retrieval))
    assert "_quantize_kernel" not in kernels  # over fp8, FlashAttention's queries come from the write's launch
    missing = served - warmed
    assert not missing, f"{len(missing)} served variants the warm-up does not launch, e.g. {sorted(missing)[0]}"


def test_the_warm_up_runs_through_each_served_layer(smollm2_dir, tmp_path):
    """`DuoAttentionImpl.warm_up` on an engine's bound layers and caches (the CPU stack's, with the Triton path as on
    a GPU without FlashAttention-3): every layer launches the K/V store, the prefill and each decode split count."""
    from engines import make_llm, random_pattern, release

    llm = make_llm(smollm2_dir, {"pattern": random_pattern(tmp_path / "p.json"), "sparsity": 0.5},
                   max_model_len=512)

    def warm_up_each_layer(model):
        from vllm_duo.backend import DuoAttentionImpl

        launched = []
        for layer in model.modules():
            if isinstance(getattr(layer, "impl", None), DuoAttentionImpl):
                keys = set()
                with recording(keys):
                    layer.impl.warm_up(layer)
                launched.append({(kernel, dict(args).get("MAX_SPLITS")) for kernel, _, args in keys})
        return launched

    (launched,) = llm.apply_model(warm_up_each_layer)
    release(llm)
    assert len(launched) == 30
    for keys in launched:
        assert {("_write_kv_kernel", None), ("_prefill_kernel", None)} <= keys
        assert {split for name, split in keys if name == "_decode_kernel"} == set(decode_split_counts())


@pytest.mark.parametrize("path", ["flash", "triton"])
def test_the_warm_up_steps_run_and_touch_only_block_0(path, monkeypatch):
    """The warm-up's steps through the real kernels (the CPU interpreter; a torch stand-in for FlashAttention-3):
    every output finite, and no block of the caches but block 0, vLLM's null block, written."""
    from test_sparse_kernels import stand_in_flash

    p = Preset(9, 3, (0,), ((0, 1),), stream_host=(2, 5))
    case = make_case(p)
    cache, stream = case.fresh_caches()
    cache[0], stream[0] = 0.0, 0.0
    before = cache.clone(), stream.clone()
    monkeypatch.setattr(vllm_seam, "flash_attn_varlen", lambda device=None: stand_in_flash)
    monkeypatch.setattr(gpu_attention, "FLASH_DTYPES", {(torch.float32, torch.float32)})
    for step in WARM_UP_STEPS:
        batch = step.inputs(p.num_heads, p.num_kv_heads, p.head_dim, torch.float32, BLOCK_SIZE, case.heads.stride,
                            CPU)
        gpu_attention.duo_attention_gpu(batch.pop("query"), batch.pop("key"), batch.pop("value"), cache, case.heads,
                                        scale=0.125, stream_cache=stream, flash_allowed=path == "flash", **batch)
        assert batch["output"].isfinite().all(), step
    for after, was in zip((cache, stream), before):
        assert torch.equal(after[1:], was[1:]) and not torch.equal(after[0], was[0])
