"""The proxy, trainer and generator (CPU) images, built with podman from services/*/Dockerfile, checked for real.

Each image runs as its non-root user, holds no secret from the build context, reports its size (the proxy's
without torch), and runs under the chart's security context: read-only root filesystem with only the chart's
writable mounts, no capabilities, no privilege escalation. The three of them train a run that way here against
a host Redis and a moto S3 endpoint, and the proxy's HEALTHCHECK and probes say what they should.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.containers import podman
from tests.support.services import MotoServer, RedisServer, free_port

# The first test also builds the images (about 20 min on a machine that never built them): not the suite's 600 s.
pytestmark = [pytest.mark.slow, pytest.mark.containers, pytest.mark.timeout(3600)]

IMAGES = {image.name: image.tag for image in podman.SERVICE_IMAGES}
RUN_SPEC = podman.ROOT / "services" / "compose" / "run-spec.cpu.json"


def test_images_report_sizes_and_only_workers_carry_torch(built_images: dict[str, float]) -> None:
    sizes = {name: podman.image_size_mb(tag) for name, tag in IMAGES.items()}
    print("\nimage build seconds (about 0: podman's cache):", {k: round(v) for k, v in built_images.items()})
    print("image sizes (MB):", {k: round(v) for k, v in sizes.items()})
    find_torch = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('torch') else 3)"
    proxy = podman.run(IMAGES["proxy"], "-c", find_torch, entrypoint="python")
    assert proxy.returncode == 3, f"the proxy image carries torch (or python failed):\n{podman.tail(proxy)}"
    for worker in ("trainer", "generator"):
        proc = podman.run(IMAGES[worker], "-c", find_torch, entrypoint="python")
        assert proc.returncode == 0, f"{worker} image has no torch:\n{podman.tail(proc)}"
    # What each image adds to the Python base they share: the proxy's stack (FastAPI, Redis, boto3) is a small part
    # of the trainer's (torch, transformers). Measured over the base, not as whole images: the whole-image ratio
    # moved with each botocore release (proxy 492 -> 494 MB against a trainer of 1480 -> 1470 MB).
    base = podman.image_size_mb(podman.PYTHON)
    added = {name: size - base for name, size in sizes.items()}
    print("added to the base (MB):", {k: round(v) for k, v in added.items()})
    assert 0 < added["proxy"] < added["trainer"] / 5, (base, sizes)


@pytest.mark.parametrize("image", podman.SERVICE_IMAGES, ids=lambda i: i.name)
def test_image_installs_exactly_its_lock(built_images: dict[str, float], image: podman.ServiceImage) -> None:
    lock = podman.parse_pins((podman.LOCKS / image.lock).read_text())
    installed = {k: v for k, v in podman.installed_pins(image.tag).items() if k not in podman.UNLOCKED}
    extra = {k: v for k, v in installed.items() if lock.get(k) != v}
    absent = sorted(set(lock) - set(installed))
    assert not extra and not absent, (
        f"{image.tag} differs from services/locks/{image.lock}: installed but not locked {extra}, locked but not "
        f"installed {absent}. Relock with `make lock`."
    )


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_runs_as_its_non_root_user(built_images: dict[str, float], name: str) -> None:
    config = json.loads(podman.podman("image", "inspect", IMAGES[name]).stdout)[0]["Config"]
    assert config["User"] == "10001:10001"
    probe = "id -u; id -g; touch /opt/venv/x 2>/dev/null && echo writable; true"
    proc = podman.run(IMAGES[name], "-c", probe, entrypoint="sh")
    assert proc.returncode == 0, podman.tail(proc)
    assert proc.stdout.split() == ["10001", "10001"], "runs as root, or the venv is writable by the service user"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_holds_no_secret_and_no_build_mount(built_images: dict[str, float], name: str) -> None:
    tag = IMAGES[name]
    # Metadata: the history (every RUN line), the environment and labels.
    history = podman.podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", tag).stdout
    config = json.loads(podman.podman("image", "inspect", tag).stdout)[0]["Config"]
    meta = history + json.dumps(config)
    assert podman.CANARY not in meta
    for word in ("TOKEN", "SECRET", "PASSWORD", "AWS_ACCESS_KEY"):
        assert not [e for e in config.get("Env") or [] if word in e.split("=")[0].upper()], config["Env"]
    # Files: the whole root filesystem, mounted read-only from podman's store.
    root = Path(podman.podman("image", "mount", tag).stdout.strip())
    try:
        leaks = scan_for_secrets(root)
    finally:
        podman.podman("image", "unmount", tag, check=False)
    assert not leaks, f"{tag}: secrets or build-time files in the image: {leaks[:20]}"


# Where the build mounts the host's pip config, CA bundle and wheels (tests/containers/podman.py). Podman 4.3
# leaves an empty file or directory where a mount point did not exist; any content there would be a leak.
BUILD_MOUNTS = ("etc/pip.conf", "etc/ssl/certs/host-ca.crt", "opt/wheels")


def scan_for_secrets(root: Path) -> list[str]:
    """Paths under ``root`` holding the canary, a credentials-shaped file, or what a build mount held."""
    suspicious_names = {".env", ".netrc", ".pypirc", "id_rsa", "id_ed25519", "credentials"}
    found = [m for m in BUILD_MOUNTS if (root / m).is_file() and (root / m).stat().st_size > 0]
    found += [m for m in BUILD_MOUNTS if (root / m).is_dir() and any((root / m).iterdir())]
    canary = podman.CANARY.encode()
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir.parts[:1] in (("proc",), ("sys",), ("dev",)):
            dirnames[:] = []
            continue
        if ".git" in dirnames:
            found.append(str(rel_dir / ".git"))
        for fname in filenames:
            path = Path(dirpath) / fname
            if fname in suspicious_names:
                found.append(str(rel_dir / fname))
                continue
            try:
                if path.is_symlink() or path.stat().st_size > 8_000_000:
                    continue  # big binaries (torch's .so) cannot hold the canary, which is only ever text
                if canary in path.read_bytes():
                    found.append(str(rel_dir / fname))
            except OSError:
                continue
    return found


# ------------------------------------------------------------------------------- the chart's hardening ----


def hardened(name: str, *mounts: str) -> list[str]:
    """``podman run`` options of the chart's securityContext: read-only root, the chart's writable mounts only."""
    opts = [
        "run",
        "-d",
        "--name",
        name,
        "--network",
        "host",
        "--read-only",
        "--read-only-tmpfs=false",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--tmpfs",
        "/tmp:rw,mode=1777",
    ]
    for mount in mounts:
        # An emptyDir the pod's fsGroup (10001) can write, as the chart's podSecurityContext makes it.
        opts += ["--mount", f"type=tmpfs,destination={mount},chown=true"]
    return opts


@pytest.fixture()
def containers() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        if name.startswith("volume:"):
            continue
        logs = podman.podman("logs", "--tail", "30", name, check=False)
        print(f"--- {name} ---\n{podman.tail(logs, 3000)}")
        podman.podman("rm", "-f", "-t", "2", name, check=False)
    for name in names:
        if name.startswith("volume:"):
            podman.podman("volume", "rm", "-f", name.removeprefix("volume:"), check=False)


def test_chart_hardened_containers_train_and_probes_tell_liveness_from_readiness(
    built_images: dict[str, float],
    containers: list[str],
    redis_server: RedisServer,
    moto_server: MotoServer,
    tmp_path: Path,
) -> None:
    suffix = uuid.uuid4().hex[:8]
    bucket = f"img-{suffix}"
    moto_server.create_bucket(bucket)
    port = free_port()
    tokens = {role: f"{role}-{uuid.uuid4().hex}" for role in ("admin", "trainer", "generator", "viewer")}
    proxy_url = f"http://127.0.0.1:{port}"
    aws = moto_server.env()

    # The tokens as the chart gives them: a Secret's key mounted read-only, mode 0440, group = the pod's fsGroup.
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("".join(f"{r}:{t}\n" for r, t in tokens.items()))
    os.chown(tokens_file, 0, 10001)
    tokens_file.chmod(0o440)

    proxy = f"brl-proxy-{suffix}"
    containers.append(proxy)
    podman.podman(
        *hardened(proxy),
        "-v",
        f"{tokens_file}:/etc/bucketrl/tokens/tokens:ro",
        "-e",
        "BUCKETRL_TOKENS_FILE=/etc/bucketrl/tokens/tokens",
        "-e",
        f"BUCKETRL_REDIS_URL={redis_server.url}",
        "-e",
        f"BUCKETRL_BUCKET_URL=s3://{bucket}/bucketrl",
        "-e",
        f"BUCKETRL_S3_ENDPOINT_URL={aws['BUCKETRL_S3_ENDPOINT_URL']}",
        "-e",
        f"AWS_ACCESS_KEY_ID={aws['AWS_ACCESS_KEY_ID']}",
        "-e",
        f"AWS_SECRET_ACCESS_KEY={aws['AWS_SECRET_ACCESS_KEY']}",
        "-e",
        "AWS_DEFAULT_REGION=us-east-1",
        "-e",
        f"BUCKETRL_PORT={port}",
        IMAGES["proxy"],
        "proxy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    )
    wait_ready(proxy_url, proxy)
    assert healthcheck(proxy) == 0, "the image's HEALTHCHECK fails on a serving proxy"

    run = f"img-{suffix}"
    worker_env = ["-e", f"BUCKETRL_PROXY_URL={proxy_url}", "-e", f"BUCKETRL_RUN={run}", "-e", "BUCKETRL_DEVICE=cpu"]
    # The tiny model, written into a volume by the trainer image as compose's model-init job does.
    volume = f"brl-models-{suffix}"
    podman.podman("volume", "create", volume)
    containers.append(f"volume:{volume}")
    init = podman.podman(
        "run", "--rm", "-v", f"{volume}:/models", "--entrypoint", "python", IMAGES["trainer"],
        "-m", "bucketrl.tasks.tiny_model", "/models/tiny-qwen2", check=False, timeout=300,
    )  # fmt: skip
    assert init.returncode == 0, podman.tail(init)
    models = ["-v", f"{volume}:/models:ro"]
    trainer = f"brl-trainer-{suffix}"
    containers.append(trainer)
    podman.podman(
        *hardened(trainer, "/cache"),
        *worker_env,
        *models,
        "-v",
        f"{RUN_SPEC}:/etc/bucketrl/run-spec.json:ro",
        "-e",
        f"BUCKETRL_TOKEN={tokens['trainer']}",
        "-e",
        "BUCKETRL_WORKER_ID=trainer",
        "-e",
        "BUCKETRL_RUN_SPEC=/etc/bucketrl/run-spec.json",
        "-e",
        "BUCKETRL_MAX_STEPS=2",
        "-e",
        "BUCKETRL_CHECKPOINT_EVERY=1",
        "-e",
        "BUCKETRL_WORK_DIR=/cache/work",
        IMAGES["trainer"],
        "trainer",
    )
    generator = f"brl-generator-{suffix}"
    containers.append(generator)
    podman.podman(
        *hardened(generator, "/cache"),
        *worker_env,
        *models,
        "-e",
        f"BUCKETRL_TOKEN={tokens['generator']}",
        "-e",
        "BUCKETRL_ENGINE=transformers",
        IMAGES["generator"],
        "generator",
    )
    exit_code = wait_exit(trainer, timeout_s=420)
    assert exit_code == 0, f"the trainer under a read-only root exited {exit_code}"
    state = httpx.get(f"{proxy_url}/v1/runs/{run}", headers=auth(tokens["viewer"]), timeout=10).json()["state"]
    assert state["trainer_step"] == 2 and state["latest_version"] >= 2, state
    assert running(generator), "the generator under a read-only root died"

    # Probes: Redis gone -> not ready (the Service stops routing) but alive (no restart).
    redis_server.kill()
    deadline = time.monotonic() + 60
    while httpx.get(f"{proxy_url}/readyz", timeout=10).status_code == 200:
        assert time.monotonic() < deadline, "/readyz still 200 with Redis down"
        time.sleep(1)
    assert httpx.get(f"{proxy_url}/healthz", timeout=10).status_code == 200
    assert healthcheck(proxy) == 0, "liveness must not fail when only Redis is down"


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def healthcheck(name: str) -> int:
    return podman.podman("healthcheck", "run", name, check=False, timeout=60).returncode


def running(name: str) -> bool:
    out = podman.podman("inspect", name, "--format", "{{.State.Running}}", check=False).stdout.strip()
    return out == "true"


def wait_exit(name: str, timeout_s: float) -> int:
    try:
        proc = podman.podman("wait", name, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} still running after {timeout_s:.0f}s")
    return int(proc.stdout.strip().splitlines()[-1])


def wait_ready(url: str, name: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert running(name), f"{name} exited before it was ready"
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"{name}: /readyz not 200 after {timeout_s:.0f}s")
