"""End-to-end helpers: a real local cluster (:class:`bucketrl.up.cluster.LocalCluster`) and docs/design.md
section 4 invariants, checked from the outside: the proxy's status, the bucket, the trainer's logs.

What each check reads and why it would fail if the system were wrong:

- dense versions (inv. 2): the proxy keeps a record of every version it committed (also after GC); for
  1..latest every record exists, epochs never go back, and the trainers' ``published vN`` log lines are
  increasing, each number once.
- leased versions kept (inv. 1): every version the status shows with a live lease has its manifest in the
  bucket (checked at every poll during the run, not only at the end); old unleased versions get collected.
- accounting (inv. 4): ``accepted == acked + dropped_stale + queued + pending`` from the proxy's counters,
  and in the trainer's effective history (the last execution of each step, across restarts: what the final
  weights were trained on) no delivery appears twice; every acked delivery was trained in it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bucketrl.storage import open_store
from bucketrl.up.cluster import LocalCluster
from bucketrl.up.config import UpConfig
from bucketrl.up.synclatency import measure
from bucketrl.wire import RunStatus

PUBLISHED = re.compile(r"published v(\d+) \(step (\d+)")

# Fast-learning settings for short e2e runs (the demo's lr is slower on purpose: it shows a curve).
E2E_LR = 3e-3


@contextmanager
def running_cluster(tmp_path: Path, *, start: bool = True, **cfg: Any) -> Iterator[LocalCluster]:
    """Start Redis, proxy, trainer and generators (``start=False``: the test starts them); stop them (by pid)
    however the test ends, printing the logs' tails when it failed."""
    cfg.setdefault("lr", E2E_LR)
    cfg.setdefault("redis_fsync", "always")
    cluster = LocalCluster(UpConfig(dir=tmp_path / "run", **cfg))
    cluster.prepare()
    ok = False
    try:
        if start:
            cluster.start_all()
        yield cluster
        ok = True
    finally:
        try:
            cluster.stop_all()
        finally:
            cluster.release()
            if not ok:
                for name, svc in cluster.services.items():
                    print(f"----- {name} (exit {svc.returncode}) {svc.log_path}\n{_tail(svc.log_path)}")


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(line for line in text if "httpx" not in line)[-6000:] if lines else ""


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, cluster: LocalCluster | None = None) -> Any:
    """Poll until ``predicate()`` is truthy (returns it). Fails early when a worker died unexpectedly."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def status(cluster: LocalCluster) -> RunStatus:
    with cluster.client("viewer", retries=3) as c:
        return c.status()


@dataclass
class Watch:
    """Polls status while a run goes on; checks invariant 1 at every poll."""

    cluster: LocalCluster
    store: Any = None
    polls: int = 0
    leased_seen: set[int] = field(default_factory=set)
    last: RunStatus | None = None

    def __post_init__(self) -> None:
        self.store = open_store(self.cluster.bucket_url)

    def poll(self) -> RunStatus | None:
        try:
            s = status(self.cluster)
        except Exception:
            return None  # the proxy may be restarting
        self.polls += 1
        self.last = s
        for v in s.versions:
            if v.leases > 0:
                self.leased_seen.add(v.version)
                if not self.store.exists(adapter_manifest(self.cluster, v.version)):
                    # Released and collected between the status read and this look? Only a version that is
                    # STILL leased after the look proves a violation.
                    again = {x.version: x.leases for x in status(self.cluster).versions}
                    assert again.get(v.version, 0) == 0, (
                        f"v{v.version} has {again[v.version]} live lease(s) but its manifest is gone from the bucket"
                    )
        return s

    def step(self) -> int:
        s = self.poll()
        return s.trainer.step if s else (self.last.trainer.step if self.last else 0)

    def until_step(self, step: int, timeout_s: float) -> None:
        wait_for(lambda: self.step() >= step, timeout_s, f"trainer step {step}")


def adapter_manifest(cluster: LocalCluster, version: int) -> str:
    return f"runs/{cluster.cfg.run}/adapters/v{version}/manifest.json"


def published_versions(cluster: LocalCluster) -> list[int]:
    text = (cluster.logs / "trainer.log").read_text(errors="replace")
    return [int(m.group(1)) for m in PUBLISHED.finditer(text)]


def version_records(cluster: LocalCluster, latest: int) -> dict[int, dict[str, str]]:
    """The proxy's record of each version 1..latest, read-only from its Redis (``keys.VERSION_INFO``)."""
    import redis

    from bucketrl.proxy import keys

    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        pipe = r.pipeline(transaction=False)
        for n in range(1, latest + 1):
            pipe.hgetall(keys.run_key(cluster.cfg.run, keys.VERSION_INFO.format(n=n)))
        return dict(zip(range(1, latest + 1), pipe.execute(), strict=True))
    finally:
        r.close()


def audit(cluster: LocalCluster) -> list[dict[str, Any]]:
    path = cluster.logs / "trainer-audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def effective_history(records: list[dict[str, Any]]) -> dict[int, list[str]]:
    """step -> deliveries of the LAST execution of that step (a resumed trainer redoes the steps after its
    checkpoint; what the final weights saw is the last execution of each)."""
    steps: dict[int, list[str]] = {}
    for r in records:
        if r["event"] == "step":
            steps[int(r["step"])] = list(r["deliveries"])
        elif r["event"] == "resume":
            # Steps after the resumed checkpoint were lost with the killed trainer's memory.
            for k in [k for k in steps if k > int(r["step"])]:
                del steps[k]
    return steps


@dataclass
class InvariantReport:
    latest_version: int
    steps: int
    accepted: int
    acked: int
    dropped_stale: int
    queued: int
    pending: int
    versions_in_bucket: list[int]
    gc_total: int

    def __str__(self) -> str:
        return (
            f"v1..v{self.latest_version} dense over {self.steps} steps; groups accepted {self.accepted} = acked "
            f"{self.acked} + dropped stale {self.dropped_stale} + queued {self.queued} + pending {self.pending}; "
            f"versions left in the bucket {self.versions_in_bucket} (GC'd {self.gc_total})"
        )


def check_invariants(
    cluster: LocalCluster, watch: Watch | None = None, *, final: bool = True, wiped: bool = False
) -> InvariantReport:
    """Assert docs/design.md section 4's invariants from status + bucket + trainer logs (see the module docstring).

    ``final``: the workers are stopped, so the queue is still and its counters can be compared exactly (a live
    submit between the status's reads of the counters and of the stream would skew them by a batch)."""
    published = published_versions(cluster)  # before the status: a live trainer only adds versions after it
    s = status(cluster)
    run = cluster.cfg.run
    # 2. Dense, monotonic versions across trainer restarts: the proxy holds a record (kept after GC, state
    # "gone") for every version 1..latest; the trainers' logs show increasing numbers, each published once.
    # (The log may miss a number: a trainer SIGKILLed after the proxy committed but before it logged.)
    records = version_records(cluster, s.latest_version)
    missing = [n for n, rec in records.items() if "published_at" not in rec]
    forgotten: list[int] = []
    store = open_store(cluster.bucket_url)
    manifests = store.list_keys(f"runs/{run}/adapters/")
    present = sorted({int(m.group(1)) for k in manifests if (m := re.search(r"/v(\d+)/manifest\.json$", k))})
    if wiped and missing:
        # A Redis wipe loses the records of versions collected before it (the bucket no longer holds them, so a
        # rebuild cannot restore them); the proxy still answers 410 for any number up to latest. GC does not
        # collect in number order (a version a slow generator leases outlives newer ones: one run kept v5 and
        # lost the records of v1-4 and v6), so the rule is: a version without a record is one the bucket no
        # longer holds, and older than the latest.
        held = [n for n in missing if n in present or n == s.latest_version]
        assert not held, f"versions in the bucket without a record on the proxy (a gap): {held} of {missing}"
        records = {n: rec for n, rec in records.items() if n not in missing}
        forgotten = missing
    else:
        assert not missing, f"versions without a record on the proxy (a gap): {missing}"
    epochs = [int(records[n].get("epoch", 0)) for n in sorted(records)]
    assert epochs == sorted(epochs), f"an older trainer epoch published after a newer one: {epochs}"
    assert published == sorted(set(published)), f"a version number was published twice or went back: {published}"
    assert set(published) <= set(records) | set(forgotten), (published, s.latest_version)
    # 1. Leased versions are in the bucket; old unleased ones get collected.
    assert s.latest_version in present, f"latest v{s.latest_version} missing from the bucket: {present}"
    for v in s.versions:
        if v.leases > 0:
            assert v.version in present, f"leased v{v.version} deleted"
    (watch or Watch(cluster)).poll()
    # 4. Accounting of accepted groups, and no delivery trained twice against one checkpointed state.
    q = s.queue
    if final:
        assert q.accepted_total == q.acked_total + q.dropped_stale_total + q.groups + q.pending, q
    history = effective_history(audit(cluster))
    trained = [d for deliveries in history.values() for d in deliveries]
    assert len(trained) == len(set(trained)), "a delivery was trained twice in the run's effective history"
    acked: set[str] = set()
    for r in audit(cluster):
        if r["event"] in ("checkpoint", "resume"):
            acked.update(r.get("acked") or [])
    assert acked <= set(trained), f"{len(acked - set(trained))} acked deliveries were never trained"
    # Staleness bound (docs/design.md sections 3-5): no trainer push, of any epoch, reports a trained group staler than
    # the run's max_staleness (the trainer's claims carry min_version = its train-time version - max_staleness).
    staleness = _all_trainer_values(cluster, "sample/staleness_max")
    with cluster.client("viewer", retries=3) as c:
        max_staleness = c.get_run().spec.max_staleness
    assert not staleness or max(staleness) <= max_staleness, (
        f"a group was trained with staleness {max(staleness)} > max_staleness {max_staleness}"
    )
    return InvariantReport(
        latest_version=s.latest_version,
        steps=len(history),
        accepted=q.accepted_total,
        acked=q.acked_total,
        dropped_stale=q.dropped_stale_total,
        queued=q.groups,
        pending=q.pending,
        versions_in_bucket=present,
        gc_total=s.gc_versions_total,
    )


def _all_trainer_values(cluster: LocalCluster, metric: str) -> list[float]:
    """Every value of a trainer metric in the proxy's metrics stream (all pushes, every trainer epoch)."""
    from bucketrl.up.watch import RunWatcher

    w = RunWatcher(cluster.proxy_url, cluster.cfg.run, cluster.tokens["viewer"])
    try:
        assert w.poll() is not None, w.last_error
        return [v for pts in w.timed_series(metric, role="trainer").values() for _, v in pts]
    finally:
        w.close()


def trainer_metric(s: RunStatus, name: str) -> float | None:
    for w in s.workers:
        if w.role == "trainer" and name in s.metrics.get(w.worker_id, {}):
            return float(s.metrics[w.worker_id][name])
    return None


def reward_curve(cluster: LocalCluster) -> list[tuple[int, float]]:
    """(step, reward) from the trainer's metric pushes (the proxy's metrics stream)."""
    from bucketrl.up.watch import RunWatcher

    w = RunWatcher(cluster.proxy_url, cluster.cfg.run, cluster.tokens["viewer"])
    try:
        assert w.poll() is not None, w.last_error
        return w.trainer_series("reward")
    finally:
        w.close()


def series(cluster: LocalCluster, metric: str) -> list[tuple[int, float]]:
    from bucketrl.up.watch import RunWatcher

    w = RunWatcher(cluster.proxy_url, cluster.cfg.run, cluster.tokens["viewer"])
    try:
        assert w.poll() is not None, w.last_error
        return w.trainer_series(metric)
    finally:
        w.close()


def print_sync_latency(cluster: LocalCluster) -> None:
    print(measure(cluster.logs, cluster.cfg.run).describe())
