"""The Helm chart (``k8s/helm/bucketrl``), linted and rendered offline, every manifest schema-validated.

    .venv/bin/python -m pytest -q tests/deploy/test_chart.py

``helm-python-sdk`` embeds Helm's Go SDK (``libhelm_c.so``), so ``helm lint --strict`` and ``helm template`` run
here without a ``helm`` binary or a cluster. Each rendered object is validated with ``kubernetes-validate``
(strict: unknown fields are errors) against the oldest Kubernetes the chart supports and the newest schemas the
package ships, then checked for what the chart promises: probes, non-root, read-only root filesystems,
resources, secret and config references that resolve, ports that agree with the proxy's settings, and tokens
that the proxy accepts for each worker's role.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.support import (
    CHART,
    build_settings,
    expand_k8s_env,
    lint_chart,
    manifests,
    pod_spec,
    render_chart,
    secret_data,
)

KUBE_VERSIONS = ("1.29", kubernetes_validate.latest_version())
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}  # no schema in kubernetes-validate: checked below

COMBOS: dict[str, dict[str, Any]] = {
    "default": {},
    "external-redis": {
        "redis": {"enabled": False, "external": {"url": "rediss://:s3cr3t@redis.cache.internal:6380/2"}},
    },
    "gpu-hpa": {
        "generator": {
            "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 16},
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "gpu": {"count": 2},
            "env": {"BUCKETRL_PROMPTS_PER_REQUEST": 32},
            "extraEnv": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        },
        "proxy": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}, "authorization": True}},
    },
    "existing-secrets": {
        "secrets": {"tokens": {"existingSecret": "team-tokens"}, "s3": {"existingSecret": "team-s3"}},
        "redis": {"enabled": False, "external": {"existingSecret": "team-redis", "existingSecretKey": "url"}},
        "run": {"existingConfigMap": "team-run-spec"},
    },
    "remote-generators": {
        "proxy": {"enabled": False},
        "trainer": {"enabled": False},
        "redis": {"enabled": False},
        "proxyUrl": "https://bucketrl.example.org/",
        "secrets": {"tokens": {"existingSecret": "generator-token"}},
    },
    "regional-relay": {
        "proxy": {"enabled": False},
        "trainer": {"enabled": False},
        "redis": {"enabled": False},
        "proxyUrl": "https://bucketrl.example.org/",
        "secrets": {"tokens": {"existingSecret": "generator-token"}},
        "relay": {"enabled": True, "cacheMaxBytes": 2147483648, "service": {"port": 8101}},
        "caSecret": {"name": "home-ca", "key": "ca.pem"},
    },
    # TRL's AsyncGRPOTrainer outside the chart trains through the gateway (docs/trl.md).
    "external-trainer": {
        "trainer": {"enabled": False},
        "gateway": {"enabled": True, "adapterVolume": {"persistentVolumeClaim": {"claimName": "trl-output"}}},
    },
    "cpu-statefulset-keys": {
        "trainer": {"kind": "StatefulSet", "gpu": {"enabled": False}, "tolerations": []},
        "generator": {"engine": "transformers", "gpu": {"enabled": False}, "tolerations": []},
        "secrets": {"s3": {"accessKeyId": "minio-user", "secretAccessKey": "minio-secret-key"}},
        "proxy": {"s3EndpointUrl": "http://minio.minio:9000", "port": 9090, "service": {"port": 80}},
        "redis": {"auth": {"enabled": False}, "persistence": {"enabled": False}, "appendfsync": "everysec"},
    },
}
# Objects the default install must produce (kind, component).
EXPECTED_DEFAULT: set[tuple[str, str]] = {
    ("Deployment", "proxy"),
    ("Service", "proxy"),
    ("PodDisruptionBudget", "proxy"),
    ("ServiceAccount", "proxy"),
    ("StatefulSet", "redis"),
    ("Service", "redis"),
    ("Job", "trainer"),
    ("ConfigMap", "trainer"),
    ("Deployment", "generator"),
    ("Secret", "tokens"),
    ("Secret", "redis"),
}


@pytest.fixture(scope="module", params=sorted(COMBOS))
def combo(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    name = request.param
    return name, COMBOS[name], manifests(render_chart(COMBOS[name]))


def by_kind(docs: list[dict[str, Any]], kind: str, component: str | None = None) -> list[dict[str, Any]]:
    return [
        d
        for d in docs
        if d["kind"] == kind
        and (component is None or d["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]


def one(docs: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    (found,) = by_kind(docs, kind, component)
    return found


def merged_values(overrides: dict[str, Any]) -> dict[str, Any]:
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        return chart.merge_values(overrides)


class Refs:
    """Resolves secret/configMap references against the rendered objects, or the configured existing ones."""

    def __init__(self, docs: list[dict[str, Any]], values: dict[str, Any]) -> None:
        self.rendered = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("Secret", "ConfigMap")}
        secrets = values["secrets"]
        self.external = {
            ("Secret", secrets["tokens"]["existingSecret"]),
            ("Secret", secrets["s3"]["existingSecret"]),
            ("Secret", values["redis"]["external"]["existingSecret"]),
            ("ConfigMap", values["run"]["existingConfigMap"]),
            ("Secret", values["caSecret"]["name"]),
        }
        # Secrets the values reference through extraEnv (e.g. an HF token) are the user's own.
        for component in ("trainer", "generator"):
            for item in values[component]["extraEnv"]:
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    self.external.add(("Secret", ref["name"]))
        # What an existing tokens Secret holds under the configured key names: a consistent stand-in, so the
        # proxy's auth can check that each worker reads its own role's key.
        keys = secrets["tokens"]["keys"]
        roles = ("admin", "trainer", "generator", "viewer", "relay")
        self.existing_tokens = {keys.get(r, r): f"existing-{r}-token" for r in roles}
        self.existing_tokens[keys["file"]] = "\n".join(f"{r}:existing-{r}-token" for r in roles)
        self.tokens_secret = secrets["tokens"]["existingSecret"]

    def __call__(self, kind: str, name: str, key: str) -> str:
        if (kind, name) in self.rendered:
            doc = self.rendered[(kind, name)]
            data = secret_data(doc) if kind == "Secret" else doc["data"]
            assert key in data, f"{kind} {name} has no key {key!r} (has {sorted(data)})"
            return data[key]
        assert (kind, name) in self.external, f"{kind} {name} is neither rendered nor a configured existing one"
        if (kind, name) == ("Secret", self.tokens_secret):
            assert key in self.existing_tokens, f"tokens Secret key {key!r} is not one of secrets.tokens.keys"
            return self.existing_tokens[key]
        return f"<{name}/{key}>"


def test_chart_lints_strictly_clean_for_every_combination() -> None:
    for name, values in COMBOS.items():
        report = lint_chart(values)
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not problems, f"{name}: {problems}"


def test_every_manifest_validates_against_the_kubernetes_schemas(combo) -> None:
    name, _, docs = combo
    assert docs, name
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_service_monitor_is_well_formed_when_enabled(combo) -> None:
    _, values, docs = combo
    monitors = by_kind(docs, "ServiceMonitor")
    assert bool(monitors) == bool(values.get("proxy", {}).get("serviceMonitor", {}).get("enabled"))
    for sm in monitors:
        service = one(docs, "Service", "proxy")
        assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        (endpoint,) = sm["spec"]["endpoints"]
        assert endpoint["port"] == service["spec"]["ports"][0]["name"] and endpoint["path"] == "/metrics"
        assert sm["metadata"]["labels"]["release"] == "kps"
        refs = Refs(docs, merged_values(values))
        creds = endpoint["authorization"]["credentials"]
        assert refs("Secret", creds["name"], creds["key"])


def test_default_install_has_every_component() -> None:
    docs = manifests(render_chart({}))
    found = {(d["kind"], d["metadata"]["labels"]["app.kubernetes.io/component"]) for d in docs}
    assert found >= EXPECTED_DEFAULT, EXPECTED_DEFAULT - found
    assert one(docs, "Deployment", "proxy")["spec"]["replicas"] == 2


def test_pods_are_non_root_read_only_and_bounded(combo) -> None:
    name, _, docs = combo
    for doc in docs:
        spec = pod_spec(doc)
        if spec is None:
            continue
        where = f"{name}: {doc['kind']} {doc['metadata']['name']}"
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["runAsUser"] >= 999, where
        assert spec.get("automountServiceAccountToken") is False, where
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            res = c["resources"]
            assert {"cpu", "memory"} <= set(res["requests"]), where
            assert "memory" in res["limits"], where
            # A read-only root needs every writable path mounted: /tmp at least.
            assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]) or c["name"] == "redis", where
            for item in c.get("env") or []:
                if any(w in item["name"] for w in ("TOKEN", "SECRET", "PASSWORD", "KEY")) and "value" in item:
                    assert "$(" in str(item["value"]) or item["name"] == "BUCKETRL_TOKENS_FILE", (
                        f"{where}: {item['name']} is given in plain text, not from a Secret"
                    )


def test_every_secret_and_config_reference_resolves(combo) -> None:
    _, values, docs = combo
    refs = Refs(docs, merged_values(values))
    for doc in docs:
        spec = pod_spec(doc)
        if spec is None:
            continue
        for c in spec["containers"]:
            expand_k8s_env(c, refs)
        for vol in spec.get("volumes") or []:
            if "secret" in vol:
                for item in vol["secret"].get("items") or []:
                    refs("Secret", vol["secret"]["secretName"], item["key"])
            if "configMap" in vol:
                for item in vol["configMap"].get("items") or []:
                    refs("ConfigMap", vol["configMap"]["name"], item["key"])


def test_services_select_pods_on_named_ports(combo) -> None:
    _, _, docs = combo
    pods = [(d, pod_spec(d)) for d in docs if pod_spec(d) is not None]
    for svc in by_kind(docs, "Service"):
        selector = svc["spec"]["selector"]
        matches = [(d, s) for d, s in pods if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert matches, f"Service {svc['metadata']['name']} selects no pod"
        names = {p["name"] for _, s in matches for c in s["containers"] for p in c.get("ports") or []}
        for port in svc["spec"].get("ports") or []:
            assert port["targetPort"] in names, f"Service {svc['metadata']['name']}: no container port {port}"
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        proxy = one(docs, "Deployment", "proxy")
        assert pdb["spec"]["selector"]["matchLabels"].items() <= proxy["spec"]["template"]["metadata"]["labels"].items()
        assert pdb["spec"]["minAvailable"] < proxy["spec"]["replicas"], "a PDB that blocks every drain"


def test_proxy_probes_ports_and_settings_agree(combo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    name, values, docs = combo
    deployments = by_kind(docs, "Deployment", "proxy")
    if not deployments:
        assert values.get("proxy", {}).get("enabled") is False
        return
    (proxy,) = deployments
    spec = pod_spec(proxy)
    (c,) = spec["containers"]
    args = c["args"]
    assert args[0] == "proxy" and args[args.index("--host") + 1] == "0.0.0.0"
    port = int(args[args.index("--port") + 1])
    (http,) = c["ports"]
    assert http["containerPort"] == port and http["name"] == "http"
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}

    refs = Refs(docs, merged_values(values))
    env = expand_k8s_env(c, refs)
    # Materialise the mounted tokens file so the proxy's own settings and auth code read what the pod reads.
    (tokens_mount,) = [m for m in c["volumeMounts"] if m["name"] == "tokens"]
    (tokens_vol,) = [v for v in spec["volumes"] if v["name"] == "tokens"]
    (item,) = tokens_vol["secret"]["items"]
    assert env["BUCKETRL_TOKENS_FILE"] == f"{tokens_mount['mountPath']}/{item['path']}"
    local_tokens = tmp_path / "tokens"
    local_tokens.write_text(refs("Secret", tokens_vol["secret"]["secretName"], item["key"]))
    env["BUCKETRL_TOKENS_FILE"] = str(local_tokens)

    from bucketrl.proxy.auth import TokenAuth
    from bucketrl.proxy.settings import ProxySettings
    from tests.deploy.support import env_names

    known = env_names(ProxySettings)
    unknown = [k for k in env if k.startswith("BUCKETRL_") and k not in known]
    assert not unknown, f"{name}: the proxy has no settings {unknown}"
    settings = build_settings(ProxySettings, {k: v for k, v in env.items() if k.startswith("BUCKETRL_")}, monkeypatch)
    assert settings.port == port
    assert settings.redis_url.startswith(("redis://", "rediss://", "<"))
    assert "$(" not in settings.redis_url, "an env var referenced before it is defined is not expanded"
    assert settings.bucket_url.startswith("s3://")
    # The /tmp spool holds what the proxy accepts: a 1Gi emptyDir under 4 GiB checkpoints filled the node's disk
    # budget and evicted the pod mid-upload (issue 12).
    (tmp_vol,) = [v for v in spec["volumes"] if v["name"] == "tmp"]
    spool = int(tmp_vol["emptyDir"]["sizeLimit"])
    assert spool >= settings.max_checkpoint_bytes + 2 * settings.max_adapter_bytes, (name, spool)
    auth = TokenAuth.from_settings(settings.tokens, settings.tokens_file, settings.allow_anonymous, "0.0.0.0")

    # Every worker in the release is pointed at this proxy's Service, with a token it accepts for its role.
    service = one(docs, "Service", "proxy")
    (svc_port,) = service["spec"]["ports"]
    for role in ("trainer", "generator"):
        pods = [
            d
            for d in docs
            if pod_spec(d) is not None and d["metadata"]["labels"]["app.kubernetes.io/component"] == role
        ]
        for doc in pods:
            (wc,) = pod_spec(doc)["containers"]
            wenv = expand_k8s_env(wc, refs)
            assert wenv["BUCKETRL_PROXY_URL"] == f"http://{service['metadata']['name']}:{svc_port['port']}"
            assert auth.authenticate(f"Bearer {wenv['BUCKETRL_TOKEN']}").role == role
    viewer = refs(
        "Secret", tokens_vol["secret"]["secretName"], merged_values(values)["secrets"]["tokens"]["keys"]["viewer"]
    )
    assert auth.authenticate(f"Bearer {viewer}").role == "viewer"
    # The relays' staging token (relay.staging, in this or a regional release) is the relay role's, and only that.
    relay = refs(
        "Secret", tokens_vol["secret"]["secretName"], merged_values(values)["secrets"]["tokens"]["keys"]["relay"]
    )
    assert auth.authenticate(f"Bearer {relay}").role == "relay"


def test_redis_is_bundled_with_persistence_or_external(combo) -> None:
    name, values, docs = combo
    merged = merged_values(values)
    statefulsets = by_kind(docs, "StatefulSet", "redis")
    if not merged["proxy"]["enabled"] or not merged["redis"]["enabled"]:
        assert not statefulsets
        if merged["proxy"]["enabled"]:
            refs = Refs(docs, merged)
            (c,) = pod_spec(one(docs, "Deployment", "proxy"))["containers"]
            url = expand_k8s_env(c, refs)["BUCKETRL_REDIS_URL"]
            assert url in (merged["redis"]["external"]["url"], "<team-redis/url>")
        return
    (redis,) = statefulsets
    (c,) = pod_spec(redis)["containers"]
    assert c["args"][c["args"].index("--appendonly") + 1] == "yes"
    # Issue 10: fsync before every answer unless a user opts out (everysec can lose a second, undetected).
    assert c["args"][c["args"].index("--appendfsync") + 1] == merged["redis"]["appendfsync"]
    assert merged["redis"]["appendfsync"] == ("everysec" if name == "cpu-statefulset-keys" else "always")
    assert c["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]
    if merged["redis"]["persistence"]["enabled"]:
        (claim,) = redis["spec"]["volumeClaimTemplates"]
        assert claim["spec"]["resources"]["requests"]["storage"] == merged["redis"]["persistence"]["size"]
    if merged["redis"]["auth"]["enabled"]:
        assert "--requirepass" in c["args"]
        assert {e["name"] for e in c["env"]} >= {"REDIS_PASSWORD", "REDISCLI_AUTH"}


def test_generators_gpu_placement_and_autoscaling(combo) -> None:
    name, values, docs = combo
    merged = merged_values(values)
    generator = one(docs, "Deployment", "generator")
    spec = pod_spec(generator)
    (c,) = spec["containers"]
    if merged["relay"]["enabled"]:
        # Generators elsewhere behind their region's relay: the relay first, the home proxy (https) as fallback;
        # only the relay's leg, over the pod network, is plain HTTP.
        env = expand_k8s_env(c, Refs(docs, merged))
        relay_svc = one(docs, "Service", "relay")
        relay_url = f"http://{relay_svc['metadata']['name']}:{relay_svc['spec']['ports'][0]['port']}"
        assert env["BUCKETRL_PROXY_URL"] == f"{relay_url},{merged['proxyUrl'].rstrip('/')}", name
        assert env["BUCKETRL_INSECURE_HTTP"] == "1" and merged["proxyUrl"].startswith("https://"), name
        assert {(d["kind"], d["metadata"]["labels"]["app.kubernetes.io/component"]) for d in docs} == {
            ("Deployment", "generator"),
            ("Deployment", "relay"),
            ("Service", "relay"),
        }, name
    elif merged["proxyUrl"]:
        # Generators elsewhere: nothing but them in this release, pointed at the remote proxy.
        env = expand_k8s_env(c, Refs(docs, merged))
        assert env["BUCKETRL_PROXY_URL"] == merged["proxyUrl"].rstrip("/"), name
        # A proxy the user names is never exempted from the workers' refusal of plain HTTP off loopback.
        assert "BUCKETRL_INSECURE_HTTP" not in env, name
        if not merged["proxy"]["enabled"]:
            assert {d["kind"] for d in docs} == {"Deployment"}, name
    else:
        # This release's own Service, over the pod network: plain HTTP on purpose, said so explicitly.
        assert expand_k8s_env(c, Refs(docs, merged))["BUCKETRL_INSECURE_HTTP"] == "1", name
    gpu = merged["generator"]["gpu"]
    limits = c["resources"]["limits"]
    if gpu["enabled"]:
        assert limits[gpu["resourceName"]] == gpu["count"]
        assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    else:
        assert "nvidia.com/gpu" not in limits
    assert spec.get("nodeSelector", {}) == merged["generator"]["nodeSelector"]
    assert spec.get("tolerations", []) == merged["generator"]["tolerations"]
    # Issue 25: SIGTERM is a preemption notice exactly as long as the pod's grace period before its SIGKILL.
    grace = spec["terminationGracePeriodSeconds"]
    assert grace == merged["generator"]["terminationGracePeriodSeconds"], name
    assert expand_k8s_env(c, Refs(docs, merged))["BUCKETRL_PREEMPTION_NOTICE_S"] == str(grace), name
    hpas = by_kind(docs, "HorizontalPodAutoscaler", "generator")
    auto = merged["generator"]["autoscaling"]
    if not auto["enabled"]:
        assert not hpas and generator["spec"]["replicas"] == merged["generator"]["replicaCount"]
        return
    (hpa,) = hpas
    assert "replicas" not in generator["spec"], "the HPA owns the replica count"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", generator["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == auto["metric"]["name"]
    assert metric["external"]["metric"]["selector"]["matchLabels"] == {"run": merged["run"]["id"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (auto["minReplicas"], auto["maxReplicas"])


def test_trainer_is_one_resumable_pod_with_the_run_spec(combo) -> None:
    _, values, docs = combo
    merged = merged_values(values)
    trainers = [d for d in docs if d["kind"] in ("Job", "StatefulSet") and "trainer" in d["metadata"]["name"]]
    if not merged["trainer"]["enabled"]:
        assert not trainers
        return
    (trainer,) = trainers
    assert trainer["kind"] == merged["trainer"]["kind"]
    if trainer["kind"] == "Job":
        assert trainer["spec"]["parallelism"] == 1 and trainer["spec"]["completions"] == 1
        (rule,) = trainer["spec"]["podFailurePolicy"]["rules"]
        assert rule["action"] == "Ignore", "preemptions must not use up the backoff limit"
    else:
        assert trainer["spec"]["replicas"] == 1
    spec = pod_spec(trainer)
    (c,) = spec["containers"]
    env = expand_k8s_env(c, Refs(docs, merged))
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["run-spec"]
    vol = {v["name"]: v for v in spec["volumes"]}["run-spec"]
    (item,) = vol["configMap"]["items"]
    assert env["BUCKETRL_RUN_SPEC"] == f"{mount}/{item['path']}"
    if not merged["run"]["existingConfigMap"]:
        cm = one(docs, "ConfigMap", "trainer")
        assert yaml.safe_load(cm["data"][item["key"]]) == merged["run"]["spec"]


BAD_VALUES = [
    # Caught by values.schema.json: the message is the value's path.
    ({"redis": {"enabled": False, "external": {"url": "http://x"}}}, "/redis/external/url"),
    ({"trainer": {"kind": "Deployment"}}, "/trainer/kind"),
    ({"generator": {"engine": "sglang"}}, "/generator/engine"),
    ({"proxy": {"port": 70000}}, "/proxy/port"),
    ({"proxy": {"bucketUrl": "gs://b"}}, "/proxy/bucketUrl"),
    ({"generator": {"env": {"GPU_MEMORY_UTILIZATION": "0.5"}}}, "'GPU_MEMORY_UTILIZATION' does not match"),
    ({"run": {"id": "has space"}}, "/run/id"),
    ({"redis": {"appendfsync": "no"}}, "/redis/appendfsync"),
    # Caught by the templates: combinations a schema cannot express.
    ({"redis": {"enabled": False}}, "redis.external.url"),
    ({"secrets": {"s3": {"accessKeyId": "only-one"}}}, "both accessKeyId and secretAccessKey"),
    ({"proxy": {"enabled": False}}, "set proxyUrl"),
    ({"proxy": {"enabled": False}, "proxyUrl": "https://p"}, "secrets.tokens.existingSecret"),
    ({"redis": {"auth": {"password": "p@ss/word"}}}, "letters and digits only"),
    ({"generator": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}}, "minReplicas"),
    ({"relay": {"enabled": True}}, "relay.enabled: set proxyUrl to the home proxy's https:// address"),
    ({"relay": {"enabled": True}, "proxyUrl": "http://p:8000"}, "https:// address"),
    ({"relay": {"env": {"BUCKETRL_PORT": "1"}}}, "'BUCKETRL_PORT' does not match"),
    (
        {"relay": {"enabled": True, "tls": {"secretName": "relay-tls"}}, "proxyUrl": "https://p"},
        "relay.tls.secretName: the generators verify the relay's certificate with caSecret",
    ),
    ({"relay": {"tls": {"secretName": "Not_A_Name"}}}, "/relay/tls/secretName"),
    ({"gateway": {"enabled": True}}, "gateway.enabled: the gateway takes the run's trainer role"),
    ({"gateway": {"enabled": True}, "trainer": {"enabled": False}}, "gateway.adapterVolume: give the volume"),
    ({"gateway": {"env": {"BUCKETRL_LEASE_TOKEN": "x"}}}, "invalid propertyName 'BUCKETRL_LEASE_TOKEN'"),
    ({"gateway": {"adapterMountPath": "trl-output"}}, "/gateway/adapterMountPath"),
]


@pytest.mark.parametrize(("values", "message"), BAD_VALUES, ids=[m for _, m in BAD_VALUES])
def test_bad_values_fail_with_a_message_naming_the_value(values: dict[str, Any], message: str) -> None:
    import helm_python as helm

    with pytest.raises(helm.HelmError) as info:
        render_chart(values)
    assert message in str(info.value)


def test_relay_settings_ports_cache_and_ca_agree(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The relay's environment parses as its own settings: upstream the home proxy, the cap, the CA file mounted
    where BUCKETRL_CA_FILE says; its probes and Service use its named port; the cache volume holds the cap."""
    from bucketrl.relay.settings import RelaySettings
    from tests.deploy.support import env_names

    values = COMBOS["regional-relay"]
    docs = manifests(render_chart(values))
    merged = merged_values(values)
    relay = one(docs, "Deployment", "relay")
    spec = pod_spec(relay)
    (c,) = spec["containers"]
    args = c["args"]
    assert args[0] == "relay" and args[args.index("--host") + 1] == "0.0.0.0"
    (port,) = c["ports"]
    assert int(args[args.index("--port") + 1]) == port["containerPort"] == merged["relay"]["port"]
    probe = {"path": "/relay/stats", "port": "http", "scheme": "HTTP"}
    assert c["readinessProbe"]["httpGet"] == c["livenessProbe"]["httpGet"] == probe
    env = expand_k8s_env(c, Refs(docs, merged))
    unknown = [k for k in env if k.startswith("BUCKETRL_RELAY_") and k not in env_names(RelaySettings)]
    assert not unknown, unknown
    ca_mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["ca"]
    ca_vol = {v["name"]: v for v in spec["volumes"]}["ca"]
    assert ca_vol["secret"]["secretName"] == "home-ca"
    assert env["BUCKETRL_CA_FILE"] == f"{ca_mount}/{ca_vol['secret']['items'][0]['path']}"
    settings = build_settings(
        RelaySettings, {k: v for k, v in env.items() if k.startswith("BUCKETRL_RELAY_")}, monkeypatch
    )
    assert settings.upstream_url == "https://bucketrl.example.org"
    assert settings.cache_max_bytes == merged["relay"]["cacheMaxBytes"]
    cache_dir = args[args.index("--cache-dir") + 1]
    (cache_vol,) = [v for v in spec["volumes"] if v["name"] == "cache"]
    assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["cache"] == cache_dir
    assert int(cache_vol["emptyDir"]["sizeLimit"]) >= settings.cache_max_bytes + merged["proxy"]["maxAdapterBytes"]
    # The generators trust the same CA for their fallback to the home proxy.
    (gc,) = pod_spec(one(docs, "Deployment", "generator"))["containers"]
    assert expand_k8s_env(gc, Refs(docs, merged))["BUCKETRL_CA_FILE"] == env["BUCKETRL_CA_FILE"]
    assert any(m["name"] == "ca" for m in gc["volumeMounts"])


def test_relay_staging_reads_the_relay_token_of_the_tokens_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """relay.staging: the relay's staging token is the tokens Secret's `relay` key, which the home release's proxy
    file lists as a relay (the proxy test above); off by default, so a regional Secret without it still works."""
    from bucketrl.relay.settings import RelaySettings

    plain = expand_k8s_env(
        pod_spec(one(manifests(render_chart(COMBOS["regional-relay"])), "Deployment", "relay"))["containers"][0],
        Refs(manifests(render_chart(COMBOS["regional-relay"])), merged_values(COMBOS["regional-relay"])),
    )
    assert "BUCKETRL_RELAY_STAGING_TOKEN" not in plain
    values = {**COMBOS["regional-relay"]}
    values["relay"] = {**values["relay"], "staging": True}
    docs = manifests(render_chart(values))
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)
    (c,) = pod_spec(one(docs, "Deployment", "relay"))["containers"]
    env = expand_k8s_env(c, Refs(docs, merged_values(values)))
    assert env["BUCKETRL_RELAY_STAGING_TOKEN"] == "existing-relay-token"
    settings = build_settings(
        RelaySettings, {k: v for k, v in env.items() if k.startswith("BUCKETRL_RELAY_")}, monkeypatch
    )
    assert settings.staging_token == "existing-relay-token"


def test_relay_tls_serves_https_to_the_generators_and_presigned_reaches_its_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """relay.tls: the relay's own settings serve HTTPS from the mounted Secret, its probes speak HTTPS, and the
    generators' first URL is https:// (verified with caSecret, as their fallback to the home proxy is)."""
    from bucketrl.relay.settings import RelaySettings

    values = {**COMBOS["regional-relay"]}
    values["relay"] = {**values["relay"], "tls": {"secretName": "relay-tls"}, "presigned": True}
    docs = manifests(render_chart(values))
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)
    merged = merged_values(values)
    spec = pod_spec(one(docs, "Deployment", "relay"))
    (c,) = spec["containers"]
    args = c["args"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    tls_vol = {v["name"]: v for v in spec["volumes"]}["relay-tls"]
    assert tls_vol["secret"]["secretName"] == "relay-tls"
    assert args[args.index("--tls-cert-file") + 1] == f"{mounts['relay-tls']}/tls.crt"
    assert args[args.index("--tls-key-file") + 1] == f"{mounts['relay-tls']}/tls.key"
    assert {i["path"] for i in tls_vol["secret"]["items"]} == {"tls.crt", "tls.key"}
    assert c["readinessProbe"]["httpGet"]["scheme"] == c["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    env = expand_k8s_env(c, Refs(docs, merged))
    settings = build_settings(
        RelaySettings, {k: v for k, v in env.items() if k.startswith("BUCKETRL_RELAY_")}, monkeypatch
    )
    assert settings.presigned is True
    (gc,) = pod_spec(one(docs, "Deployment", "generator"))["containers"]
    genv = expand_k8s_env(gc, Refs(docs, merged))
    relay_url = genv["BUCKETRL_PROXY_URL"].split(",")[0]
    assert "BUCKETRL_INSECURE_HTTP" not in genv  # every leg is TLS now: nothing to exempt
    svc = one(docs, "Service", "relay")
    assert relay_url == f"https://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"
    # Without relay.tls: plain HTTP on the pod network, as before.
    plain = pod_spec(one(manifests(render_chart(COMBOS["regional-relay"])), "Deployment", "relay"))["containers"][0]
    assert "--tls-cert-file" not in plain["args"] and plain["readinessProbe"]["httpGet"]["scheme"] == "HTTP"
