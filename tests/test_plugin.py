# SPDX-License-Identifier: Apache-2.0
"""The plugin in a real vLLM engine: `attention_backend="duo"` parses, and every attention layer runs duo."""

import gc


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
    del llm
    gc.collect()
