# SPDX-License-Identifier: Apache-2.0
"""vllm_seam: the supported vLLM range, each touch's check on the installed vLLM and on a changed shape, and the
4D cache view of vLLM 0.29+. Builds no engine."""

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_duo import vllm_seam
from vllm_duo.vllm_seam import SeamError


@pytest.mark.parametrize("text", ["0.26.0", "0.27.0", "0.27.0+cpu", "0.32.0+cpu", "0.33.0", "0.33.4", "0.33.1rc1"])
def test_supported_versions_pass(text):
    vllm_seam.check_version(text)


@pytest.mark.parametrize("text", ["0.25.2", "0.10.1", "0.34.0", "0.34.0.dev12+g1234", "1.0.0"])
def test_a_vllm_outside_the_range_stops_with_one_line_naming_it(text):
    with pytest.raises(SeamError) as error:
        vllm_seam.check_version(text)
    message = str(error.value)
    assert "\n" not in message and text in message and "0.26.0 to 0.33.x" in message


def test_register_stops_on_a_vllm_outside_the_range(monkeypatch):
    from vllm_duo import plugin

    monkeypatch.setattr(vllm_seam, "installed_version", lambda: "0.25.0")
    with pytest.raises(SeamError, match=r"supports vLLM 0\.26\.0 to 0\.33\.x.*this is vLLM 0\.25\.0"):
        plugin.register()


@pytest.mark.parametrize("version, first, last, inside", [
    ((0, 28, 3), None, "0.28", True), ((0, 29, 0), None, "0.28", False), ((0, 29, 0), "0.29.0", None, True),
    ((0, 31, 9), None, "0.31", True), ((0, 32, 0), "0.32.0", None, True), ((0, 31, 0), "0.32.0", None, False)])
def test_version_ranges(version, first, last, inside):
    assert vllm_seam.in_range(version, first, last) is inside


def test_every_touch_names_its_versions_and_holds_on_the_installed_vllm():
    import vllm.plugins

    vllm.plugins.load_general_plugins()  # installs the patches; a second install changes nothing
    vllm_seam.install()
    for touch in vllm_seam.TOUCHES:
        assert touch.versions().startswith("vLLM 0.")
        if touch.applies():
            assert touch.check() is None, touch.name


def test_patches_for_other_versions_are_not_applied():
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    widest = getattr(UniformTypeKVCacheSpecs.__dict__.get("max_num_blocks_per_req"), "_duo_widest", False)
    assert widest == vllm_seam.touch("widest_layer_block_table").applies()
    runner = vllm_seam._v2_runner()
    if runner is not None:
        widened = getattr(runner.initialize_kv_cache, "_duo_widened", False)
        assert widened == vllm_seam.touch("v2_block_table_rows").applies()


@pytest.mark.parametrize("touch_name", ["route_kv_cache_spec", "reorder_before_quant", "kv_cache_spec_registry",
                                        "block_pool", "prefix_cache_lookups", "bench_throughput_requests",
                                        "kernel_warmup"])
def test_a_changed_signature_stops_with_the_version_and_the_touch(monkeypatch, touch_name):
    """The check of each patched function fails on a signature duo does not expect, in one line."""
    if touch_name == "prefix_cache_lookups":
        from vllm.v1.core.kv_cache_manager import KVCacheManager as owner
        name, changed = "get_computed_blocks", lambda self, request, num_tokens: None
    elif touch_name == "bench_throughput_requests":
        from vllm.benchmarks import throughput as owner
        name, changed = "get_requests", lambda args: None
    elif touch_name == "route_kv_cache_spec":
        from vllm.model_executor.layers.attention.attention import Attention as owner
        name, changed = "get_kv_cache_spec", lambda self, vllm_config, layer_index: None
    elif touch_name == "reorder_before_quant":
        from vllm.model_executor.model_loader import base_loader as owner
        name, changed = "process_weights_after_loading", lambda model, load_config: None
    elif touch_name == "block_pool":
        from vllm.v1.core.block_pool import BlockPool as owner
        name, changed = "free_blocks", lambda self, blocks, group: None
    elif touch_name == "kernel_warmup":
        from vllm.v1.worker import gpu_worker as owner
        name, changed = "kernel_warmup", lambda worker, model_runner: None
    else:
        from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry as owner
        name, changed = "register", classmethod(lambda cls, spec_cls, manager: None)
    monkeypatch.setattr(owner, name, changed)
    with pytest.raises(SeamError) as error:
        vllm_seam.check(touch_name)
    message = str(error.value)
    assert "\n" not in message and touch_name in message and vllm_seam.installed_version() in message


def test_the_workers_kernel_warmup_runs_duos_after_vllms(monkeypatch):
    """kernel_warmup (applied at load): the GPU worker's warm-up runs vLLM's, then duo's over the worker's model."""
    from vllm.v1.worker import gpu_worker

    from vllm_duo import backend

    calls = []
    monkeypatch.setattr(gpu_worker, "kernel_warmup", lambda worker: calls.append(("vllm", worker)))
    monkeypatch.setattr(backend, "warm_up_duo_layers", lambda model: calls.append(("duo", model)))
    vllm_seam.warm_up_after_vllm()
    vllm_seam.warm_up_after_vllm()  # idempotent: one wrapper
    worker = type("Worker", (), {"get_model": lambda self: "the model"})()
    gpu_worker.kernel_warmup(worker)
    assert calls == [("vllm", worker), ("duo", "the model")]


def test_an_engine_core_out_of_reach_stops_the_tools_that_read_it(monkeypatch):
    from vllm.v1.engine.core_client import InprocClient

    def __init__(self, *args, **kwargs):
        self.core = None

    monkeypatch.setattr(InprocClient, "__init__", __init__)
    with pytest.raises(SeamError, match=r"inproc_engine_core .*InprocClient.__init__ no longer sets self.engine_core"):
        vllm_seam.inproc_engine_core(None)


def test_the_pretokenized_bench_sends_text_prompts_as_token_ids_once(monkeypatch):
    """`--pretokenized` wraps vLLM's sampler once: text prompts become the tokenizer's ids, token ids stay."""
    from vllm.benchmarks import throughput

    class Tokenizer:
        def encode(self, text):
            return [len(word) for word in text.split()]

    sampled = lambda args, tokenizer: [SimpleNamespace(prompt="a bb ccc"),  # noqa: E731
                                       SimpleNamespace(prompt={"prompt_token_ids": [5]})]
    monkeypatch.setattr(throughput, "get_requests", sampled)
    vllm_seam.pretokenize_bench_throughput()
    vllm_seam.pretokenize_bench_throughput()
    assert throughput.get_requests.__closure__[0].cell_contents is sampled  # wrapped once
    requests = throughput.get_requests(None, Tokenizer())
    assert [request.prompt for request in requests] == [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [5]}]


def test_an_override_that_misses_an_argument_vllm_passes_is_caught():
    class Base:
        def cache_blocks(self, request, num_tokens, retention_interval=None, *, replay_boundaries):
            pass

    class Old:
        def cache_blocks(self, request, num_tokens, retention_interval=None):
            pass

    class Extra:
        def cache_blocks(self, request, num_tokens, retention_interval=None, *, replay_boundaries=(), hint):
            pass

    class Fits:
        def cache_blocks(self, request, num_tokens, retention_interval=None, *, replay_boundaries=()):
            pass

    assert "replay_boundaries" in vllm_seam.override_problem(Old, Base, ["cache_blocks"])
    assert "hint" in vllm_seam.override_problem(Extra, Base, ["cache_blocks"])
    assert vllm_seam.override_problem(Fits, Base, ["cache_blocks"]) is None


def test_duo_overrides_take_what_the_installed_vllm_passes():
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    from vllm_duo.kv_cache import DuoKVCacheManager

    vllm_seam.check("backend_interface")
    vllm_seam.check("manager_interface")
    base = inspect.signature(SingleTypeKVCacheManager.cache_blocks).parameters
    assert ("replay_boundaries" in base) == (vllm_seam.vllm_version() >= (0, 30, 0))
    assert "replay_boundaries" in inspect.signature(DuoKVCacheManager.cache_blocks).parameters


def _layer_views(layout: str, blocks=3, heads=2, tokens=16, content=8, layers=2):
    """The 4D [B, H, N, C] view vLLM 0.29+ binds to layer 0 of a cache in `layout`, and its raw storage."""
    raw = torch.zeros(blocks * layers * heads * tokens * content)
    if layout == "LBNHC":
        view = raw.view(layers, blocks, tokens, heads, content)[0].transpose(1, 2)
        page_of = lambda b: raw.view(layers, blocks, -1)[0, b]  # noqa: E731
    elif layout == "LBHNC":
        view = raw.view(layers, blocks, heads, tokens, content)[0]
        page_of = lambda b: raw.view(layers, blocks, -1)[0, b]  # noqa: E731
    elif layout == "BLNHC":
        view = raw.view(blocks, layers, tokens, heads, content)[:, 0].transpose(1, 2)
        page_of = lambda b: raw.view(blocks, layers, -1)[b, 0]  # noqa: E731
    else:  # BLHNC
        view = raw.view(blocks, layers, heads, tokens, content)[:, 0]
        page_of = lambda b: raw.view(blocks, layers, -1)[b, 0]  # noqa: E731
    return raw, view, page_of


@pytest.mark.parametrize("layout", [name for name, _ in vllm_seam.PAGE_CONTIGUOUS_LAYOUTS])
def test_a_4d_view_is_read_as_duo_pages_in_place(layout):
    raw, view, page_of = _layer_views(layout)
    assert view.shape == (3, 2, 16, 8)
    pages = vllm_seam.as_duo_pages(view)
    assert pages.shape == (3, 2, 16, 2, 4)  # [blocks, K/V, tokens, heads, head_size]
    pages[1, 1, 5, 1] = 7.0  # V of token 5, head 1, in block 1
    page = page_of(1)
    expected = torch.zeros_like(page)
    expected.view(2, 16, 2, 4)[1, 5, 1] = 7.0
    assert torch.equal(page, expected)
    assert int((raw != 0).sum()) == 4  # nothing outside block 1's page of layer 0


def test_duo_pages_pass_through_and_a_scattered_page_is_refused():
    pages = torch.zeros(3, 2, 16, 2, 4)
    assert vllm_seam.as_duo_pages(pages) is pages
    scattered = torch.zeros(2, 3, 16, 8).transpose(0, 1)  # LHBNC: a block's heads lie apart
    with pytest.raises(SeamError, match="contiguous"):
        vllm_seam.as_duo_pages(scattered)


def test_the_backend_declares_the_page_contiguous_layouts():
    from vllm_duo.backend import DuoAttentionBackend

    if not vllm_seam.touch("kv_cache_view_4d").applies():
        pytest.skip("vLLM 0.26-0.28 allocates duo's 5D pages (kv_cache_shape_5d)")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert KVCacheLayout.LHBNC not in DuoAttentionBackend.supported_kv_cache_layouts()
    assert len(DuoAttentionBackend.supported_kv_cache_layouts()) == 4


def _engine_free_config():
    from vllm.engine.arg_utils import EngineArgs

    from vllm_duo.tools import cache_sim

    return EngineArgs(model=cache_sim._model_folder().name, skip_tokenizer_init=True, max_model_len=4096,
                      block_size=16).create_engine_config()


def test_a_kv_cache_sized_outside_the_engine_core_gets_the_layout_the_engine_core_resolves():
    """cache_sim sizes its KV cache with `get_kv_cache_configs`, which reads the layout the engine core resolves
    (vLLM 0.29+); `resolve_kv_cache_layout` resolves it the same way, and does nothing on vLLM 0.26-0.28."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_duo.backend import DuoAttentionBackend

    config = _engine_free_config()
    specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128,
                                                                    dtype=torch.bfloat16) for i in range(32)}
    vllm_seam.resolve_kv_cache_layout(config, [], specs.values())
    page_bytes = 32 * 16 * 8 * 128 * 2 * 2  # every layer's K and V of one 16-token block, bf16
    (kv_cache_config,) = get_kv_cache_configs(config, [specs], [300 * page_bytes])
    assert kv_cache_config.num_blocks == 300
    duo_config = _engine_free_config()
    vllm_seam.resolve_kv_cache_layout(duo_config, [DuoAttentionBackend], [])
    if vllm_seam.touch("kv_cache_layout_resolution").applies():
        assert config.cache_config.get_resolved_kv_cache_layout().name == "LBNHC"  # vLLM's default preference
        assert duo_config.cache_config.get_resolved_kv_cache_layout() in vllm_seam.duo_kv_cache_layouts()
    else:
        assert getattr(duo_config.cache_config, "kv_cache_layout", None) is None


def test_prefix_cache_lookups_are_recorded_as_the_scheduler_makes_them():
    """cache_sim's probes of vLLM's KV cache manager: each admission's lookup is recorded with the hit tokens vLLM
    found, and the longest hit of a prompt whose blocks are cached is its whole blocks before the last token."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from vllm_duo.tools import cache_sim

    engine = cache_sim.Engine(dense_kv_tokens=4096, max_num_batched_tokens=512, max_num_seqs=8,
                              async_scheduling=False)
    scheduler = cache_sim.build_scheduler("dense", engine, 1024)
    manager = scheduler.kv_cache_manager
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    prompt = list(range(1000, 1064))  # 4 blocks of 16 tokens
    first, second = (Request(name, prompt, SamplingParams(max_tokens=4), None, block_hasher=hasher)
                     for name in ("first", "second"))
    lookups = []
    vllm_seam.record_prefix_cache_lookups(manager, lambda request, hits: lookups.append((request.request_id, hits)))
    assert vllm_seam.longest_cache_hit(manager, second.block_hashes, len(prompt) - 1) == 0
    scheduler.add_request(first)
    scheduler.schedule()  # computes and caches the first prompt's blocks
    assert vllm_seam.longest_cache_hit(manager, second.block_hashes, len(prompt) - 1) == 48
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert lookups == [("first", 0), ("second", 48)]
    assert output.num_scheduled_tokens["second"] == len(prompt) - 48


def test_cache_sim_stops_in_one_line_on_a_vllm_it_is_not_for(monkeypatch):
    """vLLM 0.33 moved what cache_sim builds its scheduler from: the tool stops with one line, before any import."""
    monkeypatch.setattr(vllm_seam, "vllm_version", lambda: (0, 33, 0))
    monkeypatch.setattr(vllm_seam, "installed_version", lambda: "0.33.0")
    with pytest.raises(vllm_seam.SeamError) as error:
        vllm_seam.require("prefix_cache_lookups")
    assert "\n" not in str(error.value) and "vLLM 0.26.0 to 0.32.x" in str(error.value)


def test_duo_keeps_its_block_size_when_the_platform_asks_after_load():
    """vLLM 0.33's CPU platform asks the backend for its block size after the model is loaded (its default 128):
    duo answers the size its page layout was planned for."""
    from vllm_duo import DUO_BLOCK_SIZE
    from vllm_duo.backend import DuoAttentionBackend

    assert DuoAttentionBackend.get_preferred_block_size(128) == DuoAttentionBackend.get_preferred_block_size(16)
    assert DuoAttentionBackend.get_preferred_block_size(128) == DUO_BLOCK_SIZE


def test_v2_step_rows_know_each_running_requests_prompt(monkeypatch):
    """step_rows_v2 (the squeeze on vLLM's V2 model runner) gives each row's prompt from the scheduler outputs' new
    requests, and forgets a prompt once its request finished or was preempted (a resumed one comes back as new)."""
    runner = vllm_seam._v2_runner()
    if runner is None:
        pytest.skip("this vLLM has no V2 model runner")
    batch = SimpleNamespace(num_reqs=2, req_ids=["a", "b"], idx_mapping_np=np.array([1, 0]),
                            num_computed_tokens_np=np.array([0, 3]))
    monkeypatch.setattr(runner, "prepare_inputs", lambda self, scheduler_output, *args: batch)
    monkeypatch.setattr(runner, "execute_model", lambda self, scheduler_output, *args: None)
    vllm_seam.BY_NAME["step_rows_v2"].apply()
    worker = SimpleNamespace(req_states=SimpleNamespace(prompt_len=SimpleNamespace(np=np.array([7, 5])),
                                                        req_id_to_index={"a": 1, "b": 0}))

    def step(new=(), finished=(), preempted=None):
        output = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=p) for r, p in new],
                                 finished_req_ids=set(finished), preempted_req_ids=preempted)
        runner.prepare_inputs(worker, output, "batch_desc")
        rows = vllm_seam.step_rows()
        runner.execute_model(worker, output)
        assert vllm_seam.step_rows() is None
        return rows

    rows = step(new=[("a", [1] * 5), ("b", [2] * 7)])
    assert rows.req_ids == ["a", "b"] and rows.prompt_lens == [5, 7] and rows.computed == [0, 3]
    assert rows.prompt_of("a") == [1] * 5 and rows.prompt_of("b") == [2] * 7
    rows = step(finished=["a"])
    assert rows.prompt_of("a") is None and rows.prompt_of("b") == [2] * 7
    assert step(preempted={"b"}).prompt_of("b") is None
