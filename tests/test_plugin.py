# SPDX-License-Identifier: Apache-2.0
"""The plugin in a real vLLM engine: `attention_backend="duo"` parses, and every attention layer runs duo;
vLLM's V2 model runner (the GPU default) sizes block table rows for duo's streaming page groups too (patched on vLLM
0.26-0.28; from 0.29 it sizes them by the spec's max_num_blocks_per_req)."""

from types import SimpleNamespace

import pytest

from engines import release
import torch


def test_duo_member_parses():
    import vllm.plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm.plugins.load_general_plugins()
    assert AttentionBackendEnum["DUO"].get_path() == "vllm_duo.backend.DuoAttentionBackend"


def test_every_layer_resolves_the_duo_backend(smollm2_dir):
    from vllm import LLM

    from vllm_duo.backend import DuoAttentionBackend
    from vllm_duo.capacity import engine_core, held_blocks

    # no pattern given: found as the bundled pattern named after the model folder
    llm = LLM(model=smollm2_dir, max_model_len=1024, load_format="dummy", enforce_eager=True,
              distributed_executor_backend="uni", attention_backend="duo")
    layers = engine_core(llm).vllm_config.compilation_config.static_forward_context
    assert len(layers) == 30
    assert {layer.get_attn_backend() for layer in layers.values()} == {DuoAttentionBackend}
    assert held_blocks(llm) == 0
    release(llm)


class _WidthRecorded(Exception):
    """Stops the V2 runner's initialize_kv_cache once it has computed the block table widths."""


ROW_CASES = [(2048, 1), (17000, 2), (1000, 0)]


@pytest.mark.parametrize("max_model_len, group_blocks", ROW_CASES)
def test_spec_rows_hold_pages_and_page_groups(max_model_len, group_blocks):
    """What vLLM sizes a row by (all but the V2 runner of 0.26-0.28, which the plugin patches): the spec's
    max_num_blocks_per_req."""
    from vllm_duo.kv_cache import DuoAttentionSpec

    spec = DuoAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sink=64, recent=256,
                            streaming_blocks=group_blocks)
    assert spec.max_num_blocks_per_req(None, max_model_len) == -(-max_model_len // 16) * (1 + group_blocks)


@pytest.mark.skipif(not __import__("vllm_duo.vllm_seam").vllm_seam.touch("v2_block_table_rows").applies(),
                    reason="the V2 runner patch is for vLLM 0.26-0.28 (vllm_seam: v2_block_table_rows)")
@pytest.mark.parametrize("max_model_len, group_blocks", ROW_CASES)
def test_v2_runner_rows_hold_pages_and_page_groups(monkeypatch, max_model_len, group_blocks):
    """A duo request's row has 1 + m columns per 16 tokens (page, streaming page group): a row sized for
    max_model_len alone would spill into the next request's row (seen on the H100, with the earlier layout, as
    wrong greedy text under load and right text alone)."""
    import vllm.plugins
    from vllm.v1.worker.gpu import model_runner

    from vllm_duo.kv_cache import DuoAttentionSpec

    vllm.plugins.load_general_plugins()
    widths = []

    def record_width(max_num_blocks, block_size, *args, **kwargs):
        widths.append(max_num_blocks)
        return max_num_blocks

    def stop(*args, **kwargs):
        raise _WidthRecorded

    monkeypatch.setattr(model_runner, "get_block_table_width", record_width)
    monkeypatch.setattr(model_runner, "init_attn_backend", stop)
    spec = DuoAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sink=64, recent=256,
                            streaming_blocks=group_blocks)
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    runner = SimpleNamespace(max_model_len=max_model_len, is_encoder_decoder=False, dcp_size=1,
                             vllm_config=vllm_config, device=torch.device("cpu"))
    with pytest.raises(_WidthRecorded):
        model_runner.GPUModelRunner.initialize_kv_cache(runner, config)
    assert widths == [-(-max_model_len // 16) * (1 + group_blocks)]
    assert runner.max_model_len == max_model_len  # restored: the runner reads it elsewhere as the request limit
