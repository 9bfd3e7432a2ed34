"""A generator's episode side without the proxy: the real endpoint (uvicorn on loopback), a real engine (the tiny
model with a LoRA adapter) sampled by its own thread, and groups started by hand."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bucketrl.envs.service import EpisodeService
from bucketrl.generator.engines.factory import make_engine
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.rollout.engine import Engine
from bucketrl.rollout.episodes import GroupRun
from bucketrl.rollout.example import Example
from bucketrl.wire import EpisodeSpec, PromptLeaseItem, RunSpec, SamplingSpec
from tests.generator.helpers import run_spec

ADAPTER = "run-v1"
TOKEN = "test-token"


def episode_spec(model_dir: Path, **episode: Any) -> RunSpec:
    return run_spec(
        model_dir,
        group_size=4,
        sampling=SamplingSpec(temperature=1.0, max_new_tokens=8),
        episode=EpisodeSpec(**{"max_turns": 3, "episode_timeout_s": 20.0, **episode}),
    )


class Harness:
    def __init__(
        self,
        model_dir: Path,
        adapter_dir: Path,
        spec: RunSpec,
        env: Any,
        engine: GeneratorSettings | Engine | None = None,
        **service_kw: Any,
    ) -> None:
        from transformers import AutoTokenizer

        self.spec = spec
        if engine is None or isinstance(engine, GeneratorSettings):
            self.engine: Engine = make_engine(engine or GeneratorSettings(engine="transformers", seed=0), spec)
        else:
            self.engine = engine  # a test's own engine, made ready to load the adapter below
        self.engine.load_adapter(ADAPTER, 1, adapter_dir)
        self.svc = EpisodeService(
            tokenizer=AutoTokenizer.from_pretrained(model_dir),
            spec=lambda: self.spec,
            max_model_len=self.engine.max_model_len,
            env=env,
            token=TOKEN,
            **service_kw,
        )
        self._stop = threading.Event()
        self._engine_thread = threading.Thread(target=self._serve, daemon=True)
        self._seq = 0

    def _serve(self) -> None:
        while not self._stop.is_set():
            self.svc.queue.serve(self.engine, wait_s=0.05)

    def group(self, example: Example, *, external: bool = False) -> GroupRun:
        self._seq += 1
        return GroupRun(
            PromptLeaseItem(prompt_id=f"0-{self._seq}", index=example.index, **{"pass": 0}),
            example,
            version=1,
            adapter=ADAPTER,
            lease_id="lease",
            sampling=self.spec.sampling,
            group_size=self.spec.group_size,
            external=external,
        )

    def run_group(self, example: Example, timeout_s: float = 60.0) -> GroupRun:
        group = self.group(example)
        self.svc.start_group(group)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for done in self.svc.take_finished():
                assert done is group
                return group
            time.sleep(0.02)
        raise AssertionError(f"the group did not finish within {timeout_s}s")

    def close(self) -> None:
        self.svc.close()
        self._stop.set()
        self._engine_thread.join(5)
        self.engine.close()


@contextmanager
def harness(model_dir: Path, adapter_dir: Path, spec: RunSpec, env: Any = None, **kw: Any) -> Iterator[Harness]:
    h = Harness(model_dir, adapter_dir, spec, env, **kw)
    h.svc.start()
    h._engine_thread.start()
    try:
        yield h
    finally:
        h.close()
