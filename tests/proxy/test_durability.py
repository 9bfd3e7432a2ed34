"""The proxy warns at start when its Redis could come back from a crash with an older state (``durability.py``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import redis

from bucketrl.proxy.durability import rollback_risk
from tests.proxy.harness import running
from tests.support.services import RedisServer


@pytest.mark.parametrize(
    ("config", "risky"),
    [
        ({"appendonly": "yes", "appendfsync": "always", "save": "3600 1"}, None),
        ({"appendonly": "no", "appendfsync": "everysec", "save": ""}, None),  # a restart is a wipe: rebuilt
        ({"appendonly": "yes", "appendfsync": "everysec", "save": ""}, "appendfsync everysec"),
        ({"appendonly": "yes", "appendfsync": "no", "save": ""}, "appendfsync no"),
        ({"appendonly": "no", "appendfsync": "always", "save": "3600 1 300 100"}, "RDB snapshots only"),
    ],
)
def test_rollback_risk_names_what_a_crash_could_roll_back(config: dict[str, str], risky: str | None) -> None:
    risk = rollback_risk(config)
    if risky is None:
        assert risk is None
    else:
        assert risk is not None and risky in risk and "--appendfsync always" in risk


@pytest.mark.parametrize(("fsync", "warned"), [("everysec", True), ("always", False)])
def test_a_proxy_on_a_redis_with_a_lossy_fsync_warns_once_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fsync: str, warned: bool
) -> None:
    server = RedisServer(tmp_path / "redis", persistent=True).start()
    try:
        redis.Redis.from_url(server.url).config_set("appendfsync", fsync)
        with caplog.at_level(logging.WARNING, logger="bucketrl.proxy"), running(server.url, f"file://{tmp_path / 'b'}"):
            pass
    finally:
        server.kill()
    warnings = [r.getMessage() for r in caplog.records if "appendfsync" in r.getMessage()]
    assert len(warnings) == (1 if warned else 0), warnings
