"""The load generator against the real front end: every report field, exact token counts,
valid JSON, the CLI entry point, and failed requests counted as failures."""

from __future__ import annotations

import json

import pytest
from moecomm_serving.cli import loadgen
from moecomm_serving.cli.loadgen import BenchRequest, format_report, run_bench, synthetic_requests

SECTIONS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
FIELDS = (
    "successful_requests",
    "failed_requests",
    "duration_s",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
)


def test_report_against_the_front_end(served):
    reqs = synthetic_requests(
        6, input_len=16, output_len=6, range_ratio=0.5, seed=3, chars_per_token=1.0
    )
    report = run_bench(served.url, reqs, request_rate=200.0, max_concurrency=3, seed=3)
    assert set(FIELDS) <= set(report)
    assert report["successful_requests"] == 6 and report["failed_requests"] == 0
    # ignore_eos fixes output lengths; the byte tokenizer makes prompt counts predictable
    assert report["total_output_tokens"] == sum(r.max_tokens for r in reqs)
    assert report["total_input_tokens"] == sum(len(r.prompt) + 1 for r in reqs)  # + BOS
    assert report["tokens_counted_by_server"]
    for key in SECTIONS:
        s = report[key]
        assert set(s) == {"mean", "median", "p99"}
        assert 0 < s["median"] <= s["p99"]
    assert report["e2el_ms"]["mean"] >= report["ttft_ms"]["mean"]
    per = report["requests"]
    assert all(len(r["itls_s"]) == r["output_tokens"] - 1 for r in per)
    assert json.loads(json.dumps(report)) == report
    text = format_report(report)
    for label in (
        "Successful requests:",
        "Benchmark duration (s):",
        "Request throughput",
        "Output token throughput",
        "Total token throughput",
        "Median TTFT (ms):",
        "P99 TPOT (ms):",
        "Mean ITL (ms):",
        "P99 E2EL (ms):",
    ):
        assert label in text


def test_cli_with_a_jsonl_dataset_and_chat(served, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "first prompt", "max_tokens": 3}, {"prompt": "second", "output_len": 4}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    out = tmp_path / "result.json"
    argv = [
        "--base-url",
        served.url,
        "--endpoint",
        "/v1/chat/completions",
        "--dataset",
        str(data),
        "--num-prompts",
        "5",
        "--result-file",
        str(out),
    ]
    assert loadgen.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["successful_requests"] == 2  # the file holds two requests
    assert report["total_output_tokens"] == 7
    assert report["config"]["endpoint"] == "/v1/chat/completions"
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_failed_requests_are_counted(served):
    reqs = [BenchRequest("x", 2)] * 3
    report = run_bench(served.url, reqs, model="no-such-model")
    assert report["successful_requests"] == 0 and report["failed_requests"] == 3
    assert any("HTTP 404" in e for e in report["errors"])
    assert "Errors:" in format_report(report)


def test_percentiles_and_bad_inputs(tmp_path):
    s = loadgen._stats([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s == {
        "mean": pytest.approx(50.5),
        "median": pytest.approx(50.5),
        "p99": pytest.approx(99.0),
    }
    with pytest.raises(ValueError, match="range_ratio"):
        synthetic_requests(1, 8, 8, 1.5, 0, 1.0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        loadgen.jsonl_requests(str(bad), None, 8)
