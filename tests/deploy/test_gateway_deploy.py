"""The gateway beside an external trainer (TRL, docs/trl.md) in Compose (``docker-compose.trl.yml`` over the base
file) and in the Helm chart (``gateway.enabled``), checked on the rendered output without a Docker engine or a
cluster: no bucketrl trainer, generators serving completion jobs, a gateway whose environment parses as its own
settings (trainer token, generator lease token, a run spec it can read, a name book that outlives a restart), the
adapter directory mounted at the path TRL names it by.

    .venv/bin/python -m pytest -q tests/deploy/test_gateway_deploy.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from bucketrl.gateway.settings import GatewaySettings
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.wire import RunSpec
from tests.deploy.support import (
    COMPOSE_FILES,
    COMPOSE_SCHEMA,
    ENV_EXAMPLE,
    TRL_COMPOSE,
    bind_mounts,
    build_settings,
    expand_k8s_env,
    load_compose,
    manifests,
    pod_spec,
    read_env_file,
    render_chart,
    service_env,
)
from tests.deploy.test_chart import COMBOS, Refs, merged_values, one

BASE = COMPOSE_FILES[0]


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def trl(env: dict[str, str]) -> dict[str, Any]:
    return load_compose(BASE, TRL_COMPOSE, env={**env, "TRL_OUTPUT_DIR": "/home/me/trl-out"})


def test_the_override_validates_and_the_base_file_has_no_gateway(trl: dict[str, Any], env: dict[str, str]) -> None:
    validator = jsonschema.Draft7Validator(json.loads(COMPOSE_SCHEMA.read_text()))
    errors = sorted(validator.iter_errors(trl), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
    assert "gateway" not in load_compose(BASE, env=env)["services"]  # opt-in: `docker compose up` is unchanged


def test_compose_runs_no_trainer_and_generators_serve_completion_jobs(
    trl: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = trl["services"]
    # A profile nobody activates: `up` with the override starts no bucketrl trainer to fence the gateway.
    assert services["trainer"]["profiles"] == ["bucketrl-trainer"]
    assert not any(services[n].get("profiles") for n in ("gateway", "generator", "proxy", "redis"))
    gen = build_settings(GeneratorSettings, service_env(services["generator"]), monkeypatch)
    assert gen.serve_completion_jobs is True


def test_compose_gateway_settings_tokens_mounts_and_port_agree(
    trl: dict[str, Any], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gw = trl["services"]["gateway"]
    gw_env = service_env(gw)
    mounts = bind_mounts(gw)
    spec_file = mounts[gw_env["BUCKETRL_RUN_SPEC"]]  # the repo file compose mounts there
    local = {**gw_env, "BUCKETRL_RUN_SPEC": str(spec_file)}
    settings = build_settings(GatewaySettings, local, monkeypatch)
    assert settings.token == env["TRAINER_TOKEN"] and settings.lease_token == env["GENERATOR_TOKEN"]
    assert settings.proxy_url == "http://proxy:8000" and settings.run == env.get("BUCKETRL_RUN", "demo")
    assert RunSpec.model_validate_json(spec_file.read_text()).base_model  # the run it creates
    # The state on a named volume (kept over restarts), not on the read-only root.
    state_dir = str(Path(gw_env["BUCKETRL_GATEWAY_STATE"]).parent)
    assert f"gateway-state:{state_dir}" in gw["volumes"] and "gateway-state" in trl["volumes"]
    assert gw["read_only"] is True and gw["cap_drop"] == ["ALL"]
    # TRL names adapter directories by their path on the host: the same path inside, read-only.
    assert "/home/me/trl-out:/home/me/trl-out:ro" in gw["volumes"]
    cmd = gw["command"]
    port = cmd[cmd.index("--port") + 1]
    assert cmd[0] == "gateway" and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert gw["ports"] == [f"127.0.0.1:8100:{port}"]  # loopback only: TRL on this host
    assert f"127.0.0.1:{port}/health" in gw["healthcheck"]["test"][-1]
    assert gw["depends_on"]["proxy"]["condition"] == "service_healthy"
    assert gw["image"] == trl["services"]["proxy"]["image"]  # no image of its own


def test_chart_gateway_settings_tokens_and_volumes_agree(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    values = COMBOS["external-trainer"]
    docs = manifests(render_chart(values))
    merged = merged_values(values)
    kinds = {(d["kind"], d["metadata"]["labels"]["app.kubernetes.io/component"]) for d in docs}
    assert not {k for k in kinds if k[1] == "trainer" and k[0] != "ConfigMap"}  # no trainer; its run spec stays
    deployment = one(docs, "Deployment", "gateway")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    spec = pod_spec(deployment)
    assert spec is not None
    (container,) = spec["containers"]
    gw_env = expand_k8s_env(container, Refs(docs, merged))
    spec_path = tmp_path / "run-spec.json"
    spec_path.write_text(json.dumps(merged["run"]["spec"]))
    settings = build_settings(GatewaySettings, {**gw_env, "BUCKETRL_RUN_SPEC": str(spec_path)}, monkeypatch)
    refs = [(e["name"], e["valueFrom"].get("secretKeyRef")) for e in container["env"] if "valueFrom" in e]
    tokens = {name: ref["key"] for name, ref in refs if ref is not None}
    assert tokens["BUCKETRL_TOKEN"] == "trainer" and tokens["BUCKETRL_LEASE_TOKEN"] == "generator"
    assert settings.token and settings.lease_token and settings.token != settings.lease_token
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts["/trl-output"]["readOnly"] is True
    assert volumes[mounts["/trl-output"]["name"]]["persistentVolumeClaim"] == {"claimName": "trl-output"}
    assert str(settings.state_path().parent) in mounts and "emptyDir" in volumes[mounts["/state"]["name"]]
    assert volumes[mounts["/etc/bucketrl/run"]["name"]]["configMap"]["items"][0]["key"] == "run-spec.json"
    port = container["args"][container["args"].index("--port") + 1]
    assert container["ports"][0]["containerPort"] == int(port)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    generator = pod_spec(one(docs, "Deployment", "generator"))
    assert generator is not None
    (gen_container,) = generator["containers"]
    gen = build_settings(GeneratorSettings, expand_k8s_env(gen_container, Refs(docs, merged)), monkeypatch)
    assert gen.serve_completion_jobs is True


def test_chart_default_install_has_no_gateway() -> None:
    docs = manifests(render_chart({}))
    assert not [d for d in docs if d["metadata"]["labels"]["app.kubernetes.io/component"] == "gateway"]
    generator = pod_spec(one(docs, "Deployment", "generator"))
    assert generator is not None
    assert "BUCKETRL_SERVE_COMPLETION_JOBS" not in {e["name"] for e in generator["containers"][0]["env"]}
