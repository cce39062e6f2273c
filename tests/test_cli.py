# SPDX-License-Identifier: Apache-2.0
"""`vllm-duo`'s exit codes: a command whose run fails exits with code 1 and says so in its last line (bench: its
summary, tests/test_bench.py; any other command: after Python's traceback)."""
import pytest

from vllm_duo.tools import cache_sim, cli


def test_a_failed_run_exits_1_with_a_last_line_that_says_so(monkeypatch, capsys):
    def failing_replay(*args):
        raise RuntimeError("boom\nmore lines of the error")

    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # what cache-sim sets, undone after the test
    monkeypatch.setattr(cache_sim, "replay", failing_replay)
    assert cli.main(["cache-sim"]) == 1
    error = capsys.readouterr().err.splitlines()  # vLLM's log lines, the traceback, the last line
    assert "Traceback (most recent call last):" in error and "RuntimeError: boom" in error
    assert error[-1] == "vllm-duo cache-sim: failed: RuntimeError: boom"


def test_the_exit_codes_are_in_the_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "exit codes: 0 done; 1 a run failed" in " ".join(capsys.readouterr().out.split())
