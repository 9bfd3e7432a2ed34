"""The gateway leases the versions TRL can still name: GC keeps them past the run's ``max_staleness`` until TRL
unloads the name, and then collects them (a real proxy with its GC loop running, Redis, a file bucket)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bucketrl import errors
from bucketrl.client import ProxyClient
from tests.gateway.support import running_gateway
from tests.gateway.test_trl_contract import vllm_client
from tests.generator.helpers import make_adapter, run_spec
from tests.proxy.harness import TOKENS, running
from tests.support.services import RedisServer


def collected(gen: ProxyClient, version: int) -> bool:
    try:
        lease = gen.lease_version("probe", version, ttl_s=1)
    except errors.Gone:
        return True
    gen.release_lease(lease.lease_id)
    return False


def test_versions_trl_still_names_survive_gc_until_unloaded(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}", gc_interval_s=0.1) as proxy:
        proxy.client("trl", "trainer").put_run(run_spec(tiny_model_dir, max_staleness=1))
        gen = proxy.client("trl", "generator")
        with running_gateway(proxy, "trl", tmp_path, lease_token=TOKENS["generator"]) as url:
            client = vllm_client(url)
            for n in (1, 2, 3):
                client.load_lora_adapter(
                    f"trl-policy-v{n}", str(make_adapter(tiny_model_dir, tmp_path / f"a{n}", seed=n))
                )
            time.sleep(1.0)  # ten GC passes: v1 is older than latest - max_staleness
            assert not collected(gen, 1)
            client.unload_lora_adapter("trl-policy-v1")  # TRL's unload after its own staleness window
            deadline = time.monotonic() + 10
            while not collected(gen, 1):
                if time.monotonic() > deadline:
                    pytest.fail("v1 was not collected after its name was unloaded")
                time.sleep(0.1)
