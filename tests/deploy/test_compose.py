"""``docker-compose.yml`` (CPU) and ``docker-compose.gpu.yml`` (override), checked without a Docker engine.

    .venv/bin/python -m pytest -q tests/deploy/test_compose.py

The files are validated against the Compose Specification's JSON schema (vendored: ``schemas/``), interpolated
with ``.env.example`` the way Compose does, merged the way ``-f a -f b`` does, and then checked for what makes
``docker compose up`` start in the right order and ``--scale generator=N`` work.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.support import (
    COMPOSE_FILES,
    COMPOSE_SCHEMA,
    ENV_EXAMPLE,
    ROOT,
    InterpolationError,
    bind_mounts,
    interpolate,
    load_compose,
    read_env_file,
    referenced_variables,
    service_env,
    with_secrets,
)

BASE, GPU = COMPOSE_FILES
LONG_RUNNING = {"redis", "minio", "proxy", "relay"}
ONE_SHOT = {"minio-init", "model-init"}
WORKERS = {"trainer", "generator"}


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def cpu(env: dict[str, str]) -> dict[str, Any]:
    return load_compose(BASE, env=env)


@pytest.fixture(scope="module")
def gpu(env: dict[str, str]) -> dict[str, Any]:
    return load_compose(BASE, GPU, env=env)


def _validator() -> jsonschema.Draft7Validator:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_files_validate_against_the_compose_specification(path, env: dict[str, str]) -> None:
    validator = _validator()
    raw = yaml.safe_load(path.read_text())
    errors = sorted(validator.iter_errors(raw), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
    interpolated = load_compose(path, env=env)
    errors = sorted(validator.iter_errors(interpolated), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_merged_gpu_setup_validates_too(gpu: dict[str, Any]) -> None:
    errors = sorted(_validator().iter_errors(gpu), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_schema_catches_what_compose_would_refuse() -> None:
    # Guard against a vacuous schema: a misspelled key and a bad condition must both be rejected.
    validator = _validator()
    bad = {"services": {"a": {"image": "x", "depends_on": {"b": {"condition": "service_ready"}}, "restrat": "no"}}}
    messages = " ".join(e.message for e in validator.iter_errors(bad))
    assert "restrat" in messages and "service_ready" in messages


def test_env_example_provides_every_variable_and_no_secret(env: dict[str, str]) -> None:
    used: dict[str, str | None] = {}
    for path in COMPOSE_FILES:
        used.update(referenced_variables(path.read_text()))
    for name, op in used.items():
        if op in (":?", "?"):
            assert env.get(name), f"{name} is required by the compose files but empty/missing in .env.example"
        elif op is None:
            assert name in env, f"{name} has no default in the compose files and is not in .env.example"
    unused = set(env) - set(used)
    assert not unused, f".env.example defines variables no compose file reads: {sorted(unused)}"
    for name, value in env.items():
        if any(word in name for word in ("TOKEN", "PASSWORD", "SECRET")):
            assert value == "" or value.startswith("change-me"), f"{name} in .env.example looks like a real secret"
    gitignore = (ROOT / ".gitignore").read_text().split()
    assert ".env" in gitignore
    tracked = subprocess.run(["git", "ls-files", ".env"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert tracked.stdout.strip() == "", ".env must never be committed"


def test_a_missing_secret_stops_compose_with_a_message_naming_it(env: dict[str, str]) -> None:
    without = {k: v for k, v in env.items() if k != "TRAINER_TOKEN"}
    with pytest.raises(InterpolationError, match="TRAINER_TOKEN"):
        load_compose(BASE, env=without)
    assert interpolate("$${literal}", {}) == "${literal}"


def test_start_order_uses_health_and_completion_conditions(cpu: dict[str, Any]) -> None:
    services = cpu["services"]
    for name, svc in services.items():
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert isinstance(spec, dict), f"{name} -> {dep}: use the long form with a condition"
            condition = spec["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} healthy, but {dep} has no healthcheck"
            elif condition == "service_completed_successfully":
                assert dep in ONE_SHOT and services[dep].get("restart") == "no"
            else:
                pytest.fail(f"{name} -> {dep}: condition {condition} does not wait for readiness")
    conditions = {n: {d: s["condition"] for d, s in (v.get("depends_on") or {}).items()} for n, v in services.items()}
    assert conditions["minio-init"] == {"minio": "service_healthy"}
    assert conditions["proxy"] == {"redis": "service_healthy", "minio-init": "service_completed_successfully"}
    for worker in WORKERS:
        assert conditions[worker] == {"proxy": "service_healthy", "model-init": "service_completed_successfully"}
    for name in LONG_RUNNING:
        assert services[name]["healthcheck"]["test"][0] == "CMD"


def test_proxy_health_is_readiness_and_ports_agree_everywhere(cpu: dict[str, Any]) -> None:
    proxy = cpu["services"]["proxy"]
    cmd = proxy["command"]
    assert cmd[:1] == ["proxy"]
    port = cmd[cmd.index("--port") + 1]
    host = cmd[cmd.index("--host") + 1]
    assert host == "0.0.0.0", "in a container the proxy must listen beyond loopback"
    assert service_env(proxy)["BUCKETRL_PORT"] == port
    assert f"127.0.0.1:{port}/readyz" in " ".join(proxy["healthcheck"]["test"])
    (published,) = proxy["ports"]
    assert published.startswith("127.0.0.1:") and published.endswith(f":{port}")
    for worker in WORKERS:
        assert service_env(cpu["services"][worker])["BUCKETRL_PROXY_URL"] == f"http://proxy:{port}"


def test_workers_scale_no_fixed_names_ports_or_writable_shared_state(cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    for model in (cpu, gpu):
        for name, svc in model["services"].items():
            assert "container_name" not in svc, f"{name}: container_name breaks --scale and parallel projects"
        for worker in WORKERS:
            svc = model["services"][worker]
            assert "ports" not in svc and "hostname" not in svc, worker
        generator = model["services"]["generator"]
        for mount in generator.get("volumes") or []:
            _, target, *mode = str(mount).split(":")
            # Shared model weights are read-only; the HF cache is the one shared writable volume (GPU override),
            # and Hugging Face's cache is safe for concurrent readers/writers (file locks).
            assert mode == ["ro"] or target == "/cache/huggingface", f"generator mounts {mount} writable"


def test_restart_policies(cpu: dict[str, Any]) -> None:
    services = cpu["services"]
    assert set(services) == LONG_RUNNING | ONE_SHOT | WORKERS
    for name in LONG_RUNNING:
        assert services[name]["restart"] == "unless-stopped"
    for name in WORKERS:
        # A crash restarts (and resumes); a clean exit (run finished, SIGTERM) stays stopped.
        assert services[name]["restart"] == "on-failure"
    for name in ONE_SHOT:
        assert services[name]["restart"] == "no"


@pytest.mark.parametrize("stack", ["cpu", "gpu", "standins"])
def test_redis_appends_every_write_to_a_named_volume(stack: str, request: pytest.FixtureRequest) -> None:
    files = {"cpu": (BASE,), "gpu": (BASE, GPU), "standins": (BASE, ROOT / "tests/containers/compose.standins.yml")}
    model = load_compose(*files[stack], env=request.getfixturevalue("env"))
    redis = model["services"]["redis"]
    cmd = redis["command"]
    assert cmd[0] == "redis-server" and cmd[cmd.index("--appendonly") + 1] == "yes"
    # Issue 10: fsync before every answer. everysec may lose the last second of acknowledged submits, acks and
    # publishes when Redis is killed, a rollback the proxy cannot detect (the container tests' stand-in Redis
    # runs this same command).
    assert cmd[cmd.index("--appendfsync") + 1] == "always"
    (mount,) = redis["volumes"]
    volume, target = mount.split(":")
    assert target == "/data" and volume in model["volumes"]


def test_third_party_images_are_pinned_by_digest(cpu: dict[str, Any]) -> None:
    for name, svc in cpu["services"].items():
        if "build" in svc:
            continue
        assert "@sha256:" in svc["image"] and ":latest" not in svc["image"], f"{name}: {svc['image']}"


def test_only_the_proxy_holds_bucket_and_redis_credentials(cpu: dict[str, Any]) -> None:
    for name in WORKERS:
        env = service_env(cpu["services"][name])
        assert not any(k.startswith("AWS_") or "REDIS" in k or "BUCKET_URL" in k for k in env), name
    proxy = service_env(cpu["services"]["proxy"])
    assert proxy["AWS_ACCESS_KEY_ID"] == service_env(cpu["services"]["minio-init"])["S3_ACCESS_KEY_ID"]
    assert proxy["BUCKETRL_BUCKET_URL"].startswith(f"s3://{service_env(cpu['services']['minio-init'])['S3_BUCKET']}/")
    assert proxy["BUCKETRL_S3_ENDPOINT_URL"] == "http://minio:9000"


def test_every_worker_token_is_accepted_by_the_proxy_for_its_role(cpu: dict[str, Any], env: dict[str, str]) -> None:
    from bucketrl.proxy.auth import TokenAuth

    # .env.example's placeholders are refused at start (issue 12): an operator must replace them.
    with pytest.raises(ValueError, match="placeholder"):
        TokenAuth.from_settings(service_env(cpu["services"]["proxy"])["BUCKETRL_TOKENS"], None, False, "0.0.0.0")
    real = load_compose(BASE, env=with_secrets(env))
    auth = TokenAuth.from_settings(service_env(real["services"]["proxy"])["BUCKETRL_TOKENS"], None, False, "0.0.0.0")
    for worker in WORKERS:
        token = service_env(real["services"][worker])["BUCKETRL_TOKEN"]
        assert auth.authenticate(f"Bearer {token}").role == worker


def test_redis_has_a_password_and_only_the_proxy_reaches_redis_and_minio(cpu: dict[str, Any]) -> None:
    """Any generator container could rewrite coordination state: Redis had no password and shared a network
    with the workers."""
    services = cpu["services"]
    redis = services["redis"]
    password = redis["command"][redis["command"].index("--requirepass") + 1]
    assert password and service_env(redis)["REDISCLI_AUTH"] == password  # the health check authenticates
    assert service_env(services["proxy"])["BUCKETRL_REDIS_URL"] == f"redis://:{password}@redis:6379/0"
    assert cpu["networks"]["backend"].get("internal") is True

    def networks(name: str) -> set[str]:
        nets = services[name].get("networks") or ["default"]
        return set(nets if isinstance(nets, list) else nets.keys())

    assert {n for n in services if "backend" in networks(n)} == {"redis", "minio", "minio-init", "proxy"}
    for store in ("redis", "minio"):
        assert networks(store) == {"backend"}, store
    assert networks("proxy") == {"backend", "default"}
    for worker in (*WORKERS, "model-init"):
        assert "backend" not in networks(worker), worker


def test_the_tiny_model_is_built_where_the_run_spec_points(cpu: dict[str, Any]) -> None:
    from bucketrl.tasks.tiny_model import VOCAB_SIZE
    from bucketrl.wire.runs import RunSpec

    init = cpu["services"]["model-init"]
    assert init["entrypoint"] == ["python", "-m", "bucketrl.tasks.tiny_model"]
    (model_dir,) = init["command"]
    trainer = cpu["services"]["trainer"]
    spec_path = bind_mounts(trainer)[service_env(trainer)["BUCKETRL_RUN_SPEC"]]
    spec = RunSpec.model_validate_json(spec_path.read_text())
    assert spec.base_model == model_dir and spec.vocab_size == VOCAB_SIZE
    # model-init writes the models volume; the trainer and every generator read the same volume, read-only.
    mounts = {
        n: {str(v).split(":")[1]: str(v) for v in cpu["services"][n]["volumes"]} for n in ("model-init", *WORKERS)
    }
    root = "/" + model_dir.strip("/").split("/")[0]
    assert mounts["model-init"][root] == f"models:{root}"
    for worker in WORKERS:
        assert mounts[worker][root] == f"models:{root}:ro"


def test_gpu_override_switches_workers_to_cuda_and_vllm(gpu: dict[str, Any]) -> None:
    from bucketrl.wire.runs import RunSpec

    services = gpu["services"]
    for worker in WORKERS:
        svc = services[worker]
        assert svc["build"]["args"]["VARIANT"] == "gpu"
        assert not svc["image"].endswith("-cpu")
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        env = service_env(svc)
        assert env["BUCKETRL_DEVICE"] == "cuda" and env["HF_HUB_OFFLINE"] == "1"
    assert service_env(services["generator"])["BUCKETRL_ENGINE"] == "vllm"
    assert "shm_size" in services["generator"]
    # model-init downloads exactly the model the trainer's run spec names, from the same file.
    trainer_spec = bind_mounts(services["trainer"])["/etc/bucketrl/run-spec.json"]
    init = services["model-init"]
    assert bind_mounts(init)[init["command"][0]] == trainer_spec
    spec = RunSpec.model_validate_json(trainer_spec.read_text())
    assert "/" in spec.base_model and not spec.base_model.startswith("/"), "a hub model id"
    assert "snapshot_download" in init["entrypoint"][-1]


def test_bucketrl_containers_drop_capabilities_and_the_proxy_root_is_read_only(cpu: dict[str, Any]) -> None:
    for name, svc in cpu["services"].items():
        if "build" not in svc:
            continue  # third-party images (Redis, MinIO) keep their own defaults
        assert svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name
    proxy = cpu["services"]["proxy"]
    assert proxy["read_only"] is True and "/tmp" in proxy["tmpfs"]


def test_the_opt_in_relay_forwards_to_the_proxy_and_parses_as_its_settings(
    cpu: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from bucketrl.relay.settings import RelaySettings
    from tests.deploy.support import build_settings, env_names, service_env

    services = cpu["services"]
    relay = services["relay"]
    assert relay["profiles"] == ["relay"], "opt-in: `docker compose up` alone starts no relay"
    env = service_env(relay)
    assert not [k for k in env if k.startswith("BUCKETRL_RELAY_") and k not in env_names(RelaySettings)]
    settings = build_settings(RelaySettings, env, monkeypatch)
    worker_url = service_env(services["trainer"])["BUCKETRL_PROXY_URL"]
    assert settings.upstream_url == worker_url
    # Without GENERATOR_PROXY_URL the generators use the proxy, as the trainer does; the relay's port and health
    # check agree with its command.
    assert service_env(services["generator"])["BUCKETRL_PROXY_URL"] == worker_url
    cmd = relay["command"]
    port = cmd[cmd.index("--port") + 1]
    assert f"127.0.0.1:{port}/relay/stats" in relay["healthcheck"]["test"][-1]
    assert cmd[cmd.index("--cache-dir") + 1] in relay["tmpfs"] and relay["read_only"] is True
