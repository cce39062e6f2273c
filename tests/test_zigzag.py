# SPDX-License-Identifier: Apache-2.0
"""ZigzagAttention layer selection: exactness against brute force, the written pattern and the CLI command."""
import itertools
import json

import numpy as np
import pytest

from vllm_duo.pattern import HeadPattern, PatternError, find_bundled
from vllm_duo.tools import zigzag
from vllm_duo.tools.cli import main

SPARSITIES = (0.0, 0.1, 0.25, 0.3, 0.5, 0.7, 0.75, 1.0)
OMEGAS = (0.0, 0.1, 0.5, 1.0, 3.0)


def brute_force(gates, sparsity, omega):
    """Minimum cost and the first optimal streaming-layer set in lexicographic order, by enumeration."""
    num_layers, num_heads = gates.shape
    head_mask = HeadPattern._binarize(gates, sparsity)
    num_streaming = zigzag.num_streaming_layers(sparsity, num_layers)
    best_cost, best = None, None
    for chosen in itertools.combinations(range(num_layers), num_streaming):
        cost = 0.0
        for layer in range(num_layers):
            for head in range(num_heads):
                if layer in chosen and head_mask[layer, head]:
                    cost += gates[layer, head]
                elif layer not in chosen and not head_mask[layer, head]:
                    cost += omega * gates[layer, head]
        if best_cost is None or cost < best_cost - 1e-12:
            best_cost, best = cost, chosen
    return best_cost, set(best)


def cost_of(gates, sparsity, omega, mask):
    to_streaming, to_retrieval = zigzag.layer_costs(gates, HeadPattern._binarize(gates, sparsity), omega)
    return float(np.where(mask[:, 0], to_retrieval, to_streaming).sum())


def check_against_brute_force(gates, sparsity, omega, exact_ties):
    mask = zigzag.zigzag_mask(gates, sparsity, omega)
    assert mask.shape == gates.shape and mask.dtype == bool
    assert (mask.all(axis=1) | ~mask.any(axis=1)).all(), "a row is neither all retrieval nor all streaming"
    streaming = {layer for layer in range(gates.shape[0]) if not mask[layer, 0]}
    assert len(streaming) == zigzag.num_streaming_layers(sparsity, gates.shape[0])
    best_cost, best = brute_force(gates, sparsity, omega)
    assert cost_of(gates, sparsity, omega, mask) == pytest.approx(best_cost, abs=1e-9)
    if exact_ties:  # the lexicographically first optimum is the lower-layer tie rule
        assert streaming == best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_layers,num_heads", [(1, 1), (2, 3), (5, 2), (7, 4), (10, 1), (10, 4)])
def test_matches_brute_force_on_random_gates(seed, num_layers, num_heads):
    rng = np.random.default_rng(seed * 100 + num_layers * 10 + num_heads)
    gates = rng.random((num_layers, num_heads))
    for sparsity, omega in itertools.product(SPARSITIES, OMEGAS):
        check_against_brute_force(gates, sparsity, omega, exact_ties=False)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_layers,num_heads", [(3, 2), (6, 1), (8, 3), (10, 4)])
def test_matches_brute_force_with_ties(seed, num_layers, num_heads):
    # Quarter steps and dyadic omegas keep every sum exact, so equal costs are really equal.
    rng = np.random.default_rng(seed + 1000 * num_layers + num_heads)
    gates = rng.integers(0, 5, size=(num_layers, num_heads)) / 4.0
    gates[rng.integers(num_layers)] = gates[0]  # at least two identical layers
    for sparsity, omega in itertools.product(SPARSITIES, (0.0, 0.25, 0.5, 1.0, 2.0)):
        check_against_brute_force(gates, sparsity, omega, exact_ties=True)


def test_all_equal_layers_tie_to_lower_index():
    # Every layer has one retrieval head of gate 1 and one streaming head of gate 0: all differences are 1.
    mask = zigzag.zigzag_mask(np.tile([1.0, 0.0], (6, 1)), 0.5, 0.1)
    assert mask[:, 0].tolist() == [False, False, False, True, True, True]


def test_select_streaming_layers_is_the_smallest_differences():
    streaming = zigzag.select_streaming_layers(np.array([3.0, 1.0, 2.0, 1.0]), np.array([0.0, 0.0, 0.5, 0.0]), 2)
    assert streaming.tolist() == [False, True, False, True]


@pytest.mark.parametrize("sparsity,num_layers,expected", [
    (0.5, 32, 16), (0.0, 7, 0), (1.0, 7, 7), (0.5, 5, 3), (0.5, 3, 2), (0.35, 10, 4), (0.7, 10, 7), (0.24, 10, 2)])
def test_num_streaming_layers_rounds_half_up(sparsity, num_layers, expected):
    assert zigzag.num_streaming_layers(sparsity, num_layers) == expected


def test_bad_arguments_are_one_line_errors():
    gates = np.full((4, 2), 0.5)
    for call in (lambda: zigzag.zigzag_mask(gates, 1.5), lambda: zigzag.zigzag_mask(gates, float("nan")),
                 lambda: zigzag.zigzag_mask(gates, 0.5, omega=-0.1),
                 lambda: zigzag.zigzag_mask(np.full((4, 2), np.nan), 0.5), lambda: zigzag.zigzag_mask(gates[0], 0.5)):
        with pytest.raises(PatternError) as error:
            call()
        assert "\n" not in str(error.value)


def small_pattern(**changes):
    data = {
        "schema_version": 1,
        "model": {"name": "tiny", "architecture": "LlamaForCausalLM", "num_layers": 4, "num_kv_heads": 3,
                  "head_dim": 8},
        "gates": [[0.9, 0.1, 0.2], [0.1, 0.0, 0.05], [0.8, 0.9, 0.3], [0.4, 0.6, 0.5]],
        "sparsity": 0.5,
        "sink": 4,
        "recent": 16,
        "provenance": {"source": "unit test", "method": "hand-made", "date": "2025-01-01", "license": "MIT"},
    }
    data.update(changes)
    return HeadPattern.model_validate(data)


def test_zigzag_pattern_validates_and_round_trips(tmp_path):
    source = small_pattern()
    result = zigzag.zigzag_pattern(source, 0.5, 0.1, date="2025-02-03")
    assert result.layer_exclusive is True
    assert result.gates == source.gates
    assert result.retrieval_mask == [[0, 0, 0], [0, 0, 0], [1, 1, 1], [1, 1, 1]]
    assert result.sparsity == 0.5
    assert np.array_equal(result.retrieval_mask_at(), np.array(result.retrieval_mask, dtype=bool))
    assert result.retrieval_counts(0.5) == [0, 0, 3, 3]
    assert "ZigzagAttention" in result.provenance.method and "omega 0.1" in result.provenance.method
    assert "pattern tiny" in result.provenance.method and "hand-made" in result.provenance.method
    assert (result.provenance.source, result.provenance.date, result.provenance.license) == \
        ("unit test", "2025-02-03", "MIT")
    result.save(tmp_path / "z.json")
    loaded = HeadPattern.load(tmp_path / "z.json")
    assert loaded.model_dump() == result.model_dump()
    assert HeadPattern.model_validate(json.loads((tmp_path / "z.json").read_text())).layer_exclusive


def test_realized_sparsity_is_the_layer_fraction():
    result = zigzag.zigzag_pattern(small_pattern(), 0.3)  # round(1.2) = 1 of 4 layers
    assert result.sparsity == 0.25
    assert sum(result.retrieval_counts()) == 9


def test_mask_only_pattern_is_refused():
    source = small_pattern(gates=None, sparsity=None, retrieval_mask=[[1, 0, 0], [0, 0, 0], [1, 1, 0], [1, 1, 1]])
    with pytest.raises(PatternError, match="only a retrieval mask") as error:
        zigzag.zigzag_pattern(source, 0.5)
    assert "\n" not in str(error.value)


def test_cli_writes_a_pattern_that_show_reads(tmp_path, capsys):
    source, out = tmp_path / "in.json", tmp_path / "out.json"
    small_pattern().save(source)
    assert main(["pattern", "zigzag", str(source), "--sparsity", "0.5", "--omega", "0.2", "-o", str(out)]) == 0
    assert "2 of 4 layers streaming" in capsys.readouterr().out
    assert HeadPattern.load(out).layer_exclusive
    assert main(["pattern", "show", str(out)]) == 0
    report = capsys.readouterr().out
    assert "6 of 12 KV heads are retrieval" in report
    assert main(["pattern", "validate", str(out)]) == 0


def test_cli_mask_only_pattern_is_a_one_line_error(tmp_path, capsys):
    source = tmp_path / "mask.json"
    small_pattern(gates=None, sparsity=None, retrieval_mask=[[1, 0, 0], [0, 0, 0], [1, 1, 0], [1, 1, 1]]).save(source)
    with pytest.raises(SystemExit) as exit_info:
        main(["pattern", "zigzag", str(source), "--sparsity", "0.5", "-o", str(tmp_path / "out.json")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("vllm-duo: error: pattern ") and error.count("\n") == 1
    assert not (tmp_path / "out.json").exists()


def test_bundled_llama_31_at_half_sparsity(tmp_path, capsys):
    out = tmp_path / "llama.json"
    assert main(["pattern", "zigzag", "Meta-Llama-3.1-8B-Instruct", "--sparsity", "0.5", "-o", str(out)]) == 0
    capsys.readouterr()
    result = HeadPattern.load(out)
    mask = np.array(result.retrieval_mask, dtype=bool)
    assert (~mask.any(axis=1)).sum() == 16 and mask.all(axis=1).sum() == 16
    assert result.sparsity == 0.5 and result.layer_exclusive
    source = HeadPattern.load(find_bundled("Meta-Llama-3.1-8B-Instruct"))
    assert np.array_equal(mask, zigzag.zigzag_mask(np.array(source.gates), 0.5))
    assert result.gates == source.gates


@pytest.mark.parametrize("sparsity", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("omega", [0.1, 0.4])
def test_layer_gates_stream_the_lowest_layers(sparsity, omega):
    """Gates trained per layer (identify --layer-gates, constant rows): zigzag_pattern streams the layers with the
    smallest gates, as ZigzagAttention's layer-wise fine-tuning intends. SmolLM2's shape (30 layers x 3 KV heads):
    at 25% and 75% the head-level mask leaves one layer split, which the transport must still resolve that way."""
    layer_gates = np.random.default_rng(3).permutation(np.linspace(0.05, 0.95, 30))
    shape = {"name": "tiny", "architecture": "LlamaForCausalLM", "num_layers": 30, "num_kv_heads": 3, "head_dim": 8}
    source = small_pattern(model=shape, gates=np.repeat(layer_gates[:, None], 3, axis=1).tolist())
    mask = np.array(zigzag.zigzag_pattern(source, sparsity, omega).retrieval_mask, dtype=bool)
    streaming = np.flatnonzero(~mask.any(axis=1))
    assert sorted(streaming) == sorted(np.argsort(layer_gates)[:zigzag.num_streaming_layers(sparsity, 30)])
