"""The real generator worker on the simulated engine (``BUCKETRL_ENGINE=sim``): everything but the GPU is the
worker's own code (adapter download and check, prompt leases, reward scoring, submission), against a real
proxy and Redis. Its groups pass the proxy's validation and the worker follows a newly published version."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from bucketrl.rollout.detokenize import complete_text
from bucketrl.sim import engine as sim_engine
from bucketrl.tarball import pack_dir
from tests.generator.helpers import make_adapter
from tests.generator.worker_support import Consumer, create_run, running_worker, worker_settings
from tests.proxy.harness import ProxyHarness, running
from tests.support.services import RedisServer


@pytest.fixture()
def proxy(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        yield h


def test_generator_worker_runs_on_the_sim_engine(proxy: ProxyHarness, tiny_model_dir: Path, tmp_path: Path) -> None:
    adapters = {v: make_adapter(tiny_model_dir, tmp_path / f"v{v}", seed=v) for v in (1, 2)}
    trainer, spec = create_run(proxy, "s1", tiny_model_dir, adapters[1])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    sim_engine.register()
    with running_worker(worker_settings(proxy, "s1", "gen-sim", engine="sim")), Consumer(trainer) as consumer:
        first = consumer.wait_for(lambda ds: sum(len(d.groups) for d in ds) >= 4, 120)
        trainer.publish_adapter(2, pack_dir(adapters[2]))
        later = consumer.wait_for(lambda ds: any(d.version == 2 for d in ds), 120)
    assert {d.version for d in first} == {1} and any(d.version == 2 for d in later)
    for d in later:
        assert d.worker_id == "gen-sim"
        for g in d.groups:
            assert len(g.completions) == spec.group_size
            for c in g.completions:
                assert 1 <= len(c.token_ids) <= spec.sampling.max_new_tokens == 8
                assert all(0 <= t < spec.vocab_size for t in c.token_ids)
                assert all(math.isfinite(lp) and lp <= 0 for lp in c.logprobs)
                # the run's reward function scored the decoded (simulated) completion
                assert c.reward == float(len(complete_text(tok, c.token_ids)))
