# SPDX-License-Identifier: Apache-2.0
"""A tiny passkey eval through the CLI (one 512-token context; dense, duo and zigzag 50%): the outputs exist and make
sense."""
import json

from vllm_duo import cli, evaluate


def test_streaming_window_matches_the_duo_budget():
    # 90 heads at sparsity 0.5: 45 retrieval; T = 1010, sink 64 + recent 256.
    assert evaluate.num_retrieval(90, 0.5) == 45 and evaluate.num_retrieval(90, 1.0) == 0
    recent = evaluate.streaming_recent(90, 0.5, 1010, 64, 256)
    assert recent == (45 * 1010 + 45 * 320) // 90 - 64
    assert abs(90 * (64 + recent) - evaluate.duo_kv_slots(90, 0.5, 1010, 64, 256)) < 90


def test_tiny_eval_through_the_cli(smollm2_dir, tmp_path, capfd):  # capfd: vLLM needs a real stdout fileno
    out = tmp_path / "eval"
    assert cli.main(["eval", "--model", smollm2_dir, "--methods", "full", "duo50", "zigzag50", "--contexts", "512",
                     "--depths", "0.5", "--samples", "1", "--out", str(out), "--no-progress"]) == 0
    assert "results.md" in capfd.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert [m["method"] for m in results["methods"]] == ["full", "duo50", "zigzag50"]
    for method in results["methods"]:
        assert 0.0 <= method["accuracy"] <= 1.0
        assert (out / f"heatmap-{method['method']}.png").stat().st_size > 0
    zigzag = json.loads((out / "zigzag50-pattern.json").read_text())
    assert zigzag["layer_exclusive"] and {sum(row) for row in zigzag["retrieval_mask"]} == {0, 3}
    assert len(results["records"]) == 3 and results["records"][0]["prompt_tokens"] <= 512
    assert (out / "heatmaps.png").is_file() and "| duo50 |" in (out / "results.md").read_text()
