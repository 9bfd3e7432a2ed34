"""Fuzz the proxy from its own OpenAPI schema (schemathesis, pinned in the dev extra), with every role's token.

Issue 12's "what done looks like": at least 1,000 generated requests over every route and role, then
0 responses >= 500, 0 responses that contradict the schema (status code documented, content type and body
as documented), and the proxy still healthy with its memory bounded. The run ``r1`` exists (a spec, a
registered trainer, a published version) so generated requests reach the handlers' logic rather than 404.
Hypothesis is seeded (derandomized): a failure reproduces.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.proxy.harness import TOKENS, ProxyHarness, adapter_tar, make_spec, running
from tests.support.services import RedisServer

pytestmark = pytest.mark.slow


@schemathesis.serializer("application/x-ndjson", "application/x-tar")
def _ndjson(ctx, value):  # type: ignore[no-untyped-def]
    # Dataset and tar uploads are documented as binary bodies: send what was generated, as bytes.
    return value if isinstance(value, bytes) else str(value).encode()


ROLES = ("admin", "trainer", "generator", "viewer")
# Generated cases per operation (the roles in turn): ~30 operations x 44 >= 1,000 requests. A rollout batch is
# slow to generate (~2 s each: nested lists of thousands of items), so that route gets fewer.
EXAMPLES = 44
FEWER = {"POST /v1/runs/{run}/rollouts": 8}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture()
def fuzzed_proxy(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    # Long-polls (wait_s) are capped at half a second: a generated wait of an hour is legal, and only slows the test.
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}", max_wait_s=0.5) as p:
        t = p.client("r1", "trainer")
        t.put_run(make_spec())
        t.register_trainer("t0")
        t.publish_adapter(1, adapter_tar(1))
        yield p


def test_fuzzed_requests_never_500_and_always_match_the_schema(fuzzed_proxy: ProxyHarness) -> None:
    p = fuzzed_proxy
    raw = httpx.get(f"{p.url}/openapi.json").json()
    schema = schemathesis.openapi.from_dict(raw)
    proc = psutil.Process()
    rss_before = proc.memory_info().rss
    sent: Counter[str] = Counter()
    roles: set[tuple[str, str]] = set()
    failures: list[str] = []
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 20, [op.label for op in operations]

    for op in operations:
        _fuzz_operation(p.url, op, sent, roles, failures)

    total = sum(sent.values())
    assert total >= 1000, sent
    assert not failures, "\n".join(failures[:40])
    # Every route was exercised, and the proxy is healthy and its memory bounded afterwards.
    assert set(sent) == {op.label for op in operations}
    assert roles == {(op.label, role) for op in operations for role in ROLES}, "a route was not tried with a role"
    assert httpx.get(f"{p.url}/healthz").status_code == 200
    assert proc.memory_info().rss - rss_before < 512 * 1024**2


def _fuzz_operation(  # type: ignore[no-untyped-def]
    url: str, op, sent: Counter[str], roles: set[tuple[str, str]], failures: list[str]
) -> None:
    @settings(
        max_examples=FEWER.get(op.label, EXAMPLES),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(), real_run=st.booleans())
    def fuzz(case, real_run: bool) -> None:  # type: ignore[no-untyped-def]
        role = ROLES[sent[op.label] % len(ROLES)]  # in turn: every route is tried with every role's token
        roles.add((op.label, role))
        if real_run and case.path_parameters and "run" in case.path_parameters:
            case.path_parameters["run"] = "r1"  # reach the logic behind the run lookup half of the time
        response = case.call(base_url=url, headers={"Authorization": f"Bearer {TOKENS[role]}"}, timeout=60)
        sent[op.label] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except Exception as exc:  # collect them all, then report (one line each)
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            failures.append(f"{op.label} as {role}: {first} (status {response.status_code})")

    # A route with few possible inputs (GET /healthz) runs out of distinct cases before every role had its turn.
    for _ in range(len(ROLES)):
        fuzz()
        if all((op.label, role) in roles for role in ROLES):
            break
