"""Happy path of every P2 route through the real worker client, on both bucket backends."""

from __future__ import annotations

import hashlib

from bucketrl.wire import MetricsPush
from tests.proxy.harness import ProxyHarness, adapter_tar, checkpoint_tar, make_spec


def test_run_publish_lease_download_checkpoint_status(proxy: ProxyHarness) -> None:
    t = proxy.client("r1", "trainer")
    g = proxy.client("r1", "generator")
    spec = make_spec()
    info = t.put_run(spec)
    assert info.spec == spec and info.state.latest_version == 0
    reg = t.register_trainer("trainer-0")
    assert reg.epoch == 1 and reg.latest_version == 0 and reg.latest_checkpoint_step is None

    tar1 = adapter_tar(1)
    v1 = t.publish_adapter(1, tar1)
    assert v1.version == 1 and v1.sha256 == hashlib.sha256(tar1).hexdigest() and v1.bytes == len(tar1)
    assert g.wait_for_version(0, wait_s=0) == v1
    assert g.wait_for_version(1, wait_s=0) is None
    lease = g.lease_version("gen-0")
    assert lease.version == 1
    assert g.download_adapter(1) == tar1
    assert g.renew_lease(lease.lease_id, ttl_s=30).expires_at > lease.expires_at - 60

    ck = checkpoint_tar(b"x" * 1000)
    c = t.put_checkpoint(10, ck)
    assert c.step == 10 and c.epoch == 1
    assert t.latest_checkpoint() == c
    assert t.download_checkpoint(10) == ck

    g.push_metrics(MetricsPush(worker_id="gen-0", metrics={"rollout/generated_tok_s": 12.5}, loaded_versions=[1]))
    t.push_metrics(MetricsPush(worker_id="trainer-0", step=11, metrics={"train/loss": 0.5}))
    st = proxy.client("r1", "viewer").status()
    assert st.latest_version == 1
    assert [(v.version, v.leases) for v in st.versions] == [(1, 1)]
    assert st.trainer.epoch == 1 and st.trainer.step == 11
    roles = {w.worker_id: (w.role, w.loaded_versions) for w in st.workers}
    assert roles == {"gen-0": ("generator", [1]), "trainer-0": ("trainer", [])}
    assert st.metrics["gen-0"]["rollout/generated_tok_s"] == 12.5
    with proxy.http("viewer") as v:
        recent = v.get("/v1/runs/r1/metrics/recent", params={"count": 10}).json()
    assert [(r["worker_id"], r["role"], r["step"]) for r in recent] == [
        ("gen-0", "generator", None),
        ("trainer-0", "trainer", 11),
    ]
    assert recent[1]["metrics"] == {"train/loss": 0.5}
    g.release_lease(lease.lease_id)
