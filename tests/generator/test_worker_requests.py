"""Issue 21: the generator's next prompt lease rides on its submit (one request per engine call instead of two), and
its keeper's lease renewals on its heartbeat."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketrl.proxy.telemetry import Telemetry
from tests.generator.helpers import make_adapter
from tests.generator.worker_support import Consumer, create_run, running_worker, worker_settings
from tests.proxy.harness import ProxyHarness, running
from tests.support.services import RedisServer


@pytest.fixture()
def proxy_file(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        yield h


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    return {1: make_adapter(tiny_model_dir, tmp_path_factory.mktemp("request-adapters") / "v1", seed=11)}


def _requests(telemetry: Telemetry, method: str, route: str) -> float:
    value = telemetry.registry.get_sample_value(
        "bucketrl_http_request_duration_seconds_count", {"method": method, "route": route, "status": "202"}
    )
    if method == "POST" and route.endswith("/lease"):
        value = sum(
            telemetry.registry.get_sample_value(
                "bucketrl_http_request_duration_seconds_count", {"method": method, "route": route, "status": code}
            )
            or 0.0
            for code in ("200", "429")
        )
    return value or 0.0


def test_the_workers_submits_lease_its_next_prompts(
    proxy_file: ProxyHarness, tiny_model_dir: Path, adapters: dict[int, Path]
) -> None:
    # Admission allows more than a few calls in flight: the submits' leases are granted (16 prompts, 8 per pass).
    trainer, _ = create_run(
        proxy_file, "w1", tiny_model_dir, adapters[1], groups_per_step=8, max_staleness=4, queue_capacity_groups=64
    )
    viewer = proxy_file.client("w1", "viewer")
    settings = worker_settings(proxy_file, "w1", "gen-a", prompts_per_request=2, max_groups=24)
    with Consumer(trainer) as consumer, running_worker(settings) as worker:
        worker.thread.join(180)  # type: ignore[attr-defined]
        assert not worker.thread.is_alive(), "worker did not reach max_groups"  # type: ignore[attr-defined]
        consumer.wait_for(lambda ds: sum(len(d.groups) for d in ds) >= 24, 60)
    telemetry = proxy_file.ctx.telemetry
    submits = _requests(telemetry, "POST", "/v1/runs/{run}/rollouts")
    leases = _requests(telemetry, "POST", "/v1/runs/{run}/prompts/lease")
    assert submits == 12, submits  # 24 groups, 2 per call
    # Each call's prompts came either with an earlier call's submit or from a lease of their own (when no batch was
    # waiting to be submitted at that moment: how often depends on the machine's timing). Without the submits'
    # leases there would be at least one lease per call.
    assert leases < submits, (leases, submits)
    # The keeper's renewals rode on its heartbeats (every 0.3 s here): no renew request of their own.
    pushes = telemetry.registry.get_sample_value(
        "bucketrl_http_request_duration_seconds_count",
        {"method": "POST", "route": "/v1/runs/{run}/metrics", "status": "200"},
    )
    assert pushes and pushes >= 2, pushes
    for route in ("/v1/runs/{run}/leases/{lease_id}/renew", "/v1/runs/{run}/prompts/renew"):
        for code in ("200", "410"):
            assert not telemetry.registry.get_sample_value(
                "bucketrl_http_request_duration_seconds_count", {"method": "POST", "route": route, "status": code}
            ), route
    status = viewer.status()
    assert status.queue.accepted_total == 24 and status.prompts_inflight == 0  # nothing leased and left behind
    accepted = [g.prompt_id for d in consumer.deliveries for g in d.groups]
    assert len(accepted) == len(set(accepted))
