"""Several runs on one `bucketrl up` (bucketrl/up/runs.py, docs/pool.md): the options, what each run's trainer and
the pool generators get, and bad input refused with one line and exit 2 before anything is made.

    .venv/bin/python -m pytest -q tests/up/test_multirun_cli.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bucketrl.up.cluster import LocalCluster
from bucketrl.up.config import UpConfig
from bucketrl.up.runs import RunEntry, parse_runs


def _spec_file(path: Path, share: float) -> Path:
    path.write_text(json.dumps({"share": share, "group_size": 4}))
    return path


def test_runs_from_the_options(tmp_path: Path) -> None:
    assert parse_runs([], None, None, "demo") is None
    assert parse_runs([str(tmp_path / "x.json")], None, None, "demo") is None  # one file: the one-run `up`
    entries = parse_runs([], 3, "2,1,1", "sweep")
    assert entries == [
        RunEntry(run="sweep-1", share=2.0),
        RunEntry(run="sweep-2", share=1.0),
        RunEntry(run="sweep-3", share=1.0),
    ]
    a, b = _spec_file(tmp_path / "lr-1e4.json", 2), _spec_file(tmp_path / "b.json", 1)
    entries = parse_runs([str(a), f"wide={b}"], None, None, "demo")
    assert entries == [RunEntry(run="lr-1e4", spec=a), RunEntry(run="wide", spec=b)]
    # A single NAME=FILE is a pool of one run (its trainer's token is scoped, the generator in pool mode).
    assert parse_runs([f"only={b}"], None, None, "demo") == [RunEntry(run="only", spec=b)]


def test_each_run_gets_its_own_trainer_and_the_generators_serve_them_all(tmp_path: Path) -> None:
    a, b = _spec_file(tmp_path / "a.json", 2), _spec_file(tmp_path / "b.json", 1)
    cfg = UpConfig(dir=tmp_path / "run", runs=parse_runs([str(a), str(b)], None, None, "demo"), preflight=False)
    cluster = LocalCluster(cfg)
    cluster.prepare()
    try:
        specs = {run: json.loads(cluster.spec_path(run).read_text()) for run in ("a", "b")}
        assert (specs["a"]["share"], specs["b"]["share"]) == (2, 1)
        assert specs["a"]["group_size"] == 4
        ea, eb = cluster.trainer_env("a"), cluster.trainer_env("b")
        assert (ea["BUCKETRL_RUN"], eb["BUCKETRL_RUN"]) == ("a", "b")
        for key in ("BUCKETRL_RUN_SPEC", "BUCKETRL_AUDIT_LOG", "BUCKETRL_WORK_DIR", "BUCKETRL_TOKEN"):
            assert ea[key] != eb[key], key
        # Each trainer's token reaches its own run only (bucketrl.proxy.auth's role@run scope).
        lines = (cluster.dir / "tokens").read_text().splitlines()
        assert f"trainer@a:{ea['BUCKETRL_TOKEN']}" in lines and f"trainer@b:{eb['BUCKETRL_TOKEN']}" in lines
        assert cluster.trainer_name("a") == "trainer-a"
        assert ea["BUCKETRL_AUDIT_LOG"].endswith("logs/trainer-a-audit.jsonl")
    finally:
        cluster.release()
    env = _generator_env(cluster)
    assert env["BUCKETRL_RUNS"] == "a,b"
    # A resume with no options repeats the runs (their files by absolute path).
    saved = json.loads((cluster.dir / "up_options.json").read_text())
    assert [r["run"] for r in saved["runs"]] == ["a", "b"] and saved["runs"][0]["spec"] == str(a.resolve())


def _generator_env(cluster: LocalCluster) -> dict[str, str]:
    """gen-0's environment as start_generator builds it (its process is not started: only its settings count)."""
    started: list[dict[str, str]] = []

    def record(name: str, argv: list[str], env: dict[str, str]) -> _NoStart:
        started.append(env)
        return _NoStart()

    cluster._service = record  # type: ignore[method-assign,assignment]
    cluster.start_generator(0)
    return started[0]


class _NoStart:
    def start(self) -> _NoStart:
        return self


def test_runs_of_different_base_models_are_refused_before_anything_starts(tmp_path: Path) -> None:
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"base_model": "someone/other-model"}))
    cfg = UpConfig(dir=tmp_path / "run", runs=[RunEntry(run="a", spec=a), RunEntry(run="b")], preflight=False)
    cluster = LocalCluster(cfg)
    with pytest.raises(ValueError, match="one generator pool serves runs of one base model"):
        cluster.prepare()
    cluster.release()
    assert not (tmp_path / "run").exists()  # the built tiny model, tokens and logs too: a refusal changes nothing


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--runs", "2", "--run-spec", "{a}"],
            "bucketrl up: --runs and --run-spec: choose one (--runs N starts N copies of the demo run; --run-spec, "
            "repeated, one run per file)",
        ),
        (
            ["--run-spec", "x={a}", "--run-spec", "x={b}"],
            "bucketrl up: --run-spec: two runs named 'x' (x={a} and x={b}); give each its own name (NAME=FILE)",
        ),
        (
            ["--run-spec", "{a}", "--run-spec", "{a_again}"],
            "bucketrl up: --run-spec: two runs named 'a' ({a} and {a_again}); give each its own name (NAME=FILE)",
        ),
        (
            ["--runs", "2", "--shares", "2,0"],
            "bucketrl up: --shares 2,0: each share must be > 0 (a run's weight on the pool), not 0",
        ),
        (
            ["--runs", "2", "--shares", "-1,1"],
            "bucketrl up: --shares -1,1: each share must be > 0 (a run's weight on the pool), not -1",
        ),
        (["--runs", "3", "--shares", "2,1"], "bucketrl up: --shares 2,1: 2 shares for 3 runs (one per run)"),
        (["--runs", "0"], "bucketrl up: --runs 0: must be at least 1"),
        (
            ["--runs", "2", "--shares", "two,1"],
            "bucketrl up: --shares two,1: 'two' is not a number (e.g. --shares 2,1)",
        ),
        (["--run-spec", "x={a}", "--run-spec", "y=nope.json"], "bucketrl up: --run-spec y=nope.json: no such file"),
        (
            ["--runs", "2", "--external-trainer"],
            "bucketrl up: --external-trainer is a one-run `up`: it does not combine with several runs",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_made(tmp_path: Path, args: list[str], line: str) -> None:
    (tmp_path / "other").mkdir()
    paths = {name: str(_spec_file(tmp_path / f, 1)) for name, f in (("a", "a.json"), ("b", "b.json"))}
    paths["a_again"] = str(_spec_file(tmp_path / "other" / "a.json", 1))
    run_dir = tmp_path / "run"
    argv = [a.format(**paths) for a in args]
    cmd = [sys.executable, "-m", "bucketrl.cli", "up", "--dir", str(run_dir), "--no-live", *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == line.format(**paths)
    assert not run_dir.exists()


def test_live_view_and_lines_show_every_run_with_its_share_and_tokens(tmp_path: Path) -> None:
    from rich.console import Console

    from bucketrl.up import multiview
    from bucketrl.wire.pool import RunPoolStatus
    from tests.up.test_report_and_view import _watcher

    cfg = UpConfig(dir=tmp_path / "run", runs=parse_runs([], 2, "2,1", "demo"), max_steps=50, preflight=False)
    cluster = LocalCluster(cfg)
    cluster.tokens = {"viewer": "v"}
    watchers = {"demo-1": _watcher(40), "demo-2": _watcher(10)}
    for (run, w), (share, tokens) in zip(watchers.items(), ((2.0, 6000), (1.0, 3000)), strict=True):
        assert w.status is not None
        w.run = run
        w.status.pool = RunPoolStatus(
            run=run, share=share, tokens_generated=tokens, groups_accepted=tokens // 10, paused=False,
            budget_tokens=None, hold="ok" if run == "demo-2" else "finished",
        )  # fmt: skip
    console = Console(record=True, width=160)
    panel = multiview.render_runs(cluster, watchers, started=0.0, services={"trainer-demo-1": "exited 0"}, note="")
    console.print(panel)
    multiview.print_lines(console, cluster, watchers)
    text = console.export_text()
    for needle in ("2 runs on one pool", "40/50", "10/50", "6,000", "67%", "33%", "600", "finished", "exited 0"):
        assert needle in text, needle
    assert "demo-2: step 10/50  v11" in text and "share 1  tokens 3,000 (33%)  groups 300" in text


def test_a_bad_field_in_one_of_the_files_names_its_run_and_starts_nothing(tmp_path: Path) -> None:
    ok, bad = _spec_file(tmp_path / "ok.json", 1), _spec_file(tmp_path / "bad.json", 0)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "bucketrl.cli", "up", "--dir", str(run_dir), "--no-live"]
    out = subprocess.run(
        [*cmd, "--run-spec", str(ok), "--run-spec", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == f"bucketrl up: run bad ({bad}): run spec field share: Input should be greater than 0"
    assert not run_dir.exists()


def test_the_share_figure_is_the_split_while_every_run_was_generating() -> None:
    """Runs that train the same steps end with the same tokens whatever their shares; the summary's fraction
    "while all ran" is taken at the last poll before one of them finished (or was paused)."""
    from bucketrl.up import multiview
    from bucketrl.wire.pool import RunPoolStatus
    from tests.up.test_report_and_view import _watcher

    watchers = {"a": _watcher(10), "b": _watcher(5)}

    def poll(a: tuple[int, str], b: tuple[int, str]) -> dict[str, dict[str, object]]:
        for (run, w), (tokens, hold) in zip(watchers.items(), (a, b), strict=True):
            assert w.status is not None
            w.status.pool = RunPoolStatus(
                run=run, share=2.0 if run == "a" else 1.0, tokens_generated=tokens, groups_accepted=1, paused=False,
                budget_tokens=None, hold=hold,  # type: ignore[arg-type]
            )  # fmt: skip
        multiview.snapshot_shares(watchers)  # what up's loop does on every poll
        return multiview.pool_figures(watchers)

    poll((2000, "ok"), (1000, "ok"))
    mid = poll((4000, "ok"), (2000, "ok"))
    assert mid["a"]["token_fraction_while_all_ran"] == 4000 / 6000
    end = poll((4100, "finished"), (6000, "ok"))  # a done: b has had the pool since
    assert end["a"]["token_fraction"] == 4100 / 10100
    assert end["a"]["token_fraction_while_all_ran"] == 4000 / 6000  # the last split with both running
    assert end["b"]["token_fraction_while_all_ran"] == 2000 / 6000
