# SPDX-License-Identifier: Apache-2.0
"""Tests of the head-pattern format, its binarization, the bundled patterns and the `vllm-duo pattern` commands."""
import collections
import json
import math
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from vllm_duo.config import DuoSettings, ModelShape, build_plan
from vllm_duo.pattern import (FIELD_VALUES, HeadPattern, ModelInfo, PatternError, Provenance, bundled_patterns,
                              find_bundled, ideal_kv_slots, pattern_from_reference_dir, read_hf_config,
                              resolve_pattern)
from vllm_duo.tools.cli import main
from vllm_duo.tools.pattern_commands import kv_footprint, with_trained_mask
from vllm_duo.tools.zigzag import zigzag_pattern

REPO = Path(__file__).resolve().parents[1]
REFERENCE_DIR = REPO / "tests" / "fixtures" / "reference-patterns"  # the duo-attention reference folders, MIT
SHIPPED = sorted((REPO / "patterns").glob("*.json"))
# the six converted from the DuoAttention reference; the rest (SmolLM2) were made here
REFERENCE_SHIPPED = [path for path in SHIPPED if (REFERENCE_DIR / path.stem).is_dir()]

# The reference folders' per-layer number of heads strictly above the global median: with no gate equal to the
# median, these are the per-layer retrieval counts at sparsity 0.5.
README_COUNTS_ABOVE_MEDIAN = {
    "Llama-2-7B-32K-Instruct": [12, 21, 4, 10, 4, 11, 14, 13, 14, 13, 18, 17, 18, 19, 23, 20,
                                21, 20, 21, 19, 19, 15, 20, 9, 17, 14, 20, 9, 12, 15, 22, 28],
    "Meta-Llama-3.1-8B-Instruct": [2, 3, 4, 1, 4, 2, 2, 6, 4, 6, 5, 5, 2, 8, 4, 5,
                                   4, 6, 3, 4, 5, 2, 4, 5, 3, 3, 3, 4, 5, 5, 8, 1],
    "Mistral-7B-Instruct-v0.3": [2, 3, 5, 2, 3, 4, 3, 4, 1, 2, 3, 5, 5, 1, 5, 5,
                                 4, 2, 7, 5, 5, 6, 3, 4, 4, 3, 6, 3, 4, 7, 6, 6],
}


def small_pattern(num_layers=2, num_kv_heads=4, gates=None) -> dict:
    """A valid pattern as a dict, for tests to break one field at a time."""
    if gates is None:
        gates = np.linspace(0.0, 1.0, num_layers * num_kv_heads).reshape(num_layers, num_kv_heads).tolist()
    return {
        "schema_version": 1,
        "model": {"name": "Tiny", "aliases": ["org/Tiny"], "architecture": "LlamaForCausalLM",
                  "num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": 64},
        "gates": gates,
        "sparsity": 0.5,
        "sink": 4,
        "recent": 16,
        "provenance": {"source": "test", "method": "hand-made", "date": "2025-01-01"},
    }


def write_json(path: Path, data) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def write_hf_config(folder: Path, num_layers=32, num_kv_heads=8, architecture="LlamaForCausalLM") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "config.json", {"architectures": [architecture], "num_hidden_layers": num_layers,
                                        "num_attention_heads": 32, "num_key_value_heads": num_kv_heads,
                                        "hidden_size": 4096})
    return folder


def edited(edit):
    """A small pattern dict changed by `edit(data)`, which mutates it in place."""
    data = small_pattern()
    edit(data)
    return data


def set_gate(value):
    return lambda data: data["gates"][0].__setitem__(1, value)


MISTRAL_REFERENCE = REFERENCE_DIR / "Mistral-7B-Instruct-v0.3"
# A retrieval mask of small_pattern() at sparsity 0.25 (2 of its 8 heads streaming) other than its gates' ranking.
TRAINED_AT_025 = [[1, 0, 1, 1], [0, 1, 1, 1]]

# (id, file content: str as is, a dict to dump, or a Path loaded as is; check_model arguments or None; words the
# message must hold: the field and what to change, `vllm-duo pattern convert` only for a file of the reference format)
BAD_INPUTS = [
    ("not_json", "{not json", None, ["not JSON", "line 1 column 2", "fix the JSON syntax"]),
    ("empty_file", "", None, ["is empty", "a JSON object with the fields schema_version, model, gates"]),
    ("json_array", [], None, ["top level", "a JSON object with the fields schema_version, model, gates"]),
    ("missing_field", edited(lambda d: d.pop("sink")), None, ["`sink` is missing", "a whole number of tokens"]),
    ("missing_model_field", edited(lambda d: d["model"].pop("head_dim")), None,
     ["model.head_dim", "a positive integer"]),
    ("unknown_field", edited(lambda d: d.update(threshold=0.5)), None,
     ["unknown field `threshold`", "the fields are schema_version, model, gates"]),
    ("unknown_model_field", edited(lambda d: d["model"].update(layers=2)), None,
     ["model.layers", "the fields of `model` are name, aliases, architecture, num_layers"]),
    ("wrong_schema_version", edited(lambda d: d.update(schema_version=2)), None, ["schema_version 2", "reads 1"]),
    ("model_not_object", edited(lambda d: d.update(model="Tiny")), None, ["`model` = 'Tiny'", "an object with name"]),
    ("zero_layers", edited(lambda d: d["model"].update(num_layers=0)), None,
     ["model.num_layers", "a positive integer, the model's num_hidden_layers"]),
    ("aliases_string", edited(lambda d: d["model"].update(aliases="org/Tiny")), None,
     ["model.aliases", "a list of strings"]),
    ("gate_rows_vs_layers", edited(lambda d: d["gates"].pop()), None, ["gates", "num_layers", "one row per layer"]),
    ("ragged_rows", edited(lambda d: d["gates"][1].pop()), None,
     ["gates[1]", "num_kv_heads", "one entry per KV head"]),
    ("nan_gate", edited(set_gate(float("nan"))), None, ["gates[0][1]", "nan", "[0, 1]"]),
    ("inf_gate", edited(set_gate(float("inf"))), None, ["gates[0][1]", "inf", "[0, 1]"]),
    ("gate_1.5", edited(set_gate(1.5)), None, ["gates[0][1]", "1.5", "[0, 1]"]),
    ("gate_-0.5", edited(set_gate(-0.5)), None, ["gates[0][1]", "-0.5", "[0, 1]"]),
    ("gate_string", edited(set_gate("0.5")), None, ["gates[0][1]", "'0.5'", "number in [0, 1] per KV head"]),
    ("sparsity_1.2", edited(lambda d: d.update(sparsity=1.2)), None, ["sparsity", "1.2", "a number in [0, 1]"]),
    ("sparsity_-0.1", edited(lambda d: d.update(sparsity=-0.1)), None, ["sparsity", "-0.1", "a number in [0, 1]"]),
    ("gates_without_sparsity", edited(lambda d: d.pop("sparsity")), None,
     ["sparsity", "missing", "a number in [0, 1]"]),
    ("negative_sink", edited(lambda d: d.update(sink=-1)), None, ["sink", "-1", "0 or more"]),
    ("fractional_sink", edited(lambda d: d.update(sink=64.5)), None, ["sink", "64.5", "a whole number of tokens"]),
    ("sink_and_recent_zero", edited(lambda d: d.update(sink=0, recent=0)), None, ["sink", "recent", "above 0"]),
    ("layer_exclusive_string", edited(lambda d: d.update(layer_exclusive="yes")), None,
     ["layer_exclusive", "true or false"]),
    ("neither_gates_nor_mask", edited(lambda d: d.pop("gates")), None, ["gates", "retrieval_mask", "at least one"]),
    ("mask_value_2", edited(lambda d: d.update(retrieval_mask=[[2, 0, 1, 1], [0, 0, 1, 1]])), None,
     ["retrieval_mask[0][0]", "2", "0 or 1"]),
    ("mask_contradicts_sparsity", edited(lambda d: d.update(retrieval_mask=[[1, 1, 1, 1], [1, 1, 1, 0]])), None,
     ["sparsity", "0.5", "retrieval_mask", "remove it"]),
    ("masks_key_not_a_sparsity", edited(lambda d: d.update(masks={"quarter": TRAINED_AT_025})), None,
     ['masks key "quarter"', "sparsity in [0, 1]"]),
    ("masks_value_2", edited(lambda d: d.update(masks={"0.25": [[2, 0, 1, 1], [0, 1, 1, 1]]})), None,
     ['masks["0.25"][0][0] = 2', "0 or 1"]),
    ("masks_value_string", edited(lambda d: d.update(masks={"0.25": [["1", 0, 1, 1], [0, 1, 1, 1]]})), None,
     ['masks["0.25"][0][0]', "'1'", "`masks` must be an object from a sparsity"]),
    ("masks_rows_vs_layers", edited(lambda d: d.update(masks={"0.25": TRAINED_AT_025[:1]})), None,
     ['masks["0.25"]', "num_layers", "one row per layer"]),
    ("masks_count_vs_key", edited(lambda d: d.update(masks={"0.5": TRAINED_AT_025})), None,
     ['masks["0.5"] has 2 streaming heads but sparsity 0.5 selects 4 of 8']),
    ("masks_answer_one_sparsity", edited(lambda d: d.update(masks={"0.25": TRAINED_AT_025,
                                                                   "0.2": [[1, 1, 1, 1], [0, 0, 1, 1]]})), None,
     ['masks["0.2"] and masks["0.25"] both have 2 streaming heads', "keep one"]),
    ("layers_vs_model", small_pattern(), ("LlamaForCausalLM", 30, 4, 64), ["2 layers", "30", "vllm-duo identify"]),
    ("kv_heads_vs_model", small_pattern(), ("LlamaForCausalLM", 2, 8, 64), ["4 KV heads", "8", "vllm-duo identify"]),
    ("reference_config", MISTRAL_REFERENCE / "config.json", None,
     ["reference folder", f"vllm-duo pattern convert {MISTRAL_REFERENCE} -o"]),
    ("reference_gates", MISTRAL_REFERENCE / "full_attention_heads.tsv", None,
     ["reference folder", f"vllm-duo pattern convert {MISTRAL_REFERENCE} -o"]),
]


@pytest.mark.parametrize("content, model, named", [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_pattern_error(tmp_path, content, model, named):
    if isinstance(content, Path):
        path = content
    else:
        path = tmp_path / "pattern.json"
        path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    with pytest.raises(PatternError) as caught:
        pattern = HeadPattern.load(path)
        if model is not None:
            pattern.check_model(*model)
    message = str(caught.value)
    assert "\n" not in message
    assert str(path) in message
    for words in named:
        assert words in message, words
    assert ("convert" in message) == isinstance(content, Path)


def test_every_field_says_what_it_holds():
    """The messages about a hand-edited file take what a field holds from FIELD_VALUES: it must know every field."""
    assert set(FIELD_VALUES) == {*HeadPattern.model_fields, *(f"model.{name}" for name in ModelInfo.model_fields),
                                 *(f"provenance.{name}" for name in Provenance.model_fields)}


def test_missing_file_is_pattern_error(tmp_path):
    with pytest.raises(PatternError, match="cannot read pattern"):
        HeadPattern.load(tmp_path / "absent.json")


def test_small_negative_gates_are_clipped(tmp_path):
    data = small_pattern(gates=[[-0.0014, 0.2, 1.004, 0.5], [0.1, 0.3, 0.6, 0.9]])
    pattern = HeadPattern.load(write_json(tmp_path / "p.json", data))
    assert pattern.gates[0] == [0.0, 0.2, 1.0, 0.5]


def expected_retrieval_total(num_heads: int, sparsity: float) -> int:
    """N - ceil(s * (N - 1)), in exact arithmetic."""
    return num_heads - math.ceil(Fraction(str(sparsity)) * (num_heads - 1))


def straightforward_counts(gates: list[list[float]], num_retrieval: int) -> list[int]:
    """Per-layer counts of the `num_retrieval` largest gates, ties to the lower (layer, head)."""
    ranked = sorted((-gate, layer, head) for layer, row in enumerate(gates) for head, gate in enumerate(row))
    per_layer = collections.Counter(layer for _, layer, _ in ranked[:num_retrieval])
    return [per_layer[layer] for layer in range(len(gates))]


@pytest.mark.parametrize("num_layers, num_kv_heads, expected", [(32, 8, [192, 128, 64]), (32, 32, [768, 512, 256])])
def test_retrieval_count_rule(num_layers, num_kv_heads, expected):
    gates = np.random.default_rng(0).random((num_layers, num_kv_heads)).tolist()
    pattern = HeadPattern.model_validate(small_pattern(num_layers, num_kv_heads, gates))
    totals = [int(pattern.retrieval_mask_at(s).sum()) for s in (0.25, 0.5, 0.75)]
    assert totals == expected


@pytest.mark.parametrize("sparsity", [0.1, 0.3, 0.7, 0.9])
def test_retrieval_count_survives_float_rounding(sparsity):
    # 0.7 * 10 == 7.000000000000001 in floating point; the exact count of streaming heads is 7.
    pattern = HeadPattern.model_validate(small_pattern(1, 11, [np.linspace(0, 1, 11).tolist()]))
    assert int(pattern.retrieval_mask_at(sparsity).sum()) == expected_retrieval_total(11, sparsity)


def test_sparsity_extremes_and_out_of_range():
    pattern = HeadPattern.model_validate(small_pattern())
    assert pattern.retrieval_mask_at(0.0).all()
    assert not pattern.retrieval_mask_at(1.0).any()
    for sparsity in (1.2, -0.1, float("nan")):
        with pytest.raises(PatternError, match="outside"):
            pattern.retrieval_mask_at(sparsity)


def test_ties_go_to_lower_layer_then_lower_head():
    pattern = HeadPattern.model_validate(small_pattern(gates=[[0.5, 1.0, 0.5, 0.0], [1.0, 0.5, 0.5, 0.0]]))
    # 8 - ceil(0.5 * 7) = 4 retrieval heads: both 1.0 gates, then the first two 0.5 gates in (layer, head) order.
    assert pattern.retrieval_mask_at(0.5).tolist() == [[True, True, True, False], [True, False, False, False]]


def test_shipped_patterns_exist():
    assert [path.stem for path in SHIPPED] == sorted(bundled_patterns())
    assert len(SHIPPED) == 7 and len(REFERENCE_SHIPPED) == 6
    assert "SmolLM2-135M-Instruct" in bundled_patterns()


@pytest.mark.parametrize("path", SHIPPED, ids=[path.stem for path in SHIPPED])
def test_shipped_binarization(path):
    pattern = HeadPattern.load(path)
    for sparsity in (0.25, 0.5, 0.75):
        expected_total = expected_retrieval_total(pattern.num_heads, sparsity)
        counts = pattern.retrieval_counts(sparsity)
        assert sum(counts) == expected_total
        key = pattern.trained_mask_key(sparsity)  # a mask trained for this sparsity is served as stored
        expected = (np.asarray(pattern.masks[key]).sum(axis=1).tolist() if key
                    else straightforward_counts(pattern.gates, expected_total))
        assert counts == expected
        assert np.array_equal(pattern.retrieval_mask_at(sparsity), pattern.retrieval_mask_at(sparsity))
    if path.stem in README_COUNTS_ABOVE_MEDIAN:
        assert pattern.retrieval_counts(0.5) == README_COUNTS_ABOVE_MEDIAN[path.stem]


@pytest.mark.parametrize("path", SHIPPED, ids=[path.stem for path in SHIPPED])
def test_shipped_file_is_what_save_writes(tmp_path, path):
    HeadPattern.load(path).save(tmp_path / "copy.json")
    assert (tmp_path / "copy.json").read_bytes() == path.read_bytes()


def test_round_trip_with_mask(tmp_path):
    data = small_pattern()
    data["retrieval_mask"] = [[0, 0, 1, 1], [0, 1, 1, 0]]
    data["layer_exclusive"] = True
    original = HeadPattern.model_validate(data)
    original.save(tmp_path / "p.json")
    loaded = HeadPattern.load(tmp_path / "p.json")
    assert loaded.model_dump() == original.model_dump()


def test_a_trained_mask_is_served_at_its_sparsity_and_the_gates_elsewhere(tmp_path, capsys):
    """masks["0.25"] (identify --target-sparsity): any sparsity that selects its 2 of 8 streaming heads gets it, others
    the gates' ranking; it survives a save and `pattern show` names it."""
    data = small_pattern()
    data["masks"] = {"0.25": TRAINED_AT_025}
    pattern = HeadPattern.model_validate(data)
    ranked = HeadPattern.model_validate(small_pattern())
    for sparsity in (0.25, 0.2):  # ceil(0.2 x 7) = 2 as well
        assert pattern.trained_mask_key(sparsity) == "0.25"
        assert pattern.retrieval_mask_at(sparsity).astype(int).tolist() == TRAINED_AT_025
    assert not np.array_equal(ranked.retrieval_mask_at(0.25), pattern.retrieval_mask_at(0.25))
    assert pattern.trained_mask_key() is None and pattern.trained_mask_key(0.5) is None
    assert np.array_equal(pattern.retrieval_mask_at(), ranked.retrieval_mask_at(0.5))
    assert np.array_equal(pattern.retrieval_mask_at(0.75), ranked.retrieval_mask_at(0.75))

    pattern.save(tmp_path / "p.json")
    assert '"masks": {\n    "0.25": [\n      [1, 0, 1, 1],\n' in (tmp_path / "p.json").read_text()
    assert HeadPattern.load(tmp_path / "p.json").model_dump() == pattern.model_dump()
    assert main(["pattern", "show", str(tmp_path / "p.json"), "--sparsity", "0.25"]) == 0
    out = capsys.readouterr().out
    assert 'sparsity 0.25 (trained mask masks["0.25"]): 6 of 8 KV heads' in out
    assert "masks      trained for sparsity 0.25; the gates' ranking at others" in out

    assert zigzag_pattern(pattern, 0.5).masks is None  # head-level masks do not belong in a layer-exclusive one
    replaced = with_trained_mask(pattern, 0.2, np.array(TRAINED_AT_025[::-1], dtype=bool), note="retrained")
    assert replaced.masks == {"0.2": TRAINED_AT_025[::-1]} and replaced.provenance.notes == "retrained"


def test_mask_only_pattern():
    data = small_pattern()
    data.pop("gates")
    data.pop("sparsity")
    data["retrieval_mask"] = [[0, 0, 1, 1], [0, 1, 1, 1]]
    pattern = HeadPattern.model_validate(data)
    assert pattern.retrieval_counts() == [2, 3]
    assert pattern.retrieval_counts(0.375) == [2, 3]
    with pytest.raises(PatternError, match="only a retrieval mask"):
        pattern.retrieval_mask_at(0.5)


def test_kv_footprint():
    pattern = HeadPattern.model_validate(small_pattern())  # 8 heads, 4 retrieval at 0.5, sink 4 + recent 16
    long = kv_footprint(pattern, 1000)
    assert (long.dense_slots, long.duo_slots) == (8000, 4 * 1000 + 4 * 20)
    assert long.saving == pytest.approx(1 - 4080 / 8000)
    assert long.dense_bytes == 8000 * 2 * 64 * 2
    short = kv_footprint(pattern, 10, sparsity=0.75)
    assert short.duo_slots == 10 * 2 + 10 * 6


@pytest.mark.parametrize("context_len, window", [(10, 10), (20, 20), (21, 20), (1000, 20)],
                         ids=["below", "at", "above", "far-above"])
def test_ideal_kv_below_at_and_above_sink_plus_recent(context_len, window):
    """A streaming head keeps min(T, sink + recent) tokens; `vllm-duo patterns show` (kv_footprint) and the server's
    startup line (DuoPlan.capacity_ratio) count with the same function."""
    pattern = HeadPattern.model_validate(small_pattern())  # 8 heads, 4 retrieval at 0.5, sink 4 + recent 16
    duo_slots = 4 * context_len + 4 * window
    assert ideal_kv_slots(context_len, 4, 4, pattern.sink, pattern.recent) == duo_slots
    footprint = kv_footprint(pattern, context_len)
    assert (footprint.dense_slots, footprint.duo_slots) == (8 * context_len, duo_slots)
    plan = build_plan(DuoSettings(), pattern, "test", ModelShape("Tiny", "LlamaForCausalLM", 2, 4, 8, 64))
    for dtype_bytes in (1, 2):
        assert plan.capacity_ratio(context_len, dtype_bytes) == 8 * context_len / duo_slots


@pytest.mark.parametrize("path", REFERENCE_SHIPPED, ids=[path.stem for path in REFERENCE_SHIPPED])
def test_reference_import_equals_shipped(path):
    shipped = HeadPattern.load(path)
    imported = pattern_from_reference_dir(REFERENCE_DIR / path.stem)
    assert imported.gates == shipped.gates
    assert imported.model.model_dump(exclude={"aliases"}) == shipped.model.model_dump(exclude={"aliases"})
    assert (imported.sink, imported.recent) == (64, 256)
    assert "sink_size=128, recent_size=256" in imported.provenance.notes


def test_reference_import_needs_shape_for_unknown_model(tmp_path):
    folder = tmp_path / "my-run"
    shutil.copytree(REFERENCE_DIR / "Mistral-7B-Instruct-v0.3", folder)
    with pytest.raises(PatternError, match="architecture and head_dim"):
        pattern_from_reference_dir(folder)
    from_args = pattern_from_reference_dir(folder, architecture="MistralForCausalLM", head_dim=128)
    from_config = pattern_from_reference_dir(folder, model_config=write_hf_config(tmp_path / "model"))
    assert from_args.model.name == "my-run"
    assert from_config.model.architecture == "LlamaForCausalLM"
    assert main(["pattern", "validate", str(folder), "--model", str(tmp_path / "model")]) == 0
    with pytest.raises(PatternError, match="30 x 8"):
        pattern_from_reference_dir(folder, model_config=write_hf_config(tmp_path / "other", num_layers=30))


def test_read_hf_config_defaults(tmp_path):
    write_json(tmp_path / "config.json", {"architectures": ["GPT"], "num_hidden_layers": 2,
                                          "num_attention_heads": 4, "hidden_size": 256})
    assert tuple(read_hf_config(tmp_path)) == ("GPT", 2, 4, 64)


def test_find_bundled_by_name_and_alias():
    assert find_bundled("meta-llama/llama-3.1-8b-instruct").stem == "Meta-Llama-3.1-8B-Instruct"
    assert find_bundled("Mistral-7B-Instruct-v0.2").stem == "Mistral-7B-Instruct-v0.2"
    assert find_bundled("no-such-model") is None


class TestResolvePattern:
    def test_file(self, tmp_path):
        path = write_json(tmp_path / "p.json", small_pattern())
        pattern, source = resolve_pattern(str(path), "/models/anything")
        assert pattern.model.name == "Tiny" and str(path) in source

    def test_bundled_name_and_alias(self):
        assert resolve_pattern("Mistral-7B-Instruct-v0.3", "x")[0].model.name == "Mistral-7B-Instruct-v0.3"
        assert resolve_pattern("mistralai/Mistral-7B-Instruct-v0.3", "x")[0].model.name == "Mistral-7B-Instruct-v0.3"

    def test_reference_folder_wins_over_bundled_name(self, tmp_path, monkeypatch):
        # A folder named like a bundled pattern, holding another model's gates: the folder is used.
        shutil.copytree(REFERENCE_DIR / "Mistral-7B-Instruct-v0.3", tmp_path / "Meta-Llama-3.1-8B-Instruct")
        monkeypatch.chdir(tmp_path)
        pattern, source = resolve_pattern("Meta-Llama-3.1-8B-Instruct", "x")
        assert source.startswith("reference folder")
        assert pattern.gates == HeadPattern.load(find_bundled("Mistral-7B-Instruct-v0.3")).gates

    def test_duo_pattern_json_in_model_folder_wins_over_bundled(self, tmp_path):
        model_dir = tmp_path / "Llama-3.1-8B-Instruct"
        model_dir.mkdir()
        write_json(model_dir / "duo_pattern.json", small_pattern())
        pattern, source = resolve_pattern(None, str(model_dir))
        assert pattern.model.name == "Tiny" and "duo_pattern.json" in source

    @pytest.mark.parametrize("model_path", ["meta-llama/Llama-3.1-8B-Instruct", "/models/llama-3.1-8b-instruct/"])
    def test_bundled_by_model_name(self, model_path):
        pattern, source = resolve_pattern(None, model_path)
        assert pattern.model.name == "Meta-Llama-3.1-8B-Instruct" and source.startswith("bundled pattern")

    def test_nothing_found(self, tmp_path):
        with pytest.raises(PatternError) as caught:
            resolve_pattern(None, str(tmp_path / "SmolLM2-135M"))
        message = str(caught.value)
        assert "\n" not in message
        assert "SmolLM2-135M" in message and "--additional-config" in message and "Mistral-7B-Instruct-v0.2" in message

    def test_unknown_spec(self):
        with pytest.raises(PatternError, match="no head pattern 'nope'.*Meta-Llama-3.1-8B-Instruct"):
            resolve_pattern("nope", "x")


def test_cli_show(capsys, tmp_path):
    heatmap = tmp_path / "gates.png"
    assert main(["pattern", "show", "Meta-Llama-3.1-8B-Instruct", "--sparsity", "0.5", "--heatmap", str(heatmap)]) == 0
    out = capsys.readouterr().out
    row = "".join(f"{count:4d}" for count in README_COUNTS_ABOVE_MEDIAN["Meta-Llama-3.1-8B-Instruct"][:16])
    assert "  heads " + row in out
    assert "128 of 256 KV heads are retrieval (retrieval ratio 0.500)" in out
    assert "sink 64 + recent 256" in out
    assert "saving" in out
    assert heatmap.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_convert_then_validate(capsys, tmp_path):
    out = tmp_path / "l31.json"
    assert main(["pattern", "convert", str(REFERENCE_DIR / "Meta-Llama-3.1-8B-Instruct"), "-o", str(out),
                 "--architecture", "LlamaForCausalLM", "--head-dim", "128", "--alias", "x/y"]) == 0
    assert HeadPattern.load(out).model.aliases == ["x/y"]
    model_dir = write_hf_config(tmp_path / "model")
    capsys.readouterr()
    assert main(["pattern", "validate", str(out), "--model", str(model_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("OK: ") and "matches model" in lines[0]


@pytest.mark.parametrize("argv, named", [
    (["pattern", "show", "no-such-pattern"], "no head pattern 'no-such-pattern'"),
    (["pattern", "show", "Meta-Llama-3.1-8B-Instruct", "--sparsity", "1.5"], "sparsity 1.5"),
    (["pattern", "validate", "Meta-Llama-3.1-8B-Instruct", "--model", "MODEL30"], "but model"),
    (["pattern", "validate", "Meta-Llama-3.1-8B-Instruct", "--model", "/no/such/model"], "cannot read"),
    (["pattern", "convert", "/no/such/folder", "-o", "OUT"], "has no full_attention_heads.tsv"),
    (["pattern", "show", "BAD_JSON"], "is not JSON"),
    (["pattern", "validate", "REFERENCE/config.json"], "convert it once with `vllm-duo pattern convert "),
    (["pattern", "convert", "REFERENCE", "-o", "OUT", "--sparsity", "1.5"], "`sparsity` must be a number in [0, 1]"),
])
def test_cli_user_error_is_one_line_exit_2(capsys, tmp_path, argv, named):
    write_hf_config(tmp_path / "model30", num_layers=30)
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    replacements = {"MODEL30": str(tmp_path / "model30"), "BAD_JSON": str(tmp_path / "bad.json"),
                    "OUT": str(tmp_path / "out.json"), "REFERENCE": str(MISTRAL_REFERENCE),
                    "REFERENCE/config.json": str(MISTRAL_REFERENCE / "config.json")}
    with pytest.raises(SystemExit) as caught:
        main([replacements.get(arg, arg) for arg in argv])
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("vllm-duo: error: ")
    assert named in captured.err


def test_cli_average_is_the_mean_of_the_gates(capsys, tmp_path):
    seeds = []
    for seed in (1, 2, 3):
        data = small_pattern(gates=np.random.default_rng(seed).uniform(size=(2, 4)).round(6).tolist())
        data["provenance"].update(method=f"DuoAttention gate optimization ... 500 steps, ... seed {seed}; float32",
                                  notes=f"final loss 0.{seed} " + "x" * 300)
        seeds.append(write_json(tmp_path / f"seed{seed}.json", data))
    hand_made = write_json(tmp_path / "hand.json", edited(lambda d: d.update(masks={"0.25": TRAINED_AT_025})))
    out = tmp_path / "mean.json"
    assert main(["pattern", "average", *map(str, seeds), str(hand_made), "-o", str(out), "--name", "Mean"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: mean of 4 patterns")

    averaged = HeadPattern.load(out)
    inputs = [HeadPattern.load(path).gates for path in [*seeds, hand_made]]
    assert np.allclose(averaged.gates, np.mean(inputs, axis=0), atol=1e-6)
    assert (averaged.model.name, averaged.sparsity, averaged.sink, averaged.recent) == ("Mean", 0.5, 4, 16)
    assert averaged.masks is None  # an input's trained mask was chosen with its gates, not the mean
    assert averaged.provenance.method == ("mean of the gates of 4 identify runs: seed 1, 500 steps; seed 2, 500 steps; "
                                          "seed 3, 500 steps; hand.json. The runs' methods differ: see each input "
                                          "pattern's provenance.")
    assert "seed1.json: final loss 0.1" in averaged.provenance.notes and len(averaged.provenance.notes) < 3 * 200
    assert main(["pattern", "validate", str(out)]) == 0

    # runs that differ only in seed keep their recipe
    assert main(["pattern", "average", *map(str, seeds), "-o", str(out)]) == 0
    assert HeadPattern.load(out).provenance.method == (
        "mean of the gates of 3 identify runs: seed 1, 500 steps; seed 2, 500 steps; seed 3, 500 steps. Each run: "
        "DuoAttention gate optimization ... 500 steps, ... seed 1; float32")


@pytest.mark.parametrize("edit, named", [
    (lambda data: data.update(small_pattern(num_kv_heads=8)), "2 layers x 8 KV heads"),
    (lambda data: data.update(recent=32), "differ in recent 32 vs 16"),
    (lambda data: data.update(gates=None, retrieval_mask=[[1, 0, 1, 0], [0, 1, 0, 1]]), "only a retrieval mask"),
])
def test_cli_average_refuses_patterns_that_do_not_match(capsys, tmp_path, edit, named):
    first, other = write_json(tmp_path / "a.json", small_pattern()), write_json(tmp_path / "b.json", edited(edit))
    with pytest.raises(SystemExit) as caught:
        main(["pattern", "average", str(first), str(other), "-o", str(tmp_path / "out.json")])
    error = capsys.readouterr().err
    assert caught.value.code == 2 and error.count("\n") == 1 and named in error
    assert not (tmp_path / "out.json").exists()
