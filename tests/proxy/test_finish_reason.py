"""finish_reason (stop / length / abort) reaches the trainer unchanged: it decides truncation masking and that an
aborted completion is never trained as if complete (tests/trainer/test_loss_options.py)."""

from __future__ import annotations

from tests.proxy.harness import ProxyHarness
from tests.proxy.test_rollouts_routes import Setup


def test_finish_reason_survives_submit_and_claim(proxy_file: ProxyHarness) -> None:
    s = Setup(proxy_file, queue_capacity_groups=8, groups_per_step=1)
    batch = s.batch(1)
    comps = batch.groups[0].completions
    reasons = ["length", "abort"]
    assert len(comps) == len(reasons)  # make_spec's group_size
    for c, r in zip(comps, reasons, strict=True):
        c.finish_reason = r  # type: ignore[assignment]
    s.g.submit_rollouts(batch, "k-finish", use_msgpack=True)
    got = s.t.claim("trainer-0", max_groups=1)
    assert [c.finish_reason for c in got.deliveries[0].groups[0].completions] == reasons
