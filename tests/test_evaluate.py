# SPDX-License-Identifier: Apache-2.0
"""A tiny passkey eval through the CLI (one 512-token context; dense, duo and zigzag 50%): the outputs exist and make
sense."""
import json

import pytest

from vllm_duo.tools import cli
from vllm_duo.tools.accuracy import eval_report, evaluate


def test_streaming_window_matches_the_duo_budget():
    # 90 heads at sparsity 0.5: 45 retrieval; T = 1010, sink 64 + recent 256.
    assert evaluate.num_retrieval(90, 0.5) == 45 and evaluate.num_retrieval(90, 1.0) == 0
    recent = evaluate.streaming_recent(90, 0.5, 1010, 64, 256)
    assert recent == (45 * 1010 + 45 * 320) // 90 - 64
    assert abs(90 * (64 + recent) - evaluate.duo_kv_slots(90, 0.5, 1010, 64, 256)) < 90


# (full's answers, the method's answers, lost, gained, 95% interval in points): hand-computed Agresti-Min intervals
PAIRED_CASES = [
    ([True] * 50 + [False] * 30, [True] * 46 + [False] * 4 + [True] * 2 + [False] * 28, 4, 2, (-8.74, 3.86)),
    ([True] * 12, [True] * 12, 0, 0, (-14.0, 14.0)),  # no answer differs: still +-1.96 / 14
    ([True] * 12, [False] * 12, 12, 0, (-100.0, -62.65)),  # clipped at -100
]


@pytest.mark.parametrize("full, method, lost, gained, interval", PAIRED_CASES)
def test_paired_difference_with_full_attention(full, method, lost, gained, interval):
    records = [{"method": name, "context_len": 1000, "depth": 0.5, "sample": i, "correct": correct}
               for name, answers in (("full", full), ("duo50", method)) for i, correct in enumerate(answers)]
    got = eval_report.paired_with_full(records, "full", "duo50")
    assert got[:3] == (lost, gained, len(full))
    assert got[3:] == pytest.approx(interval, abs=0.01)


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

    # --report-only redraws the report from results.json, running nothing
    (out / "results.md").unlink()
    assert cli.main(["eval", "--report-only", "--out", str(out)]) == 0
    assert "| zigzag50 |" in (out / "results.md").read_text()
