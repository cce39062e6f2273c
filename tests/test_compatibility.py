# SPDX-License-Identifier: Apache-2.0
"""Every vLLM setting duo does not support stops while vLLM builds its config, with one line naming it.

Each row builds a real `VllmConfig` (`EngineArgs.create_engine_config`, what `vllm serve` and `LLM` do first) with the
duo backend on SmolLM2, or on a copy of its config.json with one model property changed. Model kinds that need
another architecture's config (encoder-decoder, hybrid, MLA, multimodal, context parallelism on a bigger model) are
checked on the same config with that one property overridden. The supported rows must build.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engines import calculated_scales
from vllm_duo.compatibility import refusal
from vllm_duo.config import DuoConfigError

DUO = {"duo": {"pattern": "SmolLM2-135M-Instruct", "sparsity": 0.5}}


def build_config(model: str, duo: bool = True, **engine_args):
    from vllm.engine.arg_utils import EngineArgs

    extra = dict(attention_backend="duo", additional_config=DUO) if duo else {}
    return EngineArgs(model=model, max_model_len=2048, **extra, **engine_args).create_engine_config()


def model_variant(smollm2_dir: str, folder: Path, **config_changes) -> str:
    """SmolLM2 with config.json changed (the weights and tokenizer linked, not copied)."""
    folder.mkdir()
    for item in Path(smollm2_dir).iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((Path(smollm2_dir) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return str(folder)


REFUSED_SETTINGS = {  # engine arguments: what the one-line error must say
    "kv cache dtype duo cannot store": (dict(kv_cache_dtype="fp8_inc"), r"^--kv-cache-dtype fp8_inc: .* use "
                                                                          r"--kv-cache-dtype auto or fp8$"),
    "per-token-head int8 kv": (dict(kv_cache_dtype="int8_per_token_head"), r"^--kv-cache-dtype int8_per_token_head"),
    "kv dtype other than the model's": (dict(kv_cache_dtype="float16", dtype="bfloat16"),
                                        r"^--kv-cache-dtype float16: duo stores K/V in the model's dtype \(bfloat16\)"),
    "fp8 on some layers only": (dict(kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=["0"]),
                                r"^--kv-cache-dtype-skip-layers: .* leave the option out$"),
    "block size off the kernel tile": (dict(block_size=24), r"^--block-size 24: .* use --block-size 16"),
    "speculative decoding": (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                      "prompt_lookup_max": 3}),
                             r"^--speculative-config: .* serve without speculative decoding$"),
    "lora": (dict(enable_lora=True), r"^--enable-lora: .* serve without LoRA"),
    "kv connector": (dict(kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"}),
                     r"^--kv-transfer-config \(connector ExampleConnector\): .* leave it out$"),
    "kv cache events": (dict(kv_events_config={"enable_kv_cache_events": True}),
                        r"^--kv-events-config with enable_kv_cache_events: .* leave the events off$"),
    "pipeline parallelism": (dict(pipeline_parallel_size=2), r"^--pipeline-parallel-size: .* --tensor-parallel-size"),
}

REFUSED_MODELS = {  # config.json changes: what the error must say
    "sliding window": (dict(sliding_window=512), r"^LlamaForCausalLM has sliding-window layers \(window 512\)"),
    "alibi": (dict(alibi=True), r"^LlamaForCausalLM uses ALiBi"),
    "logit soft-capping": (dict(attn_logit_softcapping=50.0), r"^LlamaForCausalLM soft-caps attention logits"),
}

REFUSED_KINDS = {  # ModelConfig / ParallelConfig property overridden on SmolLM2's config: what the error must say
    "encoder-decoder": ("model_config", dict(is_encoder_decoder=True), r"is an encoder-decoder model"),
    "hybrid": ("model_config", dict(is_hybrid=True), r"has state-space or linear-attention layers"),
    "attention-free": ("model_config", dict(is_attention_free=True), r"has state-space or linear-attention layers"),
    "mla": ("model_config", dict(use_mla=True), r"uses multi-head latent attention"),
    "multimodal": ("model_config", dict(is_multimodal_model=True), r"is multimodal"),
    "decode context parallelism": ("parallel_config", dict(decode_context_parallel_size=2),
                                   r"^--decode-context-parallel-size 2: .* use --tensor-parallel-size$"),
    "prefill context parallelism": ("parallel_config", dict(prefill_context_parallel_size=2),
                                    r"^--prefill-context-parallel-size 2"),
    "per-head kv scales from the checkpoint": ("quant_config", dict(kv_cache_scheme={"strategy": "attn_head"}),
                                               r"^the checkpoint's per-head KV cache scales"),
}


@pytest.mark.parametrize("case", list(REFUSED_SETTINGS))
def test_unsupported_setting_stops_config(case, smollm2_dir):
    engine_args, expected = REFUSED_SETTINGS[case]
    with pytest.raises(DuoConfigError, match=expected) as error:
        build_config(smollm2_dir, **engine_args)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("case", list(REFUSED_MODELS))
def test_unsupported_model_stops_config(case, smollm2_dir, tmp_path):
    changes, expected = REFUSED_MODELS[case]
    with pytest.raises(DuoConfigError, match=expected):
        build_config(model_variant(smollm2_dir, tmp_path / "model", **changes))


class Overridden:
    """A config object with some attributes replaced (properties and methods alike)."""

    def __init__(self, base, **attributes):
        self._base, self._attributes = base, attributes

    def __getattr__(self, name):
        if name in self._attributes:
            value = self._attributes[name]
            return (lambda: value) if callable(getattr(self._base, name, None)) else value
        return getattr(self._base, name)


@pytest.fixture(scope="module")
def fp8_config(smollm2_dir):
    return build_config(smollm2_dir, duo=False, kv_cache_dtype="fp8")


@pytest.mark.parametrize("case", list(REFUSED_KINDS))
def test_unsupported_model_kind_is_refused(case, fp8_config):
    part, attributes, expected = REFUSED_KINDS[case]
    config = Overridden(fp8_config, **{part: Overridden(getattr(fp8_config, part), **attributes)})
    reason = refusal(config)
    assert reason is not None and "\n" not in reason
    assert re.search(expected, reason), reason


SQUEEZE = {"duo": {**DUO["duo"], "squeeze": {"budget": 0.25}}}


@pytest.mark.parametrize("attributes, expected", [
    (dict(parallel_config=dict(tensor_parallel_size=2)), r"^duo.squeeze with --tensor-parallel-size > 1: .* out$")])
def test_the_squeeze_is_refused_where_it_cannot_run(attributes, expected, fp8_config):
    parts = {name: Overridden(getattr(fp8_config, name), **value) if isinstance(value, dict) else value
             for name, value in attributes.items()}
    assert refusal(Overridden(fp8_config, additional_config=SQUEEZE)) is None
    assert refusal(Overridden(fp8_config, **parts)) is None  # without the squeeze
    reason = refusal(Overridden(fp8_config, additional_config=SQUEEZE, **parts))
    assert reason is not None and "\n" not in reason and re.search(expected, reason), reason


def test_bad_squeeze_settings_stop_config_in_one_line(smollm2_dir):
    from vllm.engine.arg_utils import EngineArgs

    bad = {"duo": {**DUO["duo"], "squeeze": {"budget": 0}}}
    with pytest.raises(DuoConfigError, match=r"^bad --additional-config duo.squeeze.budget: ") as error:
        EngineArgs(model=smollm2_dir, max_model_len=2048, attention_backend="duo",
                   additional_config=bad).create_engine_config()
    assert "\n" not in str(error.value)


def test_an_unknown_attention_path_stops_config_in_one_line(smollm2_dir, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    for path in ("flash", "triton", "torch"):
        monkeypatch.setenv("VLLM_DUO_ATTENTION", path)
        assert refusal(build_config(smollm2_dir, duo=True)) is None
    monkeypatch.setenv("VLLM_DUO_ATTENTION", "fa3")
    with pytest.raises(DuoConfigError, match=r"^VLLM_DUO_ATTENTION=fa3: .*use one of flash, triton, torch") as error:
        EngineArgs(model=smollm2_dir, max_model_len=2048, attention_backend="duo",
                   additional_config=DUO).create_engine_config()
    assert "\n" not in str(error.value)


def test_fp8_needs_an_fp8_capable_gpu(fp8_config):
    assert refusal(fp8_config, fp8_capable=True) is None
    assert "compute capability 8.9" in refusal(fp8_config, fp8_capable=False)


@pytest.mark.parametrize("engine_args", [dict(kv_cache_dtype="fp8"), dict(kv_cache_dtype="fp8_e4m3"),
                                         dict(kv_cache_dtype="fp8_e5m2"), dict(kv_cache_dtype="bfloat16"),
                                         calculated_scales(kv_cache_dtype="fp8"),
                                         dict(block_size=32), dict(tensor_parallel_size=3)],
                         ids=lambda args: ",".join(f"{k}={v}" for k, v in args.items()))
def test_supported_settings_build(engine_args, smollm2_dir):
    config = build_config(smollm2_dir, **engine_args)
    assert config.cache_config.cache_dtype == engine_args.get("kv_cache_dtype", "auto")
    assert config.cache_config.enable_prefix_caching  # vLLM's default stays on under duo
