"""Experiment trackers (BUCKETRL_REPORT_TO): the trainer worker against a real proxy, its metrics read back with
each tracker's own reader (TensorBoard's event accumulator, wandb's offline run file, trackio's local database)
and compared with what the trainer pushed to the proxy; resume continues the same tracker run; an unreachable
tracker never stops training."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from bucketrl.tarball import unpack
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.trainer.trackers import _warn_if_trackio_dir_is_fixed, default_report_to, parse_report_to
from bucketrl.trainer.worker import EVAL_REPORTED, EXIT_OK, TrainerWorker
from tests.proxy.harness import TOKENS, ProxyHarness, running
from tests.support.services import RedisServer
from tests.trainer.fake_generator import FakeGenerator
from tests.trainer.test_worker import spec_json

DATASET = {"uri": "toy:digits", "size": 16}

# trackio fixes its directory when it is first imported (TRL's import does it, in the gateway's tests), so the
# database may be shared with earlier test sessions: a project name of this session's own keeps runs apart.
_SESSION = uuid.uuid4().hex[:8]


def project_name(tmp_path: Path) -> str:
    return f"proj-{_SESSION}-{tmp_path.name}"


def train(
    proxy: ProxyHarness,
    model_dir: Path,
    tmp_path: Path,
    max_steps: int,
    report_to: str,
    *,
    checkpoint_every: int = 2,
    eval_spec: dict[str, Any] | None = None,
) -> None:
    extra = {} if eval_spec is None else {"eval": eval_spec}
    settings = TrainerSettings(
        proxy_url=proxy.url,
        token=TOKENS["trainer"],
        run="r1",
        worker_id="trainer-a",
        run_spec=spec_json(model_dir, DATASET, **extra),
        max_steps=max_steps,
        checkpoint_every=checkpoint_every,
        device="cpu",
        lr=1e-2,
        claim_wait_s=0.5,
        report_to=report_to,
        tracker_dir=str(tmp_path / "trackers"),
        tracker_project=project_name(tmp_path),
        work_dir=str(tmp_path / "work"),
    )
    gen = FakeGenerator(proxy.url, "r1", TOKENS["generator"], worker_id="gen-a", evaluate=eval_spec is not None)
    gen.start()
    out: list[str] = []
    try:
        rc = TrainerWorker(settings, echo=out.append).run()
    finally:
        gen.stop()
    assert rc == EXIT_OK, out


def pushed(proxy: ProxyHarness) -> dict[int, dict[str, float]]:
    """step -> the metrics the trainer pushed to the proxy for it."""
    with proxy.http("viewer") as http:
        records = http.get("/v1/runs/r1/metrics/recent", params={"count": 500}).raise_for_status().json()
    # (phase pushes carry no step and no metrics; the last step's eval report is a push of its own)
    out: dict[int, dict[str, float]] = {}
    for r in records:
        if r["worker_id"] == "trainer-a" and r["step"] is not None:
            out.setdefault(r["step"], {}).update(r["metrics"])
    return out


def tensorboard_scalars(logdir: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            out.setdefault(ev.step, {})[tag] = ev.value
    return out


def tensorboard_text(logdir: Path, tag: str) -> str:
    """A text summary (``SummaryWriter.add_text``) read back with TensorBoard's reader, without the JSON fence."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors(f"{tag}/text_summary")
    text = tensor_util.make_ndarray(event.tensor_proto).item().decode()
    return text.removeprefix("```json").removesuffix("```")


def _leveldb_log_records(data: bytes) -> list[bytes]:
    """The records of a wandb run file: LevelDB's log framing (32 KiB blocks; per fragment crc32, length,
    type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) after wandb's 7-byte ':W&B' header. wandb 0.31 reads these
    files in its Go core only; the records themselves are wandb's protobufs."""
    block, pos, out, partial = 32768, 7, [], b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):
            out.append(partial)
            partial = b""
    return out


def wandb_history(wandb_dir: Path) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    """Every history row of the offline runs under ``wandb_dir`` (parsed with wandb's protobufs), the run ids
    and the config."""
    from wandb.proto import wandb_internal_pb2

    rows: list[dict[str, Any]] = []
    ids: list[str] = []
    config: dict[str, Any] = {}
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        ids.append(path.stem.removeprefix("run-"))
        for data in _leveldb_log_records(path.read_bytes()):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
                rows.append(row)
            elif rec.WhichOneof("record_type") == "config":
                config.update({item.key: json.loads(item.value_json) for item in rec.config.update})
            elif rec.WhichOneof("record_type") == "run":
                config.update({item.key: json.loads(item.value_json) for item in rec.run.config.update})
    return rows, ids, config


def assert_same(want: dict[int, dict[str, float]], got: dict[int, dict[str, float]], names: list[str]) -> None:
    assert sorted(got) == sorted(want)
    for step, metrics in want.items():
        for name in names:
            assert got[step][name] == pytest.approx(metrics[name], rel=1e-6), (step, name)


def _fresh_wandb() -> None:
    """wandb keeps its settings (the mode among them) in a process-wide singleton: start from none, so this
    test's environment applies whatever ran before it in this process."""
    import wandb

    wandb.teardown()


NAMES = ["train/loss", "train/grad_norm", "reward", "entropy", "ratio", "policy/version"]


def test_a_trackio_directory_fixed_by_an_earlier_import_is_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Importing TRL imports trackio and fixes its directory; the trainer then says where the database is.
    Runs before the slow tests below on purpose: they must pass with trackio already imported, as in CI."""
    import trackio.utils

    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "elsewhere"))
    with caplog.at_level(logging.WARNING, logger="bucketrl.trainer"):
        _warn_if_trackio_dir_is_fixed()
    assert f"its database is in {trackio.utils.TRACKIO_DIR}, not {tmp_path / 'elsewhere'}" in caplog.text
    caplog.clear()
    monkeypatch.setenv("TRACKIO_DIR", str(trackio.utils.TRACKIO_DIR))
    _warn_if_trackio_dir_is_fixed()
    assert caplog.text == ""


@pytest.mark.slow
def test_tensorboard_wandb_and_trackio_get_the_trainers_metrics_and_resume_continues_them(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _fresh_wandb()
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        train(proxy, tiny_model_dir, tmp_path, 2, "tensorboard,wandb,trackio")
        # A second trainer process resumes the run from its step-2 checkpoint and trains to step 4.
        train(proxy, tiny_model_dir, tmp_path, 4, "tensorboard,wandb,trackio")
        want = pushed(proxy)
    assert sorted(want) == [1, 2, 3, 4]

    tb = tensorboard_scalars(tmp_path / "trackers" / "tensorboard" / "r1")
    assert_same(want, tb, NAMES)
    for step, metrics in want.items():  # every pushed metric, under the same name
        assert set(metrics) <= set(tb[step]), set(metrics) - set(tb[step])
    # The run's cost, read from the proxy (each trainer's first and last step here: under COST_EVERY_S apart).
    spent = [tb[step]["cost/usd_total"] for step in (1, 2, 3, 4)]
    assert spent == sorted(spent) and spent[-1] > 0, spent
    assert {"cost/usd_per_step", "cost/waste_fraction", "cost/usd_per_trained_token"} <= set(tb[4])
    tb_config = json.loads(tensorboard_text(tmp_path / "trackers" / "tensorboard" / "r1", "run_spec"))
    assert tb_config["run_spec"]["group_size"] == 4 and tb_config["trainer"]["lr"] == 1e-2, tb_config

    rows, ids, config = wandb_history(tmp_path / "trackers")
    assert len(ids) == 2 and ids[0] == ids[1], "the resumed trainer logs to the same wandb run"
    assert_same(want, {int(r["_step"]): r for r in rows}, NAMES)
    assert config["run_spec"]["group_size"] == 4 and config["trainer"]["lr"] == 1e-2

    from trackio.sqlite_storage import SQLiteStorage

    project = project_name(tmp_path)
    runs = SQLiteStorage.get_runs(project)
    assert len(runs) == 1, runs  # resume="allow": one trackio run across both trainers
    logs = SQLiteStorage.get_logs(project, runs[0])
    assert_same(want, {int(r["step"]): r for r in logs}, NAMES)
    trackio_config = SQLiteStorage.get_run_config(project, runs[0]) or {}
    assert trackio_config["run_spec"]["group_size"] == 4 and trackio_config["trainer"]["lr"] == 1e-2, trackio_config


EVAL_NAMES = ["eval/reward", "eval/version", "eval/pass@1", "eval/mean_length", "eval/unscorable_frac"]


@pytest.mark.slow
def test_eval_results_reach_every_tracker_once_per_version_across_a_resume(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each evaluated version's result is pushed with the trainer's metrics once, at the step it became known,
    oldest first, and reaches the trackers under the same names. The last step waits for the final version's
    evaluation and reports it. A checkpoint holds what was reported up to its step (the report is made on the
    uploader thread, after the step's checkpoint was snapshotted): a resumed trainer reports nothing twice."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _fresh_wandb()
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    every_version = {"every": 1, "size": 2}
    report_to = "tensorboard,wandb,trackio"
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        train(proxy, tiny_model_dir, tmp_path, 2, report_to, checkpoint_every=1, eval_spec=every_version)
        first = pushed(proxy)
        # Step 1's checkpoint records the version step 1 reported (v1: evaluated before the first rollouts).
        assert first[1]["eval/version"] == 1, first[1]
        unpack(proxy.client("r1", "trainer").download_checkpoint(1), tmp_path / "ckpt1")
        assert json.loads((tmp_path / "ckpt1" / "state.json").read_text())["counters"][EVAL_REPORTED] == 1
        # The last step (2) reports the final version, v3 (published by step 2), waited for.
        assert first[2]["eval/version"] == 3, first[2]
        train(proxy, tiny_model_dir, tmp_path, 4, report_to, checkpoint_every=1, eval_spec=every_version)
        want = pushed(proxy)
        results = {e.version: e for e in proxy.client("r1", "viewer").eval_results()}
    assert sorted(want) == [1, 2, 3, 4]
    reported = [int(m["eval/version"]) for _, m in sorted(want.items()) if "eval/version" in m]
    assert reported == sorted(set(reported)), f"an evaluated version reported twice: {reported}"
    assert want[4]["eval/version"] == 5, reported  # the second trainer's final version
    for m in want.values():
        if "eval/version" in m:
            e = results[int(m["eval/version"])]
            assert (m["eval/reward"], m["eval/mean_length"]) == pytest.approx((e.reward_mean, e.mean_length))
    evals = {step: m for step, m in want.items() if "eval/version" in m}

    tb = tensorboard_scalars(tmp_path / "trackers" / "tensorboard" / "r1")
    assert_same(evals, {s: m for s, m in tb.items() if "eval/version" in m}, EVAL_NAMES)
    rows, _, _ = wandb_history(tmp_path / "trackers")
    assert_same(evals, {int(r["_step"]): r for r in rows if "eval/version" in r}, EVAL_NAMES)
    from trackio.sqlite_storage import SQLiteStorage

    project = project_name(tmp_path)
    logs = SQLiteStorage.get_logs(project, SQLiteStorage.get_runs(project)[0])
    assert_same(evals, {int(r["step"]): r for r in logs if "eval/version" in r}, EVAL_NAMES)


def test_an_unreachable_tracker_is_warned_about_once_and_training_goes_on(
    redis_server: RedisServer,
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # wandb online against a server that refuses connections (nothing listens on port 1).
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "5")
    monkeypatch.setenv("WANDB_SILENT", "true")
    caplog.set_level(logging.WARNING, logger="bucketrl.trainer")
    _fresh_wandb()
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        train(proxy, tiny_model_dir, tmp_path, 2, "wandb,tensorboard")
        want = pushed(proxy)
    warnings = [r.getMessage() for r in caplog.records if "tracker wandb" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert_same(want, tensorboard_scalars(tmp_path / "trackers" / "tensorboard" / "r1"), NAMES)


def test_report_to_is_checked_at_start_up() -> None:
    # The defaults: none for `bucketrl trainer`; `bucketrl up` writes TensorBoard files when tensorboard is here.
    assert TrainerSettings.model_fields["report_to"].default == "none" and default_report_to() == "tensorboard"
    assert parse_report_to("none") == [] and parse_report_to("") == []
    assert parse_report_to("tensorboard, wandb") == ["tensorboard", "wandb"]
    with pytest.raises(ValueError, match="mlflow is not one of"):
        TrainerSettings(report_to="tensorboard,mlflow")


def test_the_trainer_cli_names_an_unknown_tracker_once() -> None:
    env = {**os.environ, "BUCKETRL_PROXY_URL": "http://127.0.0.1:9", "BUCKETRL_TOKEN": "t"}
    out = subprocess.run(
        [sys.executable, "-m", "bucketrl.cli", "trainer", "--run", "a"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "BUCKETRL_REPORT_TO": "mlflow"},
    )
    assert out.returncode == 2
    want = "bucketrl trainer: report_to: mlflow is not one of tensorboard, wandb, trackio, none, all"
    assert out.stderr.strip() == want
