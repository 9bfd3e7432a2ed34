"""Support for the worker-loop tests: a run on a real proxy, a trainer stand-in that claims and acks, and a
generator started as a real process (``python -m bucketrl.cli generator``) so it can be SIGTERMed or SIGKILLed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bucketrl.client import ProxyClient
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.generator.worker import GeneratorWorker
from bucketrl.tarball import pack_dir
from bucketrl.wire import DatasetSpec, Delivery, RewardSpec, RunSpec, SamplingSpec
from tests.generator.helpers import run_spec
from tests.proxy.harness import TOKENS, ProxyHarness

PROMPTS = [f"{a}+{b}=" for a in range(4) for b in range(4)]  # 16 prompts
REPO = Path(__file__).resolve().parents[2]


def dataset_bytes() -> bytes:
    return "".join(json.dumps({"question": p, "solution": str(eval(p[:-1]))}) + "\n" for p in PROMPTS).encode()


def create_run(
    proxy: ProxyHarness, run: str, model_dir: Path, adapter_v1: Path, **overrides: Any
) -> tuple[ProxyClient, RunSpec]:
    """Create the run (dataset uploaded to the bucket), register a trainer, publish v1. Returns the trainer client."""
    fields: dict[str, Any] = {
        "group_size": 4,
        "max_staleness": 1,
        "groups_per_step": 4,
        "queue_capacity_groups": 16,
        "sampling": SamplingSpec(temperature=1.0, max_new_tokens=8),
        "reward": RewardSpec(name="tests.generator.reward_fixtures:length_reward"),
        "dataset": DatasetSpec(
            uri="bucket:dataset.jsonl", prompt_field="question", answer_field="solution", size=len(PROMPTS)
        ),
    }
    fields.update(overrides)
    spec = run_spec(model_dir, **fields)
    trainer = proxy.client(run, "trainer")
    trainer.put_run(spec)
    if spec.dataset.uri == "bucket:dataset.jsonl":
        trainer.upload_dataset(dataset_bytes())
    trainer.register_trainer("trainer-test")
    trainer.publish_adapter(1, pack_dir(adapter_v1))
    return trainer, spec


class Consumer:
    """A trainer stand-in: claims and acks continuously so admission control keeps granting prompts."""

    def __init__(self, trainer: ProxyClient) -> None:
        self.trainer = trainer
        self.deliveries: list[Delivery] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            got = self.trainer.claim("trainer-test", max_groups=8, wait_s=0.5)
            if got.deliveries:
                self.trainer.ack([d.delivery_id for d in got.deliveries])
                with self.lock:
                    self.deliveries.extend(got.deliveries)

    def __enter__(self) -> Consumer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)

    def wait_for(self, pred: Callable[[list[Delivery]], bool], timeout_s: float) -> list[Delivery]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                snap = list(self.deliveries)
            if pred(snap):
                return snap
            time.sleep(0.1)
        raise TimeoutError(f"condition not met in {timeout_s}s; {len(snap)} deliveries")


@contextmanager
def running_worker(settings: GeneratorSettings, engine: Any = None) -> Iterator[GeneratorWorker]:
    """``GeneratorWorker.run`` in a thread (on ``engine`` if given); stopped, and its errors re-raised, on exit."""
    worker = GeneratorWorker(settings, engine=engine)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            assert worker.run() == 0
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True, name="worker-under-test")
    thread.start()
    worker.thread = thread  # type: ignore[attr-defined]
    worker.failure = failure  # type: ignore[attr-defined]
    try:
        yield worker
    finally:
        worker.request_stop()
        thread.join(60)
    assert not thread.is_alive(), "worker did not stop within 60 s"
    if failure:
        raise failure[0]


def worker_settings(proxy: ProxyHarness, run: str, worker_id: str, **kw: Any) -> GeneratorSettings:
    fields: dict[str, Any] = {
        "proxy_url": proxy.url,
        "token": TOKENS["generator"],
        "run": run,
        "worker_id": worker_id,
        "engine": "transformers",
        "seed": 0,
        "prompts_per_request": 2,
        "reward_workers": 1,
        "version_wait_s": 2,
        "metrics_interval_s": 0.3,
    }
    fields.update(kw)
    return GeneratorSettings(**fields)


def held_by(r: Any, run: str, worker_id: str) -> set[str]:
    """The prompt ids ``worker_id`` holds leases on (the proxy's owner hash in Redis)."""
    return {k.decode() for k, v in r.hgetall(f"brl:{run}:prompts:owner").items() if v.decode() == worker_id}


def wait_until(pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise TimeoutError(f"{what}: not within {timeout_s}s")


def generator_env(proxy: ProxyHarness, run: str, **settings: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUCKETRL_")}
    env.update(
        {
            "BUCKETRL_PROXY_URL": proxy.url,
            "BUCKETRL_TOKEN": TOKENS["generator"],
            "BUCKETRL_RUN": run,
            "BUCKETRL_ENGINE": "transformers",
            "BUCKETRL_REWARD_WORKERS": "1",
            "BUCKETRL_VERSION_WAIT_S": "2",
            "BUCKETRL_METRICS_INTERVAL_S": "0.5",
            "PYTHONPATH": str(REPO),
        }
    )
    env.update({f"BUCKETRL_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def start_generator(proxy: ProxyHarness, run: str, log_path: Path, **settings: Any) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "bucketrl.cli", "generator"],
            env=generator_env(proxy, run, **settings),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
