"""`bucketrl status` against a real proxy (real Redis, real HTTP): tables, --json, --dir, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bucketrl.cli import app
from bucketrl.wire import EvalResult, EvalSample, MetricsPush, SampleCompletion
from tests.proxy.harness import TOKENS, ProxyHarness, adapter_tar, make_spec, running
from tests.support.services import RedisServer, free_port


@pytest.fixture()
def proxy(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        t = h.client("st", "trainer")
        t.put_run(make_spec())
        t.register_trainer("trainer-a")
        t.publish_adapter(1, adapter_tar(1))
        t.publish_adapter(2, adapter_tar(2))
        t.push_metrics(MetricsPush(worker_id="trainer-a", step=7, metrics={"reward": 0.625, "perf/step_s": 1.5}))
        g = h.client("st", "generator")
        g.lease_version("gen-a", 2)
        g.push_metrics(
            MetricsPush(worker_id="gen-a", metrics={"rollout/generated_tok_s": 1234.0}, loaded_versions=[1, 2])
        )
        yield h


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bucketrl.cli", "status", *args], capture_output=True, text=True, timeout=60
    )


def test_json_for_scripts(proxy: ProxyHarness) -> None:
    out = _run("--proxy", proxy.url, "--run", "st", "--token", TOKENS["viewer"], "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["latest_version"] == 2 and status["trainer"]["step"] == 7
    assert {v["version"]: v["leases"] for v in status["versions"]}[2] == 1
    workers = {w["worker_id"]: w for w in status["workers"]}
    assert workers["gen-a"]["loaded_versions"] == [1, 2] and workers["trainer-a"]["role"] == "trainer"


def test_tables_show_versions_workers_and_key_metrics(proxy: ProxyHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUCKETRL_PROXY_URL", proxy.url)
    monkeypatch.setenv("BUCKETRL_TOKEN", TOKENS["viewer"])
    monkeypatch.setenv("COLUMNS", "200")
    result = CliRunner().invoke(app, ["status", "--run", "st"])
    assert result.exit_code == 0, result.output
    text = result.output
    for needle in (
        "latest version",
        "v2",
        "gen-a",
        "v1, v2",
        "trainer-a",
        "epoch 1, step 7",
        "0.625",
        "1234",
        "lost 0",
    ):
        assert needle in text, needle


def test_run_dir_of_bucketrl_up(proxy: ProxyHarness, tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "st"
    run_dir.mkdir(parents=True)
    (run_dir / "endpoint.json").write_text(json.dumps({"proxy_url": proxy.url, "run": "st"}))
    (run_dir / "tokens").write_text(f"viewer:{TOKENS['viewer']}\n")
    out = _run("--dir", str(run_dir), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["run"] == "st"


def test_errors_are_clear(proxy: ProxyHarness, tmp_path: Path) -> None:
    bad_token = _run("--proxy", proxy.url, "--run", "st", "--token", "nope")
    assert bad_token.returncode == 1 and "--token" in bad_token.stderr
    unknown = _run("--proxy", proxy.url, "--run", "nosuchrun", "--token", TOKENS["viewer"])
    assert unknown.returncode == 1 and "unknown run" in unknown.stderr
    down = _run("--proxy", f"http://127.0.0.1:{free_port()}", "--run", "st")
    assert down.returncode == 1 and "unreachable" in down.stderr
    not_a_run_dir = _run("--dir", str(tmp_path))
    assert not_a_run_dir.returncode == 2 and "endpoint.json" in not_a_run_dir.stderr
    bad_url = _run("--proxy", "ftp://x", "--run", "st")
    assert bad_url.returncode == 2 and "http://" in bad_url.stderr


def test_eval_results_and_sample_completions_are_shown(proxy: ProxyHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = make_spec(eval={"every": 1, "size": 2})
    proxy.client("st", "trainer").put_run(spec)  # eval is a mutable field of a live run
    g = proxy.client("st", "generator")
    items = g.lease_eval("gen-a", [2], n=8).items
    assert [(i.version, i.index) for i in items] == [(2, 0), (2, 1)]
    g.submit_eval(
        "gen-a", [EvalResult(version=2, index=i.index, samples=[EvalSample(reward=1.0, length=5)]) for i in items]
    )
    sample = SampleCompletion(version=2, prompt="even:", completion="2468", reward=1.0)
    g.push_metrics(MetricsPush(worker_id="gen-a", metrics={}, samples=[sample]))
    status = proxy.client("st", "viewer").status()
    assert [e.version for e in status.eval] == [2] and status.samples == [sample]
    monkeypatch.setenv("BUCKETRL_PROXY_URL", proxy.url)
    monkeypatch.setenv("BUCKETRL_TOKEN", TOKENS["viewer"])
    monkeypatch.setenv("COLUMNS", "200")
    result = CliRunner().invoke(app, ["status", "--run", "st"])
    assert result.exit_code == 0, result.output
    assert "evaluation" in result.output and "1 (k=1)" in result.output, result.output
