"""`bucketrl up` pieces that need no services: the run spec it builds, the sync-latency log parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from bucketrl.tasks.tiny_model import VOCAB_SIZE
from bucketrl.tasks.toy import DEMO_LR, DEMO_MAX_STEPS
from bucketrl.up.config import UpConfig, build_run_spec
from bucketrl.up.synclatency import measure
from bucketrl.wire import RunSpec


def test_default_is_the_measured_demo(tmp_path: Path) -> None:
    cfg = UpConfig(dir=tmp_path)
    assert cfg.is_demo and cfg.run_dir == tmp_path.resolve()
    assert cfg.effective_lr() == DEMO_LR and cfg.effective_max_steps() == DEMO_MAX_STEPS
    spec = RunSpec.model_validate(build_run_spec(cfg, tmp_path / "model"))
    assert spec.base_model == str(tmp_path / "model")
    assert spec.vocab_size == VOCAB_SIZE
    assert spec.dataset.uri == "toy:digits" and spec.reward.name == "toy"
    assert UpConfig(run="r1").run_dir == (Path("runs") / "r1").resolve()
    # Issue 10: a SIGKILLed Redis must lose nothing it acknowledged (everysec can lose a second, undetected).
    assert cfg.redis_fsync == "always"


def test_knobs_reach_the_spec(tmp_path: Path) -> None:
    cfg = UpConfig(
        dir=tmp_path,
        group_size=4,
        groups_per_step=2,
        max_staleness=1,
        temperature=0.7,
        max_new_tokens=6,
        lora_r=4,
        queue_capacity=1,
        dataset="toy:parity",
        generator_engines=["transformers", "vllm"],
    )
    spec = RunSpec.model_validate(build_run_spec(cfg, tmp_path))
    assert (spec.group_size, spec.groups_per_step, spec.max_staleness) == (4, 2, 1)
    assert (spec.sampling.temperature, spec.sampling.max_new_tokens) == (0.7, 6)
    assert spec.reward.kwargs["length"] == 6  # the toy reward looks at as many characters as are generated
    assert (spec.lora.r, spec.lora.alpha) == (4, 8.0)
    assert spec.queue_capacity_groups == 2  # raised to hold one step
    assert spec.dataset.uri == "toy:parity"
    assert [cfg.engine_of(i) for i in range(3)] == ["transformers", "vllm", "transformers"]


def test_a_real_dataset_leaves_its_size_to_the_trainer(tmp_path: Path) -> None:
    spec = build_run_spec(UpConfig(dir=tmp_path, dataset="/data/train.jsonl", reward="exact"), tmp_path)
    assert "size" not in spec["dataset"] and spec["reward"]["name"] == "exact"
    assert spec["sampling"]["temperature"] == 1.0


@pytest.mark.parametrize(
    "kw",
    [
        {"run": "../escape"},
        {"generators": -1},
        {"engine": "tensorrt"},
        {"generator_engines": []},
        {"lr": 0},
        {"unknown_option": 1},
    ],
)
def test_bad_options_are_refused(kw: dict) -> None:
    with pytest.raises(ValidationError):
        UpConfig(**kw)


def test_trainer_shard_base_needs_ranks_one_line_and_nothing_created(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from bucketrl.cli import app

    out = CliRunner().invoke(app, ["up", "--trainer-shard-base", "--dir", str(tmp_path / "run")])
    assert out.exit_code == 2, out.output
    assert out.output.strip() == (
        "bucketrl up: --trainer-shard-base shards the base across trainer ranks: add --trainer-procs 2 (or more)"
    )
    assert not (tmp_path / "run").exists()
    assert UpConfig(trainer_procs=2, trainer_shard_base=True).trainer_shard_base


def test_unknown_toy_task_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown toy task"):
        build_run_spec(UpConfig(dir=tmp_path, dataset="toy:chess"), tmp_path)


def _log(path: Path, lines: list[str]) -> None:
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def test_sync_latency_from_logs(tmp_path: Path) -> None:
    d = "2026-01-01 10:00:"
    _log(
        tmp_path / "trainer.log",
        [
            f"{d}00,000 INFO bucketrl.trainer: published v1 (step 0, 10 bytes) in 0.100s",
            f"{d}10,000 INFO bucketrl.trainer: published v2 (step 1, 10 bytes) in 0.100s",
            f"{d}20,000 INFO bucketrl.trainer: published v3 (step 2, 10 bytes) in 0.100s",
            f"{d}30,000 INFO bucketrl.trainer: published v4 (step 3, 10 bytes) in 0.100s",
        ],
    )
    _log(
        tmp_path / "gen-0.log",
        [
            "=== 2026-01-01 10:00:00 start gen-0: bucketrl generator",
            f"{d}01,000 INFO bucketrl.generator.worker [MainThread] loaded r-v1 in 0.5s (resident: [1])",
            f"{d}10,200 INFO bucketrl.generator.worker [MainThread] loaded r-v2 in 0.1s (resident: [1, 2])",
            f"{d}20,300 INFO bucketrl.generator.worker [MainThread] loaded r-v3 in 0.1s (resident: [2, 3])",
            f"{d}30,100 INFO bucketrl.generator.worker [MainThread] loaded r-v4 in 0.1s (resident: [3, 4])",
        ],
    )
    _log(
        tmp_path / "gen-1.log",
        [
            "=== 2026-01-01 10:00:00 start gen-1: bucketrl generator",
            f"{d}05,000 INFO bucketrl.generator.worker [MainThread] loaded r-v1 in 4.5s (resident: [1])",
            # v2 skipped: v3 covers it (published 20.0, loaded 20.5 -> v2 latency 10.5 s)
            f"{d}20,500 INFO bucketrl.generator.worker [MainThread] loaded r-v3 in 0.1s (resident: [1, 3])",
            f"{d}21,000 INFO bucketrl.generator.worker [MainThread] heartbeat",
            # killed; the restarted instance's first load is start-up, not sync
            "=== 2026-01-01 10:00:25 start gen-1: bucketrl generator",
            f"{d}35,000 INFO bucketrl.generator.worker [MainThread] loaded r-v4 in 0.1s (resident: [4])",
        ],
    )
    lat = measure(tmp_path, "r")
    # v1: every first load is a start-up, not a sync: no figure.
    assert 1 not in lat.per_version
    assert lat.per_version[2] == pytest.approx(10.6, abs=1e-3)  # gen-1 got it only with v3
    assert lat.per_version[3] == pytest.approx(0.6, abs=1e-3)
    # v4: the first gen-1 instance was dead, the second one started after the publish -> gen-0 only.
    assert lat.per_version[4] == pytest.approx(0.2, abs=1e-3)
    assert lat.p50 == pytest.approx(0.6, abs=1e-3) and lat.max == pytest.approx(10.6, abs=1e-3)
    assert "p50" in lat.describe()
    assert measure(tmp_path / "nothing", "r").per_version == {}


def test_report_to_is_a_flag_that_reaches_the_trainer_and_a_typo_stops_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL's ``report_to`` as ``bucketrl up --report-to`` (it was only BUCKETRL_REPORT_TO): the flag wins over the
    variable, and a tracker name that does not exist is refused before anything is made."""
    import subprocess
    import sys

    from bucketrl.up.cluster import LocalCluster

    monkeypatch.setenv("BUCKETRL_REPORT_TO", "tensorboard")
    cluster = LocalCluster(UpConfig(dir=tmp_path / "a", report_to="none"))
    cluster.tokens = {"trainer": "t"}
    assert cluster.trainer_env()["BUCKETRL_REPORT_TO"] == "none"
    cluster = LocalCluster(UpConfig(dir=tmp_path / "b"))
    cluster.tokens = {"trainer": "t"}
    assert cluster.trainer_env()["BUCKETRL_REPORT_TO"] == "tensorboard"

    run_dir = tmp_path / "typo"
    cmd = [sys.executable, "-m", "bucketrl.cli", "up", "--report-to", "tensorbored", "--dir", str(run_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "bucketrl up: --report-to: tensorbored is not one of tensorboard, wandb, trackio, none, all"
    )
    assert not run_dir.exists()


def test_a_toy_task_with_a_run_spec_file_keeps_its_own_max_new_tokens(tmp_path: Path) -> None:
    """With ``--run-spec`` on a toy dataset the preflight used to choose a length to fit the model and report it
    ("max_new_tokens 507 (chosen to fit)") while the spec kept the task's own 8."""
    from bucketrl.up.config import max_new_tokens_given

    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"loss": {"objective": "decoupled"}}))
    cfg = UpConfig(dir=tmp_path / "run", run_spec=spec_file)
    assert max_new_tokens_given(cfg)
    assert (
        build_run_spec(cfg, None)["sampling"]["max_new_tokens"]
        == build_run_spec(UpConfig(dir=tmp_path), None)["sampling"]["max_new_tokens"]
    )
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text('{"prompt": "1+1", "answer": "2"}\n')
    assert not max_new_tokens_given(UpConfig(dir=tmp_path / "real", dataset=str(jsonl), run_spec=spec_file))


def test_a_run_spec_file_keeps_the_toy_tasks_lr_and_steps_unless_given(tmp_path: Path) -> None:
    """``--run-spec {"loss": ...}`` on the demo used to drop the task's lr and steps for the trainer's generic 1e-5
    and 200 (the tiny model barely moves at 1e-5); what the trainer process is given, as ``up`` starts it."""
    from bucketrl.tasks.toy import ARABIC_DEMO_LR, ARABIC_DEMO_MAX_STEPS
    from bucketrl.up.cluster import LocalCluster
    from bucketrl.up.runs import parse_runs

    def trainer_env(cfg: UpConfig, run: str | None = None) -> dict[str, str]:
        cluster = LocalCluster(cfg)
        cluster.tokens = {"trainer": "t", **{f"trainer@{r}": "t" for r in cluster.runs}}
        return cluster.trainer_env(run)

    def trainer_settings(cfg: UpConfig, run: str | None = None) -> tuple[float, int]:
        env = trainer_env(cfg, run)
        return float(env["BUCKETRL_LR"]), int(env["BUCKETRL_MAX_STEPS"])

    def spec_file(name: str, data: dict) -> Path:
        (tmp_path / name).write_text(json.dumps(data))
        return tmp_path / name

    loss = spec_file("loss.json", {"loss": {"entropy_coef": 0.01}})
    assert trainer_settings(UpConfig(dir=tmp_path / "a", run_spec=loss)) == (DEMO_LR, DEMO_MAX_STEPS)
    arabic = spec_file("arabic.json", {"dataset": {"uri": "toy:arabic-math"}, "loss": {"entropy_coef": 0.1}})
    assert trainer_settings(UpConfig(dir=tmp_path / "b", run_spec=arabic)) == (ARABIC_DEMO_LR, ARABIC_DEMO_MAX_STEPS)
    # The Arabic task's lr decays to 0 over its steps; the others' stays constant.
    schedule = {
        name: trainer_env(cfg).get("BUCKETRL_LR_SCHEDULE")
        for name, cfg in (
            ("arabic", UpConfig(dir=tmp_path / "b", run_spec=arabic)),
            ("digits", UpConfig(dir=tmp_path / "a")),
        )
    }
    assert schedule == {"arabic": "linear", "digits": None}
    # --dataset over the file's, and --lr / --max-steps over the task's.
    cfg = UpConfig(dir=tmp_path / "c", run_spec=arabic, dataset="toy:parity", lr=0.01, max_steps=7)
    assert trainer_settings(cfg) == (0.01, 7)
    assert trainer_settings(UpConfig(dir=tmp_path / "d", run_spec=arabic, dataset="toy:parity")) == (
        DEMO_LR,
        DEMO_MAX_STEPS,
    )
    # Several runs, one file each: each run's trainer gets its own task's.
    runs = parse_runs([f"x={loss}", f"y={arabic}"], None, None, "demo")
    cfg = UpConfig(dir=tmp_path / "e", runs=runs)
    assert trainer_settings(cfg, "x") == (DEMO_LR, DEMO_MAX_STEPS)
    assert trainer_settings(cfg, "y") == (ARABIC_DEMO_LR, ARABIC_DEMO_MAX_STEPS)
    # Not the built-in model (the file's base_model) or not a toy task: the generic defaults, as without a file.
    real = spec_file("real.json", {"base_model": "Qwen/Qwen2.5-0.5B-Instruct"})
    assert trainer_settings(UpConfig(dir=tmp_path / "f", run_spec=real)) == (1e-5, 200)
    assert trainer_settings(UpConfig(dir=tmp_path / "g", run_spec=loss, dataset="/data/train.jsonl")) == (1e-5, 200)


def test_a_run_spec_files_base_model_is_what_the_generators_load(tmp_path: Path) -> None:
    """No --model and a --run-spec file naming one: ``up`` used to build the tiny model anyway and hand it to every
    generator (BUCKETRL_MODEL_PATH), while the trainer trained the file's model."""
    from bucketrl.up.cluster import LocalCluster

    (tmp_path / "spec.json").write_text(json.dumps({"base_model": str(tmp_path / "other"), "vocab_size": 320}))
    cfg = UpConfig(dir=tmp_path / "run", run_spec=tmp_path / "spec.json", preflight=False)
    assert not cfg.builtin_model and not cfg.is_demo
    cluster = LocalCluster(cfg)
    try:
        cluster.prepare()
    finally:
        cluster.release()
    assert cluster.model_dir is None and not (tmp_path / "run" / "model").exists()
    assert json.loads((tmp_path / "run" / "run_spec.json").read_text())["base_model"] == str(tmp_path / "other")
