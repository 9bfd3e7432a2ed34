"""A whole run through real processes, real Redis and real HTTP: proxy + trainer + 2 generators learn the toy
task, publish versions, and every docs/design.md section 4 invariant holds at the end (file:// and s3:// buckets).

    .venv/bin/python -m pytest -q -s tests/e2e/test_full_run.py
"""

from __future__ import annotations

import statistics
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.helpers import Watch, check_invariants, print_sync_latency, reward_curve, running_cluster, series

pytestmark = pytest.mark.slow

STEPS = 30


def _bucket(kind: str, request: pytest.FixtureRequest) -> dict[str, str]:
    if kind == "file":
        return {}
    moto = request.getfixturevalue("moto_server")  # sets AWS_* and BUCKETRL_S3_ENDPOINT_URL for the children
    name = f"e2e-{uuid.uuid4().hex[:10]}"
    moto.create_bucket(name)
    return {"bucket_url": f"s3://{name}/bucketrl"}


@pytest.mark.parametrize("bucket", ["file", "s3"])
def test_full_run_learns_and_keeps_the_invariants(tmp_path: Path, bucket: str, request: pytest.FixtureRequest) -> None:
    t0 = time.monotonic()
    with running_cluster(tmp_path, max_steps=STEPS, generators=2, **_bucket(bucket, request)) as cluster:
        watch = Watch(cluster)
        trainer = cluster.services["trainer"]
        deadline = time.monotonic() + 420
        while trainer.alive and time.monotonic() < deadline:
            watch.poll()
            for name in cluster.generator_names:
                assert cluster.services[name].alive, f"{name} died: {cluster.services[name].log_tail()}"
            time.sleep(1.0)
        assert trainer.wait(5) == 0, trainer.log_tail()
        cluster.stop_workers()  # generators release their prompts; the queue is still from here on
        report = check_invariants(cluster, watch)
        rewards = [r for _, r in reward_curve(cluster)]
        ratio = [v for _, v in series(cluster, "ratio")]
        print(f"\n[{bucket}] {report}")
        print(
            f"[{bucket}] {len(rewards)} steps in {time.monotonic() - t0:.0f}s; reward first 8 steps "
            f"{statistics.fmean(rewards[:8]):.3f} -> last 8 {statistics.fmean(rewards[-8:]):.3f}; "
            f"ratio mean {statistics.fmean(ratio):.5f}; {watch.polls} status polls, leased versions seen "
            f"{sorted(watch.leased_seen)[:3]}..{sorted(watch.leased_seen)[-3:]}"
        )
        print_sync_latency(cluster)
    assert len(rewards) == STEPS
    first, last = statistics.fmean(rewards[:8]), statistics.fmean(rewards[-8:])
    assert last >= 2 * first and last - first >= 0.15, (first, last)
    assert report.latest_version >= 5
    assert report.acked > 0 and report.accepted >= STEPS * 8 - 8
    # Versions older than latest - max_staleness without a lease were garbage-collected.
    assert report.gc_total > 0 and min(report.versions_in_bucket) > 1
