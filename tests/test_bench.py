# SPDX-License-Identifier: Apache-2.0
"""`vllm-duo bench`: the tiny workloads end to end on the CPU stack (dense and duo through vLLM's own `bench
throughput`, a zigzag server and its `bench serve` clients, the chat client, the ceiling), plus the parts that need no
vLLM run: commands, log parsing, overrides, failures, the report."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines import random_pattern
from vllm_duo.tools import cli
from vllm_duo.tools.bench import logs, offline, roofline, workloads
from vllm_duo.tools.bench import report as bench_report
from vllm_duo.tools.bench.settings import Settings
from vllm_duo.tools.processes import run_logged

ROOT = Path(__file__).resolve().parents[1]
LLAMA_8B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 14336,
            "vocab": 128256}


def smollm2_pattern(tmp_path) -> str:
    if (ROOT / "patterns" / "SmolLM2-135M-Instruct.json").exists():
        return "SmolLM2-135M-Instruct"
    return random_pattern(tmp_path / "pattern.json")


@pytest.fixture
def subprocess_env(monkeypatch):
    """What the bench's vLLM subprocesses inherit: a 1 GiB CPU KV cache, no hub access, vLLM's own defaults."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)  # conftest's, for in-process engines
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # conftest's, for the kernel tests


def test_tiny_dense_vs_duo_on_cpu(smollm2_dir, tmp_path, subprocess_env):
    """Dense and duo through `bench throughput`, on the offline shared-documents path, whose prompts reach vLLM as
    token ids."""
    out = tmp_path / "results"
    start = time.monotonic()
    code = cli.main(["bench", "--workloads", "tiny_docs_full", "--model", smollm2_dir, "--sparsity", "0.5",
                     "--pattern", smollm2_pattern(tmp_path), "--out", str(out), "--timeout", "170"])
    elapsed = time.monotonic() - start
    assert code == 0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the caller's SIGTERM handling is back

    results = json.loads((out / "results.json").read_text())
    runs = {run["backend"]: run for run in results["runs"]}
    assert set(runs) == {"dense", "duo s=0.5"}
    for run in runs.values():
        assert run["status"] == "ok", run.get("log_tail")
        assert "-m vllm_duo.tools.bench --pretokenized bench throughput" in run["command"]
        assert run["metrics"]["output_tok_s"] > 0 and run["metrics"]["total_tok_s"] > 0
        assert run["kv_cache_tokens"] > 0 and run["max_concurrency"] > 0 and run["max_concurrency_len"] == 1024
        assert run["device"] and run["vllm_version"] and run["torch_version"] and run["vllm_duo_commit"]
    duo_run, dense_run = runs["duo s=0.5"], runs["dense"]
    assert "--attention-backend duo" in duo_run["command"] and "--attention-backend" not in dense_run["command"]
    assert "duo: pattern" in (out / duo_run["log"]).read_text()  # the plugin's own line: duo really ran
    assert "duo:" not in (out / dense_run["log"]).read_text()
    assert duo_run["retrieval_ratio"] == pytest.approx(0.5, abs=0.1)

    report = (out / "results.md").read_text()
    assert "## tiny_docs_full" in report and "| duo s=0.5 |" in report and "duo/dense" in report
    assert "(plots/maximum_concurrency_vs_sparsity.png)" in report
    assert (out / "plots" / "maximum_concurrency_vs_sparsity.png").stat().st_size > 0
    assert elapsed < 300, f"the tiny bench took {elapsed:.0f} s"  # 140 s alone on 2 cores, 190 beside another test


def test_tiny_zigzag_serve_sweep_on_cpu(smollm2_dir, tmp_path, subprocess_env):
    """The server path as tpot_sweep uses it: one server, one `bench serve` client per prompt length; the server is
    zigzag's, so its layer-exclusive pattern file is written and vLLM serves it through duo."""
    out = tmp_path / "results"
    code = cli.main(["bench", "--workloads", "tiny_serve", "--model", smollm2_dir, "--zigzag-sparsity", "0.5",
                     "--only", "zigzag", "--set", "tiny_serve.input_lens=64,128", "tiny_serve.max_concurrency=2",
                     "--pattern", smollm2_pattern(tmp_path), "--out", str(out), "--timeout", "170"])
    assert code == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(run["phase"], run["input_len"]) for run in runs] == [("in=64 rate=inf", 64), ("in=128 rate=inf", 128)]
    for run in runs:
        assert run["status"] == "ok", run.get("log_tail")
        assert run["backend"] == "zigzag s=0.5" and run["layer_exclusive"]
        assert run["pattern"] == str((out / "patterns" / "zigzag-0.5.json").resolve())
        assert "--max-concurrency 2" in run["command"] and run["client_concurrency"] == 2
        assert run["metrics"]["completed"] == 4 and run["metrics"]["median_itl_ms"] > 0
        # the server's own counters over the client's run: its steps and the TTFT's parts
        assert run["metrics"]["engine_steps"] >= 4 and run["metrics"]["engine_mean_prefill_ms"] > 0
        assert 0 <= run["metrics"]["engine_mean_queue_ms"] < run["metrics"]["engine_mean_ttft_ms"]
        assert run["server_log"] == runs[0]["server_log"]  # both clients against one server
    heads = re.search(r"retrieval heads per layer \[([\d, ]+)\]", (out / runs[0]["server_log"]).read_text()).group(1)
    per_layer = [int(n) for n in heads.split(", ")]
    assert set(per_layer) == {0, 3} and per_layer.count(0) == 15  # 15 of 30 layers streaming, the rest retrieval
    assert "| zigzag s=0.5 | 128 | inf |" in (out / "results.md").read_text()


def test_side_by_side_servers_take_their_clients_in_turn_on_cpu(smollm2_dir, tmp_path, subprocess_env):
    """--side-by-side: dense's and duo's servers up at once, a repeated point's clients against them in turn (dense,
    duo, then duo, dense), each run recorded against its own server with the same prompts as the other's."""
    out = tmp_path / "results"
    code = cli.main(["bench", "--workloads", "tiny_serve", "--model", smollm2_dir, "--sparsity", "0.5",
                     "--set", "tiny_serve.input_lens=64", "tiny_serve.repeats=2", "--side-by-side",
                     "--pattern", smollm2_pattern(tmp_path), "--out", str(out), "--timeout", "170"])
    assert code == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(run["backend"], run["repeat"]) for run in runs] == [("dense", 1), ("duo s=0.5", 1), ("duo s=0.5", 2),
                                                                 ("dense", 2)]
    for run in runs:
        assert run["status"] == "ok", run.get("log_tail")
        assert run["servers_side_by_side"] == 2 and run["metrics"]["completed"] == 4
        assert run["server_log"].endswith(("__dense__server.log", "__duo-s-0.5__server.log"))
        # each server's counters count its own clients' requests alone
        assert run["metrics"]["engine_steps"] >= 4
    assert runs[0]["server_log"] == runs[3]["server_log"] != runs[1]["server_log"] == runs[2]["server_log"]
    assert runs[0]["command"].split("--seed ")[1].split()[0] == runs[1]["command"].split("--seed ")[1].split()[0]
    servers = {(out / run["server_log"]).read_text().splitlines()[0] for run in runs}
    assert len(servers) == 2 and all("--gpu-memory-utilization 0.44" in line for line in servers)
    # the two were up together: duo's server started before dense's served its last client
    assert runs[1]["server_startup_s"] > 0 and runs[0]["finished_at"] <= runs[3]["started_at"]
    assert "servers ran side by side" in (out / "results.md").read_text()


def test_multi_turn_chat_hits_the_prefix_cache_on_cpu(smollm2_dir, tmp_path, subprocess_env):
    """The multi-turn chat client (chat.py) against a duo server: 2 chats of 3 turns, each turn resending the
    conversation; the server's own counters give the hit rate. (shared_docs is vLLM's `prefix_repetition` client
    with the same hit counting: its command is checked in the dry run below.)"""
    out = tmp_path / "results"
    code = cli.main(["bench", "--workloads", "tiny_chat", "--model", smollm2_dir, "--sparsity", "0.5", "--only", "duo",
                     "--pattern", smollm2_pattern(tmp_path), "--out", str(out), "--timeout", "170"])
    assert code == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["status"] == "ok", run.get("log_tail")
    assert "--enable-prefix-caching" in run["server_command"]
    metrics = run["metrics"]
    assert metrics["completed"] == 6 and metrics["failed"] == 0 and metrics["output_tok_s"] > 0
    assert len(metrics["median_ttft_ms_by_turn"]) == 3
    assert metrics["prefix_cache_hit_rate"] > 0.4  # turns 2 and 3 resend what turns 1 and 2 prefilled (61% measured)
    (raw,) = (out / "json").glob("tiny_chat*.json")
    turns = json.loads(raw.read_text())["turns"]
    assert sorted((t["conversation"], t["turn"]) for t in turns) == [(c, n) for c in range(2) for n in range(3)]
    assert all(0 < t["ttft_ms"] <= t["latency_ms"] for t in turns)
    report = (out / "results.md").read_text()
    assert "prefix cache hits" in report and "turn 3 TTFT ms" in report


def test_tiny_ceiling_dense_vs_duo_on_cpu(smollm2_dir, tmp_path, subprocess_env):
    """The single-request ceiling on a 1 GiB CPU cache: 65,536 tokens fit neither backend, so each startup fails with
    vLLM's estimate, which is the measurement (no failed run); duo 50% holds about twice dense's."""
    out = tmp_path / "results"
    code = cli.main(["bench", "--workloads", "tiny_ceiling", "--model", smollm2_dir, "--sparsity", "0.5",
                     "--pattern", smollm2_pattern(tmp_path), "--out", str(out), "--timeout", "170"])
    assert code == 0
    runs = {run["backend"]: run for run in json.loads((out / "results.json").read_text())["runs"]}
    assert set(runs) == {"dense", "duo s=0.5"}
    for run in runs.values():
        assert run["status"] == "ok" and run["returncode"] != 0, run.get("log_tail")
        assert not run["metrics"]["lower_bound"] and run["metrics"]["accepted_len"] < 65536
        assert run["command"].startswith("VLLM_CPU_KVCACHE_SPACE=1 VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 ")
    dense_len, duo_len = (runs[b]["metrics"]["accepted_len"] for b in ("dense", "duo s=0.5"))
    assert duo_len > 1.6 * dense_len  # 46,160 / 23,296 = 1.98x measured
    report = (out / "results.md").read_text()
    assert "| backend | longest request (tokens) | duo/dense |" in report
    assert f"| duo s=0.5 | {duo_len:,} | {duo_len / dense_len:.2f}x |" in report
    assert "## Failed runs" not in report


def test_dry_run_prints_every_vllm_command(tmp_path, capsys):
    assert cli.main(["bench", "--model", "/models/llama8b", "--tokenizer", "/models/smol", "--sparsity", "0.5",
                     "--capacity-sparsity", "0.25", "0.5", "--pattern", "Meta-Llama-3.1-8B-Instruct",
                     "--out", str(tmp_path / "dry"), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    commands = [line for line in printed.splitlines() if not line.startswith("#")]
    # capacity and ceiling 3 each + (decode, prefill, short, shared_docs_full, shared_doc_64k) 2 each + tpot 4 + ttft 2
    # + serve 2 x (server + 2 rates) + tpot_sweep 2 x (server + 5 prompt lengths)
    # + short_itl 2 x (server + 2 prompt lengths x 3 runs) + shared_docs 2 x (server + 2 rates)
    # + chat_turns and repeat_32k 2 x (server + 1 client) each
    assert len(commands) == 3 + 3 + 10 + 4 + 2 + 6 + 12 + 14 + 6 + 4 + 4
    assert not (tmp_path / "dry").exists()
    assert sum("bench throughput" in c for c in commands) == 16
    assert sum("bench latency" in c for c in commands) == 6
    assert sum("bench serve" in c for c in commands) == 4 + 10 + 12 + 4 + 2
    assert sum("vllm.entrypoints.openai.api_server" in c for c in commands) == 2 + 2 + 2 + 6
    duo_config = '{"duo": {"pattern": "Meta-Llama-3.1-8B-Instruct", "sparsity": 0.5, "sink": 64, "recent": 256}}'
    # capacity, ceiling, throughput x5, tpot x2, ttft, the six servers
    assert sum(duo_config in c for c in commands) == 1 + 1 + 5 + 2 + 1 + 6
    # the ceiling asks beyond the model's context (Llama 3.1: 131,072), which vLLM allows only when told
    long_len = [c for c in commands if "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 " in c]
    assert len(long_len) == 3 and all("ceiling__" in c and "--max-model-len 4194304" in c
                                      and "--enforce-eager --max-num-seqs 1" in c for c in long_len)
    full = [c for c in commands if "shared_docs_full__" in c]
    assert len(full) == 2 and all(
        "--dataset-name prefix_repetition --prefix-repetition-prefix-len 20000 --prefix-repetition-suffix-len 300 "
        "--prefix-repetition-num-prefixes 40 --prefix-repetition-output-len 150 --num-prompts 320" in c
        and "--enable-prefix-caching" in c for c in full)
    docs = [c for c in commands if "shared_docs__duo" in c and "bench serve" in c]
    assert all("--dataset-name prefix_repetition --prefix-repetition-prefix-len 24000" in c
               and "--prefix-repetition-num-prefixes 8" in c for c in docs)
    assert ["--seed 0" in docs[0], "--seed 1" in docs[1]] == [True, True]  # each rate on new documents
    chat = [c for c in commands if "vllm_duo.tools.bench.chat" in c]
    assert len(chat) == 2 and all("--conversations 16 --turns 6 --first-len 16000" in c for c in chat)
    servers = [c for c in commands if "api_server" in c]
    assert sum("--enable-prefix-caching" in c for c in servers) == 6  # the three shared-prefix workloads' servers
    sweep = [c for c in commands if "tpot_sweep__" in c]
    assert [c.split("--random-input-len ")[1].split()[0] for c in sweep[:5]] == ["1024", "4096", "16384", "65536",
                                                                                   "98304"]
    assert all("--max-concurrency 4" in c and "--num-prompts 4" in c for c in sweep)
    short = [c for c in commands if "short_itl__" in c and "bench serve" in c]
    assert len(short) == 12 and all("--max-concurrency 32" in c and "--num-prompts 32" in c for c in short)
    # each run of a repeated point has its own files and its own prompts (seed)
    assert len({c.split("--result-filename ")[1].split()[0] for c in short}) == 12
    assert len({c.split("--seed ")[1].split()[0] for c in short[:6]}) == 6
    ttft = next(c for c in commands if "ttft_128k__duo" in c)
    for flag in ("--input-len 131000", "--output-len 1", "--batch-size 1", "--max-model-len 131072",
                 "--load-format dummy", "--tokenizer /models/smol"):
        assert flag in ttft


@pytest.mark.parametrize("only, dense_runs, duo_runs, zigzag_runs", [
    (None, 2, 4, 2), ("dense", 2, 0, 0), ("duo", 0, 4, 0), ("zigzag", 0, 0, 2)])
def test_only_runs_one_part_of_the_suite(tmp_path, capsys, only, dense_runs, duo_runs, zigzag_runs):
    only_args = ["--only", only] if only else []
    assert cli.main(["bench", "--model", "/models/llama8b", "--workloads", "tpot_64k", "capacity",
                     "--sparsity", "0.25", "0.5", "--capacity-sparsity", "0.5", "--zigzag-sparsity", "0.5",
                     "--pattern", "Meta-Llama-3.1-8B-Instruct", *only_args, "--out", str(tmp_path / "dry"),
                     "--dry-run"]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    tpot = [c for c in commands if "tpot_64k" in c]
    zigzag_file = str((tmp_path / "dry" / "patterns" / "zigzag-0.5.json").resolve())
    zigzag_config = json.dumps({"duo": {"pattern": zigzag_file, "sink": 64, "recent": 256}})
    assert sum(zigzag_config in c for c in tpot) == zigzag_runs  # the stored layer-exclusive mask: no sparsity
    assert sum("--attention-backend duo" in c for c in tpot) == duo_runs + zigzag_runs
    assert sum("--attention-backend" not in c for c in tpot) == dense_runs
    assert not any(zigzag_file in c for c in commands if "capacity" in c)
    assert not (tmp_path / "dry").exists()


def test_squeeze_runs_duo_with_the_squeeze_at_each_budget(tmp_path, capsys):
    """`--squeeze 0.0625 0.25`: duo with duo.squeeze at each budget after plain duo, not in the capacity workload;
    `--only squeeze` keeps those runs alone."""
    args = ["bench", "--model", "/models/llama8b", "--workloads", "tpot_64k", "capacity", "--sparsity", "0.5",
            "--pattern", "Meta-Llama-3.1-8B-Instruct", "--squeeze", "0.0625", "0.25", "--out", str(tmp_path / "dry"),
            "--dry-run"]
    assert cli.main(args) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    squeezed = [c for c in commands if '"squeeze"' in c]  # tpot_64k: a latency and a prefill run each
    assert len(squeezed) == 4 and all("tpot_64k__duo-s-0.5-sq-" in c for c in squeezed)
    assert [sum(f'"budget": {b}' in c for c in squeezed) for b in ("0.0625", "0.25")] == [2, 2]
    assert cli.main([*args, "--only", "squeeze"]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")] == squeezed
    with pytest.raises(SystemExit) as stopped:
        cli.main([*args[:-3], "--squeeze", "0", "--out", str(tmp_path / "dry"), "--dry-run"])
    assert stopped.value.code == 2
    assert cli.main([*args, "--only", "squeeze", "--squeeze-keys-per-cluster", "32"]) == 0
    coarse = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(coarse) == 4 and all("-sq-0.0625-k32" in c or "-sq-0.25-k32" in c for c in coarse)
    assert all('"keys_per_cluster": 32' in c for c in coarse)
    assert not any("keys_per_cluster" in c for c in squeezed)
    for wrong in (["--squeeze", "0.25", "--squeeze-keys-per-cluster", "0"], ["--squeeze-keys-per-cluster", "32"]):
        with pytest.raises(SystemExit) as stopped:
            cli.main([*args[:-6], *wrong, "--out", str(tmp_path / "dry"), "--dry-run"])
        assert stopped.value.code == 2
    assert "--squeeze-keys-per-cluster is the keys per centroid" in capsys.readouterr().err


def test_zigzag_patterns_are_written_layer_exclusive(tmp_path):
    settings = Settings(model="/models/llama8b", tokenizer=None, load_format="dummy",
                              pattern="Meta-Llama-3.1-8B-Instruct", sparsity=[0.5], capacity_sparsity=[0.5],
                              zigzag_sparsity=[0.25, 0.5], sink=64, recent=256, workloads=[], extra_dense_backends=[],
                              engine_args=[], out=tmp_path, timeout=60)
    settings.write_zigzag_patterns()
    for sparsity, streaming_layers in ((0.25, 8), (0.5, 16)):
        written = json.loads(settings.zigzag_file(sparsity).read_text())
        rows = written["retrieval_mask"]
        assert written["layer_exclusive"] and len(rows) == 32
        assert all(len(set(row)) == 1 for row in rows)  # each layer all retrieval or all streaming
        assert sum(row[0] == 0 for row in rows) == streaming_layers
    without_pattern = dataclasses.replace(settings, pattern=None)
    with pytest.raises(workloads.BenchError, match="--zigzag-sparsity needs --pattern"):
        without_pattern.write_zigzag_patterns()


def test_startup_figures_from_a_log():
    log = "\n".join([
        "(EngineCore pid=1) INFO [core.py:121] Initializing a V1 LLM engine (v0.26.0) with config: dtype=torch.float16",
        "(EngineCore pid=1) INFO [platforms.py:41] duo: pattern bundled X; retrieval ratio 0.469 (sparsity 0.5)",
        "(EngineCore pid=1) INFO [kv_cache_utils.py:1] GPU KV cache size: 457,288 tokens",
        "(EngineCore pid=1) INFO [kv_cache_utils.py:2] Maximum concurrency for 17,000 tokens per request: 26.90x",
        "Throughput: 0.93 requests/s, 15877.00 total tokens/s, 492.30 output tokens/s"])
    figures = logs.startup_figures(log)
    assert figures["kv_cache_tokens"] == 457288 and figures["max_concurrency"] == 26.9
    assert figures["max_concurrency_len"] == 17000 and figures["retrieval_ratio"] == 0.469
    assert figures["dtype"] == "float16" and figures["duo_log"][0].startswith("duo: pattern")
    workload = workloads.WORKLOADS["prefill_heavy"]
    raw = {"elapsed_time": 34.0, "num_requests": 32, "total_num_tokens": 528384, "requests_per_second": 0.94,
           "tokens_per_second": 15540.7}
    assert logs.throughput_metrics(raw, log, workload)["output_tok_s"] == 492.3
    assert logs.throughput_metrics(raw, "", workload)["output_tok_s"] == pytest.approx(32 * 512 / 34.0)
    assert "prefix_cache_hit_rate" not in logs.throughput_metrics(raw, log, workload)
    # with the engine's stats lines: peak load, and vLLM's hit rate of the last one
    stats = "\n".join(_stats_line(*row) for row in SERVER_STATS).replace("hit rate: 0.0%", "hit rate: 86.7%")
    loaded = logs.throughput_metrics(raw, log + "\n" + stats, workload)
    assert (loaded["peak_running"], loaded["peak_waiting"], loaded["peak_kv_usage_pct"]) == (28, 10, 98.1)
    assert loaded["prefix_cache_hit_rate"] == pytest.approx(0.867)


def test_ceiling_from_a_log_and_its_table(tmp_path):
    """A ceiling run is vLLM's estimate where the startup check failed, else at least the length asked for ("≥");
    a startup that failed otherwise measured nothing. Ratios with a lower bound are bounds themselves."""
    log = ("(EngineCore pid=1) ERROR [core.py:1349] ValueError: To serve at least one request with the model's max "
           "seq len (4194304), (250.0 GiB KV cache is needed, which is larger than the available KV cache memory "
           "(58.1 GiB). Based on the available memory, the estimated maximum model length is 951232. Try increasing")
    assert logs.estimated_ceiling(log) == {"accepted_len": 951232, "lower_bound": False}
    assert logs.estimated_ceiling("ValueError: No available memory for the cache blocks.") is None
    ceiling = workloads.WORKLOADS["ceiling"]
    assert logs.started_ceiling(ceiling) == {"accepted_len": 4194304, "lower_bound": True}
    assert "max_model_len 4,194,304" in ceiling.describe() and "`bench throughput`" in ceiling.describe()

    def accepted(n, lower_bound=False):
        return {"metrics": {"accepted_len": n, "lower_bound": lower_bound}}

    runs = [_run("ceiling", "dense", **accepted(475000)),
            _run("ceiling", "dense fp8", kv_cache_dtype="fp8", **accepted(950000)),
            _run("ceiling", "duo s=0.5 fp8", kv_cache_dtype="fp8", **accepted(1880000)),
            _run("ceiling", "duo s=0.75 fp8", kv_cache_dtype="fp8", **accepted(4194304, lower_bound=True))]
    results = {"device": "NVIDIA H100 80GB HBM3", "model_shape": LLAMA_8B, "runs": runs,
               "workloads": {"ceiling": dict(vars(ceiling))}}
    report = bench_report.markdown(results, tmp_path, plots=False)
    assert "| dense fp8 | 950,000 | - | 2.00x |" in report
    assert "| duo s=0.5 fp8 | 1,880,000 | 1.98x | 3.96x |" in report
    assert "| duo s=0.75 fp8 | ≥ 4,194,304 | ≥ 4.42x | ≥ 8.83x |" in report
    summary = bench_report.checked_summary(results, tmp_path)  # raises FailedRuns on a failed run
    row = next(line for line in summary.splitlines() if "duo s=0.75 fp8" in line)
    assert row.split() == ["ceiling", "duo", "s=0.75", "fp8", "accepts", "≥", "4,194,304", "tokens", "≥", "4.42x",
                           "dense", "fp8"]


@pytest.mark.parametrize("device", ["GPU", "CPU", "GPU + host"])
def test_startup_figures_from_the_one_line_of_vllm_0_30_on(device):
    """vLLM 0.30+ logs both figures on one line, named by the device ("CPU" on the CPU stack)."""
    log = (f"(EngineCore pid=1) INFO [kv_cache_utils.py:2328] {device} KV cache size: 457,288 tokens, "
           "Maximum concurrency for 17,000 tokens per request: 26.90x")
    figures = logs.startup_figures(log)
    assert figures["kv_cache_tokens"] == 457288 and figures["max_concurrency"] == 26.9
    assert figures["max_concurrency_len"] == 17000


def _stats_line(clock: str, running: int, waiting: int, kv: float, extra: str = "") -> str:
    return (f"(APIServer pid=7) INFO 11-24 {clock} [loggers.py:310] Engine 000: Avg prompt throughput: 16000.0 tokens/s,"
            f" Avg generation throughput: 500.0 tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, {extra}"
            f"GPU KV cache usage: {kv}%, Prefix cache hit rate: 0.0%")


# A server log of two clients, one after the other: (clock, running, waiting, KV usage %, optional fields).
SERVER_STATS = (("05:51:43", 3, 0, 10.5, ""),  # the first client's last 10 s
                ("05:52:33", 10, 0, 34.8, ""), ("05:52:43", 28, 10, 98.1, "Preemptions: 2, "),
                ("05:52:53", 27, 0, 94.8, ""), ("05:53:03", 0, 0, 0.0, ""))


def test_engine_timeline_keeps_the_stats_lines_of_one_client():
    log = "\n".join([_stats_line(*row) for row in SERVER_STATS] + ["INFO 11-24 05:52:40 [api_server.py:1] GET /metrics"])
    samples = logs.engine_timeline(log, "2026-11-24T05:51:40+00:00", "2026-11-24T05:53:00+00:00")
    assert [(s.seconds, s.running, s.waiting, s.kv_usage_pct) for s in samples] == [
        (53.0, 10, 0, 34.8), (63.0, 28, 10, 98.1), (73.0, 27, 0, 94.8)]
    assert samples[0].prompt_tok_s == 16000.0 and samples[0].generation_tok_s == 500.0


def test_repeated_serve_points_are_numbered_runs():
    from vllm_duo.tools.bench.run_index import rate_and_run

    short = workloads.WORKLOADS["short_itl"]
    assert short.serve_points()[:4] == [(1024, float("inf"), 0), (1024, float("inf"), 1), (1024, float("inf"), 2),
                                        (4096, float("inf"), 0)]
    assert short.serve_phase(4096, float("inf"), 1) == "in=4096 rate=inf run=2"
    assert rate_and_run({"phase": "in=4096 rate=inf run=2", "request_rate": "inf", "repeat": 2}) == "inf (2)"
    once = workloads.apply_overrides([short], [], ["short_itl.repeats=1"])[0]
    assert once.serve_phase(1024, float("inf")) == "in=1024 rate=inf" and len(once.serve_points()) == 2
    assert rate_and_run({"phase": "in=1024 rate=inf", "request_rate": "inf", "repeat": None}) == "inf"
    assert rate_and_run({"phase": "rate=2"}) == "2"  # a record from before repeats (and request_rate) were recorded


def test_workload_overrides():
    chosen = workloads.apply_overrides(workloads.parse_workloads(["short", "serve_16k"]), ["short=3000"],
                                   ["short.num_prompts=64", "serve_16k.request_rates=1,inf"])
    assert chosen[0].max_model_len == 3000 and chosen[0].num_prompts == 64
    assert chosen[1].request_rates == (1.0, float("inf"))
    assert [w.name for w in workloads.parse_workloads(["all"])] == list(workloads.GPU_WORKLOADS)
    for bad in (["short.kind=latency"], ["short.num_prompts=many"], ["decode_heavy.num_prompts=2"]):
        with pytest.raises(workloads.BenchError):
            workloads.apply_overrides(workloads.parse_workloads(["short"]), [], bad)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["bench", "--workloads", "nope", "--dry-run"])
    assert stopped.value.code == 2


@pytest.mark.parametrize("user_space, space", [(None, "1"), ("3", "3")])
def test_failed_runs_are_recorded_the_suite_goes_on_and_exits_1(tmp_path, monkeypatch, capsys, subprocess_env,
                                                                user_space, space):
    """A vLLM that fails every run: each is recorded, and the command's last line counts them, with exit code 1. Each
    run had the CPU KV cache the user set (VLLM_CPU_KVCACHE_SPACE), else 1 GiB, and its recorded command says so."""
    if user_space:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", user_space)
    else:
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    fake_vllm = "import os, sys; print('boom, KV cache', os.environ.get('VLLM_CPU_KVCACHE_SPACE')); sys.exit(3)"
    monkeypatch.setattr(offline, "vllm_cli", lambda pretokenized=False: [sys.executable, "-c", fake_vllm])
    out = tmp_path / "results"
    assert cli.main(["bench", "--workloads", "tiny", "--model", str(tmp_path), "--sparsity", "0.25", "0.5",
                     "--out", str(out)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == f"3 runs, 3 failed; results: {out / 'results.md'}"
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["backend"] for r in runs] == ["dense", "duo s=0.25", "duo s=0.5"]
    assert all(r["status"] == "failed" and r["returncode"] == 3 and f"boom, KV cache {space}" in r["log_tail"]
               and r["command"].startswith(f"VLLM_CPU_KVCACHE_SPACE={space} ") for r in runs)
    report = (out / "results.md").read_text()
    assert "## Failed runs" in report and "**failed**" in report
    assert cli.main(["bench", "--report-only", "--out", str(out)]) == 1  # the report of failed runs too
    assert capsys.readouterr().out.splitlines()[-1].startswith("3 runs, 3 failed")


SLEEPER = """
import sys
from pathlib import Path
from vllm_duo.tools.processes import run_logged, stop_runs_on_sigterm
stop_runs_on_sigterm()
run_logged([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"],
           Path(sys.argv[1]), timeout=120)
"""


def test_sigterm_stops_the_run_in_flight(tmp_path):
    """`timeout` kills the harness with SIGTERM; the vLLM run it started in its own session must not outlive it."""
    log = tmp_path / "run.log"
    harness = subprocess.Popen([sys.executable, "-c", SLEEPER, str(log)])
    deadline = time.time() + 60
    while len(log.read_text().splitlines() if log.exists() else []) < 2 and time.time() < deadline:
        time.sleep(0.2)
    run_pid = int(log.read_text().splitlines()[1])
    harness.send_signal(signal.SIGTERM)
    assert harness.wait(timeout=60) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(run_pid, 0)



def test_a_settled_run_that_hangs_is_stopped_not_timed_out(tmp_path):
    """vLLM 0.32's teardown after a failed startup can hang on the CPU stack: a ceiling run whose log already holds
    vLLM's estimate is stopped after the exit grace and counts (not a timeout); one that never settles times out."""
    hang = "import time; print('the estimated maximum model length is 4096.', flush=True); time.sleep(120)"
    start = time.monotonic()
    code, timed_out = run_logged([sys.executable, "-c", hang], tmp_path / "settled.log", timeout=60,
                                 settled=logs.estimated_ceiling, exit_grace=1)
    assert (code, timed_out) == (None, False) and time.monotonic() - start < 30
    quiet = "import time; print('still loading', flush=True); time.sleep(120)"
    assert run_logged([sys.executable, "-c", quiet], tmp_path / "quiet.log", timeout=3,
                      settled=logs.estimated_ceiling, exit_grace=1) == (None, True)

def _run(workload, backend, phase="main", **fields):
    spec = workloads.WORKLOADS[workload]
    duo_kind = backend.startswith(("duo", "zigzag"))
    run = {"workload": workload, "kind": spec.kind, "backend": backend, "phase": phase, "status": "ok",
           "attention_backend": "duo" if duo_kind else None, "layer_exclusive": backend.startswith("zigzag"),
           "sparsity": 0.5 if duo_kind else None, "input_len": spec.input_len,
           "output_len": 1 if phase == "prefill" else spec.output_len, "num_prompts": spec.num_prompts,
           "batch_size": spec.batch_size, "max_model_len": spec.max_model_len, "command": f"vllm bench {workload}",
           "log": f"logs/{workload}.log", "device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "wall_s": 60.0,
           "kv_cache_dtype": "auto"}
    if duo_kind:
        fields = {"retrieval_ratio": 0.5, "sink": 64, "recent": 256, **fields}
    return {**run, **fields}


def test_report_tables_limits_and_plots(tmp_path):
    dense_cap, duo_cap = {"max_concurrency": 3.49, "max_concurrency_len": 131072}, {"max_concurrency": 6.9,
                                                                                   "max_concurrency_len": 131072}
    runs = [
        _run("capacity", "dense", **dense_cap), _run("capacity", "duo s=0.5", **duo_cap),
        _run("prefill_heavy", "dense", metrics={"output_tok_s": 492.0, "total_tok_s": 15877.0, "requests_per_s": 1},
             max_concurrency=26.9, max_concurrency_len=17000),
        _run("prefill_heavy", "duo s=0.5", metrics={"output_tok_s": 600.0, "total_tok_s": 19000.0, "requests_per_s": 1},
             max_concurrency=53.0, max_concurrency_len=17000),
        _run("short", "dense", metrics={"output_tok_s": 2846.0, "total_tok_s": 25076.0, "requests_per_s": 11}),
        _run("short", "duo s=0.5", status="failed", error="exit code 1", log_tail="Traceback ... boom"),
        _run("tpot_64k", "dense", metrics={"avg_latency_s": 10.0}),
        _run("tpot_64k", "dense", "prefill", metrics={"avg_latency_s": 8.0}),
        _run("tpot_64k", "duo s=0.5", metrics={"avg_latency_s": 7.0}),
        _run("tpot_64k", "duo s=0.5", "prefill", metrics={"avg_latency_s": 5.8}),
        _run("tpot_64k", "zigzag s=0.5", metrics={"avg_latency_s": 6.9}),
        _run("tpot_64k", "zigzag s=0.5", "prefill", metrics={"avg_latency_s": 5.8}),
        _run("serve_16k", "dense", "rate=1", metrics={"output_tok_s": 300.0, "p99_ttft_ms": 900.0,
                                                      "mean_tpot_ms": 40.0, "completed": 24, "failed": 0},
             server_log="logs/serve_16k__dense__server.log", started_at="2026-11-24T05:51:40+00:00",
             finished_at="2026-11-24T05:54:00+00:00"),
        _run("serve_16k", "duo s=0.5", "rate=1", metrics={"output_tok_s": 310.0, "p99_ttft_ms": 700.0,
                                                          "mean_tpot_ms": 30.0, "completed": 24, "failed": 0}),
        *(_run("tpot_sweep", backend, f"in={n} rate=inf", input_len=n, request_rate="inf", client_concurrency=4,
               metrics={"median_itl_ms": itl, "completed": 4, "failed": 0})
          for backend, n, itl in (("dense", 4096, 8.0), ("duo s=0.5", 4096, 7.0), ("dense", 65536, 20.0),
                                  ("duo s=0.5", 65536, 12.0))),
    ]
    results = {"device": "NVIDIA H100 80GB HBM3", "model_shape": LLAMA_8B, "runs": runs,
               "workloads": {name: dict(vars(workloads.WORKLOADS[name])) for name in
                             ("capacity", "prefill_heavy", "short", "tpot_64k", "serve_16k", "tpot_sweep")}}
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "serve_16k__dense__server.log").write_text("\n".join(_stats_line(*r) for r in SERVER_STATS))
    report = bench_report.markdown(results, tmp_path, plots=True)

    # capacity: 131072 / (0.5 * 131072 + 0.5 * 320) = 1.995x is the limit; 6.9 / 3.49 = 1.98x measured
    assert "| duo s=0.5 | - | 6.90x | 1.98x | 2.00x | 99% |" in report
    # tpot: (10 - 8) / 127 = 15.75 ms dense, (7 - 5.8) / 127 = 9.45 ms duo
    assert "| 15.75 |" in report and "| 9.45 | 0.60x |" in report
    # zigzag after duo, against the same dense run: (6.9 - 5.8) / 127 = 8.66 ms
    assert report.index("| duo s=0.5 | 7.000") < report.index("| zigzag s=0.5 | 6.900")
    assert "| 8.66 | 0.55x |" in report
    assert "**failed**" in report and "Traceback ... boom" in report
    assert "| duo s=0.5 | 16,000 | 1 | 310.0 | - | 700 |" in report
    # the sweep: one row per prompt length, median ITL against dense's at the same length
    assert "| duo s=0.5 | 65,536 | inf |" in report and "| 12.0 | - | 4/0 | - | - | - | - | 0.60x |" in report
    # the serve profile: 3 busy stats lines of 10 s, one of them with a queue
    assert "| dense | 1 | 30 | 28 | 10 | 10 | 98.1% | 16,000 | 500 |" in report
    for name in ("output_throughput_vs_context_length.png", "time_per_output_token_vs_context_length.png",
                 "maximum_concurrency_vs_sparsity.png", "requests_running_and_waiting_while_serving.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 0

    shape = roofline.ModelShape(**LLAMA_8B)
    assert shape.matmul_params == pytest.approx(7.5e9, rel=0.01)
    dense, duo = (roofline.Roofline(shape, 989e12, 3.35e12),
                  roofline.Roofline(shape, 989e12, 3.35e12, retrieval=0.5, window=320))
    assert duo.prefill_s(512) == pytest.approx(dense.prefill_s(512), rel=0.02)  # all inside the window
    assert dense.step_s(32, 32768) / duo.step_s(32, 32768) > 1.5  # KV-bound decode: half the KV read


def test_kv_cache_dtypes_run_every_backend_at_each(tmp_path, capsys):
    """`--kv-cache-dtype auto fp8`: dense and duo at both, the fp8 runs with the flag, nothing else changed."""
    assert cli.main(["bench", "--model", "/models/llama8b", "--workloads", "decode_heavy", "--sparsity", "0.5",
                     "--pattern", "Meta-Llama-3.1-8B-Instruct", "--kv-cache-dtype", "auto", "fp8",
                     "--out", str(tmp_path / "dry"), "--dry-run"]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(commands) == 4
    stems = [c.split("--output-json ")[1].rsplit("/", 1)[1] for c in commands]
    assert stems == ["decode_heavy__dense.json", "decode_heavy__dense-fp8.json", "decode_heavy__duo-s-0.5.json",
                     "decode_heavy__duo-s-0.5-fp8.json"]
    assert ["--kv-cache-dtype fp8" in c for c in commands] == [False, True, False, True]


def test_repeated_bursts_report_their_mean_ttft_after_each_servers_first(tmp_path):
    """The short-TTFT target is a ratio of mean TTFTs; each server's first run (cold) is left out of it."""
    runs = [_run("short_itl", backend, f"in=1024 rate=inf run={repeat}", input_len=1024, request_rate="inf",
                 repeat=repeat, metrics={"mean_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "output_tok_s": 2900.0})
            for backend, ttfts in (("dense", (650.0, 480.0, 490.0)), ("duo s=0.5", (600.0, 500.0, 520.0)))
            for repeat, ttft in enumerate(ttfts, 1)]
    results = {"device": "NVIDIA H100 80GB HBM3", "model_shape": LLAMA_8B, "runs": runs,
               "workloads": {"short_itl": dict(vars(workloads.WORKLOADS["short_itl"]))}}
    report = bench_report.markdown(results, tmp_path, plots=False)
    assert "| duo s=0.5 | 1,024 | inf (2) | 2,900.0 | 500 | 1,000 |" in report
    assert "| 1.00x | 1.04x | 1.04x | - |" in report  # duo/dense: output tok/s, mean TTFT, p99 TTFT, ITL
    assert "- 1,024 tokens at inf req/s, dense: 485.0 ms over runs 2-3 (each 480.0-490.0)" in report
    # 485 / 510, not the first runs' 650 / 600
    assert "duo s=0.5: 510.0 ms over runs 2-3 (each 500.0-520.0); dense/duo s=0.5 0.951x" in report


def test_report_takes_each_ratio_against_dense_at_the_same_kv_dtype(tmp_path):
    cap = dict(max_concurrency_len=131072)
    runs = [_run("capacity", "dense", max_concurrency=3.5, **cap),
            _run("capacity", "dense fp8", max_concurrency=7.0, kv_cache_dtype="fp8", **cap),
            _run("capacity", "duo s=0.5 fp8", max_concurrency=13.9, kv_cache_dtype="fp8", **cap),
            _run("decode_heavy", "dense", metrics={"output_tok_s": 800.0}),
            _run("decode_heavy", "dense fp8", kv_cache_dtype="fp8", metrics={"output_tok_s": 1200.0}),
            _run("decode_heavy", "duo s=0.5 fp8", kv_cache_dtype="fp8", metrics={"output_tok_s": 1800.0})]
    results = {"device": "NVIDIA H100 80GB HBM3", "model_shape": LLAMA_8B, "runs": runs,
               "workloads": {name: dict(vars(workloads.WORKLOADS[name])) for name in ("capacity", "decode_heavy")}}
    report = bench_report.markdown(results, tmp_path, plots=False)
    # capacity: 13.9 / 7.0 against dense fp8, 13.9 / 3.5 against dense with the model's dtype
    assert "| duo/dense | vs dense with the model's KV dtype |" in report
    assert "| dense fp8 | - | 7.00x | - | 2.00x |" in report
    assert "| duo s=0.5 fp8 | - | 13.90x | 1.99x | 3.97x |" in report
    assert "| duo s=0.5 fp8 | 1,800.0 | - | - | 1.50x |" in report  # 1800 / 1200, not / 800
    assert "| dense fp8 | 1,200.0 | - | - | - |" in report
    summary = bench_report.summary(results, tmp_path)
    row = next(line for line in summary.splitlines() if line.startswith("decode_heavy") and "duo s=0.5 fp8" in line)
    assert row.split() == ["decode_heavy", "duo", "s=0.5", "fp8", "1,800.00", "out", "tok/s", "1.50x", "dense", "fp8"]


def test_pretokenized_throughput_sends_the_sampled_prompts_as_token_ids(smollm2_dir, monkeypatch):
    """`--pretokenized`: vLLM's own sampler runs, and each text prompt it drew reaches `bench throughput` as the
    token ids of that text."""
    from vllm.benchmarks import throughput
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_duo import vllm_seam

    parser = FlexibleArgumentParser()
    throughput.add_cli_args(parser)
    args = parser.parse_args(["--model", smollm2_dir, "--dataset-name", "prefix_repetition", "--num-prompts", "4",
                              "--prefix-repetition-prefix-len", "64", "--prefix-repetition-suffix-len", "8",
                              "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "4"])
    tokenizer = get_tokenizer(smollm2_dir)
    texts = [request.prompt for request in throughput.get_requests(args, tokenizer)]
    monkeypatch.setattr(throughput, "get_requests", throughput.get_requests)  # undone after the test
    vllm_seam.pretokenize_bench_throughput()  # what `python -m vllm_duo.tools.bench --pretokenized` does
    requests = throughput.get_requests(args, tokenizer)
    assert [request.prompt for request in requests] == [{"prompt_token_ids": tokenizer.encode(t)} for t in texts]


def test_server_counters_give_each_client_its_hits_and_the_engines_latencies(monkeypatch):
    """The /metrics counters are summed over label sets; the older ITL histogram counts only where the newer is
    absent; a client's figures are the counters' growth over its run: latencies, TTFT's parts and steps."""
    import io
    import urllib.request

    from vllm_duo.tools.bench import served

    pages = iter([
        'vllm:prefix_cache_queries_total{engine="0"} 100\nvllm:prefix_cache_hits_total{engine="0"} 40\n'
        'vllm:inter_token_latency_seconds_sum{engine="0"} 2.0\nvllm:inter_token_latency_seconds_count{engine="0"} 100\n'
        'vllm:time_per_output_token_seconds_sum{engine="0"} 9.0\nvllm:time_to_first_token_seconds_sum 1.0\n'
        'vllm:time_to_first_token_seconds_count 2\nvllm:request_queue_time_seconds_sum 0.5\n'
        'vllm:request_queue_time_seconds_count 2\nvllm:request_prefill_time_seconds_sum 0.4\n'
        'vllm:request_prefill_time_seconds_count 2\nvllm:iteration_tokens_total_count{engine="0"} 10\n'
        'vllm:iteration_tokens_total_sum{engine="0"} 2000\nvllm:iteration_tokens_total_bucket{engine="0",le="64.0"} 6\n'
        'vllm:iteration_tokens_total_bucket{engine="0",le="+Inf"} 10\n# HELP vllm:ignored x\n',
        'vllm:prefix_cache_queries_total{engine="0"} 300\nvllm:prefix_cache_hits_total{engine="0"} 190\n'
        'vllm:inter_token_latency_seconds_sum{engine="0"} 3.0\nvllm:inter_token_latency_seconds_count{engine="0"} 150\n'
        'vllm:time_per_output_token_seconds_sum{engine="0"} 99.0\nvllm:time_to_first_token_seconds_sum 7.0\n'
        'vllm:time_to_first_token_seconds_count 4\nvllm:request_queue_time_seconds_sum 0.9\n'
        'vllm:request_queue_time_seconds_count 4\nvllm:request_prefill_time_seconds_sum 4.4\n'
        'vllm:request_prefill_time_seconds_count 4\nvllm:iteration_tokens_total_count{engine="0"} 14\n'
        'vllm:iteration_tokens_total_sum{engine="0"} 10200\nvllm:iteration_tokens_total_bucket{engine="0",le="64.0"} 9\n'
        'vllm:iteration_tokens_total_bucket{engine="0",le="+Inf"} 14\n'])
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: io.BytesIO(next(pages).encode()))
    before, after = served.server_counters(8000), served.server_counters(8000)
    counts = served.client_counts(before, after)
    assert counts["prefix_cache_hit_rate"] == pytest.approx(150 / 200)
    assert counts["engine_mean_itl_ms"] == pytest.approx(1e3 * 1.0 / 50)
    assert counts["engine_mean_ttft_ms"] == pytest.approx(1e3 * 6.0 / 2)
    assert counts["engine_mean_queue_ms"] == pytest.approx(1e3 * 0.4 / 2)
    assert counts["engine_mean_prefill_ms"] == pytest.approx(1e3 * 4.0 / 2)
    assert counts["engine_steps"] == 4 and counts["engine_tokens_per_step"] == pytest.approx(8200 / 4)
    assert counts["engine_steps_by_tokens"] == {"<=64": 3, "<=+Inf": 4}  # one of the four steps carried prefill
    assert served.client_counts({}, after) == {}


def test_gpu_timeline_splits_a_window_into_busy_and_idle():
    """Overlapping kernels count once, the window clips them, idle gaps name the host events across them (the
    window's own annotation excluded), host time is summed by scope and device time by kernel; each gap is charged
    to the host ops around the launch of the work that ended it, or to the queue where that launch came first."""
    from vllm_duo.tools.bench.timeline import QUEUED, gpu_timeline

    def event(cat, name, ts, dur, correlation=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1,
                **({"args": {"correlation": correlation}} if correlation is not None else {})}

    events = [event("user_annotation", "burst", 1000, 10000),
              event("kernel", "gemm", 500, 1500),  # 1000..2000 inside the window
              event("kernel", "attention", 1800, 1200),  # overlaps the gemm: busy to 3000
              event("gpu_memcpy", "copy", 7000, 1000, correlation=7),  # after a 4 ms gap
              event("kernel", "late", 10500, 2000, correlation=9),  # clipped at 11000
              event("user_annotation", "schedule: allocate_slots", 3500, 2500),
              event("cpu_op", "vllm::unified_attention_with_output", 5000, 300),
              event("cuda_runtime", "cudaMemcpyAsync", 5100, 10, correlation=7),  # late: the GPU idled from 3000
              event("cuda_driver", "cuLaunchKernel", 6500, 10, correlation=9)]  # before its gap (8000) began
    timeline = gpu_timeline(events, (1000, 11000), exclude=("burst",))
    assert timeline["window_ms"] == 10.0 and timeline["busy_ms"] == 3.5 and timeline["idle_ms"] == 6.5
    assert [(gap["at_ms"], gap["ms"]) for gap in timeline["longest_gaps"]] == [(2.0, 4.0), (7.0, 2.5)]
    assert timeline["longest_gaps"][0]["host"] == ["schedule: allocate_slots (2.50 ms)",
                                                   "vllm::unified_attention_with_output (0.30 ms)"]
    assert timeline["host_ms_by_scope"] == {"schedule: allocate_slots": 2.5}
    assert timeline["device_ms_by_kernel"] == {"attention": 1.2, "gemm": 1.0, "copy": 1.0, "late": 0.5}
    assert next(iter(timeline["device_ms_by_kernel"])) == "attention"
    assert timeline["idle_ms_by_launch"] == {
        "schedule: allocate_slots > vllm::unified_attention_with_output": {"ms": 4.0, "gaps": 1},
        QUEUED: {"ms": 2.5, "gaps": 1}}
