"""The trainer's start-up steps against the proxy and its trackers: create or confirm the run spec (``PUT
/runs/{run}``; ``dataset.size`` counted when missing), or read it; upload BUCKETRL_DATASET_FILE as the run's
dataset (``bucket:dataset.jsonl``) when given; open BUCKETRL_REPORT_TO's trackers."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from bucketrl import errors
from bucketrl.client import ProxyClient
from bucketrl.datasets import describe_dataset, parse_jsonl
from bucketrl.trainer.exits import ConfigError
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.trainer.trackers import Trackers, open_trackers, parse_report_to, tracker_run_id
from bucketrl.wire import DatasetSpec, RunSpec

# The worker's logger: these lines read as they did when this code was part of the worker.
log = logging.getLogger("bucketrl.trainer")

BUCKET_DATASET_URI = "bucket:dataset.jsonl"


def ensure_run(settings: TrainerSettings, client: ProxyClient) -> tuple[RunSpec, float]:
    """The run's spec and its creation time on the proxy (which names the tracker run)."""
    given = settings.run_spec_dict()
    if given is None:
        try:
            info = client.get_run()
            return info.spec, info.state.created_at
        except errors.NotFound as exc:
            raise ConfigError(
                f"run {settings.run!r} does not exist on the proxy: set BUCKETRL_RUN_SPEC to create it"
            ) from exc
    dataset = given.get("dataset")
    upload = _dataset_upload(settings, dataset)
    if isinstance(dataset, dict) and "size" not in dataset:
        given = {**given, "dataset": {**dataset, "size": _count_dataset(settings, client, dataset, upload)}}
    spec = RunSpec.model_validate(given)
    try:
        info = client.put_run(spec)
        spec, created_at = info.spec, info.state.created_at
    except errors.Conflict as exc:
        raise ConfigError(
            f"BUCKETRL_RUN_SPEC changes an immutable field of the existing run {settings.run!r}: "
            f"{exc.message}. Use a new BUCKETRL_RUN or the original spec."
        ) from exc
    if upload is not None:
        _upload_dataset(settings, client, upload)
    return spec, created_at


def _upload_dataset(settings: TrainerSettings, client: ProxyClient, upload: bytes) -> None:
    try:
        info = client.upload_dataset(upload)
    except errors.Invalid as exc:
        raise ConfigError(f"BUCKETRL_DATASET_FILE {settings.dataset_file}: {exc.message}") from exc
    except errors.Conflict as exc:
        raise ConfigError(
            f"BUCKETRL_DATASET_FILE differs from the dataset run {settings.run!r} already has: "
            f"{exc.message}. Use a new BUCKETRL_RUN."
        ) from exc
    log.info("uploaded dataset (%d rows, sha256 %s)", info.rows, info.sha256[:12])


def _dataset_upload(settings: TrainerSettings, dataset: Any) -> bytes | None:
    """The bytes of BUCKETRL_DATASET_FILE, if set (the spec must point at the uploaded file)."""
    path = settings.dataset_file
    if not path:
        return None
    uri = dataset.get("uri") if isinstance(dataset, dict) else None
    if uri != BUCKET_DATASET_URI:
        raise ConfigError(
            f"BUCKETRL_DATASET_FILE is set, so the run spec's dataset.uri must be {BUCKET_DATASET_URI!r}, not {uri!r}"
        )
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"BUCKETRL_DATASET_FILE: cannot read {path!r}: {exc}") from exc


def _count_dataset(
    settings: TrainerSettings, client: ProxyClient, dataset: dict[str, Any], upload: bytes | None
) -> int:
    fields = {k: dataset[k] for k in ("prompt_field", "answer_field", "split") if k in dataset}
    try:
        if upload is not None:
            probe = DatasetSpec(uri=BUCKET_DATASET_URI, size=1, **fields)
            size = len(parse_jsonl(upload, probe, settings.dataset_file))
        else:
            size = describe_dataset(dataset.get("uri", ""), client=client, **fields).size
    except errors.Invalid as exc:
        raise ConfigError(f"dataset {dataset.get('uri')!r}: {exc.message}") from exc
    if size < 1:
        raise ConfigError(f"dataset {dataset.get('uri')!r} is empty")
    log.info("dataset %s has %d examples", dataset.get("uri"), size)
    return size


def open_run_trackers(settings: TrainerSettings, spec: RunSpec, run_created_at: float, resume_step: int) -> Trackers:
    """BUCKETRL_REPORT_TO's trackers, continuing the same tracker run after a resume."""
    s = settings
    return open_trackers(
        parse_report_to(s.report_to),
        run=s.run,
        run_id=tracker_run_id(s.run, run_created_at),
        config={"run": s.run, "run_spec": spec.model_dump(mode="json"), "trainer": _tracker_settings(s)},
        directory=s.tracker_dir,
        project=s.tracker_project,
        resume_step=resume_step,
    )


def _tracker_settings(settings: TrainerSettings) -> dict[str, Any]:
    """The trainer's own hyper-parameters for the tracker config (no token, no URLs)."""
    keep: tuple[str, ...] = ("lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "max_grad_norm")
    keep += ("warmup_steps", "lr_schedule", "min_lr_ratio", "max_steps", "sync_every", "checkpoint_every", "seed")
    keep += ("dtype",)
    return {k: getattr(settings, k) for k in keep}


def finish_generation(client: ProxyClient) -> None:
    """Tell a shared pool this run wants no more groups (its share goes to the others at once, not once its
    queue has filled). Best effort: an older proxy (404) or an outage only leaves the pool to find out."""
    try:
        client.finish_generation()
    except errors.BucketRLError as exc:
        log.info("could not mark the run finished on the pool (%s): its queue fills and it is passed over", exc)
