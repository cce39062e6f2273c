# SPDX-License-Identifier: Apache-2.0
"""`vllm-duo cache-sim`: prefix caching under a full KV cache, dense vs duo, through vLLM's own scheduler.

The traces are the issue's (shared documents beyond dense's cache) scaled down to seconds on a CPU, on the
Llama-3.1-8B shape. Duo's cache holds twice dense's tokens at these bytes; what these tests guard is that it turns
them into hits: before duo's manager kept the windows later hits need, its hit rate on DOCS was 8% (HALF) and 17%
(ROOM), against dense's 46% and 59%.
"""

from __future__ import annotations

import json

import pytest

from vllm_duo.tools import cache_sim, cli
from vllm_duo.tools.cache_sim import BACKENDS, BLOCK_SIZE, Engine, Trace, replay

DOCS = Trace("docs", documents=24, document_len=12000, question_len=200, output_len=100, requests=144)  # 288k tokens
HALF = Engine(150_000, "bf16")  # dense's cache holds about half the documents, duo's about all of them
ROOM = Engine(200_000, "bf16")  # duo's cache holds them with room for the running requests; dense's two thirds
POINT = 0.01


def replays(trace: Trace, engine: Engine) -> dict[str, cache_sim.Replay]:
    return {backend: replay(backend, trace, engine) for backend in BACKENDS}


def ideal_hit_rate(trace: Trace) -> float:
    """Hit tokens / prompt tokens of a cache that keeps everything: the system prompt and each document miss once,
    and a chat's later turn hits its conversation so far (its full blocks: the last answer token is never
    computed). Questions of a fixed length."""
    shared = trace.system_len + trace.document_len
    prompt = shared + trace.question_len
    hits = (trace.documents - 1) * trace.system_len + (trace.requests - trace.documents) * shared
    tokens = trace.requests * prompt
    for _ in range(1, trace.turns):
        hits += trace.requests * ((prompt + trace.output_len - 1) // BLOCK_SIZE * BLOCK_SIZE)
        prompt += trace.output_len + trace.question_len
        tokens += trace.requests * prompt
    return hits / tokens


def test_duo_hits_more_where_the_documents_outgrow_dense():
    result = replays(DOCS, HALF)
    dense, duo = result["dense"], result["duo"]
    assert duo.hit_rate >= dense.hit_rate
    assert duo.prompt_tokens_computed < dense.prompt_tokens_computed


def test_duo_recomputes_little_where_its_cache_holds_the_documents():
    result = replays(DOCS, ROOM)
    dense, duo = result["dense"], result["duo"]
    ideal = ideal_hit_rate(DOCS)
    assert dense.hit_rate < ideal - 0.1  # the documents outgrow dense's cache
    assert duo.hit_rate == pytest.approx(ideal, abs=POINT)
    assert duo.recomputed_tokens < 0.1 * dense.recomputed_tokens


def test_both_reach_the_ideal_hit_rate_where_the_documents_fit_both():
    trace = Trace("fits", documents=4, document_len=12000, question_len=200, output_len=100, requests=24)
    for backend, result in replays(trace, HALF).items():
        assert result.hit_rate == pytest.approx(ideal_hit_rate(trace), abs=POINT), backend
        assert result.recomputed_tokens == 0, backend


def test_duo_hits_the_earlier_turns_of_chats_beyond_dense():
    # one document per chat: every hit past the first turn is the chat's own conversation
    trace = Trace("chats", documents=48, document_len=4000, question_len=200, output_len=100, requests=48, turns=3)
    result = replays(trace, HALF)
    ideal = ideal_hit_rate(trace)
    assert result["dense"].hit_rate < ideal - 0.1  # the chats outgrow dense's cache
    assert result["duo"].hit_rate == pytest.approx(ideal, abs=POINT)


def test_a_shared_system_prompt_keeps_duo_ahead():
    # every prompt shares the system prompt, a prefix far shorter than a document: duo must keep the documents' ends
    trace = Trace("system", documents=24, document_len=12000, question_len=200, output_len=100, requests=144,
                  system_len=2000)
    result = replays(trace, ROOM)
    dense, duo = result["dense"], result["duo"]
    assert duo.hit_rate >= dense.hit_rate
    assert duo.prompt_tokens_computed < dense.prompt_tokens_computed
    assert duo.recomputed_tokens < 0.1 * dense.recomputed_tokens


def test_hit_rate_and_preemptions_are_what_vllm_counts(monkeypatch):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    counted = []
    make_stats = KVCacheManager.make_prefix_cache_stats

    def counting(self):
        counted.append(make_stats(self))
        return counted[-1]

    monkeypatch.setattr(KVCacheManager, "make_prefix_cache_stats", counting)
    trace = Trace("preempted", documents=8, document_len=4000, question_len=200, output_len=300, requests=48)
    for backend in BACKENDS:
        counted.clear()
        result = replay(backend, trace, Engine(30_000, "bf16"))
        assert result.preemptions > 0, backend  # so the lookups of preempted requests, counted apart, are checked
        assert sum(stats.requests for stats in counted) == trace.requests
        assert result.hit_rate == round(sum(s.hits for s in counted) / sum(s.queries for s in counted), 4)
        assert result.preemptions == sum(stats.preempted_requests for stats in counted)


def test_command_prints_the_table_and_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # what the command sets, undone after the test
    out = tmp_path / "sim.json"
    assert cli.main(["cache-sim", "--documents", "2", "--document-len", "2000", "--question-len", "50",
                     "--output-len", "10", "--requests", "6", "--dense-kv-tokens", "20000", "--kv-cache-dtype",
                     "bf16", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["trace"]["documents"] == 2 and written["engine"]["kv_dtype"] == "bf16"
    assert [r["backend"] for r in written["replays"]] == ["dense", "duo"]
    assert all(r["scheduler_ms"] > 0 for r in written["replays"])  # the scheduler's host time, timed
    replayed = [cache_sim.Replay(**r) for r in written["replays"]]
    assert cache_sim.format_table(replayed) in printed
    assert "| dense |" in printed and "| duo |" in printed and "duo vs dense: hit rate" in printed
    assert "scheduler host time a step" in printed


@pytest.mark.parametrize("options", [
    ["--documents", "0"],
    ["--documents", "8", "--requests", "4"],
    ["--kv-cache-dtype", "fp16"],
    ["--max-num-batched-tokens", "512"],
    ["--backends", "sparse"],
    ["--dense-kv-tokens", "10000"],
    ["--sparsity", "1.5"],
    ["--pattern", "no-such-pattern"],
])
def test_bad_values_fail_in_one_line_before_any_replay(options, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # what the command sets, undone after the test
    monkeypatch.setattr(cache_sim, "replay", lambda *args: pytest.fail("replayed with bad settings"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["cache-sim", *options])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("vllm-duo: error: ") and error.count("\n") == 1
