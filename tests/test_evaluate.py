# SPDX-License-Identifier: Apache-2.0
"""The eval's prompts (both families), its paired intervals and its guard against a weak reference without an engine;
then a tiny eval through the CLI (one 512-token context, one short classic passkey; dense, duo and zigzag 50%): the
outputs exist and make sense."""
import json
import re

import pytest

from vllm_duo.tools import cli
from vllm_duo.tools.accuracy import eval_report, evaluate, needles, passkey


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("template", needles.TEMPLATES)
def test_prompts_hide_the_needle_from_streaming_heads(tokenizer, smollm2_dir, template):
    settings = evaluate.EvalSettings(model=smollm2_dir, out="-", families=("needles",), contexts=(600, 1500),
                                     depths=(0.0, 0.5, 1.0), samples=12, template=template, sink=64, recent=256)
    cases = evaluate.make_cases(tokenizer, settings)
    assert len(cases) == 2 * 3 * 12
    # every pair of needle phrasing and haystack style in each cell
    assert {(c.needle, c.haystack) for c in cases if c.context_len == 600 and c.depth == 0.5} == {
        (n, h) for n in needles.DEFAULT_NEEDLES for h in needles.HAYSTACKS}
    for case in cases:
        text = tokenizer.decode(case.prompt)
        needle = needles.NEEDLES[case.needle]
        tail = text[text.rindex(needle.question) - (2 if template == "chat" else 1):]  # as needle_prompt encodes it
        question_start = len(case.prompt) - len(tokenizer(tail, add_special_tokens=False).input_ids)
        fact_len = len(tokenizer(" " + needle.fact.format(key=case.key), add_special_tokens=False).input_ids)
        assert case.context_len - 20 < len(case.prompt) + len(tokenizer(" " + case.key).input_ids) <= case.context_len
        assert re.findall(r"\d+", text.split("<|im_start|>user")[-1]) == [case.key] * text.count(case.key)
        assert text.endswith(needle.answer) and (template == "chat") == ("<|im_start|>assistant" in text)
        fact = tokenizer.decode(case.prompt[case.needle_start:]).lstrip()
        assert fact.startswith(needle.fact.format(key=case.key))
        assert case.needle_start >= 64
        assert case.needle_start + fact_len <= question_start - 256  # the needle ends before every query's window
    # depth 0 and 1 are the first and last places outside the window: the needle moves with depth
    starts = {c.depth: c.needle_start for c in cases if c.context_len == 1500 and c.sample == 0}
    assert starts[0.0] < starts[0.5] < starts[1.0]
    assert starts[0.0] < 64 + 40 and starts[1.0] > 1500 - 256 - 120


def test_classic_passkey_prompts_are_the_published_test(tokenizer, smollm2_dir):
    """Word for word the classic test (issue 31): intro, the paragraph repeated, the needle after int(R x depth)
    repeats (a depth drawn per prompt), the question; SmolLM2 token counts as measured there (1,506 tokens at 60
    repeats ... 7,026 at 290)."""
    settings = evaluate.EvalSettings(model=smollm2_dir, out="-", families=("passkey",),
                                     passkey_repeats=evaluate.DEFAULT_PASSKEY_REPEATS, depths=(0.1, 0.5, 0.9),
                                     samples=2)
    cases = evaluate.make_cases(tokenizer, settings)
    assert len(cases) == 5 * 3 * 2 and {c.family for c in cases} == {"passkey"}
    assert all(c.context_len == {60: 1506, 110: 2706, 170: 4146, 230: 5586, 290: 7026}[c.row] for c in cases)
    depths = [c.depth for c in cases]  # drawn per prompt in [0.1, 0.9], not one per grid cell
    assert min(depths) >= 0.1 and max(depths) <= 0.9 and len(set(depths)) == len(cases)
    columns = [evaluate.depth_column(d, (0.1, 0.5, 0.9)) for d in (0.1, 0.29, 0.31, 0.7, 0.71)]
    assert columns == [0.1, 0.1, 0.5, 0.5, 0.9]
    for case in cases:
        text = tokenizer.decode(case.prompt)
        before = int(case.row * case.depth)
        assert text == (passkey.CLASSIC_INTRO + passkey.CLASSIC_FILLER * before
                        + passkey.CLASSIC_NEEDLE.format(key=case.key) + passkey.CLASSIC_FILLER * (case.row - before)
                        + passkey.CLASSIC_QUESTION)
        assert re.findall(r"\d+", text) == [case.key, case.key]
        assert tokenizer.decode(case.prompt[case.needle_start:]).lstrip().startswith(f"The pass key is {case.key}.")
        assert "pass" not in tokenizer.decode(case.prompt[:case.needle_start])
    assert len({c.key for c in cases}) == len(cases)
    assert case.correct(f"\n{case.key}.") and not case.correct(case.key[:4])  # anywhere in the answer


@pytest.mark.parametrize("name, kind, sparsity, kv_cache, recent, reference, squeeze", [
    ("duo50", "duo", 0.5, "", None, "full", None),
    ("duo50-fp8", "duo", 0.5, "-fp8", None, "full-fp8", None),
    ("duo50-fp8calc-r512", "duo", 0.5, "-fp8calc", 512, "full", None),  # no full-fp8calc in the eval: full
    ("full-fp8", "full", 0.0, "-fp8", None, "full", None),
    ("full", "full", 0.0, "", None, None, None),
    ("streaming50-r384", "streaming", 0.5, "", 384, "full", None),
    ("duo50-fp8-sq25-r512", "duo", 0.5, "-fp8", 512, "full-fp8", 0.25),
    ("duo50-sq12k32", "duo", 0.5, "", None, "full", 0.12)])
def test_methods_name_their_kv_cache_window_and_reference(name, kind, sparsity, kv_cache, recent, reference, squeeze):
    method = evaluate.Method.parse(name)
    assert (method.kind, method.sparsity, method.kv_cache, method.recent) == (kind, sparsity, kv_cache, recent)
    assert method.squeeze == squeeze and method.keys_per_cluster == (32 if name.endswith("k32") else None)
    assert method.reference(["full", "full-fp8", name]) == reference
    assert evaluate.KV_CACHE_ARGS[kv_cache].get("kv_cache_dtype") == ("fp8" if kv_cache else None)


@pytest.mark.parametrize("name, keys_per_cluster", [("duo50-sq12", None), ("duo50-sq12k32", 32)])
def test_a_squeezed_method_engine_takes_its_budget_and_keys_per_cluster(name, keys_per_cluster):
    settings = evaluate.EvalSettings(model="m", out="o", sink=64, recent=256)
    [(duo, _cases)] = evaluate._engine_runs(settings, evaluate.Method.parse(name), 3, {}, [])
    assert duo["squeeze"]["budget"] == 0.12
    assert duo["squeeze"].get("keys_per_cluster") == keys_per_cluster


@pytest.mark.parametrize("name", ["full50", "duo", "duo50-fp16", "duo50-r", "duo50-r512-fp8", "duo101",
                                  "zigzag50-sq25", "duo50-sq0", "duo50-r512-sq25", "duo50-sq12k0",
                                  "duo50-k32"])
def test_a_method_name_out_of_the_grammar_is_one_line(name):
    with pytest.raises(evaluate.PatternError, match="optionally with -fp8 or -fp8calc"):
        evaluate.Method.parse(name)


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
    records = [{"method": name, "family": "needles", "row": 1000, "depth": 0.5, "sample": i, "correct": correct}
               for name, answers in (("full", full), ("duo50", method)) for i, correct in enumerate(answers)]
    got = eval_report.paired_with_full(records, "full", "duo50")
    assert got[:3] == (lost, gained, len(full))
    assert got[3:] == pytest.approx(interval, abs=0.01)


def test_paired_difference_per_family_and_row():
    records = [{"method": name, "family": family, "row": c, "depth": 0.5, "sample": i,
                "correct": name == "full" or c == 1000}
               for name in ("full", "duo50") for family in ("needles", "passkey") for c in (1000, 2000)
               for i in range(10)]
    assert eval_report.paired_with_full(records, "full", "duo50", "needles", 1000)[:3] == (0, 0, 10)
    assert eval_report.paired_with_full(records, "full", "duo50", "needles", 2000)[:3] == (10, 0, 10)
    assert eval_report.paired_with_full(records, "full", "duo50", "passkey")[:3] == (10, 0, 20)
    assert eval_report.paired_with_full(records, "full", "duo50")[:3] == (20, 0, 40)


def _results(full_correct: int, prompts: int = 10) -> dict:
    """A hand-made results.json of the eval before the passkey family: full attention right on `full_correct` of
    `prompts`, duo50 on all but one."""
    settings = {"model": "m", "contexts": [1000], "depths": [0.5], "samples": prompts, "max_tokens": 8}
    records = [{"method": name, "context_len": 1000, "depth": 0.5, "sample": i, "needle": "passkey",
                "haystack": "story", "correct": i < (full_correct if name == "full" else prompts - 1)}
               for name in ("full", "duo50") for i in range(prompts)]
    methods = [{"method": name, "kind": kind, "accuracy": accuracy, "by_context": {"1000": accuracy},
                "grid": [[accuracy]], "kv_fraction": {"1000": 1.0}}
               for name, kind, accuracy in (("full", "full", full_correct / prompts), ("duo50", "duo", 0.9))]
    machine = {"device": "cpu", "vllm_version": "-", "torch_version": "-", "vllm_duo_commit": "-"}
    return {"settings": settings, "command": "vllm-duo eval", "started": "-", "machine": machine, "pattern": "p",
            "methods": methods, "engines": [], "records": records}


@pytest.mark.parametrize("full_correct, code", [(9, 0), (8, 3)])
def test_an_eval_whose_full_attention_misses_10_percent_warns_and_exits_3(tmp_path, capsys, full_correct, code):
    (tmp_path / "results.json").write_text(json.dumps(_results(full_correct)))
    assert cli.main(["eval", "--report-only", "--out", str(tmp_path)]) == code
    report, printed = (tmp_path / "results.md").read_text(), capsys.readouterr().out
    assert ("WARNING: full attention answers 80.0% of the needles prompts" in report) == (code == 3)
    assert ("cannot see a loss" in printed) == (code == 3)
    assert "| duo50 | +" in report or "| duo50 | -" in report  # the per-context interval table


@pytest.mark.parametrize("grid, contexts, repeats, samples", [
    ([], evaluate.CPU_CONTEXTS, evaluate.CPU_PASSKEY_REPEATS, evaluate.CPU_SAMPLES),
    (["--samples", "3"], evaluate.DEFAULT_CONTEXTS, evaluate.DEFAULT_PASSKEY_REPEATS, 3),
    (["--contexts", "1000"], (1000,), evaluate.CPU_PASSKEY_REPEATS, evaluate.DEFAULT_SAMPLES),
    (["--passkey-repeats", "9"], evaluate.CPU_CONTEXTS, (9,), evaluate.DEFAULT_SAMPLES)])
def test_a_cpu_eval_without_a_grid_runs_a_small_one_and_says_what_it_runs(tmp_path, monkeypatch, capsys, grid,
                                                                            contexts, repeats, samples):
    """On a CPU the default grid takes hours: without --contexts and --samples the eval runs a small one, and it says
    first what it runs, about how long that takes, and how to ask for the full grid."""
    class Ran(Exception):
        pass

    def evaluate_nothing(settings, progress):
        raise Ran(settings)

    monkeypatch.setattr(evaluate, "_on_cpu", lambda: True)
    monkeypatch.setattr(evaluate, "evaluate", evaluate_nothing)
    args = cli.build_parser().parse_args(["eval", "--model", "/models/smol", "--out", str(tmp_path), *grid])
    with pytest.raises(Ran) as ran:
        evaluate.command(args)
    settings = ran.value.args[0]
    assert (settings.contexts, settings.passkey_repeats, settings.samples) == (contexts, repeats, samples)
    lines = capsys.readouterr().err.splitlines()
    prompts = (len(contexts) + len(repeats)) * len(evaluate.DEFAULT_DEPTHS) * samples
    assert lines[0].startswith(f"vllm-duo eval: 7 methods x {prompts} prompts (")
    assert re.search(r"; about [\d.]+ (min|h) on 2 idle CPU cores", lines[0])
    assert any("the full grid: --contexts 1000 2000 3000 4500 6000 --passkey-repeats 60 110 170 230 290 --samples 16"
               in line for line in lines) == (grid != ["--samples", "3"])


def test_tiny_eval_through_the_cli(smollm2_dir, tmp_path, capfd):  # capfd: vLLM needs a real stdout fileno
    out = tmp_path / "eval"
    code = cli.main(["eval", "--model", smollm2_dir, "--methods", "full", "duo50", "zigzag50", "--contexts", "512",
                     "--passkey-repeats", "12", "--depths", "0.5", "--samples", "1", "--out", str(out),
                     "--recent", "256",  # not the pattern's 512: a 512-token prompt then has room for a needle
                     "--no-progress"])
    assert "results.md" in capfd.readouterr().out
    results = json.loads((out / "results.json").read_text())
    full = results["methods"][0]["families"]
    assert set(full) == {"needles", "passkey"} and full["passkey"]["row_tokens"]["12"] > 300
    assert code == (3 if min(family["accuracy"] for family in full.values()) < 0.9 else 0)
    assert [m["method"] for m in results["methods"]] == ["full", "duo50", "zigzag50"]
    for method in results["methods"]:
        for family in ("needles", "passkey"):
            assert 0.0 <= method["families"][family]["accuracy"] <= 1.0
            assert (out / f"heatmap-{family}-{method['method']}.png").stat().st_size > 0
    zigzag = json.loads((out / "zigzag50-pattern.json").read_text())
    assert zigzag["layer_exclusive"] and {sum(row) for row in zigzag["retrieval_mask"]} == {0, 3}
    assert len(results["records"]) == 6 and results["records"][0]["prompt_tokens"] <= 512
    report = (out / "results.md").read_text()
    assert (out / "heatmaps-passkey.png").is_file() and "## Classic passkey" in report
    assert report.count("| duo50 | ") >= 4  # summary and per-row tables of both families

    # --report-only redraws the report from results.json, running nothing
    (out / "results.md").unlink()
    assert cli.main(["eval", "--report-only", "--out", str(out)]) == code
    assert "| zigzag50 |" in (out / "results.md").read_text()
