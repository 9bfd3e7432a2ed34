"""Every ``BUCKETRL_*`` variable the deployment files set is a real setting, and every needed one is set.

    .venv/bin/python -m pytest -q tests/deploy/test_settings_coverage.py

pydantic-settings ignores unknown variables (``extra="ignore"``), so a misspelled ``BUCKETRL_GPU_MEMORY_UTILISATION``
would be silently dropped: these tests catch it. Each service's environment, as Compose (with ``.env.example``)
or the chart (for every value combination of ``test_chart``) would hand it over, is parsed by the service's own
settings class — ``ProxySettings``, ``TrainerSettings``, ``GeneratorSettings`` — with files that would be mounted
(the run spec) materialised from the repo or the rendered ConfigMap.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.support import (
    CHART,
    COMPOSE_FILES,
    ENV_EXAMPLE,
    ROOT,
    SERVICES,
    TRL_COMPOSE,
    bind_mounts,
    build_settings,
    env_names,
    expand_k8s_env,
    load_compose,
    manifests,
    pod_spec,
    read_env_file,
    render_chart,
    required_fields,
    service_env,
    settings_class,
)
from tests.deploy.test_chart import COMBOS, Refs, merged_values

# Set by every deployment even though the settings have a default: the default is wrong in a container
# (loopback proxy URL, no token, a /tmp bucket...).
MUST_SET = {
    "proxy": {"BUCKETRL_REDIS_URL", "BUCKETRL_BUCKET_URL", "BUCKETRL_PORT"},
    "trainer": {"BUCKETRL_PROXY_URL", "BUCKETRL_TOKEN", "BUCKETRL_RUN", "BUCKETRL_RUN_SPEC"},
    "generator": {"BUCKETRL_PROXY_URL", "BUCKETRL_TOKEN", "BUCKETRL_RUN"},
}
ONE_OF = {"proxy": {"BUCKETRL_TOKENS", "BUCKETRL_TOKENS_FILE"}}


def _check(component: str, env: dict[str, str], where: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    cls = settings_class(component)
    known = env_names(cls)
    ours = {k: v for k, v in env.items() if k.upper().startswith("BUCKETRL_")}
    unknown = sorted(set(ours) - set(known))
    assert not unknown, f"{where}: {cls.__name__} has no setting {unknown}"
    missing = MUST_SET[component] - set(ours)
    assert not missing, f"{where}: {component} must be given {sorted(missing)}"
    if component in ONE_OF:
        assert ONE_OF[component] & set(ours), f"{where}: set one of {sorted(ONE_OF[component])}"
    for field in required_fields(cls):
        assert any(known[k] == field for k in ours), f"{where}: required setting {field} is not provided"
    return build_settings(cls, ours, monkeypatch)


def test_settings_classes_import_without_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import bucketrl.proxy.settings, bucketrl.trainer.settings, bucketrl.generator.settings\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("files", [COMPOSE_FILES[:1], COMPOSE_FILES], ids=["cpu", "gpu"])
def test_compose_environments_parse_as_each_services_settings(files, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_compose(*files, env=read_env_file(ENV_EXAMPLE))
    for component in SERVICES:
        service = model["services"][component]
        env = service_env(service)
        mounts = bind_mounts(service)
        # A path the container sees through a bind mount is read from the repo file that would be mounted.
        env = {k: str(mounts[v]) if v in mounts else v for k, v in env.items()}
        settings = _check(component, env, f"{files[-1].name}:{component}", monkeypatch)
        if component == "trainer":
            assert settings.run_spec_dict()["base_model"]


@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_chart_environments_parse_as_each_services_settings(
    combo: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    values = COMBOS[combo]
    docs = manifests(render_chart(values))
    merged = merged_values(values)
    refs = Refs(docs, merged)
    seen = set()
    for doc in docs:
        spec = pod_spec(doc)
        component = doc["metadata"]["labels"]["app.kubernetes.io/component"]
        if spec is None or component not in SERVICES:
            continue
        seen.add(component)
        (container,) = spec["containers"]
        env = expand_k8s_env(container, refs)
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts") or []}
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        for key, value in list(env.items()):
            # Files from a mounted Secret/ConfigMap: write what the kubelet would project there.
            for mount_path, vol_name in mounts.items():
                source = volumes.get(vol_name, {})
                if not value.startswith(mount_path + "/") or not ({"secret", "configMap"} & set(source)):
                    continue
                kind, ref = ("Secret", source["secret"]) if "secret" in source else ("ConfigMap", source["configMap"])
                name = ref.get("secretName") or ref.get("name")
                (item,) = [i for i in ref["items"] if f"{mount_path}/{i['path']}" == value]
                content = refs(kind, name, item["key"])
                if content.startswith("<"):  # an existing ConfigMap we cannot see: the values' spec stands in
                    import json

                    content = json.dumps(merged["run"]["spec"])
                local = tmp_path / component / item["path"]
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_text(content)
                env[key] = str(local)
        _check(component, env, f"chart[{combo}] {doc['kind']} {doc['metadata']['name']}", monkeypatch)
    expected = {c for c in SERVICES if merged[c]["enabled"]}
    assert seen == expected, f"chart[{combo}]: rendered {seen}, expected {expected}"


def test_every_bucketrl_name_in_the_deploy_files_is_a_setting() -> None:
    from bucketrl.gateway.settings import GatewaySettings
    from bucketrl.relay.settings import RelaySettings

    known = set().union(
        *(env_names(settings_class(c)) for c in SERVICES), env_names(RelaySettings), env_names(GatewaySettings)
    )
    files = [*COMPOSE_FILES, TRL_COMPOSE, ENV_EXAMPLE, *sorted(CHART.rglob("*")), ROOT / "docs" / "deploy.md"]
    for path in files:
        if not path.is_file():
            continue
        names = set(re.findall(r"\bBUCKETRL_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
        unknown = sorted(names - known)
        assert not unknown, f"{path.relative_to(ROOT)} mentions {unknown}, which no service reads"
