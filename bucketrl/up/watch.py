"""What ``bucketrl up`` (and the end-to-end tests) see of a run: the proxy's status and metric pushes.

:class:`RunWatcher` polls ``GET /v1/runs/{run}/status`` and ``GET /v1/runs/{run}/metrics/recent`` with a
viewer token and keeps the whole history (pushes merged by worker and timestamp; one status sample per
poll, which is where the queue-depth series comes from: queue depth is state, not a pushed metric).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bucketrl.tls import TransportSecurity
from bucketrl.wire import RunStatus

FIRST_FETCH = 5000
NEXT_FETCH = 500


class RunWatcher:
    def __init__(self, base_url: str, run: str, token: str, timeout_s: float = 10.0) -> None:
        self.run = run
        security = TransportSecurity.from_env()
        security.check(base_url)
        self._http = httpx.Client(
            verify=security.verify(),
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"} if token else {},
            timeout=timeout_s,
        )
        self.pushes: list[dict[str, Any]] = []
        self._seen: set[tuple[str, float]] = set()
        self.status_history: list[dict[str, Any]] = []
        self.status: RunStatus | None = None
        self.last_error: str | None = None
        self._fetched = False
        # The run's generated tokens at the last poll while every run of the pool was still generating (a
        # several-run up): what the shares decided, before a run's end gave the others its share.
        self.tokens_while_all_ran: int | None = None

    def close(self) -> None:
        self._http.close()

    # -- polling ------------------------------------------------------------------------------------

    def poll(self) -> RunStatus | None:
        """One status + metrics poll; on failure keeps the previous state and records ``last_error``."""
        try:
            resp = self._http.get(f"/v1/runs/{self.run}/status")
            resp.raise_for_status()
            status = RunStatus.model_validate(resp.json())
            count = NEXT_FETCH if self._fetched else FIRST_FETCH
            resp = self._http.get(f"/v1/runs/{self.run}/metrics/recent", params={"count": count})
            resp.raise_for_status()
            self._merge(resp.json())
            self._fetched = True
        except (httpx.HTTPError, ValueError) as exc:
            self.last_error = _describe(exc)
            return None
        self.last_error = None
        self.status = status
        self.status_history.append(
            {
                "ts": time.time(),
                "queue": status.queue.groups,
                "capacity": status.queue.capacity,
                "prompts_inflight": status.prompts_inflight,
                "latest_version": status.latest_version,
                "step": status.trainer.step,
            }
        )
        return status

    def _merge(self, pushes: list[dict[str, Any]]) -> None:
        added = False
        for p in pushes:
            key = (str(p.get("worker_id")), float(p.get("ts", 0.0)))
            if key in self._seen:
                continue
            self._seen.add(key)
            self.pushes.append(p)
            added = True
        if added:
            self.pushes.sort(key=lambda p: p["ts"])

    def waiting_for(self) -> str:
        """What a start is waiting for, in words: a run the trainer has not created yet is normal, not an alarm."""
        err = self.last_error or ""
        if "unknown_run" in err:
            return "the trainer is creating the run"
        if not err or "ConnectError" in err or "ConnectTimeout" in err:
            return "the proxy is starting"
        return f"the proxy answered {err}"

    # -- series ---------------------------------------------------------------------------------------

    def trainer_series(self, metric: str) -> list[tuple[int, float]]:
        """``[(step, value)]`` of a trainer metric, one value per step (the latest push wins: a resumed
        trainer repeats the steps after its checkpoint, and what counts is what it did last)."""
        by_step: dict[int, float] = {}
        for p in self.pushes:
            if p.get("role") == "trainer" and p.get("step") is not None and metric in p.get("metrics", {}):
                by_step[int(p["step"])] = float(p["metrics"][metric])
        return sorted(by_step.items())

    def timed_series(self, metric: str, role: str | None = None) -> dict[str, list[tuple[float, float]]]:
        """``{worker_id: [(ts, value)]}`` of a metric."""
        out: dict[str, list[tuple[float, float]]] = {}
        for p in self.pushes:
            if (role is None or p.get("role") == role) and metric in p.get("metrics", {}):
                out.setdefault(p["worker_id"], []).append((float(p["ts"]), float(p["metrics"][metric])))
        return out

    def latest(self, worker_id: str, metric: str) -> float | None:
        if self.status is None:
            return None
        value = self.status.metrics.get(worker_id, {}).get(metric)
        return float(value) if value is not None else None

    def trainer_id(self) -> str | None:
        if self.status is None:
            return None
        return next((w.worker_id for w in self.status.workers if w.role == "trainer"), None)

    def rolling_reward(self, n: int = 10) -> float | None:
        rewards = [v for _, v in self.trainer_series("reward")[-n:]]
        return statistics.fmean(rewards) if rewards else None

    # -- persistence ------------------------------------------------------------------------------------

    def save(self, run_dir: Path) -> None:
        """``metrics.jsonl`` (every push) and ``status_history.jsonl`` (every poll) in ``run_dir``."""
        # Written aside and renamed: `up` saves every few seconds, and a kill mid-write must not lose history.
        for name, rows in (("metrics.jsonl", self.pushes), ("status_history.jsonl", self.status_history)):
            tmp = run_dir / f".{name}.tmp"
            with open(tmp, "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
            tmp.replace(run_dir / name)

    def load_history(self, run_dir: Path) -> None:
        """Start from what earlier sessions of this run directory saw (a resumed run): their pushes and status
        samples. The proxy's stream keeps only the recent pushes, so the summary of a resumed run is over the
        whole run only with these."""
        path = run_dir / "status_history.jsonl"
        if path.exists():
            self.status_history = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        path = run_dir / "metrics.jsonl"
        if path.exists():
            pushes = []
            for line in path.read_text().splitlines():
                try:
                    pushes.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut short by a kill mid-write
                    continue
            self._merge(pushes)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        try:
            err = exc.response.json()["error"]
            return f"{exc.response.status_code} {err['code']}: {err['message']}"
        except (ValueError, KeyError, TypeError):
            return f"HTTP {exc.response.status_code}"
    return f"{type(exc).__name__}: {exc}"
